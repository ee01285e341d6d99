"""The LightningModule every conformance cell trains: a small transformer of a user's own, with switches.

``ConformanceModule(shape, features)`` is what a Lightning user writes (``nn.Embedding``, ``nn.Linear``,
``nn.LayerNorm``, ``F.scaled_dot_product_attention``; built in ``configure_model``), and joins megascale's
layouts only by what it declares: a ``tensor_parallel_plan``, ``pipeline_layers()``/``pipeline_loss()`` and a
``context_parallel_plan`` (its attention and position embedding use the ``context_parallel`` they are given).
``shape`` (drawn from a seed by ``scenarios.draw_shape``) sets depth, width, heads, biases; ``features``
switch on what a scenario exercises (frozen parameters, LayerDrop, manual optimization, schedulers, ...).

Initial weights are the same in every layout and on one process: ``init_weights()`` draws each parameter
from a generator seeded by its name. MegaScaleStrategy calls it after materialising the meta-device model
(it sees split parameters whole); on one process ``configure_model`` calls it itself.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm
from torch import nn

from megascale.core import GPTConfig, MoEConfig
from megascale.core.model import PipelineLayers
from megascale.core.model.moe import MoE, take_balancing_losses
from tests.conformance.callbacks import grad_sq

LR = 1e-2
# AdamW's eps bounds how much it amplifies rounding noise in a near-zero gradient (each layout sums in its own
# order): an element's update differs by at most ~lr·noise/eps between layouts.
EPS = 1e-6


class Attention(nn.Module):
    context_parallel = (
        None  # set under cp > 1 (the Net's context_parallel_plan): attends over every rank's keys
    )
    documents_unpassed_under_cp = False  # a user's cp branch written before packed documents

    def __init__(self, width: int, heads: int, kv_heads: int, bias: bool, fused: bool, mask_len: int,
                 mask_device: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.head_dim = width // heads
        self.kv_width = kv_heads * self.head_dim
        self.fused = fused
        # No key bias: softmax ignores it (it adds the same q·b to a query's every score), so its gradient is
        # rounding noise that AdamW would turn into ±lr steps, different in every layout.
        if fused:  # one projection for q, k and v, chunked after (GPT-2's c_attn)
            self.qkv = nn.Linear(width, width + 2 * self.kv_width, bias=False)
        else:
            self.q = nn.Linear(width, width, bias=bias)
            self.k = nn.Linear(width, self.kv_width, bias=False)
            self.v = nn.Linear(width, self.kv_width, bias=bias)
        self.o = nn.Linear(width, width, bias=bias)
        if mask_len:  # a causal mask computed in __init__, as many user models (and nanoGPT) keep one
            # (device "cpu": computed for real even when the model is built on the meta device)
            device = "cpu" if mask_device else None
            mask = torch.ones(mask_len, mask_len, device=device).tril().bool()
            self.register_buffer("mask", mask, persistent=False)
        else:
            self.mask = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` (B, T): packed documents (restarting at 0 at each), attended to apart. Under cp they
        are the whole sequences', as context_parallel.attention takes them."""
        if self.fused:  # q ‖ k ‖ v (as many heads each): a column split must cut each part, not the whole
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        B, T = q.shape[:2]  # from a projection: under sequence parallelism x holds T/tp positions
        q = q.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        if self.context_parallel is not None:  # (B, T, heads, hd) in and out; causal over the whole sequence
            passed = None if self.documents_unpassed_under_cp else position_ids
            y = self.context_parallel.attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=None, position_ids=passed
            )
            return self.o(y.reshape(B, T, -1))
        if position_ids is not None:  # as a user writes it: same document ∧ causal, dense
            ids = (position_ids == 0).cumsum(-1)
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            documents = ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=documents, enable_gqa=True)
        elif self.mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:T, :T], enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, width: int, bias: bool, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        if fused:  # gate ‖ up in one Linear (SwiGLU as many checkpoints store it)
            self.gate_up = nn.Linear(width, 4 * width, bias=bias)
        else:
            self.up = nn.Linear(width, 2 * width, bias=bias)
        self.down = nn.Linear(2 * width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


def experts(width: int, heads: int) -> MoE:
    """megascale's mixture-of-experts layer as a model of one's own uses it: 4 experts of width 2·width, 2 per
    token, a balancing loss the model adds to its loss (``take_balancing_losses``)."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=2 * width, aux_loss_coef=0.05)
    return MoE(GPTConfig(vocab_size=8, d_model=width, n_heads=heads, moe=moe))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, bias: bool, fused: bool, mask_len: int,
                 layer_scale: bool, mask_device: bool, moe: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.attn_norm = nn.LayerNorm(width, bias=bias)
        self.attn = Attention(width, heads, kv_heads, bias, fused, mask_len, mask_device)
        self.mlp_norm = nn.LayerNorm(width, bias=bias)
        self.mlp: nn.Module = experts(width, heads) if moe else MLP(width, bias, fused)
        # a learned per-block gain (LayerScale / ReZero), a plain parameter held by the block itself
        self.gain = nn.Parameter(torch.ones(width)) if layer_scale else None
        self.active = True  # LayerDrop: the LightningModule switches blocks off for a step
        # (batch,) bool: the samples this block runs on, set per batch; Net does not call it where none is
        self.keep: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not self.active:
            return x
        keep = self.keep
        h = x + self.attn(self.attn_norm(x), position_ids)
        out = h + self.mlp(self.mlp_norm(h))
        out = x + (out - x) * self.gain if self.gain is not None else out
        return out if keep is None else torch.where(keep[:, None, None], out, x)


class Head(nn.Module):
    def __init__(self, width: int, vocab: int, bias: bool, unused: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, bias=bias)
        self.proj = nn.Linear(width, vocab, bias=False)
        self.unused = nn.Parameter(torch.zeros(width)) if unused else None  # no forward reads it
        self.detach_input = False  # the loss reaches the head (and what is tied to it) only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x.detach() if self.detach_input else x))


class Embeddings(nn.Module):
    """Token and learned position embeddings, summed: one layer, so a pipeline's first stage holds both."""

    context_parallel = None  # set under cp > 1: the tokens' places in the whole sequence

    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cp = self.context_parallel
        places = (
            cp.positions(ids.shape[1], ids.device)
            if cp is not None
            else torch.arange(ids.shape[1], device=ids.device)
        )
        return self.tokens(ids) + self.positions(places)


class NextTokenLoss(nn.Module):
    """The mean cross-entropy, in fp32, as a module (what the context_parallel_plan's "loss" names).

    ``conditional_vocab``: also a small layer run only on the tokens whose target is below 3 (about one in 21)
    and only when the batch has any, as ``if sel.any(): loss += extra(h[sel])`` in a user's model: in a step
    one rank's data may use it and another's not."""

    ignore_index = -100

    def __init__(self, conditional_vocab: int = 0) -> None:
        super().__init__()
        self.extra = nn.Linear(conditional_vocab, 1) if conditional_vocab else None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=self.ignore_index
        )
        if self.extra is not None:
            sel = targets < 3
            if (
                sel.any()
            ):  # a per-token term, normalised as the mean above (context parallelism rescales both)
                loss = loss + self.extra(logits[sel].float()).pow(2).sum() / targets.numel()
        return loss


class Net(nn.Module):
    """Embedding → blocks → head; lists its layers and loss for pipelines; declares its TP plan."""

    blocks_take_position_ids = True  # block(x, position_ids): packed documents, through pipeline stages too

    def __init__(self, shape: dict[str, Any], features: dict[str, Any]) -> None:
        super().__init__()
        vocab, width, seq = shape["vocab"], shape["width"], shape["seq"]
        self.features = features
        self.embed = (
            Embeddings(vocab, seq, width) if features.get("pos_embed") else nn.Embedding(vocab, width)
        )
        mask_len = seq if features.get("mask_buffer") else 0
        heads = shape["heads"]
        kv_heads = heads if features.get("fused") else shape["kv_heads"]
        blocks = [
            Block(width, heads, kv_heads, shape["bias"], bool(features.get("fused")), mask_len,
                  bool(features.get("layer_scale")), features.get("mask_buffer") == "cpu",
                  bool(features.get("moe")))
            for _ in range(shape["layers"])
        ]  # fmt: skip
        for block in blocks:
            block.attn.documents_unpassed_under_cp = bool(features.get("documents_unpassed"))
        # flat: the blocks in an nn.Sequential of a model that lists no layers, so no ZeRO unit holds them
        self.blocks = nn.Sequential(*blocks) if features.get("flat") else nn.ModuleList(blocks)
        self.head = Head(width, vocab, shape["bias"], bool(features.get("unused")))
        if features.get("tie") or features.get("tie_unplanned"):
            self.head.proj.weight = self.embed.weight  # type: ignore[assignment]
        self.loss_fn = NextTokenLoss(vocab if features.get("conditional") else 0)
        # context parallelism: which module takes the tokens, which attend, which computes the loss
        self.context_parallel_plan = {"tokens": "embed", "attention": "blocks.*.attn", "loss": "loss_fn"}

    def tensor_parallel_plan(self) -> dict[str, Any] | None:
        f = self.features
        if f.get("own_parallelize"):
            return None  # the LightningModule splits it itself (ModelParallelStrategy's way)
        plan: dict[str, Any] = {
            **(
                {"embed.tokens": "rowwise", "embed.positions": "position_embedding"}
                if f.get("pos_embed")
                else {"embed": "rowwise"}
            ),
            "blocks.*.attn.o": "rowwise",
            "blocks.*.mlp.down": "rowwise",
        }
        if not f.get("tie_unplanned"):  # a head tied to the split embedding, itself left out of the plan
            plan["head.proj"] = "colwise_rep"
        if f.get("fused"):
            plan |= {"blocks.*.attn.qkv": "colwise", "blocks.*.mlp.gate_up": "colwise"}
        else:
            plan |= {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                     "blocks.*.mlp.up": "colwise"}  # fmt: skip
        norms = ["blocks.*.attn_norm", "blocks.*.mlp_norm", "head.norm"]
        if f.get("torch_sp_norms"):  # torch's own SequenceParallel style for the norms
            from torch.distributed.tensor.parallel import SequenceParallel

            plan |= {n: SequenceParallel(use_local_output=True) for n in norms}
        elif not f.get("unmarked_norms"):  # as Hugging Face's base_model_tp_plan: norms left out
            plan |= {n: "sequence_parallel" for n in norms}
        if f.get("layer_scale") and not f.get("unmarked_norms"):
            plan |= {"blocks.*": "sequence_parallel"}
        return plan

    def pipeline_layers(self) -> PipelineLayers:
        return PipelineLayers(first=[self.embed], blocks=list(self.blocks), last=[self.head])

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_ids``: packed documents (restarting at 0 at each), attended to apart: each block is given
        them (``blocks_take_position_ids``: a pipeline stage hands its microbatch's on the same way)."""
        x = self.embed(tokens)
        for block in self.blocks:
            if block.keep is None or bool(block.keep.any()):  # none of this rank's samples: not called
                x = block(x) if position_ids is None else block(x, position_ids)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = self.pipeline_loss(logits, targets)
        balancing = take_balancing_losses(self)  # mixture-of-experts layers' (a pipeline stage adds its own)
        return loss if balancing is None else loss + balancing


class FlatNet(Net):
    """The same model as a user writes it without megascale in mind: no ``pipeline_layers()`` (so no pipeline,
    and every parameter the FSDP root's own at ZeRO-2/3)."""

    pipeline_layers = None  # type: ignore[assignment]


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


class ConformanceModule(LightningModule):
    """A user's LightningModule; ``features`` (all optional):

    frozen: parameter-name substrings with requires_grad=False from the start ("drawn": the shape's); unused: a parameter no forward
    reads; layerdrop: block i is skipped on steps where (step + i) % 3 == 0; manual: two AdamW optimizers
    (blocks; embedding and head) stepped by hand in one training_step, the second forward reading what the
    first step wrote ("single": one optimizer, zero_grad/backward/step; "accumulate": two batches a step;
    "toggle": each step between toggle_optimizer and untoggle_optimizer, as Lightning's GAN example);
    read_grads (with manual="single"): the gradients' squared norms summed as numbers and logged between
    manual_backward and the step, then clipped by norm with clip_gradients;
    skip_odd_steps: optimizer_step runs the closure but steps only on even batches;
    conditional_block: the first and last blocks run only on samples whose first token is 0 (first) or 1 (last)
    modulo 3, and are skipped where a rank's batch holds none;
    conditional: a layer in the loss that only tokens with a small target run (``NextTokenLoss``), so ranks use
    it in different steps; log_sum: a per-batch total logged with reduce_fx="sum" (training and validation); log_reductions: the
    batch's largest, smallest and mean token logged with reduce_fx "max", "min" and "mean" (sync_dist), the
    loss's epoch mean (on_epoch), and the batch index unsynced (every rank logs the same); log_l2: the sum of every
    parameter's squares, over ``self.parameters()`` inside training_step, logged with sync_dist=True;
    detach: on odd steps the head reads its input detached, so the loss reaches the head (and the embedding
    tied to it) only; three: by hand, three optimizers (blocks; embedding; head), each stepped after its own
    forward; overlap: with two optimizers, one parameter in both (each steps it with its own state);
    flat: the model lists no layers and holds its blocks in an nn.Sequential (``FlatNet``); schedulers: a per-step warm-up and a per-epoch decay on one optimizer; log_grad_norm:
    "lightning" or "megascale": that library's grad_norm logged in on_before_optimizer_step; clip_in_module: configure_gradient_clipping
    clips by norm through Lightning's clip_gradients; torch_clip: ...through torch.nn.utils.clip_grad_norm_;
    sgd: plain SGD (for bf16-mixed, whose AdamW updates would hide a defect in rounding noise); eager: the
    model built in ``__init__`` on real tensors (BaseFinetuning and StochasticWeightAveraging read or copy it
    in their ``setup``, before ``configure_model`` runs); and the
    model's own: tie, tie_unplanned (the tied head left out of the TP plan), pos_embed, mask_buffer (True, or
    "cpu": created with an explicit device), fused,
    layer_scale, unmarked_norms, torch_sp_norms; moe: every block's feed-forward megascale's mixture of
    experts (``experts``; the ep layouts' model); own_parallelize: configure_model splits the model itself
    on ``self.device_mesh`` as a module written for ModelParallelStrategy does.
    """

    def __init__(self, shape: dict[str, Any], features: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.shape, self.features = dict(shape), dict(features or {})
        self.net: Net | None = None
        self.automatic_optimization = not self.features.get("manual")
        # the hooks below are overridden for the scenarios that use them; the others read no gradient, and say
        # so (else ZeRO-1 would all-reduce whole gradients for every scenario: weight_readers.py)
        self.reads_gradients = any(
            self.features.get(k)
            for k in ("log_grad_norm", "clip_in_module", "torch_clip", "read_grads", "log_tensors")
        ) or self.features.get("manual") in ("closure", "split")  # as a manual module that says nothing is
        if self.features.get("eager"):  # built here, as callbacks that copy or freeze it in setup() need
            self.configure_model()

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = (FlatNet if self.features.get("flat") else Net)(self.shape, self.features)
        frozen = self.features.get("frozen", ())
        frozen = self.shape["frozen"] if frozen == "drawn" else frozen
        for name, p in self.named_parameters():
            if any(part in name for part in frozen):
                p.requires_grad_(False)
        if self.features.get("own_parallelize") and self.device_mesh is not None:
            self._parallelize(self.net)
        if not any(p.is_meta for p in self.parameters()):  # one process builds real tensors: initialise
            self.init_weights()

    def _parallelize(self, net: Net) -> None:
        """As a module written for Lightning's ModelParallelStrategy does: torch's tensor parallelism on the
        "tensor_parallel" mesh, FSDP2 on the "data_parallel" mesh."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        assert self.device_mesh is not None
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in net.blocks:
            if tp.size() > 1:
                parallelize_module(block, tp, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
            fully_shard(block, mesh=dp)
        fully_shard(net, mesh=dp)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter from a generator seeded by its name: the same values in any layout."""
        for module in self.modules():  # their routers' statistics buffers (zero) too, as MoE's docs say
            if isinstance(module, MoE):
                module.init_weights()
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(_seed(name))
            values = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                values = values * 0.1
            elif name.endswith(("norm.weight", "gain")):
                values = 1.0 + 0.1 * values
            else:
                values = 0.1 * values
            p.copy_(values.to(p.dtype))

    # ---- steps ------------------------------------------------------------------------------------------

    def _loss(self, batch: Any) -> torch.Tensor:
        assert self.net is not None
        inputs, targets, *positions = batch  # (inputs, targets, position_ids) with packed documents
        if positions:
            return self.net(inputs, targets, positions[0])
        if self.features.get("conditional_block"):  # per sample, so one process runs the same on the union
            first, last = self.net.blocks[0], self.net.blocks[-1]
            first.keep, last.keep = inputs[:, 0] % 3 == 0, inputs[:, 0] % 3 == 1
        return self.net(inputs, targets)

    def _set_layerdrop(self, batch_idx: int) -> None:
        if self.features.get("layerdrop") and self.net is not None:
            # "batch": by batch, so a block skipped in one micro-batch of an accumulation runs in the other
            count = batch_idx if self.features["layerdrop"] == "batch" else self.global_step
            for i, block in enumerate(self.net.blocks):
                block.active = (count + i) % 3 != 0
        head = getattr(self.net, "head", None)  # (a pipeline stage without it: None)
        if self.features.get("detach") and head is not None:
            head.detach_input = self.trainer.fit_loop.total_batch_idx % 2 == 1  # every other batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        self._set_layerdrop(batch_idx)
        if self.features.get("manual"):
            return self._manual_step(batch)
        loss = self._loss(batch)
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        if self.features.get("log_sum"):  # a total over the batch's samples, summed over the ranks
            self.log(
                "train/loss_sum", loss.detach() * len(batch[0]), on_step=True, sync_dist=True, reduce_fx="sum"
            )
        if self.features.get("log_reductions"):  # each reduce_fx over the ranks' samples, as over the union
            tokens = batch[0][:, 0].float()  # each sample's first token: a few per rank, unlike the union
            self.log("train/token_max", tokens.max(), on_step=True, sync_dist=True, reduce_fx="max")
            self.log("train/token_min", tokens.min(), on_step=True, sync_dist=True, reduce_fx="min")
            self.log("train/token_mean", tokens.mean(), on_step=True, sync_dist=True, reduce_fx="mean")
            self.log("train/loss_epoch_mean", loss.detach(), on_step=False, on_epoch=True, sync_dist=True)
            self.log("train/batch_idx", float(batch_idx), on_step=True)  # alike on every rank: not synced
        if self.features.get("log_l2"):  # an L2 penalty over every parameter, logged (not trained on)
            l2 = sum(p.float().pow(2).sum() for p in self.parameters())
            self.log("train/l2", l2, on_step=True, sync_dist=True)
        if self.features.get("schedulers"):
            self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True)
        return loss

    def _manual_step(self, batch: Any) -> None:
        if self.features["manual"] == "accumulate":  # one optimizer, stepped every second batch
            return self._manual_accumulation(batch)
        if self.features["manual"] == "closure":  # the same, the second backward inside step(closure=...)
            return self._closure_accumulation(batch)
        if self.features["manual"] == "split":  # one backward, both optimizers step (a Muon + AdamW loop)
            matrices, vectors = self.optimizers()  # type: ignore[misc]
            loss = self._loss(batch)
            matrices.zero_grad()
            vectors.zero_grad()
            self.manual_backward(loss)
            matrices.step()
            vectors.step()
            self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
            return None
        if self.features["manual"] == "single":  # one optimizer, the loop Lightning's docs show
            optimizer = self.optimizers()
            loss = self._loss(batch)
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            if self.features.get("read_grads"):  # read as numbers between the backward and the step
                total = grad_sq(self)
                self.log("user/grad_sq_manual", total, on_step=True)
                self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            optimizer.step()  # type: ignore[union-attr]
            self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
            return None
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        toggle = self.features["manual"] == "toggle"  # Lightning's GAN example: only one optimizer's grads
        losses = []
        # each forward reads what the steps before it wrote (a GAN's discriminator step after the generator's)
        for optimizer in optimizers:
            if toggle:
                self.toggle_optimizer(optimizer)
            loss = self._loss(batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            if toggle:
                self.untoggle_optimizer(optimizer)
            losses.append(loss.detach())
        for i, loss in enumerate(losses):
            self.log("train/loss" if i == 0 else f"train/loss{i + 1}", loss, on_step=True, sync_dist=True)
        return None

    def _manual_accumulation(self, batch: Any) -> None:
        optimizer = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss / 2)
        if (self.trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1) % 2 == 0:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)

    def _closure_accumulation(self, batch: Any) -> None:
        optimizer = self.optimizers()
        losses = []

        def closure() -> torch.Tensor:
            loss = self._loss(batch)
            self.manual_backward(loss / 2)
            losses.append(loss.detach())
            return loss

        if (self.trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1) % 2 == 0:
            optimizer.step(closure=closure)  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        else:
            closure()
        self.log("train/loss", losses[0], on_step=True, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)
        if self.features.get("log_sum"):
            self.log("val/loss_sum", loss * len(batch[0]), on_epoch=True, sync_dist=True, reduce_fx="sum")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.features.get("log_tensors"):  # tensors, not numbers: DTensors where the layout splits them
            assert self.net is not None
            up = self.net.blocks[0].attn.q.weight
            assert up.grad is not None
            self.log("user/up_grad_norm", up.grad.norm(), on_step=True, sync_dist=True)
            self.log_dict({"user/up_norm": up.norm(), "user/up_max": up.max()}, on_step=True)  # not synced
        which = self.features.get("log_grad_norm")
        if which == "lightning":
            self.log_dict(grad_norm(self, norm_type=2))
        elif which == "megascale":  # the same keys, whole gradients under every layout
            from megascale.lightning import grad_norm as whole_grad_norm

            self.log_dict(whole_grad_norm(self, norm_type=2))

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        if self.features.get("skip_odd_steps") and batch_idx % 2 == 1:
            optimizer_closure()  # training_step and backward, no step: Lightning's documented pattern
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        # zero_to_zeros: gradients kept as zero tensors between steps, not freed (set_to_none=False)
        optimizer.zero_grad(set_to_none=not self.features.get("zero_to_zeros"))

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:  # fmt: skip
        if self.features.get("clip_in_module"):
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        elif self.features.get("torch_clip"):
            norm = torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.grad is not None], 0.05)
            self.log("user/grad_norm", norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        assert self.net is not None
        if self.features.get("manual") in ("accumulate", "single", "closure"):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR, eps=EPS)
        if self.features.get("manual") == "split":  # every layer's matrices in one, its vectors in the other
            params = [p for p in self.parameters() if p.requires_grad]
            matrices = [p for p in params if p.dim() >= 2]
            vectors = [p for p in params if p.dim() < 2]
            if self.features.get("overlap"):  # the last vector in both optimizers: stepped by each
                matrices += vectors[-1:]
            return torch.optim.AdamW(matrices, lr=LR, eps=EPS), torch.optim.SGD(vectors, lr=0.1, momentum=0.9)
        if self.features.get("manual"):
            blocks = [p for p in self.net.blocks.parameters() if p.requires_grad]
            rest = [
                p for n, p in self.net.named_parameters() if not n.startswith("blocks.") and p.requires_grad
            ]
            if self.features.get("overlap"):  # the rest's last parameter in both optimizers: stepped by each
                blocks += rest[-1:]
            if not self.features.get("three"):
                return torch.optim.AdamW(blocks, lr=LR, eps=EPS), torch.optim.AdamW(rest, lr=LR, eps=EPS)
            # the rest split in two: the embedding's, and the head's (a tied head: the embedding's); one left
            # with nothing to train (frozen) is not made, as a user would not make it
            embed = [p for n, p in self.net.named_parameters() if n.startswith("embed.") and p.requires_grad]
            head = [p for p in rest if all(p is not q for q in embed)]
            return tuple(torch.optim.AdamW(g, lr=LR, eps=EPS) for g in (blocks, embed, head) if g)
        params = [p for p in self.parameters() if p.requires_grad]
        if self.features.get("sgd"):
            return torch.optim.SGD(params, lr=0.5, momentum=0.9)
        kind = self.features.get("optimizer")
        if kind == "nesterov":
            return torch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True, weight_decay=0.01)
        if kind == "amsgrad":
            return torch.optim.Adam(params, lr=LR, eps=EPS, amsgrad=True)
        if kind == "groups":  # matrices decayed at the default lr, vectors undecayed at twice it (nanoGPT's)
            matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
            groups = [
                {"params": matrices, "weight_decay": 0.1},
                {"params": vectors, "weight_decay": 0.0, "lr": 2 * LR},
            ]
            return torch.optim.AdamW(groups, lr=LR, eps=EPS)
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=EPS)
        if not self.features.get("schedulers"):
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [
            {"scheduler": warmup, "interval": "step"},
            {"scheduler": decay, "interval": "epoch"},
        ]
