"""Plan a model of your own: memory per rank from an ``nn.Module``'s actual parameters, its
``tensor_parallel_plan`` and, when given one micro-batch to run, its measured activations.

The GPT planner (``memory.py``) knows megascale's GPT layer by layer; for any other module it knows only what the
module exposes, so this is what it counts:

- **Parameters, gradients, optimizer state** per ZeRO stage, from the module's parameters (a meta-device module
  will do; shared parameters count once), split as the ``tensor_parallel_plan`` declared in its tree splits them:
  ``colwise``/``colwise_rep`` split a Linear's weight and bias over tp, ``rowwise`` its weight (the bias stays
  whole) or an Embedding's rows, and torch's ``ColwiseParallel``/``RowwiseParallel`` alike; everything else is
  replicated. fp32 master weights and gradients and ``k`` fp32 optimizer states per parameter, sharded over dp
  as ``memory.py`` states (ZeRO-1: optimizer state; ZeRO-2/3: all three).
- **Gathered parameters** under ZeRO-2 (every parameter in the compute dtype, forward to backward) and ZeRO-3
  (two units at a time), with the units megascale makes of this module (``parallel.compose``: its
  ``pipeline_layers()`` or its plain ``ModuleList``/``ModuleDict`` entries, grouped up to ``bucket_size_mb``).
- **Activations**, measured, not predicted: ``measure_activations`` runs one micro-batch forward of the dense
  module on this machine and counts what autograd saves with ``SavedTensorMeter`` (every tensor, per storage).
  That is the tp = 1 figure for that micro-batch; with tp > 1 it is reported as an upper bound, since which of
  the module's activations the plan splits (and sequence parallelism shards) is not modelled. Without a
  measurement the activations are left out and ``RankMemoryOfModule.activations`` is None, named in ``missing``.

Not modelled here, and said so in ``not_modelled``: pipeline parallelism (refused: a module's split into stages
is not known here; plan each stage's module on its own), the saved activations' split over tp/SP, activation
checkpointing (measure with it on instead), gradient buckets and other communication buffers, workspace (logits
and their gradient alive at once), and step time (there is no FLOP count of an arbitrary module; the GPT
planner's throughput model needs the layer shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from megascale.core.plan.layout import OPTIMIZER_STATES

__all__ = ["RankMemoryOfModule", "measure_activations", "module_memory", "parameters_per_rank"]

_SPLIT_WEIGHT_AND_BIAS = ("colwise", "colwise_rep")


def _style_name(style: Any) -> str | None:
    """A megascale style string, or torch's ParallelStyle mapped to its megascale kin."""
    if isinstance(style, str):
        return style
    name = type(style).__name__
    return {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise"}.get(name)


def _split(model: nn.Module, tp: int, sequence_parallel: bool) -> dict[int, int]:
    """{id(parameter): elements per tp rank} for the parameters the declared plans split (module docstring)."""
    split: dict[int, int] = {}
    if tp <= 1:
        return split
    from megascale.core.parallel.tp.user_model import check_tensor_parallel_plan, find_tensor_parallel_plans

    plans = find_tensor_parallel_plans(model)
    if not plans:
        raise ValueError(
            f"{type(model).__name__} declares no tensor_parallel_plan, so megascale cannot split it over "
            f"tp={tp}: give it one (module-name patterns -> 'colwise'/'rowwise'/...), or plan tp=1"
        )
    for name, owner, plan in plans:
        matched = check_tensor_parallel_plan(owner, plan, tp, sequence_parallel=sequence_parallel, name=name)
        for module, style in matched.values():
            kind = _style_name(style)
            for pname, p in module.named_parameters(recurse=False):
                if kind in _SPLIT_WEIGHT_AND_BIAS or (kind == "rowwise" and pname == "weight"):
                    split[id(p)] = p.numel() // tp
    return split


def _count(parameters: Iterable[nn.Parameter], split: dict[int, int]) -> int:
    seen: set[int] = set()
    total = 0
    for p in parameters:
        if id(p) not in seen:  # a shared (tied) parameter counts once
            seen.add(id(p))
            total += split.get(id(p), p.numel())
    return total


def parameters_per_rank(model: nn.Module, tp: int = 1, sequence_parallel: bool = True) -> int:
    """Elements of ``model``'s parameters one tensor-parallel rank holds, split as the ``tensor_parallel_plan``
    declared in its tree says (module docstring). With tp > 1 and no plan anywhere, a ValueError: megascale
    would refuse the module too."""
    return _count(model.parameters(), _split(model, tp, sequence_parallel))


def _largest_unit(model: nn.Module, bucket_size_mb: float, split: dict[int, int]) -> int:
    """Elements (per tp rank) of the largest ZeRO-3 unit megascale makes of ``model``, or of the whole module
    when it finds no layers to make units of (the root then holds every parameter)."""
    from megascale.core.parallel.compose import _unit_segments
    from megascale.core.parallel.zero.fsdp import group_layers

    segments = _unit_segments(model, module_lists=True)
    units = [unit for seg in segments for unit in group_layers(seg, bucket_size_mb)]
    if not units:
        return _count(model.parameters(), split)
    return max(_count((p for m in unit for p in m.parameters()), split) for unit in units)


def measure_activations(
    model: nn.Module, step: Callable[[], torch.Tensor], ignore: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes autograd saves for backward while ``step()`` runs one micro-batch forward of ``model`` and returns
    its loss (counted per storage by ``SavedTensorMeter``; parameters and ``ignore`` excluded). The graph is
    dropped afterwards without a backward. Run it on a dense module at the micro-batch size to plan for."""
    from megascale.core.memory_meter import SavedTensorMeter

    meter = SavedTensorMeter(ignore=[*model.parameters(), *model.buffers(), *ignore])
    with meter:
        loss = step()
    saved = meter.current
    del loss
    return int(saved)


@dataclass(frozen=True)
class RankMemoryOfModule:
    """Predicted bytes on one rank for a module of your own (module docstring says what is counted)."""

    parameters: float
    gradients: float
    optimizer_state: float
    gathered_parameters: float
    activations: float | None  # measured for one micro-batch; None: not measured
    parameters_per_rank: int  # elements, after the tp split
    missing: tuple[str, ...] = ()
    not_modelled: tuple[str, ...] = field(default=())

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        """What is counted (activations only when measured): a lower bound for the rank's peak."""
        return self.states + self.gathered_parameters + (self.activations or 0.0)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["total"] = self.total
        return out


def module_memory(
    model: nn.Module,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    sequence_parallel: bool = True,
    bucket_size_mb: float = 25.0,
    activations: float | None = None,
) -> RankMemoryOfModule:
    """Memory of one rank training ``model`` split tp × dp (ZeRO ``zero_stage``), as the module docstring says.

    Args:
        activations: bytes from ``measure_activations`` (one micro-batch, dense module), or None.

    Raises:
        ValueError: for pp > 1 (a module's pipeline split is not modelled), an unknown optimizer or precision,
            or tp > 1 without a ``tensor_parallel_plan`` (or with one that cannot split the module over tp).
    """
    if pp > 1:
        raise ValueError(
            "megascale plan cannot split a module of your own into pipeline stages (which layers go where, and "
            "what crosses between them, is not known here): plan each stage's module with pp=1, or use a GPT"
        )
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_STATES)}")
    if precision not in ("bf16-mixed", "32-true"):
        raise ValueError(f"precision={precision!r} must be 'bf16-mixed' or '32-true'")
    if tp < 1 or dp < 1 or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"tp={tp}, dp={dp} must be >= 1 and zero_stage={zero_stage} one of 0-3")
    split = _split(model, tp, sequence_parallel)
    p = _count(model.parameters(), split)
    zero = zero_stage if dp > 1 else 0
    k = OPTIMIZER_STATES[optimizer]
    c = 2 if precision == "bf16-mixed" else 4
    sharded = -(-p // dp)
    gathered = 0.0
    if zero == 2:
        gathered = float(p * c)
    elif zero == 3:
        gathered = 2.0 * _largest_unit(model, bucket_size_mb, split) * c
    missing = () if activations is not None else ("activations (give measure_activations' bytes)",)
    not_modelled = [
        "step time (no FLOP count of an arbitrary module)",
        "communication buffers (gradient buckets)",
        "workspace (logits and their gradient at once)",
        "activation checkpointing (measure with it on)",
    ]
    if tp > 1 and activations is not None:
        not_modelled.append(
            "the activations' split over tp / sequence parallelism: the dense figure is an upper bound"
        )
    return RankMemoryOfModule(
        parameters=4.0 * (sharded if zero >= 2 else p),
        gradients=4.0 * (sharded if zero >= 2 else p),
        optimizer_state=4.0 * k * (p if zero == 0 else sharded),
        gathered_parameters=gathered,
        activations=None if activations is None else float(activations),
        parameters_per_rank=p,
        missing=missing,
        not_modelled=tuple(not_modelled),
    )
