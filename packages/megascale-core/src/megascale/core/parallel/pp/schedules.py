# Pipeline schedules with decoupled, asynchronous point-to-point communication (MegaScale, Jiang et al. 2024,
# "MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs", §3.2), and a small recorder of
# per-rank action intervals from which the pipeline bubble is measured.
#
# Scope: ScheduleDecoupled1F1B is a drop-in replacement for torch.distributed.pipelining.Schedule1F1B (same
# constructor, same step()/eval(), same per-microbatch losses and gradients, one PipelineStage per rank). It
# computes in exactly torch's 1F1B order; only the communication around the computations differs.
#
# The order, for stage s of P with M microbatches (M ≥ P), w = P - s:
#     warmup    F0 F1 ... F(w-1)                       (the last stage: F0 only)
#     steady    B0 F(w) B1 F(w+1) ... B(M-w-1) F(M-1)   one backward, then one forward
#     cooldown  B(M-w) ... B(M-1)
# eval() (no backward) runs F0 ... F(M-1).
#
# What torch's Schedule1F1B does around them. In steady state it fuses the send of F(i)'s activations with
# the receive of the next backward's gradients into one batch_isend_irecv, and the send of B(j)'s gradients
# with the receive of the next forward's activations, and WAITS on the whole batch before computing. On gloo
# (and NCCL) a send completes only once the peer has posted the matching receive (gloo's TCP transport is a
# rendezvous: the payload leaves only after the receiver's "recv ready" notice), so a stage stalls until its
# downstream neighbour reaches the point where it posts the receive for the activations, even when the data
# it needs itself has long arrived. In warmup it waits on the previous forward send after each forward, and
# every receive is posted only when the compute that needs it is next, so transfer never overlaps compute.
#
# What this schedule does instead (beyond torch's):
#   - Forward-direction traffic (activations, s -> s+1) and backward-direction traffic (gradients,
#     s+1 -> s) are never fused: each op is posted on its own (dist.isend / dist.irecv), and on backends
#     other than gloo each direction gets its own process group (its own communicators and streams), see
#     "Deadlock-freedom" below.
#   - Sends are fired right after the computation that produces them and are not waited before the next
#     computation: they are waited at the end of step(), or earlier only when more than P sends of one
#     direction are outstanding (a memory bound; in training that window never fills, see below).
#   - Receives are prefetched: when the receive for microbatch i is waited, the receives for microbatches
#     i+1 ... i+recv_lookahead of the same direction are already posted (at step start the first
#     1 + recv_lookahead of each direction are), so the receive for F(i+1) is in flight while F(i) and the
#     backward between them compute, and the receive for B(j+1) while B(j) and the forward between them do.
#     A receive is waited just before the computation that reads it.
# The overlap gained: a stage's compute waits only for data it actually needs (the upstream activation or
# downstream gradient of the next action), never for the neighbour to be ready to take its own output, and
# the transfers themselves proceed in the background (gloo's device thread, NCCL's stream) during compute.
#
# Deadlock-freedom (the argument, for any backend whose isend/irecv do not block the caller):
#   1. Matching. Between two adjacent stages each direction carries one kind of tensor: s sends only
#      activations to s+1 and s+1 sends only gradients to s. Forwards run in microbatch order 0..M-1 and so
#      do backwards, so s posts the activation sends in microbatch order, and s+1 posts the matching
#      receives in the same order (prefetching only changes when, not the order). gloo matches sends to
#      receives per (peer, tag) in posting order (the stage ops all use tag 0), and a receive from peer q
#      only matches messages sent by q, so the i-th send meets the i-th receive. Posting order across
#      different peers and directions does not matter to gloo.
#   2. NCCL, by contrast, runs the P2P kernels between a pair of ranks on one stream in issue order, and a
#      send kernel blocks until the peer's receive kernel runs; two early-posted receives on both sides of
#      one pair (F and B directions) would deadlock there. Hence on non-gloo backends the two directions
#      use two process groups over the same ranks (directional_p2p_groups): each group's pair stream then
#      sees one direction only, posted in the same order on both sides. (Reasoned, not tested here: this
#      repository's CI has no GPUs.)
#   3. Progress. Posting never blocks. A stage blocks only (a) on a receive, which the peer satisfies by
#      computing the corresponding action, which depends only on strictly earlier actions of the pipeline
#      DAG, and torch's 1F1B order on every rank is a topological order of that DAG; or (b) on a send, only
#      when more than P sends of one direction are outstanding. In training that cannot happen: when s
#      posts the send of F(i) it has already received the gradients of every j ≤ i-(P-s) (1F1B runs F(w+j)
#      after B(j)), and receiving B(j)'s gradient implies s+1 has received F(j)'s activations, so at most
#      P-s forward sends are incomplete; likewise when s posts the send of B(i), stage s-1 has already
#      received every gradient up to i-P+s-1 (s holds F(i)'s input, which s-1 sent after its B(i-P+s-1)).
#      In eval (forward only) the bound can bite, and waits on the oldest send, whose receive the next
#      stage posts without needing anything from this stage. So every wait is eventually satisfied.
#   4. Nothing leaks: every posted op is waited before step() returns, so collectives issued after step()
#      (gradient reduction, clipping) and the next step's metadata exchange see quiet channels.
#
# Instrumentation: ScheduleTimeline records, per rank, the wall-clock interval of every computation (by
# wrapping the stages' forward_one_chunk / backward_one_chunk / backward_weight_one_chunk, so it works with
# torch's schedules too) and, for ScheduleDecoupled1F1B, of every receive and send wait plus the instants
# receives are posted. Off (no timeline attached), the schedule pays one attribute test per action and the
# stages are not wrapped at all. The bubble fraction of a rank over a step window [t0, t1] is
# 1 - (time inside [t0, t1] covered by that rank's computations) / (t1 - t0).
#
# Wait timer (straggler detection and the run's timeline, wait_timer.py): the Pipeline sets ``wait_timer``
# on its schedules; the decoupled schedules call it around every receive and send wait ("pipeline-recv-F",
# ...) and, when it is a ``Timers``, its ``compute`` around every microbatch's forward (loss included) and
# backward ("F" / "B", microbatch, stage). Untimed (the default): one nullcontext per action.
#
# The interleaved (virtual-stage) schedule: torch's ScheduleInterleaved1F1B already posts sends and receives as
# separate actions (its runtime plans SEND_F / RECV_F / SEND_B / RECV_B) and waits sends only at the end;
# interleaved.py (ScheduleDecoupledInterleaved1F1B) prefetches its receives, one P2P tag (gloo) or
# group (other backends) per stream, and records its waits here too (it reuses _post, _SendQueue, _timed_wait).

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _add_reduce_grad,
    _ComputationType,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from megascale.core.parallel.wait_timer import ComputeTimer, WaitTimer, compute_timer, untimed

__all__ = [
    "COMPUTE_KINDS",
    "ScheduleDecoupled1F1B",
    "ScheduleTimeline",
    "TimelineEvent",
    "directional_p2p_groups",
]

# Event kinds a ScheduleTimeline records. Computations: F (forward), B (full backward), I (input-gradient
# backward of a zero-bubble schedule), W (weight-gradient backward). Communication, the decoupled schedules
# only: wait_recv_F / wait_recv_B (blocked on activations / gradients arriving), wait_send_F / wait_send_B
# (blocked on own activation / gradient send), post_recv_F / post_recv_B (instant: a receive was posted).
COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})


class _Recording(Protocol):
    """A schedule that records its communication on a timeline (ScheduleDecoupled1F1B and
    pipeline_interleaved.ScheduleDecoupledInterleaved1F1B): ``timeline`` is set by ScheduleTimeline.attach."""

    timeline: ScheduleTimeline | None


@dataclass(frozen=True)
class TimelineEvent:
    """One recorded interval on one rank (``start == end`` for an instant such as a posted receive)."""

    kind: str
    start: float
    end: float
    microbatch: int | None = None
    stage: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


class ScheduleTimeline:
    """Per-rank recorder of pipeline actions, for measuring the bubble.

    Usage::

        timeline = ScheduleTimeline()
        with timeline.attach(schedule):          # wraps the schedule's stages; detaches on exit
            dist.barrier(); t0 = timeline.clock()
            schedule.step(x, target=y)
            dist.barrier(); t1 = timeline.clock()
        bubble = timeline.bubble_fraction(t0, t1)

    Works with any torch pipeline schedule (computations are recorded by wrapping the stage methods the
    schedules call); the decoupled schedules (ScheduleDecoupled1F1B, and ScheduleDecoupledInterleaved1F1B in
    interleaved.py) also record their communication waits. Timestamps come from
    ``clock`` (``time.perf_counter``: comparable across processes of one host on Linux, not across hosts).
    ``synchronize`` (e.g. ``torch.cuda.synchronize``), if given, is called before each timestamp of a
    computation, so that on an asynchronous device the interval covers execution rather than the kernel
    launches; it serialises host and device around computations, so timed runs lose a little overlap.
    """

    _WRAPPED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, synchronize: Callable[[], None] | None = None
    ) -> None:
        self.clock = clock
        self.synchronize = synchronize
        self.events: list[TimelineEvent] = []
        self._wrapped: list[tuple[object, str]] = []
        self._schedules: list[_Recording] = []

    def record(
        self, kind: str, start: float, end: float, microbatch: int | None = None, stage: int | None = None
    ) -> None:
        """Append one event."""
        self.events.append(TimelineEvent(kind, start, end, microbatch, stage))

    @contextmanager
    def span(self, kind: str, microbatch: int | None = None, stage: int | None = None) -> Iterator[None]:
        """Record the wall-clock interval of the ``with`` body as one event."""
        start = self.clock()
        try:
            yield
        finally:
            self.record(kind, start, self.clock(), microbatch, stage)

    def clear(self) -> None:
        """Forget the recorded events (stay attached)."""
        self.events.clear()

    def attach(self, schedule: Any) -> ScheduleTimeline:
        """Start recording ``schedule``'s computations (and, for the decoupled schedules, their waits).

        Wraps the ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` methods of
        the schedule's stage(s) with instance attributes; :meth:`detach` (or leaving a ``with`` block on the
        returned timeline) removes them. Returns ``self``.
        """
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in self._WRAPPED:
                if name in vars(stage):
                    raise RuntimeError(
                        f"stage {stage.stage_index}.{name} is already wrapped (attached twice?)"
                    )
        for stage in stages:
            for name in self._WRAPPED:
                setattr(stage, name, self._wrap(getattr(stage, name), name, stage.stage_index))
                self._wrapped.append((stage, name))
        if hasattr(schedule, "timeline"):  # a schedule that records its waits (see _Recording)
            schedule.timeline = self
            self._schedules.append(schedule)
        return self

    def detach(self) -> None:
        """Undo every :meth:`attach` (the recorded events stay)."""
        for obj, name in self._wrapped:
            vars(obj).pop(name, None)
        self._wrapped.clear()
        for schedule in self._schedules:
            if schedule.timeline is self:
                schedule.timeline = None
        self._schedules.clear()

    def __enter__(self) -> ScheduleTimeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _wrap(self, method: Callable[..., Any], name: str, stage_index: int) -> Callable[..., Any]:
        clock, record, sync = self.clock, self.record, self.synchronize

        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_one_chunk":
                kind = "B" if kwargs.get("full_backward", True) else "I"
            else:
                kind = "W"
            if sync is not None:
                sync()
            start = clock()
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                record(kind, start, clock(), chunk_id, stage_index)

        return timed

    # --- analysis -------------------------------------------------------------------------------------

    def compute_events(self) -> list[TimelineEvent]:
        """The computation events (kinds in :data:`COMPUTE_KINDS`), by start time."""
        return sorted((e for e in self.events if e.kind in COMPUTE_KINDS), key=lambda e: e.start)

    def busy_time(self, start: float, end: float) -> float:
        """Time within ``[start, end]`` covered by at least one computation."""
        busy, reach = 0.0, start
        for e in self.compute_events():
            lo, hi = max(e.start, reach), min(e.end, end)
            if hi > lo:
                busy += hi - lo
            reach = max(reach, min(e.end, end))
        return busy

    def bubble_fraction(self, start: float, end: float) -> float:
        """Idle share of the window: ``1 - busy_time(start, end) / (end - start)``."""
        if end <= start:
            raise ValueError(f"empty window [{start}, {end}]")
        return 1.0 - self.busy_time(start, end) / (end - start)

    def total(self, kind_prefix: str) -> float:
        """Summed duration of the events whose kind starts with ``kind_prefix`` (e.g. ``"wait_"``)."""
        return sum(e.duration for e in self.events if e.kind.startswith(kind_prefix))


def directional_p2p_groups(
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two new process groups over ``group``'s ranks (same rank order): one for activations, one for gradients.

    Collective over ``group``'s ranks only (``use_local_synchronization``): every rank of the pipeline
    group must call it, at the same point, and no other rank needs to.
    """
    group = group if group is not None else dist.group.WORLD
    assert group is not None
    ranks = dist.get_process_group_ranks(group)
    made = []
    for desc in ("pp_fwd_p2p", "pp_bwd_p2p"):
        g = dist.new_group(ranks, use_local_synchronization=True, group_desc=desc, sort_ranks=False)
        assert isinstance(g, dist.ProcessGroup)
        made.append(g)
    return made[0], made[1]


def _post(ops: Sequence[dist.P2POp], group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Post each op on its own (no batching: nothing here may wait on anything else), on ``group`` if given.

    ``group`` spans the ops' group's ranks in the same order, so an op's ``group_peer`` is valid in it.
    """
    works: list[dist.Work] = []
    for op in ops:
        g = op.group if group is None else group
        if op.op is dist.isend:
            work = dist.isend(op.tensor, group=g, tag=op.tag, group_dst=op.group_peer)
        else:
            work = dist.irecv(op.tensor, group=g, tag=op.tag, group_src=op.group_peer)
        assert work is not None  # only None for a rank outside the group, which a stage never is
        works.append(work)
    return works


class _RecvStream:
    """The receives of one direction, posted in microbatch order, ``lookahead`` ahead of the one waited."""

    def __init__(
        self,
        get_ops: Callable[[int], list[dist.P2POp]],
        group: dist.ProcessGroup | None,
        n: int,
        lookahead: int,
        direction: str,
        schedule: _Recording,
        stage_index: int,
    ) -> None:
        self._get_ops, self._group, self._n, self._lookahead = get_ops, group, n, lookahead
        self._direction, self._schedule, self._stage_index = direction, schedule, stage_index
        self._posted: dict[int, list[dist.Work]] = {}
        self._next = 0  # the next microbatch whose receive is to be posted

    def post_through(self, mb: int) -> None:
        while self._next <= min(mb, self._n - 1):
            ops = self._get_ops(self._next)
            if ops:
                self._posted[self._next] = _post(ops, self._group)
                tl = self._schedule.timeline
                if tl is not None:
                    now = tl.clock()
                    tl.record(f"post_recv_{self._direction}", now, now, self._next, self._stage_index)
            self._next += 1

    def wait(self, mb: int) -> None:
        self.post_through(mb + self._lookahead)  # prefetch before blocking on (and computing) this one
        works = self._posted.pop(mb, None)
        if works:
            _timed_wait(works, self._schedule, f"wait_recv_{self._direction}", mb, self._stage_index)

    def drain(self) -> None:
        for mb in sorted(self._posted):
            self.wait(mb)


class _SendQueue:
    """Outstanding sends of one direction, waited oldest first: at the end, or past ``limit`` of them."""

    def __init__(self, limit: int, direction: str, schedule: _Recording, stage_index: int) -> None:
        self._limit, self._direction, self._schedule, self._stage_index = (
            limit,
            direction,
            schedule,
            stage_index,
        )
        self._pending: deque[tuple[int, list[dist.Work]]] = deque()

    def push(self, mb: int, works: list[dist.Work]) -> None:
        if works:
            self._pending.append((mb, works))
        while len(self._pending) > self._limit:
            self._wait_oldest()

    def drain(self) -> None:
        while self._pending:
            self._wait_oldest()

    def wait_through(self, mb: int) -> None:
        """Wait the pending sends of microbatches up to ``mb`` (pushed in microbatch order)."""
        while self._pending and self._pending[0][0] <= mb:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        mb, works = self._pending.popleft()
        _timed_wait(works, self._schedule, f"wait_send_{self._direction}", mb, self._stage_index)


def _timed_wait(works: list[dist.Work], schedule: _Recording, name: str, mb: int, stage: int) -> None:
    """Wait for ``works``; the time blocked goes on the schedule's timeline (when recording) as ``name``, and
    through the schedule's ``wait_timer`` (set by the Pipeline; straggler detection) as "pipeline-<name>"."""
    tl = schedule.timeline
    start = tl.clock() if tl is not None else 0.0
    timer: WaitTimer = getattr(schedule, "wait_timer", untimed)
    with timer(f"pipeline-{name.removeprefix('wait_')}"):
        for w in works:
            w.wait()
    if tl is not None:
        tl.record(name, start, tl.clock(), mb, stage)


def _computing(compute: ComputeTimer | None, kind: str, mb: int, stage: int) -> AbstractContextManager[None]:
    """The span of one microbatch's computation for the schedule's compute timer (nothing without one)."""
    return nullcontext() if compute is None else compute(kind, mb, stage)


def _one_f_one_b_order(
    stage_index: int, num_stages: int, n_microbatches: int, has_backward: bool
) -> list[tuple[str, int]]:
    """Torch's Schedule1F1B computation order on one stage, as ``[("F" | "B", microbatch), ...]``."""
    if not has_backward:
        return [("F", i) for i in range(n_microbatches)]
    warmup = min(n_microbatches, num_stages - stage_index)
    order = [("F", i) for i in range(warmup)]
    for j in range(n_microbatches - warmup):
        order += [("B", j), ("F", warmup + j)]
    order += [("B", j) for j in range(n_microbatches - warmup, n_microbatches)]
    return order


class ScheduleDecoupled1F1B(PipelineScheduleSingle):
    """1F1B with decoupled, asynchronous sends and prefetched receives (MegaScale §3.2).

    Drop-in for ``torch.distributed.pipelining.Schedule1F1B``: same arguments, same ``step()`` / ``eval()``,
    same computation order, losses and gradients (scaled by ``1 / n_microbatches`` when ``scale_grads``).
    Differences are in communication only (see the module header): no send is waited before the next
    computation, activations and gradients never share a blocking batch, and each direction's receives run
    ``recv_lookahead`` microbatches ahead of use. One deliberate behavioural difference: ``eval()`` does not
    touch parameter gradients (torch's Schedule1F1B divides any existing ``.grad`` by ``n_microbatches``
    in ``eval()`` too).

    Args:
        stage: this rank's ``PipelineStage``.
        n_microbatches: microbatches per step, at least the number of stages.
        loss_fn: called on the last stage's output and target of each microbatch.
        args_chunk_spec: as for ``Schedule1F1B``.
        kwargs_chunk_spec: as for ``Schedule1F1B``.
        output_merge_spec: as for ``Schedule1F1B``.
        scale_grads: divide gradients by ``n_microbatches`` after the step.
        recv_lookahead: how many receives of one direction are kept posted beyond the one being waited
            (≥ 1; each microbatch has its own receive buffer, so any depth is safe).
        p2p_groups: (activation group, gradient group), each spanning the stage's group's ranks in the same
            order. Default: the stage's group for both on gloo (which matches per peer, see the header),
            otherwise two new groups from :func:`directional_p2p_groups`, made here (a collective over the
            pipeline group's ranks).
    """

    def __init__(
        self,
        stage: _PipelineStageBase,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        recv_lookahead: int = 1,
        p2p_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    ) -> None:
        super().__init__(
            stage=stage,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
        )
        if n_microbatches < self._num_stages:
            raise ValueError(
                f"Number of microbatches ({n_microbatches}) must be greater than or equal to the number of "
                f"stages ({self._num_stages})."
            )
        if recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be ≥ 1, got {recv_lookahead}")
        self.recv_lookahead = recv_lookahead
        #: Set by ScheduleTimeline.attach; None (the default) records nothing.
        self.timeline: ScheduleTimeline | None = None
        #: Times the waits (and, a ``Timers``, the microbatches): set by the Pipeline (see the header)
        self.wait_timer: WaitTimer = untimed

        group = stage.group if stage.group is not None else dist.group.WORLD
        assert group is not None
        if p2p_groups is None:
            if torch.device(stage.device).type == "cpu" and "gloo" in str(dist.get_backend(group)):
                self._fwd_group: dist.ProcessGroup | None = None  # None: the stage's own group
                self._bwd_group: dist.ProcessGroup | None = None
            else:
                self._fwd_group, self._bwd_group = directional_p2p_groups(group)
        else:
            want = dist.get_process_group_ranks(group)
            for g in p2p_groups:
                if dist.get_process_group_ranks(g) != want:
                    raise ValueError(
                        f"p2p_groups must span the stage group's ranks {want} in that order, got "
                        f"{dist.get_process_group_ranks(g)}"
                    )
            self._fwd_group, self._bwd_group = p2p_groups

    def _get_pipeline_order(self) -> dict[int, list[_Action | None]] | None:
        # The schedule IR (read by torch's schedule visualiser only): the computations in execution order,
        # without the idle slots. Built from our own order, not torch's Schedule1F1B IR, whose steady-state
        # microbatch numbering is off for stages without warmup forwards (stage P-1 lists F1 F2 ... where it
        # runs F0 F1 ...).
        kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
        return {
            s: _add_reduce_grad(
                [
                    _Action(s, kinds[k], mb)
                    for k, mb in _one_f_one_b_order(s, self._num_stages, self._n_microbatches, True)
                ],
                self._n_microbatches,
            )
            for s in range(self._num_stages)
        }

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)

        stage, n = self._stage, self._n_microbatches
        has_backward = self._has_backward
        s = stage.stage_index
        fwd_recvs = _RecvStream(stage.get_fwd_recv_ops, self._fwd_group, n, self.recv_lookahead, "F", self, s)
        bwd_recvs = _RecvStream(
            stage.get_bwd_recv_ops,
            self._bwd_group,
            n if has_backward else 0,
            self.recv_lookahead,
            "B",
            self,
            s,
        )
        fwd_sends = _SendQueue(self._num_stages, "F", self, s)
        bwd_sends = _SendQueue(self._num_stages, "B", self, s)
        # Post the first receives of both directions now: the gradients for B0 then land while warmup runs.
        fwd_recvs.post_through(self.recv_lookahead)
        bwd_recvs.post_through(self.recv_lookahead)
        compute = compute_timer(self.wait_timer)

        for kind, mb in _one_f_one_b_order(s, self._num_stages, n, has_backward):
            if kind == "F":
                fwd_recvs.wait(mb)
                with _computing(compute, "F", mb, s):
                    output = stage.forward_one_chunk(
                        mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs
                    )
                    fwd_sends.push(mb, _post(stage.get_fwd_send_ops(mb), self._fwd_group))  # fire, don't wait
                    self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)
                del output  # the last stage's logits: the loss's graph keeps what backward needs
            else:
                bwd_recvs.wait(mb)
                with _computing(compute, "B", mb, s):
                    loss = self._maybe_get_loss(stage, mb)
                    stage.backward_one_chunk(mb, loss=loss, last_backward=mb == n - 1)
                bwd_sends.push(mb, _post(stage.get_bwd_send_ops(mb), self._bwd_group))
        # Leave nothing in flight (every receive has been consumed above; the drains are a safety net). Not
        # done when a computation raised: the peers would never send what this rank still expects, and
        # waiting would turn the error into a timeout.
        fwd_sends.drain()
        bwd_sends.drain()
        fwd_recvs.drain()
        bwd_recvs.drain()

        self._update_losses(stage, losses)
        if has_backward:
            stage.perform_reduce_grad(n if self.scale_grads else 1)
