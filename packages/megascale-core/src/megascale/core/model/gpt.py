"""GPT: token embedding → blocks → final norm and vocabulary projection, and the next-token loss.

The model knows nothing of process groups. ``layers()`` lists its pipeline-cuttable pieces in order
(embedding, each block, head); blocks sit in a ModuleDict keyed by layer number so their parameter names
stay the same when a pipeline stage keeps only some of them.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from megascale.core import kernels
from megascale.core._dtensor import is_dtensor, local
from megascale.core.config import GPTConfig
from megascale.core.model.block import make_block
from megascale.core.model.layers import PipelineLayers
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.model.moe import GroupedExperts, reset_router_buffers, take_balancing_losses
from megascale.core.model.norm import LayerNorm, RMSNorm, make_norm
from megascale.core.model.rope import RotaryEmbedding

__all__ = ["GPT", "LMHead", "NextTokenLoss", "TokenEmbedding", "flops_per_token"]


class TokenEmbedding(nn.Module):
    """Rows of a (padded_vocab, d_model) table, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.padded_vocab_size, config.d_model))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(nn.functional.embedding(tokens, self.weight))


class LMHead(nn.Module):
    """Final norm, then logits over the padded vocabulary (the padded columns are ignored by the loss)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = make_norm(config)
        self.proj = FanOutLinear(config.d_model, {"logits": config.padded_vocab_size}, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (logits,) = self.proj(self.norm(x))
        return logits


class NextTokenLoss(nn.Module):
    """Mean cross-entropy over targets != ignore_index, over the real (unpadded) vocabulary."""

    def __init__(self, config: GPTConfig, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.ignore_index = ignore_index
        self.backend = config.kernels.get("cross_entropy")

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return kernels.cross_entropy(
            logits, targets, vocab_size=self.vocab_size, ignore_index=self.ignore_index, backend=self.backend
        )


class WeightsSource(Protocol):
    """Weights that ``GPT.init_weights()`` loads in place of random ones, each rank filling the parameters (and
    shards) it holds: ``megascale.core.hf.HFWeights`` reads a Hugging Face model directory."""

    def load_into(self, model: GPT) -> None: ...


class GPT(nn.Module):
    """A decoder-only transformer. ``GPT(config)(tokens)`` gives logits; with ``targets`` it gives the loss.

    Built on the meta device (``with torch.device("meta")``), it allocates nothing; ``to_empty`` and
    ``init_weights`` then give exactly the weights a direct build gives under the same seed, also after the
    model was split (tensor parallel, pipeline stages, FSDP). Set ``weights_source`` before that (a Hugging
    Face model directory: ``megascale.core.hf.HFWeights(path)``), and ``init_weights`` loads its weights
    instead, each rank reading only its part.
    """

    init_weights_handles_shards = True  # init_weights fills tensor-parallel shards itself, layout independent
    blocks_take_position_ids = True  # block(x, position_ids): pipeline stages hand packed documents on
    embed: TokenEmbedding | None  # None on pipeline ranks that hold no first stage
    head: LMHead | None  # None on pipeline ranks that hold no last stage
    sequence_multiple: int = 1  # sequence lengths must be multiples of this (sequence parallelism sets tp)
    #: what ``init_weights()`` loads instead of drawing random weights (``megascale.core.hf.HFWeights``);
    #: None: random weights from ``init_seed``
    weights_source: WeightsSource | None = None

    @property
    def pretrained(self) -> None:
        return None

    @pretrained.setter
    def pretrained(self, path: str | Path | None) -> None:  # the attribute before weights_source: not ignored
        raise AttributeError(
            f"GPT.pretrained = {path!r}: set model.weights_source = megascale.core.hf.HFWeights({path!r}) "
            "instead (the Hugging Face loader lives on the HF side)"
        )

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling
        )
        self.embed = TokenEmbedding(config)
        self.blocks = nn.ModuleDict(
            {str(i): make_block(config, self.rope, i) for i in range(config.n_layers)}
        )
        self.head = LMHead(config)
        self.loss_fn = NextTokenLoss(config)
        self._tie_weights()
        # load_state_dict(assign=True) replaces each module's parameter by its own entry, which would untie
        # the shared embedding: tie it again after every load.
        self.register_load_state_dict_post_hook(_retie_after_load)
        # Drawn now, used whenever the weights are materialised: a model built on the meta device and
        # initialised later (after it was split) gets the weights a direct build gets.
        self.init_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item())
        if self.rope.cos.device.type != "meta":
            self.init_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.proj["logits"].weight = self.embed.weight

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Module._apply (behind to(), to_empty(), half(), ...) re-wraps each module's parameters separately,
        # which would silently untie the shared embedding: tie it again.
        out = super()._apply(fn, recurse)
        self._tie_weights()
        return out

    def layers(self) -> list[nn.Module]:
        """The model in order, as a pipeline cuts it: embedding, each block, head (final norm + logits)
        (those this model holds: a pipeline rank keeps only its stages' layers)."""
        return [m for m in (self.embed, *self.blocks.values(), self.head) if m is not None]

    def pipeline_layers(self) -> PipelineLayers:
        """The layers a pipeline cuts (``megascale.core.model.layers``): the embedding first, the blocks, and
        the head (final norm + logits) last."""
        return PipelineLayers(
            first=[self.embed] if self.embed is not None else [],
            blocks=list(self.blocks.values()),
            last=[self.head] if self.head is not None else [],
        )

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the last pipeline stage's output: what ``forward(tokens, targets)`` returns."""
        return self.loss_fn(logits, targets)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` (B, T), or the mean loss against ``targets``.

        ``position_ids`` (B, T), for rows packing several documents: each token's position in its document,
        restarting at 0 at each document's first token (transformers' and torchtitan's convention). Rotary
        angles are taken at those positions and attention is kept inside each document (and causal, and
        within a sliding window), so each document gets the logits it gets alone. None: one sequence per row.

        With a mixture of experts, the loss includes the routers' balancing losses of this forward (when
        training; ``MoEConfig.aux_loss_coef``, ``z_loss_coef``).

        A model holding only some layers (a pipeline rank) computes its slice: hidden states in and/or out.
        """
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens is longer than max_seq_len={self.config.max_seq_len}"
            )
        if position_ids is not None and position_ids.shape != tokens.shape[:2]:
            raise ValueError(
                f"position_ids must have the tokens' shape (B, T) = {tuple(tokens.shape[:2])}; got "
                f"{tuple(position_ids.shape)}"
            )
        x = tokens if self.embed is None else self.embed(tokens)
        for block in self.blocks.values():
            x = block(x) if position_ids is None else block(x, position_ids)
        if self.head is None:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        balancing = take_balancing_losses(self) if self.config.moe is not None else None
        return loss if balancing is None else loss + balancing

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weights, output projections scaled by 1/sqrt(2·n_layers) (GPT-2), biases 0,
        norm weights 1; rotary tables recomputed. With ``weights_source`` set, its weights instead (a Hugging
        Face model directory, of which each rank reads only the slices it holds; no seed is used then: giving
        one is an error).

        Every parameter draws from its own generator, seeded by ``seed`` and its name, so the values do not
        depend on the layout: a tensor-parallel shard, a pipeline stage holding some layers, or the whole
        model on one process all get the same numbers for the same seed. ``seed=None`` draws the seed from
        ``init_seed``, drawn from the global RNG when the model was built (so ``torch.manual_seed`` decides as
        usual); a given seed replaces it.
        """
        if self.weights_source is not None:
            if seed is not None:
                raise ValueError(
                    f"init_weights(seed={seed}): this GPT loads its weights from {self.weights_source} "
                    "(weights_source); set weights_source = None to draw random weights"
                )
            self.weights_source.load_into(self)
            return
        if seed is None:
            seed = self.init_seed
        self.init_seed = seed
        std, out_scale = self.config.init_std, 1 / math.sqrt(2 * self.config.n_layers)
        for prefix, module in self.named_modules():
            for name, param in module.named_parameters(prefix=prefix, recurse=False):
                if self.embed is not None and param is self.embed.weight and module is not self.embed:
                    continue  # a tied output projection: initialised as the embedding
                if isinstance(module, (RMSNorm, LayerNorm)):
                    _fill_(param, 1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    _fill_(param, 0.0)
                else:
                    parent = self.get_submodule(prefix.rpartition(".")[0])
                    scaled = isinstance(parent, FanInLinear) or (
                        isinstance(module, GroupedExperts) and name.endswith("down")
                    )
                    _normal_(param, std * (out_scale if scaled else 1.0), name, seed)
        self.rope.reset_parameters()
        reset_router_buffers(self)

    def num_parameters(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters counted once (tied weights once); sharded parameters at their full size. ``active``:
        with a mixture of experts, only those one token uses (top_k of each layer's routed experts)."""
        seen: set[int] = set()
        total = 0
        for module in self.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen or (exclude_embedding and self.embed is not None and p is self.embed.weight):
                    continue
                seen.add(id(p))
                n = p.numel()
                if active and isinstance(module, GroupedExperts) and self.config.moe is not None:
                    n = n * self.config.moe.top_k // self.config.moe.num_experts
                total += n
        return total


def _retie_after_load(module: nn.Module, incompatible_keys: object) -> None:
    cast(GPT, module)._tie_weights()


def _normal_(param: torch.Tensor, std: float, name: str, seed: int) -> None:
    """Fill ``param`` (or its shard) with the values N(0, std) gives the whole tensor under (seed, name)."""
    target = local(param)
    gen = torch.Generator(device=target.device).manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
    if not is_dtensor(param):
        target.normal_(0.0, std, generator=gen)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    dt = cast(DTensor, param)
    full = torch.empty(dt.shape, dtype=target.dtype, device=target.device).normal_(0.0, std, generator=gen)
    # src_data_rank=None: every rank holds the same full tensor and keeps its own slice, no communication
    target.copy_(distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local())


def _fill_(param: torch.Tensor, value: float) -> None:
    local(param).fill_(value)


def flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6·N for the matmuls plus the attention scores.

    N excludes the embedding lookup (no matmul) but includes the output projection; attention adds
    12·layers·(n_heads·head_dim)·(keys attended), counting a sliding window's keys only (PaLM appendix B);
    n_heads·head_dim is d_model unless ``head_size`` sets another head width. With a mixture of experts N
    counts the active parameters: the router, top_k routed experts and the shared ones (MFU on active
    parameters, as Megatron and DeepSeek report it).
    """
    d, L = config.d_model, config.n_layers
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    per_block = d * (q + 2 * kv) + q * d  # q, k, v, o
    projections = 3 if config.activation == "swiglu" else 2
    if config.moe is None:
        per_block += projections * d * config.ffn_dim
    else:
        experts = config.moe.top_k + config.moe.shared_experts
        per_block += projections * d * config.expert_dim * experts + d * config.moe.num_experts
    matmul_params = L * per_block + d * config.padded_vocab_size
    keys = 0.0
    for layer in range(L):
        w = config.window_for_layer(layer)
        # average number of keys a query attends under a causal (windowed) mask
        keys += (seq_len + 1) / 2 if w is None or w >= seq_len else w - (w * (w - 1)) / (2 * seq_len)
    return 6.0 * matmul_params + 12.0 * q * keys
