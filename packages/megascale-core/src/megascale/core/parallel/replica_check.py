"""A cheap run-time check that the ranks meant to hold equal tensors do: the safety net for what no rule caught.

Data-parallel replicas hold the same parameters and, after the gradient reduction, the same gradients
(ZeRO-0; ZeRO-1's values once gathered); the ranks of a tensor-parallel group hold the same copy of every
parameter that is not split (plain parameters, Replicate-placed DTensors) and, once its gradient is summed
where it must be, the same gradient. When they do not, training goes on silently with replicas that drift
apart (a norm left out of a tensor-parallel plan: 0.054 after 3 AdamW steps; a gradient reduction that
missed a parameter). This compares, at the first optimizer steps, a checksum of each such tensor across the
groups that should agree and stops the run with one error naming the parameters, gradient or value, the
group, the disagreeing ranks and the usual cause.

    check_replicas(entries, {"dp": dp_group, "tp": tp_group}, what="gradient")   # any training loop
    ReplicaGuard(steps=2)   # what MegaScaleStrategy(replica_check_steps=2) runs around each optimizer step

Checksum: float64 sum and sum of squares of each tensor's local values; one all-gather of all of them (and
of each rank's group membership, so every rank reaches the same verdict) per check. Tolerance: replicas
computed the same way are usually bit-equal; ``16·eps(dtype)`` relative to the largest the sum could be
(``sqrt(numel·sumsq)``) leaves room for a nondeterministic kernel's order of sums, while a partial gradient
or a missed reduction differs by O(1) of it.

Cost, per check: two reductions over every local parameter (values) or gradient, i.e. reading them once
more, and an all-gather of 24 bytes per tensor per rank (a 7B model's ~300 tensors: 7 KB per rank); the
value check after a ZeRO-1 step first waits for the parameter gather that would otherwise overlap the next
forward. Two checks per optimizer step for the first ``steps`` steps (default 2), then nothing.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.core._dtensor import is_dtensor, local
from megascale.core.parallel.tp.comm import all_gather_flat

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from megascale.core.parallel.compose import ParallelRuntime

__all__ = ["CAUSES", "ReplicaEntry", "ReplicaGuard", "ReplicaMismatchError", "agree_over", "check_replicas"]

CAUSES: dict[tuple[str, str], str] = {
    ("tp", "gradient"): (
        "a parameter used in the sequence-parallel or tensor-parallel region (on sequence shards, or on this "
        "rank's heads) whose gradient no style sums over tp: mark its module 'sequence_parallel' (a norm on "
        "sequence shards, a block holding a gain) or 'replicated_with_grad_allreduce' (inside attention) in "
        "the tensor_parallel_plan"
    ),
    ("tp", "value"): (
        "the tensor-parallel ranks started from different values (a module initialised outside the strategy's "
        "seeding, a random draw that differs per rank) or stepped differently (weights changed on one rank)"
    ),
    ("dp", "gradient"): (
        "the data-parallel gradient reduction missed the parameter (it became trainable or joined the "
        "optimizer after setup), or code changed one rank's gradient after the reduction"
    ),
    ("dp", "value"): (
        "the data-parallel replicas hold different values: weights changed on one rank outside the optimizer "
        "step, or optimizer states that differ"
    ),
    ("edp", "gradient"): (
        "the experts' gradient averaging over the ranks holding the same experts missed the parameter, or "
        "code changed one rank's expert gradient after it"
    ),
    ("edp", "value"): (
        "ranks holding the same experts hold different values: expert weights changed on one rank outside "
        "the optimizer step"
    ),
}


class ReplicaMismatchError(RuntimeError):
    """Ranks that should hold equal tensors do not (raised on every rank of the check, with the same text)."""


@dataclass(frozen=True)
class ReplicaEntry:
    """A tensor to compare: ``name`` (a parameter's), its local values (None: absent, e.g. no gradient), and
    the labels of the groups over which it must be equal."""

    name: str
    tensor: Tensor | None
    groups: tuple[str, ...]


def _checksums(entries: Sequence[ReplicaEntry], device: torch.device) -> Tensor:
    """(present, sum, sum of squares) per entry, float64 on ``device``: computed where each tensor lives and
    moved together (no host sync per tensor)."""
    rows = []
    for e in entries:
        if e.tensor is None:
            rows.append(torch.zeros(3, dtype=torch.float64, device=device))
            continue
        x = e.tensor.detach()
        one = torch.ones((), dtype=torch.float64, device=x.device)
        row = torch.stack([one, x.sum(dtype=torch.float64), x.double().square().sum()])
        rows.append(row.to(device, non_blocking=True))
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device=device)


def _close(a: Tensor, b: Tensor, numel: int, rtol: float) -> bool:
    """Rows (present, sum, sumsq) ``a`` and ``b`` agree within ``rtol`` (see the module docstring)."""
    if bool(torch.equal(a, b)) or (a[0] == 0 and b[0] == 0):
        return True
    if a[0] != b[0]:
        return False  # present on one rank only
    if bool(a.isnan().any()) or bool(b.isnan().any()):
        return bool(torch.equal(a.isnan(), b.isnan()))  # NaN (a diverged run) on both is no disagreement
    sumsq = max(float(a[2]), float(b[2]), 0.0)
    scale = math.sqrt(max(numel, 1) * sumsq)
    return abs(float(a[1] - b[1])) <= rtol * scale and abs(float(a[2] - b[2])) <= 2 * rtol * sumsq


def check_replicas(
    entries: Sequence[ReplicaEntry],
    groups: Mapping[str, dist.ProcessGroup | None],
    *,
    what: str,
    gather_group: dist.ProcessGroup | None = None,
    step: int | None = None,
    rtol: float | None = None,
    note: str = "",
) -> None:
    """Raise ``ReplicaMismatchError`` on every rank of ``gather_group`` when ranks of a group in ``groups`` hold
    different values of an entry (see the module docstring).

    Args:
        entries: the same names in the same order on every rank of ``gather_group``.
        groups: label ("dp", "tp", ...) -> the process group of this rank over which the entries carrying
            that label must agree (None or size 1: nothing to compare).
        what: "gradient" or "value", for the message and the usual cause (``CAUSES``).
        gather_group: the ranks taking part (one all-gather): every rank of each group of ``groups`` must be
            in it; default the world. Ranks holding different entries (pipeline stages) need separate ones.
        step: the optimizer step, for the message.
        rtol: relative tolerance; default ``16·eps`` of each tensor's dtype.
        note: appended to the message (how to turn the check off).
    """
    labels = [k for k, g in groups.items() if g is not None and dist.get_world_size(g) > 1]
    if not labels:
        return
    # where the collective runs: the tensors' device (NCCL needs CUDA tensors), else the CPU
    device = next((e.tensor.device for e in entries if e.tensor is not None), torch.device("cpu"))
    names = zlib.crc32("\0".join(e.name for e in entries).encode())
    membership = [float(min(dist.get_process_group_ranks(groups[k]))) for k in labels]  # type: ignore[arg-type]
    head = torch.tensor([float(names), *membership], dtype=torch.float64, device=device)
    mine = torch.cat([head, _checksums(entries, device).flatten()])
    world = dist.get_world_size(gather_group)
    every = mine.new_empty(world * mine.numel())
    all_gather_flat(every, mine, group=gather_group)
    every = every.view(world, -1).cpu()
    if not bool((every[:, 0] == every[0, 0]).all()):
        raise ValueError(
            f"check_replicas: the ranks of the gather group passed different entries ({len(entries)} here): pass "
            "the same tensors in the same order on every rank (pipeline stages: one gather group per stage)"
        )
    tensors = every[:, 1 + len(labels) :].reshape(world, len(entries), 3)
    global_rank = [
        dist.get_global_rank(gather_group, i) if gather_group is not None else i for i in range(world)
    ]
    found: list[str] = []
    causes: list[str] = []
    for li, label in enumerate(labels):
        parts: dict[float, list[int]] = {}
        for i in range(world):
            parts.setdefault(float(every[i, 1 + li]), []).append(i)
        for ranks in parts.values():
            for ei, entry in enumerate(entries):
                if label not in entry.groups or len(ranks) < 2:
                    continue
                numel = entry.tensor.numel() if entry.tensor is not None else 0
                tol = rtol if rtol is not None else _rtol(entry.tensor)
                ref = tensors[ranks[0], ei]
                off = [i for i in ranks[1:] if not _close(tensors[i, ei], ref, numel, tol)]
                if not off:
                    continue
                said = ", ".join(f"rank {global_rank[i]}: {_show(tensors[i, ei])}" for i in off[:3]) + (
                    f" and {len(off) - 3} more" if len(off) > 3 else ""
                )
                found.append(
                    f"{entry.name} over {label} ranks {[global_rank[i] for i in ranks]}: rank {global_rank[ranks[0]]} "
                    f"has {_show(ref)}, {said}"
                )
                cause = CAUSES.get((label, what))
                if cause is not None and cause not in causes:
                    causes.append(cause)
    if not found:
        return
    shown = "\n  ".join(found[:10]) + (f"\n  ... and {len(found) - 10} more" if len(found) > 10 else "")
    at = f" at optimizer step {step}" if step is not None else ""
    raise ReplicaMismatchError(
        f"replica check{at}: ranks that should hold the same {what}s do not ({len(found)} disagreeing):\n  {shown}\n"
        f"Usual cause: {'; or '.join(causes) or 'code that changed one rank'}.{note}"
    )


def _rtol(t: Tensor | None) -> float:
    dtype = t.dtype if t is not None and t.is_floating_point() else torch.float32
    return 16 * torch.finfo(dtype).eps


def _show(row: Tensor) -> str:
    if row[0] == 0:
        return "none"
    return f"sum {float(row[1]):.9g}, sum of squares {float(row[2]):.9g}"


# ---- what MegaScaleStrategy runs -----------------------------------------------------------------------


def agree_over(group: dist.ProcessGroup, verdict: str | None) -> list[tuple[int, str]]:
    """Every rank's ``verdict`` (None: nothing found) over ``group``, as (group rank, text) of those that found
    something: so that ranks which found nothing can stop with those that did (pipeline stages otherwise
    wait for each other until the collective timeout)."""
    verdicts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, verdict, group=group)
    return [(rank, text) for rank, text in enumerate(verdicts) if text is not None]


class ReplicaGuard:
    """``check_replicas`` at the first ``steps`` optimizer steps of a ``parallelize``d module: gradients after
    the reduction, before the step; values after the step. What must agree where:

    - over dp: ZeRO-0 gradients and values; ZeRO-1 values (after the gather) and, with
      ``zero1_sharding="parameters"``, gradients (all-reduced whole); not ZeRO-1 "elements" gradients (each
      rank holds its piece) nor tensors sharded over dp (ZeRO-2/3, a model's own fully_shard);
    - over tp (tp > 1): plain parameters and DTensors placed Replicate on the tp mesh, and their gradients
      unless Partial.

    Args:
        steps: optimizer steps to check (0: none).
    """

    def __init__(self, steps: int = 2) -> None:
        if steps < 0:
            raise ValueError(f"replica_check_steps={steps} must be >= 0 (0 turns the check off)")
        self.steps = steps
        self.done = 0
        self._gather: dist.ProcessGroup | None = None
        self._gather_made = False
        self._dims: dict[int, tuple[str | None, ...]] = {}

    @property
    def active(self) -> bool:
        return self.done < self.steps

    def check_gradients(
        self, optimizer: Optimizer, module: nn.Module | None, runtime: ParallelRuntime
    ) -> None:
        """After the gradient reduction (and clipping), before ``optimizer.step()``: the gradients of
        ``optimizer``'s parameters (named as in ``module``)."""
        if not self.active:
            return
        scattered = runtime.zero.grad_sum_group() is not None  # ZeRO-1 "elements": pieces over dp
        entries = []
        for name, p in self._named(optimizer, module):
            if p.requires_grad:
                g = p.grad
                labels = self._labels(g if g is not None else p, runtime, dp_ok=not scattered)
                entries.append(ReplicaEntry(name, local(g), labels))
        self._check(entries, runtime, "gradient")

    def check_values(self, optimizer: Optimizer, module: nn.Module | None, runtime: ParallelRuntime) -> None:
        """After ``optimizer.step()`` and ZeRO's hooks after it: the values of ``optimizer``'s parameters;
        counts one checked step."""
        if not self.active:
            return
        runtime.zero.wait_for_params()  # ZeRO-1: the gathered values, not the stale ones
        entries = [ReplicaEntry(n, local(p), self._labels(p, runtime, dp_ok=True))
                   for n, p in self._named(optimizer, module)]  # fmt: skip
        self.done += 1
        self._check(entries, runtime, "value")

    # ---- pieces ---------------------------------------------------------------------------------------

    def _named(self, optimizer: Optimizer, module: nn.Module | None) -> list[tuple[str, nn.Parameter]]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        seen: set[int] = set()
        out = []
        for i, p in enumerate(params):
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((names.get(id(p), f"param_groups parameter {i} {tuple(p.shape)}"), p))
        return out

    def _labels(self, t: Tensor, runtime: ParallelRuntime, *, dp_ok: bool) -> tuple[str, ...]:
        dims = self._mesh_dims(t, runtime)
        labels = []
        if "ep" in dims:  # an expert stack: its replicas are the ranks holding the same experts
            edp = runtime.expert_mesh["edp"].size() if runtime.expert_mesh is not None else 1
            if edp > 1 and dp_ok and runtime.zero.stage in (0, 1):
                labels.append("edp")
        elif runtime.dims.dp > 1 and dp_ok and runtime.zero.stage in (0, 1) and "dp" not in dims:
            labels.append("dp")
        if runtime.dims.tp > 1 and "tp" not in dims:
            labels.append("tp")
        return tuple(labels)

    def _mesh_dims(self, t: Tensor, runtime: ParallelRuntime) -> tuple[str | None, ...]:
        """The runtime's mesh dims over which DTensor ``t`` is split (or Partial); () for a plain tensor."""
        if not is_dtensor(t):
            return ()
        mesh = t.device_mesh  # type: ignore[attr-defined]
        if id(mesh) not in self._dims:
            meshes = {d: runtime.mesh[d] for d in ("dp", "tp")}
            if runtime.expert_mesh is not None:
                meshes["ep"] = runtime.expert_mesh["ep"]
            known = {tuple(dist.get_process_group_ranks(m.get_group())): d for d, m in meshes.items()}
            self._dims[id(mesh)] = tuple(
                known.get(tuple(dist.get_process_group_ranks(mesh.get_group(i)))) for i in range(mesh.ndim)
            )
        return tuple(d for d, pl in zip(self._dims[id(mesh)], t.placements) if not pl.is_replicate())  # type: ignore[attr-defined]

    def _check(self, entries: list[ReplicaEntry], runtime: ParallelRuntime, what: str) -> None:
        if runtime.dims.dp == 1 and runtime.dims.tp == 1:
            return  # no replicas: nothing to compare
        groups = {"dp": runtime.mesh["dp"].get_group(), "tp": runtime.mesh["tp"].get_group()}
        if runtime.expert_mesh is not None:
            groups["edp"] = runtime.expert_mesh["edp"].get_group()
        found: ReplicaMismatchError | None = None
        try:
            check_replicas(
                entries, groups, what=what, gather_group=self._gather_group(runtime), step=self.done if what == "value" else self.done + 1,
                note=f" (Checked at the first {self.steps} optimizer steps; MegaScaleStrategy(replica_check_steps=0) turns it off.)",
            )  # fmt: skip
        except ReplicaMismatchError as error:
            found = error
        if runtime.dims.pp > 1:  # a stage's verdict stops every stage, not only its own ranks
            verdicts = agree_over(runtime.mesh["pp"].get_group(), str(found) if found is not None else None)
            if found is None and verdicts:
                raise ReplicaMismatchError(f"pipeline stage {verdicts[0][0]}: {verdicts[0][1]}")
        if found is not None:
            raise found

    def _gather_group(self, runtime: ParallelRuntime) -> dist.ProcessGroup | None:
        # ranks of one pipeline stage hold the same entries: gather over dp × tp of this stage (made once,
        # by every rank at the same step)
        if not self._gather_made:
            self._gather_made = True
            if runtime.dims.pp > 1:
                self._gather = runtime.mesh["dp", "tp"]._flatten().get_group()
        return self._gather
