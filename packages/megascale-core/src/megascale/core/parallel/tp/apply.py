"""Tensor (and sequence) parallelism applied to a built GPT: ``apply_tensor_parallel(model, tp_mesh, ...)``.

Why explicit Megatron-style layers rather than DTensor's ``parallelize_module``: MegaScale's gains come from
controlling the communication itself — one all-gather shared by Q, K, V, gate and up of a parallel block, one
reduce-scatter for its summed attention and MLP outputs, each split into chunks that overlap the GEMMs
(``overlap.py``). DTensor's styles issue one collective per linear, and its async-TP overlap exists only for
CUDA symmetric memory. So compute runs on local shards with our own collectives, while every parameter
becomes a DTensor on the TP mesh (Shard for split weights, Replicate for the rest). The rest of the
ecosystem then sees the truth: ``torch.distributed.checkpoint`` reshards across layouts, FSDP2 composes
on a 2-D mesh, and gradient-norm clipping counts sharded parameters once and replicated ones once.

Layout per block, with sequence parallelism (SP) on; without it, activations are replicated and the
all-gather / reduce-scatter become identity / all-reduce:

    x (B, T/tp, D) → norm → [all-gather T] → Q,K,V,gate,up  (column-parallel: local heads, local ffn)
      → attention on H/tp heads, activation on ffn/tp → o, down (row-parallel) → [reduce-scatter T] → + x
    per-head q/k norms (qk_norm), inside attention: replicated weights over the local heads, gradients
      summed over tp (with or without SP: each rank's gradient covers its heads only)
    embedding: vocab rows split; lookups outside this rank's rows are zero, then reduce-scatter over T
    head: norm on shards → [all-gather T] → logits for this rank's vocabulary columns
    loss: vocabulary-parallel cross-entropy (``cross_entropy.py``)

Waits: every layer issuing a collective holds a ``wait_timer`` (``wait_timer.py``; untimed by default) that
spans its blocking waits in forward and backward (``ParallelRuntime.set_wait_timer`` sets it on the layers
``tp_layers`` finds): a rank slow to reach a collective shows as ``tp-...`` waits on its peers.

Dropout: all ranks of a TP group start from the same RNG state (the strategy seeds them alike), so dropout
on replicated activations matches across ranks; on sequence shards each rank masks its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from megascale.core import kernels
from megascale.core._dtensor import local
from megascale.core.model.attention import SelfAttention
from megascale.core.model.gpt import GPT, NextTokenLoss, TokenEmbedding
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.model.moe import MoE
from megascale.core.model.norm import LayerNorm, RMSNorm
from megascale.core.parallel.tp.comm import (
    SequenceSplitOverMesh,
    copy_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)
from megascale.core.parallel.tp.cross_entropy import vocab_parallel_cross_entropy
from megascale.core.parallel.tp.overlap import column_parallel_matmul, row_parallel_matmul
from megascale.core.parallel.wait_timer import WaitTimed, WaitTimer, untimed

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelLayerNorm",
    "TensorParallelRMSNorm",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "local",
    "tp_layers",
]


class _Distributor:
    """Turns parameters into DTensors on the TP mesh; a parameter shared by two modules (tied embeddings)
    is distributed once and shared again."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.done: dict[int, nn.Parameter] = {}

    def __call__(self, module: nn.Module, name: str, placements: Sequence[Placement]) -> None:
        param = getattr(module, name)
        if param is None:
            return
        if isinstance(param, DTensor):
            raise ValueError(
                f"{type(module).__name__}.{name} is already distributed: apply tensor parallelism once"
            )
        if id(param) not in self.done:
            dt = distribute_tensor(param.detach(), self.mesh, list(placements))
            self.done[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
        setattr(module, name, self.done[id(param)])


class _OnTPMesh:
    """TP modules keep the mesh (picklable, so models deep-copy) and derive the process group from it, and
    a ``wait_timer`` for their collectives' waits, which their autograd functions carry into backward."""

    mesh: DeviceMesh
    wait_timer: WaitTimer

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            # Under torch.compile (ParallelPlan.compile) their collectives, autograd functions carrying process
            # groups and DTensor-to-local views run eagerly (dynamo cannot trace them): a compiled block's
            # graph breaks around each TP layer, and what lies between them (attention core, activations,
            # residuals) is compiled.
            setattr(cls, "forward", torch.compiler.disable(cls.__dict__["forward"]))  # noqa: B010

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


class ColumnParallelLinear(_OnTPMesh, FanOutLinear):
    """A FanOutLinear with each weight split by output features over the TP group (Megatron column-parallel).

    Under SP the input is this rank's sequence shard and is all-gathered (once for all weights), chunked to
    overlap the GEMMs; outputs are (B, T, out/tp).
    """

    def __init__(
        self, dense: FanOutLinear, distribute: _Distributor, *, sequence_parallel: bool, chunks: int
    ):
        nn.ModuleDict.__init__(
            self, dict(dense.items())
        )  # keep the Projection children: same state-dict keys
        self.fused_bias = dense.fused_bias
        self.mesh, self.wait_timer = distribute.mesh, untimed
        self.sequence_parallel, self.chunks = sequence_parallel, chunks
        for _, proj in self.projections():
            distribute(proj, "weight", [Shard(0)])
            distribute(proj, "bias", [Shard(0)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = [local(p.weight) for _, p in self.projections()]
        biases = [None if name in self.fused_bias else local(p.bias) for name, p in self.projections()]
        return column_parallel_matmul(
            x, weights, biases, self.group, sequence_parallel=self.sequence_parallel, chunks=self.chunks,
            timer=self.wait_timer,
        )  # fmt: skip

    def bias_of(self, name: str) -> torch.Tensor | None:
        return local(super().bias_of(name))

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}, chunks={self.chunks}"


class RowParallelLinear(_OnTPMesh, FanInLinear):
    """A FanInLinear with each weight split by input features; partial sums reduced over the TP group
    (reduce-scattered to sequence shards under SP), chunked to overlap the GEMMs. Bias added once, after."""

    def __init__(self, dense: FanInLinear, distribute: _Distributor, *, sequence_parallel: bool, chunks: int):
        nn.ModuleDict.__init__(self, dict(dense.items()))
        self.bias = dense.bias
        self.mesh, self.wait_timer = distribute.mesh, untimed
        self.sequence_parallel, self.chunks = sequence_parallel, chunks
        for _, proj in self.projections():
            distribute(proj, "weight", [Shard(1)])
        distribute(self, "bias", [Replicate()])

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        weights = [local(p.weight) for _, p in self.projections()]
        y = row_parallel_matmul(
            list(xs), weights, self.group, sequence_parallel=self.sequence_parallel, chunks=self.chunks,
            timer=self.wait_timer,
        )  # fmt: skip
        bias = local(self.bias)
        if bias is None:
            return y
        if not self.sequence_parallel:
            return y + bias
        return y + copy_to_tp_region(bias, self.group, timer=self.wait_timer)

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}, chunks={self.chunks}"


def _replicated_weight(
    w: torch.Tensor | None, group: dist.ProcessGroup, sum_grads: bool, timer: WaitTimer
) -> torch.Tensor | None:
    # When each rank's gradient covers only a part (its tokens under SP, its heads inside attention), the
    # backward all-reduce makes it whole.
    w = local(w)
    return copy_to_tp_region(w, group, timer=timer) if (w is not None and sum_grads) else w


class TensorParallelRMSNorm(_OnTPMesh, RMSNorm):
    """RMSNorm with a replicated weight; under SP it runs on sequence shards. ``per_head``: a q/k norm inside
    attention, which sees this rank's heads only, so its gradient is summed over tp with or without SP."""

    def __init__(
        self, dense: RMSNorm, distribute: _Distributor, *, sequence_parallel: bool, per_head: bool = False
    ) -> None:
        nn.Module.__init__(self)
        self.eps, self.backend, self.weight = dense.eps, dense.backend, dense.weight
        self.mesh, self.sequence_parallel, self.wait_timer = distribute.mesh, sequence_parallel, untimed
        self.sum_grads = sequence_parallel or per_head
        distribute(self, "weight", [Replicate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _replicated_weight(self.weight, self.group, self.sum_grads, self.wait_timer)
        return kernels.rms_norm(x, w, self.eps, backend=self.backend)


class TensorParallelLayerNorm(_OnTPMesh, LayerNorm):
    """LayerNorm with replicated weight and bias; under SP it runs on sequence shards. ``per_head``: as for
    ``TensorParallelRMSNorm``."""

    def __init__(
        self, dense: LayerNorm, distribute: _Distributor, *, sequence_parallel: bool, per_head: bool = False
    ) -> None:
        nn.Module.__init__(self)
        self.eps, self.backend, self.weight, self.bias = dense.eps, dense.backend, dense.weight, dense.bias
        self.mesh, self.sequence_parallel, self.wait_timer = distribute.mesh, sequence_parallel, untimed
        self.sum_grads = sequence_parallel or per_head
        distribute(self, "weight", [Replicate()])
        distribute(self, "bias", [Replicate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _replicated_weight(self.weight, self.group, self.sum_grads, self.wait_timer)
        b = _replicated_weight(self.bias, self.group, self.sum_grads, self.wait_timer)
        return kernels.layer_norm(x, w, b, self.eps, backend=self.backend)


class VocabParallelEmbedding(_OnTPMesh, TokenEmbedding):
    """Embedding rows split over the TP group; each rank looks up the tokens it owns (zeros elsewhere) and
    the partial rows are summed: reduce-scattered to sequence shards under SP, all-reduced otherwise."""

    def __init__(self, dense: TokenEmbedding, distribute: _Distributor, *, sequence_parallel: bool) -> None:
        nn.Module.__init__(self)
        self.weight, self.dropout = dense.weight, dense.dropout
        self.mesh, self.sequence_parallel, self.wait_timer = distribute.mesh, sequence_parallel, untimed
        distribute(self, "weight", [Shard(0)])
        rows = self.weight.shape[0] // distribute.mesh.size()
        self.vocab_start = distribute.mesh.get_local_rank() * rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight)
        ids = tokens - self.vocab_start
        outside = (ids < 0) | (ids >= weight.shape[0])
        x = nn.functional.embedding(ids.masked_fill(outside, 0), weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            x = reduce_scatter_to_sp_region(x, self.group, timer=self.wait_timer)
        else:
            x = reduce_from_tp_region(x, self.group, timer=self.wait_timer)
        return self.dropout(x)


class VocabParallelCrossEntropy(_OnTPMesh, NextTokenLoss):
    """The next-token loss over this rank's vocabulary columns (see ``cross_entropy.py``)."""

    def __init__(self, dense: NextTokenLoss, mesh: DeviceMesh, padded_vocab_size: int) -> None:
        nn.Module.__init__(self)
        self.vocab_size, self.ignore_index, self.backend = dense.vocab_size, dense.ignore_index, dense.backend
        self.mesh, self.wait_timer = mesh, untimed
        self.vocab_start = mesh.get_local_rank() * (padded_vocab_size // mesh.size())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from every rank's columns (..., V/tp) → (..., V): for sampling."""
        parts = [torch.empty_like(logits) for _ in range(self.mesh.size())]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            targets,
            self.group,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            ignore_index=self.ignore_index,
            timer=self.wait_timer,
        )


def tp_layers(module: nn.Module) -> list[WaitTimed]:
    """The tensor-parallel layers inside ``module`` (``apply_tensor_parallel``'s): each holds the
    ``wait_timer`` of its collectives."""
    return [m for m in module.modules() if isinstance(m, _OnTPMesh)]


def apply_tensor_parallel(
    model: GPT,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    overlap: bool = True,
    overlap_chunks: int = 4,
) -> GPT:
    """Split ``model`` over the 1-D ``tp_mesh`` in place (and return it).

    Args:
        model: a GPT on the mesh's device whose weights are equal on every rank of the mesh (same seed, or
            loaded); each rank keeps its shard. A model built on the meta device stays on meta.
        tp_mesh: the tensor-parallel mesh (the innermost dimension of the strategy's mesh, so a TP group sits
            on one node's fast links).
        sequence_parallel: norms, dropout and residuals run on sequence shards (1/tp of the activation memory
            outside attention and MLP), with all-gather/reduce-scatter instead of all-reduce.
        overlap: split each TP collective into ``overlap_chunks`` pieces overlapped with the GEMMs.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D TP mesh; got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    model.config.check_tensor_parallel(tp)
    if overlap_chunks < 1:
        raise ValueError(f"overlap_chunks={overlap_chunks} must be >= 1")
    chunks = overlap_chunks if overlap else 1
    distribute = _Distributor(tp_mesh)

    def convert(module: nn.Module, parent: nn.Module) -> nn.Module | None:
        # norms inside the attention core (qk_norm) see this rank's heads only
        per_head = isinstance(parent, SelfAttention)
        if isinstance(module, FanOutLinear):
            return ColumnParallelLinear(
                module, distribute, sequence_parallel=sequence_parallel, chunks=chunks
            )
        if isinstance(module, FanInLinear):
            return RowParallelLinear(module, distribute, sequence_parallel=sequence_parallel, chunks=chunks)
        if isinstance(module, RMSNorm):
            return TensorParallelRMSNorm(
                module, distribute, sequence_parallel=sequence_parallel, per_head=per_head
            )
        if isinstance(module, LayerNorm):
            return TensorParallelLayerNorm(
                module, distribute, sequence_parallel=sequence_parallel, per_head=per_head
            )
        if isinstance(module, TokenEmbedding):
            return VocabParallelEmbedding(module, distribute, sequence_parallel=sequence_parallel)
        if isinstance(module, NextTokenLoss):
            return VocabParallelCrossEntropy(module, tp_mesh, model.config.padded_vocab_size)
        if isinstance(module, MoE):  # routed whole on every tp rank; its shared experts split as MLPs below
            module.sequence_parallel_split = SequenceSplitOverMesh(tp_mesh) if sequence_parallel else None
        return None

    # token counts must be multiples of tp under sequence parallelism (generation pads to it)
    model.sequence_multiple = tp if sequence_parallel else 1
    # The embedding goes first so a tied output projection finds its weight already distributed.
    targets = sorted(
        ((name, m) for name, m in model.named_modules() if name), key=lambda nm: nm[1] is not model.embed
    )
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = convert(module, parent)
        if new is not None:
            setattr(parent, attr, new)
    return model
