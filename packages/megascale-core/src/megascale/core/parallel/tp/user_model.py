"""Tensor parallelism for a model of the user's own, from a declarative plan of module-name patterns.

A model (any ``nn.Module`` in the tree) declares ``tensor_parallel_plan``: a dict, or a method returning one,
from module names relative to it (``fnmatch`` per name component: ``"layers.*.attn.q"``) to a style, in the
spirit of Hugging Face's ``tp_plan`` and torchtitan's plans. Megascale's own sequence parallelism and chunked
comm/GEMM overlap (``overlap.py``) then serve every column-then-row pair of ``nn.Linear`` layers, not only
megascale's GPT. Activations are (B, T, ...); under sequence parallelism (SP) rank r holds positions
[r·T/tp, (r+1)·T/tp).

| style | on | parameters | forward |
|---|---|---|---|
| ``colwise`` | nn.Linear | weight, bias Shard(0) | input replicated, or (SP) this rank's sequence shard all-gathered in chunks overlapped with the GEMM; output: this rank's out-features. Refused on a layer named like a fused projection (see below) |
| ``colwise_unfused`` | nn.Linear | as colwise | colwise, without the fused-name rule: says the layer is not a fused projection |
| ``rowwise`` | nn.Linear | weight Shard(1), bias replicated | input: this rank's in-features; partial outputs all-reduced, or (SP) reduce-scattered to sequence shards; bias added once |
| ``rowwise`` | nn.Embedding | rows Shard(0) | vocabulary parallel: ids outside this rank's rows look up zeros; all-reduced, or (SP) reduce-scattered: enters the sequence region |
| ``colwise_rep`` | nn.Linear | as colwise | colwise, then the output features gathered: every rank holds the whole output (an LM head feeding F.cross_entropy) |
| ``sequence_parallel`` | any (norms) | plain, replicated | runs on sequence shards under SP, where each rank's gradient covers its tokens only: the gradients are summed over tp. Without SP nothing changes. Also a block holding a LayerScale/ReZero gain of its own |
| ``replicated_with_grad_allreduce`` | any (per-head q/k norms) | plain, replicated | inside the tensor-parallel region each rank sees its heads only: gradients summed over tp |
| ``replicated_unsummed`` | any | plain, replicated | nothing: for a module that makes its parameters' gradients whole itself (its own collective); exempt from the first-forward check |
| ``position_embedding`` | nn.Embedding | plain, replicated | a learned position table whose output's dim -2 is the positions: under SP each rank keeps its positions' rows (backward: all-gathered, so the table's gradient is whole) |
| ``sequence_scatter`` | any | — | SP: its output split to this rank's sequence shard (backward: all-gathered): enters the sequence region |
| ``sequence_gather`` | any | — | SP: its first input gathered along the sequence (backward: this rank's slice, for a replicated consumer such as a value head) |
| ``split_region`` | any (attention core, dropout) | plain | runs on this rank's part (its heads between a colwise and a rowwise layer, or a sequence shard): random draws (dropout) come from the rank's own tensor-parallel stream (``rng.py``), so masks do not repeat across ranks |
| a torch ``ParallelStyle`` | as torch says | DTensor | handed to ``parallelize_module`` as is (no megascale overlap or SP); a replicated parameter's gradient that arrives Partial (torch's ``SequenceParallel``) is made whole (all-reduced over tp) as it is accumulated, so every ZeRO stage sees whole gradients |

How: a module keeps its identity, its parameter names and ``isinstance``; its class is swapped for a subclass
whose ``forward`` does the above (as FSDP2's ``fully_shard`` swaps classes). Split parameters become DTensors
on the TP mesh (checkpoints reshard, FSDP2 composes, clipping counts them once); compute runs on the local
shards. Summing replicated gradients over tp happens inside the autograd graph (the parameter is read through
``copy_to_tp_region`` during the forward), so it composes with FSDP2 and activation checkpointing.

The user's code between a ``colwise`` and a ``rowwise`` layer sees this rank's share of the features: it must
reshape with -1 for the head count (``q.view(B, T, -1, head_dim)``), and grouped-query models need kv heads
divisible by tp. Under SP the code between blocks sees (B, T/tp, D), including the input of a module holding
``colwise`` layers (the gather happens inside them, overlapped): read B and T from a projection's output
(``q = self.q(x); B, T = q.shape[:2]``), not from that input. A mistake there fails loudly (the row-parallel
layer then receives the wrong number of features). A plan that cannot apply is refused by
``check_tensor_parallel_plan`` before any collective; at run time an input that should be a sequence shard but
is not (a path around the region's entry) is refused by the layer that would gather it.

What is refused rather than silently wrong (each naming the module and the fix):
- a trainable plain parameter used on a part of the activations (a sequence shard, this rank's heads) that no
  style sums over tp: found in the first forward (``region_check.py``), before any optimizer step;
- plain ``colwise`` on a layer named like a fused projection (``FUSED_NAMES``: qkv, c_attn, query_key_value,
  in_proj, gate_up, w13, w_pack): rank r would hold a contiguous block of the fused output (all of q on rank
  0, v on rank 1), not its share of each part, and the model's ``chunk``/``split`` of the output would compute
  a different network. A fused-aware split (rank r holding its slice of each part) has no DTensor placement
  that ``torch.distributed.checkpoint`` can save (``_StridedShard`` on a 1-D mesh: "overlapping chunks"), so
  it is not offered: give each part its own ``nn.Linear`` (q, k, v; gate, up), each ``colwise``; a layer
  that is not fused despite its name: ``colwise_unfused``;
- a weight tied between modules the plan splits differently (one split, one left whole; or split along
  different dimensions): the tie would be silently broken. An embedding ``rowwise`` tied to an LM head
  ``colwise``/``colwise_rep`` splits both by vocabulary rows and stays tied.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from megascale.core._dtensor import is_dtensor, local
from megascale.core.parallel.tp.apply import _Distributor
from megascale.core.parallel.tp.comm import (
    all_gather_seq,
    copy_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)
from megascale.core.parallel.tp.overlap import column_parallel_matmul, row_parallel_matmul
from megascale.core.parallel.tp.region_check import (
    MARKS,
    PART_FEATURES,
    PART_SEQUENCE,
    install_region_check,
    mark_covered,
    mark_part,
)

__all__ = [
    "FUSED_NAMES",
    "TP_STYLES",
    "apply_tensor_parallel_plan",
    "check_tensor_parallel_plan",
    "check_tied_parameters",
    "find_tensor_parallel_plans",
    "make_replicated_grads_whole",
    "tensor_parallel_plan_of",
    "tied_parameter_sites",
]

TP_STYLES = (
    "colwise",
    "colwise_unfused",
    "rowwise",
    "colwise_rep",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "replicated_unsummed",
    "position_embedding",
    "sequence_scatter",
    "sequence_gather",
    "split_region",
)
_COLWISE = ("colwise", "colwise_unfused", "colwise_rep")
_SPLIT = (*_COLWISE, "rowwise")
FUSED_NAMES = ("qkv", "c_attn", "query_key_value", "in_proj", "gate_up", "w13", "w_pack")
"""Parts of layer names commonly given to fused projections (q‖k‖v, gate‖up in one Linear): plain
``colwise`` is refused on them (see the module docstring)."""


def tensor_parallel_plan_of(module: nn.Module) -> dict[str, Any] | None:
    """The plan ``module`` declares (a dict attribute ``tensor_parallel_plan``, or a method of that name
    returning one), or None."""
    plan = getattr(module, "tensor_parallel_plan", None)
    if callable(plan):
        plan = plan()
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{type(module).__name__}.tensor_parallel_plan is a {type(plan).__name__}: give a dict of "
            "module-name patterns -> styles"
        )
    return dict(plan)


def find_tensor_parallel_plans(root: nn.Module) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """(qualified name, module, plan) of every module in ``root``'s tree declaring a plan, outermost first."""
    found = []
    for name, module in root.named_modules():
        plan = tensor_parallel_plan_of(module)
        if plan is not None:
            found.append((name, module, plan))
    return found


# ---- checking -------------------------------------------------------------------------------------------


def _matches(module: nn.Module, plan: Mapping[str, Any], where: str) -> dict[str, tuple[nn.Module, Any]]:
    """{qualified name: (module, style)} for every plan entry; refuses unmatched and conflicting ones."""
    out: dict[str, tuple[nn.Module, Any]] = {}
    names = [(n, m) for n, m in module.named_modules() if n]
    for pattern, style in plan.items():
        parts = pattern.split(".")
        hits = [
            (n, m)
            for n, m in names
            if len(n.split(".")) == len(parts) and all(map(fnmatchcase, n.split("."), parts))
        ]
        if not hits:
            raise ValueError(f"tensor_parallel_plan of {where}: pattern {pattern!r} matches no submodule")
        for n, m in hits:
            if n in out and out[n][1] != style:
                raise ValueError(
                    f"tensor_parallel_plan of {where}: {n} is matched by two patterns with different styles "
                    f"({out[n][1]!r} and {style!r})"
                )
            out[n] = (m, style)
    return out


def _fits(size: int, tp: int, what: str, name: str, where: str) -> None:
    if size % tp:
        fitting = [t for t in range(1, size + 1) if size % t == 0 and t <= 64]
        raise ValueError(
            f"tensor_parallel_plan of {where}: {name} has {what}={size}, not divisible by tp={tp} "
            f"(tp can be one of {fitting}; or change the layer's size)"
        )


def _check_torch_style(style: Any, name: str, where: str, tp: int, sequence_parallel: bool) -> None:
    """torch's ``SequenceParallel`` takes its input as this rank's sequence shard and sums its weights'
    gradients over tp: on whole sequences (sequence_parallel=False) it would count every token tp times, and
    a DTensor output would meet megascale's layers, which take local tensors."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if not isinstance(style, SequenceParallel) or tp == 1:
        return
    if not sequence_parallel:
        raise ValueError(
            f"tensor_parallel_plan of {where}: {name} uses torch's SequenceParallel, which takes its input as a "
            "sequence shard, but sequence_parallel=False gives it whole sequences (its weights' gradients would "
            "count every token tp times): set sequence_parallel=True, or use 'sequence_parallel' (megascale's "
            "style, which does nothing without sequence parallelism)"
        )
    if not style.use_local_output:
        raise ValueError(
            f"tensor_parallel_plan of {where}: {name} uses torch's SequenceParallel with a DTensor output, which "
            "megascale's split layers (local tensors) cannot take: SequenceParallel(use_local_output=True), or "
            "megascale's 'sequence_parallel' style"
        )


def check_tensor_parallel_plan(
    module: nn.Module, plan: Mapping[str, Any], tp: int, *, sequence_parallel: bool, name: str = ""
) -> dict[str, tuple[nn.Module, Any]]:
    """Check ``plan`` against ``module`` for ``tp`` ranks without any collective (meta-device modules too) and
    return what each pattern matched. ValueError, naming the module and the pattern, for: a pattern matching
    nothing, an unknown style, a style on a layer it cannot split, sizes not divisible by tp, sequence
    parallelism without an entry into the sequence region, one module matched with two styles, or
    parameters already split (the plan applied twice)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    where = f"{name or '<root>'} ({type(module).__name__})"
    matched = _matches(module, plan, where)
    for n, (m, style) in matched.items():
        if isinstance(style, ParallelStyle):
            _check_torch_style(style, n, where, tp, sequence_parallel)
            continue
        if style not in TP_STYLES:
            raise ValueError(
                f"tensor_parallel_plan of {where}: {n}: unknown style {style!r}; one of {TP_STYLES}"
            )
        if any(is_dtensor(p) for p in m.parameters(recurse=False)):
            raise ValueError(
                f"tensor_parallel_plan of {where}: {n} already holds split (DTensor) parameters: a plan applies "
                "once (is it also split by configure_model, or applied twice?)"
            )
        if style == "rowwise" and isinstance(m, nn.Embedding):
            if m.max_norm is not None or m.sparse:
                raise ValueError(f"tensor_parallel_plan of {where}: {n}: a vocabulary-parallel embedding "
                                 "takes neither max_norm nor sparse gradients")  # fmt: skip
            _fits(m.num_embeddings, tp, "num_embeddings", n, where)
        elif style in _SPLIT:
            if not isinstance(m, nn.Linear):
                hint = " (an nn.Embedding splits by rows: 'rowwise')" if isinstance(m, nn.Embedding) else ""
                raise ValueError(
                    f"tensor_parallel_plan of {where}: {n} is a {type(m).__name__}; {style!r} splits an "
                    f"nn.Linear{hint}"
                )
            if style == "rowwise":
                _fits(m.in_features, tp, "in_features", n, where)
            else:
                _fits(m.out_features, tp, "out_features", n, where)
            fused = [f for f in FUSED_NAMES if f in n.rpartition(".")[2].lower()]
            if style == "colwise" and fused:
                raise ValueError(
                    f"tensor_parallel_plan of {where}: {n} is named like a fused projection ({fused[0]!r}: "
                    "q‖k‖v or gate‖up in one nn.Linear), and 'colwise' would give each rank a contiguous block "
                    "of its outputs (all of the first part on rank 0), not its share of each part: the model's "
                    "chunk/split of the output would then compute a different network. Give each part its own "
                    "nn.Linear, each 'colwise' (a fused split is not offered: torch.distributed.checkpoint "
                    f"cannot save its layout); if {n} is not fused, mark it 'colwise_unfused'"
                )
        elif style == "position_embedding" and not isinstance(m, nn.Embedding):
            raise ValueError(
                f"tensor_parallel_plan of {where}: {n} is a {type(m).__name__}; 'position_embedding' takes an "
                "nn.Embedding (a position table of your own: take this rank's positions of it in a module marked "
                "'sequence_scatter')"
            )
    styles = {n: s for n, (m, s) in matched.items() if isinstance(s, str)}
    enters = [n for n, s in styles.items()
              if s == "sequence_scatter" or (s == "rowwise" and isinstance(matched[n][0], nn.Embedding))]  # fmt: skip
    if sequence_parallel and tp > 1 and any(s in _SPLIT for s in styles.values()) and not enters:
        raise ValueError(
            f"tensor_parallel_plan of {where}: with sequence_parallel=True the activations between blocks are "
            "sequence shards, but nothing in the plan splits the sequence: give the embedding 'rowwise' "
            "(vocabulary parallel) or the module that produces the first hidden states 'sequence_scatter'; or "
            "set sequence_parallel=False"
        )
    check_tied_parameters(module, {n: s for n, (_, s) in matched.items()}, where=where)
    return matched


def _placement(module: nn.Module, style: Any, param: str) -> str | None:
    """How ``style`` splits ``module``'s parameter ``param``: a placement's name, or None (left whole)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(style, ParallelStyle):
        return f"{type(style).__name__} (torch)"
    if style in _COLWISE or (style == "rowwise" and isinstance(module, nn.Embedding)):
        return "split by rows, Shard(0)"  # a Linear's out-features, an Embedding's vocabulary rows
    if style == "rowwise":
        return "split by columns, Shard(1)" if param == "weight" else "replicated DTensor"
    return None


def tied_parameter_sites(root: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """{id(parameter): [(module name, module, attribute), ...]} for every parameter held by two modules or
    more under ``root`` (tied weights)."""
    sites: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, m in root.named_modules():
        for attr, p in m._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append((name, m, attr))
    return {k: v for k, v in sites.items() if len(v) > 1}


def check_tied_parameters(root: nn.Module, styles: Mapping[str, Any], *, where: str) -> None:
    """Refuse a weight tied between modules that ``styles`` ({module name under ``root``: style}) would
    split differently, one of them split and another left whole included: the tie would be broken."""
    for sites in tied_parameter_sites(root).values():
        how = {f"{n}.{attr}": _placement(m, styles.get(n), attr) for n, m, attr in sites}
        if len(set(how.values())) < 2:
            continue
        said = ", ".join(f"{k}: {v or 'left whole (not in the plan)'}" for k, v in how.items())
        raise ValueError(
            f"tensor_parallel_plan of {where}: {' and '.join(how)} are one tied parameter, but the plan splits "
            f"its uses differently ({said}): they would be silently untied (one split copy, one whole), and "
            "their gradients wrong from the second step. Split every use the same way (an embedding 'rowwise' "
            "tied to an LM head 'colwise' or 'colwise_rep': both by vocabulary rows), or untie them"
        )


# ---- the sequence region --------------------------------------------------------------------------------


class _SequenceRegion:
    """The full sequence length of the current forward, recorded where the sequence is split, checked where
    it is gathered. None on ranks that hold no entry (later pipeline stages): nothing to check there."""

    def __init__(self) -> None:
        self.length: int | None = None

    def enter(self, length: int) -> None:
        self.length = length

    def check(self, x: torch.Tensor, tp: int, name: str) -> None:
        if x.dim() < 3:
            raise ValueError(
                f"{name}: under sequence parallelism inputs are (B, T/tp, ...), got {tuple(x.shape)}"
            )
        if self.length is not None and x.shape[1] * tp != self.length:
            raise RuntimeError(
                f"{name}: its input has {x.shape[1]} positions, which gathered over tp={tp} would make "
                f"{x.shape[1] * tp}, but the sequence entering the sequence-parallel region has {self.length}: the "
                "input did not come through the region (it is not a sequence shard). Route it through the "
                "embedding or a 'sequence_scatter' module, or give its consumer 'sequence_gather'"
            )


# ---- autograd pieces ------------------------------------------------------------------------------------


class _SplitToSP(torch.autograd.Function):
    """forward: this rank's sequence shard of a replicated (B, T, ...) (positions on ``dim``, 1 by default);
    backward: all-gather on that dim, so a replicated producer gets its whole gradient on every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[dim] % tp:
            raise ValueError(
                f"sequence parallelism splits {x.shape[dim]} positions over tp={tp}: not divisible"
            )
        ctx.group, ctx.dim = group, dim
        n = x.shape[dim] // tp
        return x.narrow(dim, rank * n, n).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.dim == 1:
            return all_gather_seq(grad, ctx.group), None, None
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


class _GatherForReplicated(torch.autograd.Function):
    """forward: all-gather on ``dim``; backward: this rank's slice. For a consumer that computes the same on
    every rank (its gradient is then the same everywhere, and this rank's part is its slice), unlike
    Megatron's gather whose backward sums partial gradients of a split consumer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
        if dim == 1:
            return all_gather_seq(x, group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = dist.get_rank(ctx.group) * ctx.size
        return grad.narrow(ctx.dim, start, ctx.size).contiguous(), None, None


# ---- the styles: forwards swapped in ---------------------------------------------------------------------


class _TPLayer:
    """State every swapped layer keeps (the mesh, not the group: modules stay picklable)."""

    _tp_mesh: DeviceMesh
    _tp_sp: bool
    _tp_chunks: int
    _tp_region: _SequenceRegion
    _tp_name: str
    _megascale_tp_marks = False  # a first-forward check is watching: mark outputs (region_check.py)

    def _mark(self, y: Any, part: str | None) -> Any:
        return mark_part(y, part) if self._megascale_tp_marks else y

    @property
    def _tp_group(self) -> dist.ProcessGroup:
        return self._tp_mesh.get_group()


class _Colwise(_TPLayer):
    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tp_sp:
            self._tp_region.check(x, self._tp_mesh.size(), self._tp_name)
        (y,) = column_parallel_matmul(x, [local(self.weight)], [local(self.bias)], self._tp_group,
                                      sequence_parallel=self._tp_sp, chunks=self._tp_chunks)  # fmt: skip
        return self._mark(y, PART_FEATURES)


class _ColwiseRep(_Colwise):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _GatherForReplicated.apply(super().forward(x), self._tp_group, -1 % (x.dim()))
        return self._mark(y, None)


class _Rowwise(_TPLayer):
    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2
        x = x.unsqueeze(0) if flat else x
        y = row_parallel_matmul([x], [local(self.weight)], self._tp_group, sequence_parallel=self._tp_sp,
                                chunks=self._tp_chunks)  # fmt: skip
        bias = local(self.bias)
        if bias is not None:
            y = y + (copy_to_tp_region(bias, self._tp_group) if self._tp_sp else bias)
        return self._mark(y.squeeze(0) if flat else y, PART_SEQUENCE if self._tp_sp else None)


class _VocabParallelEmbedding(_TPLayer):
    weight: torch.Tensor
    padding_idx: int | None
    scale_grad_by_freq: bool

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight)
        start = self._tp_mesh.get_local_rank() * weight.shape[0]
        ids = ids - start
        outside = (ids < 0) | (ids >= weight.shape[0])
        pad = None if self.padding_idx is None else self.padding_idx - start
        pad = pad if pad is not None and 0 <= pad < weight.shape[0] else None
        x = F.embedding(ids.masked_fill(outside, 0), weight, pad, scale_grad_by_freq=self.scale_grad_by_freq)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if not self._tp_sp:
            return self._mark(reduce_from_tp_region(x, self._tp_group), None)
        self._tp_region.enter(ids.shape[1])
        return self._mark(reduce_scatter_to_sp_region(x, self._tp_group), PART_SEQUENCE)


class _PositionEmbedding(_TPLayer):
    """A learned position table (nn.Embedding; its output's dim -2 holds the positions): under SP each rank
    keeps its own positions' rows; backward all-gathers them, so the table's gradient is whole everywhere."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        out = super().forward(positions)  # type: ignore[misc]
        if not self._tp_sp:
            return out
        return self._mark(_SplitToSP.apply(out, self._tp_group, out.dim() - 2), PART_SEQUENCE)


class _GradSumOverTP(_TPLayer):
    """Reads its own parameters through copy_to_tp_region (identity forward, all-reduce backward)."""

    _parameters: dict[str, Any]
    _tp_sum_grads: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._tp_sum_grads:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        saved = dict(self._parameters)
        for n, p in saved.items():
            if p is not None:
                self._parameters[n] = copy_to_tp_region(p, self._tp_group)
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._parameters.update(saved)


class _SequenceScatter(_TPLayer):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not self._tp_sp:
            return out
        self._tp_region.enter(out.shape[1])
        return self._mark(_SplitToSP.apply(out, self._tp_group), PART_SEQUENCE)


class _SequenceGather(_TPLayer):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._tp_sp:
            self._tp_region.check(x, self._tp_mesh.size(), self._tp_name)
            x = self._mark(_GatherForReplicated.apply(x, self._tp_group, 1), None)
        return self._mark(super().forward(x, *args, **kwargs), None)  # type: ignore[misc]


_SWAPPED: dict[tuple[type, type], type] = {}


def _swap(module: nn.Module, mixin: type, **state: Any) -> None:
    cls = type(module)
    if (mixin, cls) not in _SWAPPED:
        name = mixin.__name__.strip("_") + cls.__name__
        _SWAPPED[mixin, cls] = type(name, (mixin, cls), {"__module__": cls.__module__})
    module.__class__ = _SWAPPED[mixin, cls]
    for key, value in state.items():
        setattr(module, f"_tp_{key}", value)


# ---- applying -------------------------------------------------------------------------------------------


def apply_tensor_parallel_plan(
    module: nn.Module,
    plan: Mapping[str, Any],
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    overlap_chunks: int = 1,
    name: str = "",
    check_regions: bool = True,
) -> nn.Module:
    """Split ``module`` over the 1-D ``tp_mesh`` as ``plan`` says, in place (see the module docstring); checks
    the plan first. Works on meta-device modules (compute happens after materialisation).

    Args:
        sequence_parallel: activations between blocks are sequence shards.
        overlap_chunks: pieces each TP collective is split into, overlapped with the GEMMs (1: none).
        name: the module's qualified name, for messages.
        check_regions: watch the first forward for trainable plain parameters used on a part of the
            activations that no style sums over tp, and refuse them by name (``region_check.py``).
            ``parallelize`` turns it off here and watches the whole LightningModule instead.
    """
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    tp = tp_mesh.size()
    matched = check_tensor_parallel_plan(module, plan, tp, sequence_parallel=sequence_parallel, name=name)
    distribute = _Distributor(tp_mesh)
    region = _SequenceRegion()
    torch_styles: dict[str, Any] = {}
    for n, (m, style) in matched.items():
        if isinstance(style, ParallelStyle):
            torch_styles[n] = style
            continue
        state = dict(mesh=tp_mesh, sp=sequence_parallel, chunks=overlap_chunks, region=region, name=n)
        covered = True  # the style takes care of the module's own parameters (region_check.py)
        if style in _COLWISE:
            distribute(m, "weight", [Shard(0)])
            distribute(m, "bias", [Shard(0)])
            _swap(m, _ColwiseRep if style == "colwise_rep" else _Colwise, **state)
        elif style == "rowwise" and isinstance(m, nn.Embedding):
            distribute(m, "weight", [Shard(0)])
            _swap(m, _VocabParallelEmbedding, **state)
        elif style == "rowwise":
            distribute(m, "weight", [Shard(1)])
            distribute(m, "bias", [Replicate()])
            _swap(m, _Rowwise, **state)
        elif style in ("sequence_parallel", "replicated_with_grad_allreduce"):
            # on sequence shards (SP) or inside the TP region, each rank's gradient is a part of the whole
            split = sequence_parallel or style != "sequence_parallel"
            _swap(m, _GradSumOverTP, **state, sum_grads=split)
            m._megascale_split_region = split  # type: ignore[assignment]  # its dropout: the tp stream
            covered = split
        elif style == "split_region":
            m._megascale_split_region = True  # type: ignore[assignment]  # parallelize forks its RNG stream
            covered = False  # its parameters, if any, see this rank's part
        elif style == "position_embedding":
            _swap(m, _PositionEmbedding, **state)
        elif style == "sequence_scatter":
            _swap(m, _SequenceScatter, **state)
        elif style == "sequence_gather":
            _swap(m, _SequenceGather, **state)
        # "replicated_unsummed": nothing to do but exempt it from the check
        if covered:
            mark_covered(m)
    if torch_styles:
        parallelize_module(module, tp_mesh, torch_styles)
        for n, style in torch_styles.items():
            m = module.get_submodule(n)
            mark_covered(m)
            _mark_torch_style_outputs(m, style)
        make_replicated_grads_whole(module)
    if check_regions and tp > 1:
        install_region_check(module, [(name, module)], tp=tp, sequence_parallel=sequence_parallel)
    return module


def _mark_torch_style_outputs(module: nn.Module, style: Any) -> None:
    """Mark what a torch style's (local) output holds, for the first-forward check."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    layouts = getattr(style, "output_layouts", None)
    layout = layouts[0] if isinstance(layouts, tuple) else layouts
    if isinstance(style, SequenceParallel) or (isinstance(layout, Shard) and layout.dim == 1):
        part: str | None = PART_SEQUENCE
    elif isinstance(style, ColwiseParallel) and isinstance(layout, Shard):
        part = PART_FEATURES
    elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
        part = None
    else:
        return
    setattr(module, MARKS, False)

    def hook(m: nn.Module, args: Any, out: Any) -> Any:
        return mark_part(out, part) if getattr(m, MARKS, False) and not is_dtensor(out) else out

    module.register_forward_hook(hook)


def _whole_grad(p: torch.Tensor) -> None:
    g = p.grad
    if g is not None and is_dtensor(g) and any(pl.is_partial() for pl in g.placements):  # type: ignore[attr-defined]
        p.grad = g.redistribute(g.device_mesh, p.placements)  # type: ignore[attr-defined]


def make_replicated_grads_whole(module: nn.Module) -> int:
    """Give every DTensor parameter of ``module`` with a Replicate placement a post-accumulate-grad hook that
    turns a Partial (unreduced) gradient into the parameter's own placements (an all-reduce over tp); returns
    how many got one.

    Why: torch's ``SequenceParallel`` leaves its replicated weights' gradients Partial. DTensor-aware code
    sums them when it needs to, but data-parallel reduction works on the local tensors: ZeRO-1 reduced the
    unreduced piece as if whole and the tp ranks diverged (0.017 after a few steps). Registered at
    parallelisation, before ZeRO's hooks, so every ZeRO stage sees the whole gradient. Meta-device parameters
    are skipped: call it again once they are materialised (``parallelize`` does)."""
    hooked = 0
    for p in module.parameters():
        if not is_dtensor(p) or p.is_meta or getattr(p, "_megascale_whole_grad", False):
            # meta: a hook registered on a meta tensor is lost (and blocks later ones) when materialisation
            # gives it memory; parallelize registers them after materialising
            continue
        if any(isinstance(pl, Replicate) for pl in p.placements):  # type: ignore[attr-defined]
            # a frozen parameter may train later (BaseFinetuning): torch registers hooks only on tensors that
            # require grad, and keeps them when requires_grad changes; so it is switched on just to register
            frozen = not p.requires_grad
            p.requires_grad_(True)
            try:
                p.register_post_accumulate_grad_hook(_whole_grad)
            finally:
                p.requires_grad_(not frozen)
            p._megascale_whole_grad = True  # type: ignore[attr-defined]
            hooked += 1
    return hooked
