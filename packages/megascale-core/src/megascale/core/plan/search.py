"""Layout search: every feasible layout of a workload on a cluster, predicted and ranked.

The space: tp among the divisors of a node's GPU count that split the model; cp 1, and for sequences of at
least ``LONG_SEQUENCE`` tokens the powers of two with tp·cp within a node that split the sequence into 2·cp
chunks (context parallelism exchanges keys/values in every layer, so it stays on NVLink like tp); pp among the
divisors of what remains (at most one block per stage); dp the rest, dividing the global batch; the micro-batch size among the
divisors of each replica's share; pipeline schedules 1F1B and interleaved (2 to 8 stages per rank that split the
blocks evenly), GPipe only when asked for; ZeRO 0-3 (0 with dp = 1; 3 not with pp > 1); sequence
parallelism on or off with tp > 1; activation checkpointing none, selective or full; for a mixture of experts,
ep among the divisors of dp that split the experts evenly (what ``check_expert_parallel`` refuses is skipped:
ZeRO-1 by elements beside ep > 1, where it shards by parameters instead). The overlap switches
stay at the strategy's defaults (on). Any part can be fixed (``Fixed``); the rest is enumerated.

Ranking: layouts whose predicted memory fits (``ClusterSpec.usable_memory``) by predicted step time (which the
GPU kind's MFU cap bounds: ``rates.py``), then by the step the model's parts sum to (so layouts at the cap keep
their order), then by memory; those that do not fit come after, least memory first, so a fully fixed layout is still predicted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

from megascale.core.parallel.plan import ParallelPlan
from megascale.core.plan.cluster import ClusterSpec
from megascale.core.plan.layout import Layout, Workload
from megascale.core.plan.memory import MemoryEstimate, predict_memory
from megascale.core.plan.throughput import StepEstimate, predict_step

__all__ = ["LONG_SEQUENCE", "Candidate", "Fixed", "enumerate_layouts", "search"]

LONG_SEQUENCE = 16384
"""Sequences at least this long are also tried with context parallelism (shorter ones: only when fixed)."""


@dataclass(frozen=True)
class Fixed:
    """Parts of the layout the user fixed (None: searched). Names as ``ParallelPlan``'s and ``Layout``'s."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero_stage: int | None = None
    micro_batch_size: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    sequence_parallel: bool | None = None
    activation_checkpointing: str | None = None

    def given(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Candidate:
    """A layout with its predictions."""

    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool

    def to_dict(self) -> dict[str, object]:
        p = self.layout.plan
        return {
            "layout": {
                "tp": p.tp, "pp": p.pp, "dp": self.layout.dp, "cp": p.cp, "ep": p.ep, "zero_stage": p.zero_stage,
                "micro_batch_size": self.layout.micro_batch_size, "num_microbatches": self.layout.microbatches,
                "accumulation": self.layout.accumulation, "schedule": p.schedule,
                "virtual_stages": p.virtual_stages, "sequence_parallel": p.sequence_parallel,
                "activation_checkpointing": p.activation_checkpointing, "describe": self.layout.describe(),
            },
            "fits": self.fits,
            "memory_per_gpu": self.memory.peak.to_dict(),
            "step": self.step.to_dict(),
        }  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _groups(workload: Workload, cluster: ClusterSpec, fixed: Fixed | None) -> Iterator[list[Layout]]:
    fx = fixed or Fixed()
    cfg, gpus, batch = workload.model, cluster.gpus, workload.global_batch
    tps = [fx.tp] if fx.tp else [t for t in _divisors(cluster.gpus_per_node) if gpus % t == 0]
    for tp in tps:
        try:
            cfg.check_tensor_parallel(tp)
        except ValueError:
            if fx.tp:
                raise
            continue
        for cp in _context_parallel_sizes(workload, cluster, fx, tp):
            pps = [fx.pp] if fx.pp else [p for p in _divisors(gpus // (tp * cp)) if p <= cfg.n_layers]
            for pp in pps:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if (fx.dp and dp != fx.dp) or batch % dp:
                    continue
                per_replica = batch // dp
                mbss = (
                    [fx.micro_batch_size]
                    if fx.micro_batch_size
                    else [b for b in _divisors(per_replica) if b <= 16]
                )
                for mbs in mbss:
                    if per_replica % mbs:
                        continue
                    m = per_replica // mbs
                    if fx.num_microbatches and fx.num_microbatches != m:
                        continue
                    yield from _plans(workload, fx, tp, pp, dp, mbs, m, cp)


def _context_parallel_sizes(workload: Workload, cluster: ClusterSpec, fx: Fixed, tp: int) -> list[int]:
    """cp sizes to try with ``tp``: the fixed one, else 1 and, for long sequences, the powers of two that keep
    tp·cp within a node and split the sequence into 2·cp chunks (whole tp shards under SP)."""
    if fx.cp:  # the sequence must split into 2·cp chunks (times tp under SP: checked per plan)
        return [fx.cp] if workload.seq_len % (2 * fx.cp) == 0 else []
    sizes, cp = [1], 2
    while workload.seq_len >= LONG_SEQUENCE and tp * cp <= cluster.gpus_per_node:
        if cluster.gpus % (tp * cp) == 0 and workload.seq_len % (2 * cp * tp) == 0:
            sizes.append(cp)
        cp *= 2
    return sizes


def enumerate_layouts(
    workload: Workload, cluster: ClusterSpec, fixed: Fixed | None = None
) -> Iterator[Layout]:
    """Every layout of ``workload`` on all of ``cluster``'s GPUs allowed by ``fixed`` (module docstring)."""
    for group in _groups(workload, cluster, fixed):
        yield from group


def _plans(
    workload: Workload, fx: Fixed, tp: int, pp: int, dp: int, mbs: int, m: int, cp: int = 1
) -> Iterator[list[Layout]]:
    """Groups of layouts differing only in activation checkpointing, least recomputation first."""
    cfg = workload.model
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        schedules += [("interleaved", v) for v in range(2, 9) if cfg.n_layers % (pp * v) == 0 and m % pp == 0]
        if fx.schedule == "gpipe":
            schedules = [("gpipe", 1)]
        if fx.schedule == "zb1p":  # asked for only: its bubble is theory, not yet checked on GPUs (issue 35)
            schedules = [("zb1p", 1)]
    if fx.schedule:
        schedules = [(s, v) for s, v in schedules if s == fx.schedule]
    if fx.virtual_stages:
        schedules = [(s, v) for s, v in schedules if v == fx.virtual_stages]
    if pp > 1 and m < pp:
        schedules = [(s, v) for s, v in schedules if s == "gpipe"]
    zeros = (
        [fx.zero_stage]
        if fx.zero_stage is not None
        else ([0, 1, 2] + ([3] if pp == 1 else []) if dp * cp > 1 else [1])
    )
    sps = (
        [fx.sequence_parallel] if fx.sequence_parallel is not None else ([True, False] if tp > 1 else [True])
    )
    acs = [fx.activation_checkpointing] if fx.activation_checkpointing else ["none", "selective", "full"]
    if fx.ep:
        eps = [fx.ep] if dp % fx.ep == 0 else []
    elif cfg.moe is not None:
        eps = [e for e in _divisors(dp) if cfg.moe.num_experts % e == 0]
    else:
        eps = [1]
    for schedule, v, ep in ((s, v, e) for s, v in schedules for e in eps):
        for zero in zeros:
            if zero == 3 and pp > 1:
                continue
            for sp in sps:
                if cp > 1 and sp and tp > 1 and workload.seq_len % (2 * cp * tp):
                    continue  # this rank's chunks would not split over tp
                group = []
                for ac in acs:
                    try:
                        plan = ParallelPlan(
                            tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero, schedule=schedule,  # type: ignore[arg-type]
                            # ZeRO-1 beside expert parallelism shards by parameters (check_expert_parallel)
                            zero1_sharding="parameters" if ep > 1 and zero == 1 else "elements",
                            virtual_stages=v, num_microbatches=m if pp > 1 else None, sequence_parallel=sp,
                            activation_checkpointing=ac,  # type: ignore[arg-type]
                        )  # fmt: skip
                        plan.check_gpt_config(cfg, sum_tied_gradients=True)
                    except ValueError:
                        continue
                    group.append(Layout(plan, dp=dp, micro_batch_size=mbs, accumulation=1 if pp > 1 else m))
                if group:
                    yield group


def _why_none(workload: Workload, cluster: ClusterSpec, fx: Fixed) -> str:
    """Why no layout is possible, naming the first cause found: the fixed parts against the GPU count, the
    layers, the global batch; else the general statement."""
    gpus, batch, layers = cluster.gpus, workload.global_batch, workload.model.n_layers
    cp = fx.cp or 1
    if fx.tp and fx.pp and fx.dp and fx.tp * fx.pp * fx.dp * cp != gpus:
        product = fx.tp * fx.pp * fx.dp * cp
        with_cp = f" × cp={cp}" if cp > 1 else ""
        return (f"tp × pp × dp = {fx.tp} × {fx.pp} × {fx.dp}{with_cp} = {product} GPUs, but --gpus is {gpus}: "
                "a layout uses every GPU; change --gpus or one of --tp/--pp/--dp" + ("/--cp" if cp > 1 else ""))  # fmt: skip
    if fx.cp and workload.seq_len % (2 * fx.cp * (fx.tp or 1)):
        return (f"--cp {fx.cp} cuts each sequence into {2 * fx.cp} equal chunks (× tp under sequence parallelism), "
                f"but --seq-len is {workload.seq_len}: use a multiple of {2 * fx.cp * (fx.tp or 1)}")  # fmt: skip
    fixed_product = (fx.tp or 1) * (fx.pp or 1) * (fx.dp or 1) * cp
    if gpus % fixed_product:
        named = " × ".join(
            f"{k}={v}" for k, v in (("tp", fx.tp), ("pp", fx.pp), ("dp", fx.dp), ("cp", fx.cp)) if v
        )
        return f"{named} = {fixed_product} does not divide the {gpus} GPUs: a layout uses every GPU"
    if fx.ep and fx.ep > 1:
        try:  # what expert parallelism refuses for this model, in its own words
            ParallelPlan(tp=fx.tp or 1, pp=fx.pp or 1, cp=cp, ep=fx.ep, zero_stage=0,
                         num_microbatches=fx.num_microbatches).check_gpt_config(workload.model, sum_tied_gradients=True)  # fmt: skip
        except ValueError as e:
            return f"--ep {fx.ep}: {e}"
        if fx.dp and fx.dp % fx.ep:
            return f"--ep {fx.ep} must divide dp={fx.dp}: the expert-parallel ranks are data-parallel ranks"
    if fx.pp and fx.pp > layers:
        return f"pp={fx.pp} is more pipeline stages than the model's {layers} layers"
    if fx.dp and batch % fx.dp:
        return f"the global batch {batch} is not divisible by dp={fx.dp}: every replica takes an equal share"
    given = fx.given()
    return (f"no layout of {gpus} GPUs ({cluster.gpus_per_node} per node) divides the global batch {batch} and "
            f"splits this model ({layers} layers, {workload.model.n_heads} heads)" + (f" with {given}" if given else ""))  # fmt: skip


def search(
    workload: Workload, cluster: ClusterSpec, fixed: Fixed | None = None, top: int | None = None
) -> list[Candidate]:
    """Predict the layouts ``enumerate_layouts`` gives and rank them (module docstring); the best ``top``.

    Recomputation only adds time, so of layouts differing only in activation checkpointing the first that
    fits (none, then selective, then full) is the fastest of them: the others are not predicted.
    """
    fitting: list[Candidate] = []
    too_big: list[tuple[float, Layout, MemoryEstimate]] = []
    for group in _groups(workload, cluster, fixed):
        for layout in group:
            memory = predict_memory(workload, layout)
            if memory.total <= cluster.usable_memory:
                fitting.append(Candidate(layout, memory, predict_step(workload, layout, cluster), fits=True))
                break
            too_big.append((memory.total, layout, memory))
    if not fitting and not too_big:
        raise ValueError(_why_none(workload, cluster, fixed or Fixed()))
    fitting.sort(key=lambda c: (c.step.step_time, c.step.uncapped_step_time or 0.0, c.memory.total))
    too_big.sort(key=lambda t: t[0])
    rest = too_big[: max(0, (top or len(fitting) + len(too_big)) - len(fitting))]
    out = fitting + [
        Candidate(lay, mem, predict_step(workload, lay, cluster), fits=False) for _, lay, mem in rest
    ]
    return out[:top] if top else out
