"""LightningModules a user would write, none of them megascale's GPTModule, for test_own_module.py.

- ``OwnTransformerModule``: a small transformer written here (its own attention and MLP on ``nn.Linear``,
  ``nn.LayerNorm``, ``nn.Embedding``) that joins every layout by what it declares: a ``tensor_parallel_plan``
  and ``pipeline_layers()``/``pipeline_loss()``.
- ``GPTWithValueHead``: megascale's GPT plus a value head (an ``nn.Linear`` outside the GPT), trained on the LM
  loss plus a value loss: the parameters ZeRO must cover beyond the GPT.
- ``CustomLayerModule``: a layer of the user's own with a parameter and no ``reset_parameters``;
  ``CustomLayerWithInitModule`` initialises it in the LightningModule's ``init_weights()``.
- ``HiddenTieModule``: its head projects with the embedding's weight reached through a list (a tie torch
  cannot see), which pipelines refuse by name.
- ``ModelParallelStyleModule``: written for Lightning's ModelParallelStrategy: its ``configure_model`` splits
  the model over ``self.device_mesh["tensor_parallel"]`` with DTensor's ``parallelize_module`` and shards it with
  ``fully_shard`` over ``self.device_mesh["data_parallel"]``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn

from megascale.core import GPT, GPTConfig
from tests._models import Head, LayeredLM


def _batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0], batch[1]


class _Trains(LightningModule):
    """The training step and optimizer the modules share: AdamW, the loss logged synced."""

    lr = 1e-3

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(*_batch(batch))
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


# ---- a transformer of the user's own --------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, kv_heads * self.head_dim)
        self.v = nn.Linear(width, kv_heads * self.head_dim)
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        # B, T from the projections (under sequence parallelism x holds this rank's T/tp positions only) and
        # -1 heads (under tensor parallelism q, k, v hold this rank's heads only)
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.attn = Attention(width, heads, kv_heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class OwnTransformer(LayeredLM):
    # module-name patterns -> megascale tensor-parallel styles (megascale.core.parallel.tp.user_model)
    tensor_parallel_plan: ClassVar[dict[str, str] | None] = {
        "embed": "rowwise",  # vocabulary rows split; output reduce-scattered to sequence shards under SP
        "blocks.*.attn_norm": "sequence_parallel",
        "blocks.*.mlp_norm": "sequence_parallel",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "head.norm": "sequence_parallel",
        "head.proj": "colwise_rep",  # whole logits on every rank, for F.cross_entropy
    }

    def __init__(
        self, vocab: int = 64, width: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2
    ) -> None:
        blocks = [Block(width, heads, kv_heads) for _ in range(layers)]
        super().__init__(vocab, width, blocks, Head(width, vocab, bias=False))


class OwnTransformerModule(_Trains):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.vocab = vocab
        self.model: OwnTransformer | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = OwnTransformer(self.vocab)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(inputs, targets)  # under pp: the whole pipeline step, backward included


class HiddenTieHead(nn.Module):
    """A head projecting with the embedding's weight, reached through a list: a tie torch cannot see."""

    def __init__(self, embed: nn.Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self._embed = [embed]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self._embed[0].weight)


class HiddenTieModule(OwnTransformerModule):
    """``OwnTransformerModule`` whose head uses the embedding through ``HiddenTieHead``: refused under pp."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = OwnTransformer(self.vocab)
            self.model.head = HiddenTieHead(self.model.embed, 32)


# ---- megascale's GPT with a value head ------------------------------------------------------------------


class GPTWithValueHead(_Trains):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = GPTConfig(**config)
        self.gpt: GPT | None = None
        self.value_head: nn.Linear | None = None

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = GPT(self.config)
            self.value_head = nn.Linear(self.config.padded_vocab_size, 1)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.gpt is not None and self.value_head is not None
        logits = self.gpt(inputs)
        vocab = self.config.vocab_size
        lm = F.cross_entropy(logits[..., :vocab].flatten(0, 1), targets.flatten())
        value = self.value_head(logits).squeeze(-1)
        return lm + (value - targets.float() / vocab).pow(2).mean()


# ---- a layer with no reset_parameters --------------------------------------------------------------------


class Scale(nn.Module):
    """A learned per-feature gain: the user's own layer, with no reset_parameters()."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class CustomLayerModule(_Trains):
    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.vocab, self.width = vocab, width
        self.model: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = nn.Sequential(nn.Embedding(self.vocab, self.width), Scale(self.width),
                                       nn.Linear(self.width, self.vocab))  # fmt: skip

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())


class CustomLayerWithInitModule(CustomLayerModule):
    """The same, initialised by the LightningModule's own init_weights()."""

    @torch.no_grad()
    def init_weights(self) -> None:
        assert self.model is not None
        nn.init.normal_(self.model[0].weight, std=0.02)
        self.model[1].gain.fill_(0.5)
        nn.init.normal_(self.model[2].weight, std=0.02)
        nn.init.zeros_(self.model[2].bias)


# ---- a module written for Lightning's ModelParallelStrategy ---------------------------------------------


class PlainTransformer(OwnTransformer):
    """The same transformer, declaring no tensor-parallel plan (its module splits it itself)."""

    tensor_parallel_plan = None


class ModelParallelStyleModule(_Trains):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.vocab = vocab
        self.model: PlainTransformer | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.model is not None:
            return
        self.model = PlainTransformer(self.vocab)
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            for block in self.model.blocks:
                parallelize_module(block, tp, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
        for block in self.model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(inputs, targets)


class WeightProbe(Callback):
    """What an EMA of the weights would read after each optimizer step: a checksum of every parameter."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        total = torch.zeros((), dtype=torch.float64)
        for p in pl_module.parameters():
            whole = (
                p.full_tensor() if hasattr(p, "full_tensor") else p
            )  # a collective on every rank, in order
            total += whole.detach().double().sum()
        self.sums.append(float(total))


class PrebuiltOptimizerModule(_Trains):
    """The transformer built in ``__init__`` and its optimizer with it, over ``self.parameters()`` before any
    split: configure_optimizers returns that optimizer (issue 48, case 1)."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = OwnTransformer(vocab)
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer


class NoOptimizerModule(OwnTransformerModule):
    """configure_optimizers returns None (Lightning allows it: training steps run, nothing is stepped)."""

    def configure_optimizers(self) -> None:  # type: ignore[override]
        return None


class LBFGSModule(OwnTransformerModule):
    """An optimizer whose state is not one tensor per parameter (LBFGS keeps lists of past steps)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


class _BoringManual(LightningModule):
    """Lightning's BoringModel (one Linear(32, 2) on random vectors) reading the language-model batches as
    vectors, with manual optimization (issue 48, case 5)."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.layer = nn.Linear(32, 2)

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, _ = _batch(batch)
        x = torch.nn.functional.one_hot(inputs[:, :2] % 16, 16).float().flatten(1)  # (B, 32)
        return self.layer(x).pow(2).mean()


class ClosureAccumulationModule(_BoringManual):
    """Two batches accumulated by hand, the second's backward inside ``opt.step(closure=...)``."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()

        def closure() -> torch.Tensor:
            loss = self._loss(batch) / 2
            self.manual_backward(loss)
            return loss

        if (batch_idx + 1) % 2 == 0:
            loss = opt.step(closure=closure)
            opt.zero_grad()
        else:
            loss = closure()
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class TwoOptimizersOneLayerModule(_BoringManual):
    """Two optimizers over the one layer: its weight in AdamW, its bias in SGD."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        loss = self._loss(batch)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([self.layer.weight], lr=1e-2), torch.optim.SGD([self.layer.bias], lr=0.1)


class HandReducedGradientsModule(_BoringManual):
    """Sums its weight's gradient over the ranks by hand with ``dist.all_reduce`` and logs the sum divided by the
    world size as ``train/loss`` (DDP's averaged gradient, summed). ``where``: "before_step"
    (``on_before_optimizer_step``), "batch_end" (``on_train_batch_end``), or "whole" (before the step, on
    ``full_tensor()`` of a DTensor, as the refusal's message advises)."""

    def __init__(self, where: str = "whole", vocab: int = 64) -> None:
        super().__init__(vocab)
        self.automatic_optimization = True
        self.where = where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.where == "batch_end":  # callbacks' on_train_batch_end (the tests' recorder) runs before ours
            self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        return loss

    def _hand_reduced(self) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        grad = self.layer.weight.grad
        assert grad is not None
        if self.where == "whole" and isinstance(grad, DTensor):
            grad = grad.full_tensor()
        summed = grad.detach().clone()
        dist.all_reduce(summed)
        self.log("train/loss", summed.sum() / dist.get_world_size(), on_step=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.where in ("before_step", "whole"):
            self._hand_reduced()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_end":
            self._hand_reduced()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
