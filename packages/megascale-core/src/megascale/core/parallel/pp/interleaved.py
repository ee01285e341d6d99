# The interleaved (virtual-stage) 1F1B schedule with MegaScale's decoupled point-to-point communication
# (Jiang et al. 2024, §3.2), as ScheduleDecoupled1F1B (schedules.py) does it for plain 1F1B.
#
# Scope: ScheduleDecoupledInterleaved1F1B is a drop-in replacement for torch.distributed.pipelining's
# ScheduleInterleaved1F1B (same constructor, same step()/eval(), same per-microbatch losses and gradients bit
# for bit, V PipelineStages per rank in looped placement: rank r holds stages r, r+P, r+2P, ...). It runs
# torch's own plan: the computation order is torch's (_calculate_single_rank_operations, i.e.
# _get_1f1b_rank_ops), lowered by torch (_prepare_schedule_with_comms: UNSHARD/RESHARD for FSDP stages,
# REDUCE_GRAD, SEND_*/RECV_* placed by a lockstep simulation). Only the receives move, and the schedule
# executes the plan itself (not through torch's runtime) so that it can post every op on its stream's tag or
# group and record its waits on a ScheduleTimeline.
#
# Streams. A stream is one direction into one stage: ("F", t) carries stage t-1's activations to stage t,
# ("B", t) carries stage t+1's gradients to stage t. With V stages per rank a rank pair carries several
# streams (rank r gets activations from rank r-1 for each of its V stages; at P=2 both neighbours are the
# same rank, so both directions of both stage pairs run between the same two ranks).
#
# What torch's ScheduleInterleaved1F1B does (torch 2.13, _PipelineScheduleRuntime): every send and receive is
# an action of its own and sends are waited only at the end of the step, so activations and gradients never
# share a blocking batch. But a receive is posted where the lockstep simulation puts it: in the receiver's
# list right after the action it runs at the simulated moment the sender computes, which is often right
# before the computation that needs it (rank 1 of P=2, V=2, M=4 runs "1RECV_F1 1F1", "3RECV_F0 3F0", ...),
# so the transfer cannot overlap this rank's compute, and all streams share tag 0 of one group.
#
# What this schedule does instead:
#   - Receives prefetched (prefetch_receives): the receive of microbatch i of a stream is posted before the
#     computation that consumes microbatch i - recv_lookahead of the same stream (the first recv_lookahead
#     at the start of the step), or where torch posts it if that is earlier. So when a computation waits
#     on its input, the inputs of the next recv_lookahead microbatches of its stream are already in flight,
#     landing while this one (and whatever the rank runs in between) computes. A receive is waited just
#     before the computation that reads it.
#   - Sends are posted right after the computation that produces them (torch's place) and never waited before
#     a computation that does not need them: an activation send of (stage s, microbatch i) is waited once
#     the gradient for (s, i) has arrived (by then stage s+1 has consumed those activations, so the wait
#     returns at once and frees the tensor); gradient sends, and anything left, at the end of step(). No
#     count bound is needed: that is at most what torch's runtime holds (it waits every send at the end).
#   - F and B traffic are never in one blocking batch: each op is posted on its own (dist.isend/irecv).
#   - Each stream has its own P2P tag (stream_tag) on gloo, and on other backends its own process group
#     (stream_p2p_groups), whatever tags or groups the stage's ops carried.
# eval() (and step() without a loss_fn): the forwards of the same plan only, in the same order, with their
# receives and sends; no backward, no REDUCE_GRAD, so parameter gradients are not touched (torch's eval()
# runs REDUCE_GRAD, which divides existing .grad by n_microbatches when scale_grads).
#
# Deadlock-freedom (any backend whose isend/irecv do not block the caller):
#   1. Matching. A stream's sends are posted in microbatch order: its producing stage runs its forwards, and
#      its backwards, in microbatch order (torch's _get_1f1b_rank_ops numbers each stage's F and B by a
#      per-stage counter). Its receives are posted in microbatch order too: torch's placements of a stream's
#      receives are in microbatch order (they follow the sender), so are "before the consumer of i - L"
#      (the consumers run in microbatch order), and so is the earlier of the two. gloo matches sends to
#      receives per (peer, tag) in posting order and a receive from q only matches messages from q; with
#      one tag per stream, each (peer, tag) channel carries exactly one stream in one direction, so the
#      k-th send of a stream meets the k-th receive of the same stream. Without per-stream tags it would
#      not: the receiver posts its streams' receives interleaved differently from the order in which the
#      sender posts their sends (prefetching changes the cross-stream order; torch's lockstep placement
#      kept the two sides in step), so one stream's message would fill another's buffer — silently when
#      the shapes agree (tests/core/test_pipeline_interleaved.py checks both the IR and a real run).
#   2. NCCL ignores tags and runs a communicator's P2P kernels between a rank pair on one stream in issue
#      order, a receive kernel blocking until its send runs. Two streams on one communicator and pair,
#      posted in different orders on the two sides, can deadlock (at P=2 a (direction, virtual stage) group
#      carries two opposite streams on the same pair: each rank's prefetched receive then blocks the send the
#      other one waits for). Hence off gloo every stream gets a process group of its own (2(PV-1) groups,
#      each used by one rank pair in one direction, posted in microbatch order on both sides). Reasoned, not
#      run: this repository's CI has no GPUs.
#   3. Progress. Let T(x) be the time step of computation x in torch's lockstep plan (pipeline_order, idle
#      slots included). A computation's input comes from a computation of the neighbouring stage with a
#      smaller T, and each rank runs its computations in increasing T. By induction on t: if every
#      computation with T < t has finished, a rank whose next computation x has T(x) = t has finished all
#      its earlier ones, so it reaches x; the only thing x waits for is the receive of its input, whose
#      producer has finished and posted the send right after (posting never blocks), whose receive this rank
#      posted at the latest just before x, and which that send matches by 1. Send waits block on nobody: an
#      activation send is waited only after the gradient of the same microbatch arrived, which the next stage
#      sends only after it received those activations; the rest are waited after this rank's last
#      computation, and every receive they match is posted, since every rank gets through all its
#      computations. eval() runs the forward subsequence, whose T and dependencies are unchanged.
#   4. Nothing leaks: every posted op is waited before step() returns (collectives after the step see quiet
#      channels). Every receive has its own buffer (torch's stages allocate one per microbatch), so posting
#      early never overwrites data still in use.
#
# Instrumentation: with a ScheduleTimeline attached, the stages' computations are recorded (F, B), and so
# are post_recv_F / post_recv_B (instants), wait_recv_F / wait_recv_B and wait_send_F / wait_send_B. The
# Pipeline's wait_timer spans the waits and, a ``Timers``, each microbatch's forward and backward on each of
# this rank's stages (as for ScheduleDecoupled1F1B, schedules.py).

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, UnshardHandle
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    _Action,
    _ComputationType,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from megascale.core.parallel.pp.schedules import (
    ScheduleTimeline,
    _computing,
    _post,
    _SendQueue,
    _timed_wait,
)
from megascale.core.parallel.wait_timer import WaitTimer, compute_timer, untimed

__all__ = [
    "ScheduleDecoupledInterleaved1F1B",
    "prefetch_receives",
    "stream_p2p_groups",
    "stream_tag",
]

_T = _ComputationType
# a receive action -> the computation that consumes what it receives
_CONSUMER = {_T.RECV_F: _T.FORWARD, _T.RECV_B: _T.FULL_BACKWARD}
# actions that exist only with a backward (skipped by eval())
_BACKWARD_ONLY = frozenset({_T.FULL_BACKWARD, _T.RECV_B, _T.SEND_B, _T.REDUCE_GRAD})


def stream_tag(direction: str, receiving_stage: int) -> int:
    """The P2P tag of the stream delivering ``direction`` ("F" activations, "B" gradients) to a stage."""
    return 2 * receiving_stage + (direction == "B")


def stream_p2p_groups(group: dist.ProcessGroup, num_stages: int) -> dict[tuple[str, int], dist.ProcessGroup]:
    """One process group per stream, keyed ``(direction, receiving stage)``: ("F", t) for t = 1..S-1 and
    ("B", t) for t = 0..S-2, each over ``group``'s ranks in the same order (for backends that order P2P per
    communicator and ignore tags, e.g. NCCL). Collective over the pipeline ranks: every one calls it at the
    same point (each group is then used by one rank pair only)."""
    ranks = dist.get_process_group_ranks(group)
    keys = [("F", t) for t in range(1, num_stages)] + [("B", t) for t in range(num_stages - 1)]
    out = {}
    for direction, t in keys:
        g = dist.new_group(ranks, use_local_synchronization=True, group_desc=f"pp_{direction}{t}_stream",
                           sort_ranks=False)  # fmt: skip
        assert isinstance(g, dist.ProcessGroup)
        out[(direction, t)] = g
    return out


def prefetch_receives(actions: Sequence[_Action], lookahead: int = 1) -> list[_Action]:
    """One rank's plan (torch's, with communication) with every receive moved earlier, nothing else moved.

    The receive of microbatch i of a (stage, direction) stream goes right before the computation consuming
    microbatch ``i - lookahead`` of that stream (to the start for the first ``lookahead``), or stays where
    torch put it if that is earlier. Receives placed at the same point keep torch's relative order.
    """
    others = [a for a in actions if a.computation_type not in _CONSUMER]
    where = {a: i for i, a in enumerate(others)}
    at: defaultdict[int, list[_Action]] = defaultdict(list)
    seen = 0  # non-receive actions before the current one in torch's list
    for a in actions:
        kind = a.computation_type
        if kind not in _CONSUMER:
            seen += 1
            continue
        assert a.microbatch_index is not None
        earlier = a.microbatch_index - lookahead
        ours = 0
        if earlier >= 0:
            consumer = _Action(a.stage_index, _CONSUMER[kind], earlier)
            if consumer not in where:
                raise AssertionError(f"{a}: no computation {consumer} in the plan")
            ours = where[consumer]
        at[min(seen, ours)].append(a)
    out: list[_Action] = []
    for i, a in enumerate(others):
        out.extend(at.pop(i, ()))
        out.append(a)
    out.extend(at.pop(len(others), ()))
    return out


class ScheduleDecoupledInterleaved1F1B(ScheduleInterleaved1F1B):
    """Interleaved 1F1B with prefetched receives and decoupled sends (see the module header).

    Drop-in for ``torch.distributed.pipelining.ScheduleInterleaved1F1B``: same arguments, ``step()`` /
    ``eval()``, computation order, losses and gradients. Works with torch's ``PipelineStage`` as is: the
    schedule puts every op on its stream's tag (and, off gloo, group) itself. ``eval()`` leaves parameter
    gradients alone (torch's divides them by ``n_microbatches`` when ``scale_grads``). Custom functions
    (``register_custom_function``) and ``defer_pp_recv`` are not supported.

    Args (beyond torch's):
        recv_lookahead: how many receives of one stream are posted beyond the one being waited (≥ 1; each
            microbatch has its own receive buffer, so any depth is safe).
        p2p_groups: ``{(direction, receiving stage): group}`` for every stream (see
            :func:`stream_p2p_groups`), each over the stages' group's ranks in the same order. Default: on
            gloo with CPU stages none (the stages' group, streams told apart by tag), otherwise made here by
            :func:`stream_p2p_groups` (a collective over the pipeline ranks).
    """

    def __init__(
        self,
        stages: list[_PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        recv_lookahead: int = 1,
        p2p_groups: Mapping[tuple[str, int], dist.ProcessGroup] | None = None,
    ) -> None:
        if defer_pp_recv:
            raise ValueError("defer_pp_recv contradicts prefetching receives; it is not supported here")
        if recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be ≥ 1, got {recv_lookahead}")
        super().__init__(
            stages,
            n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
        )
        self.recv_lookahead = recv_lookahead
        #: Set by ScheduleTimeline.attach; None (the default) records nothing.
        self.timeline: ScheduleTimeline | None = None
        #: Times the waits (and, a ``Timers``, the microbatches): set by the Pipeline (see the header)
        self.wait_timer: WaitTimer = untimed
        assert self.pipeline_order_with_comms is not None
        #: torch's plan with every receive moved earlier (prefetch_receives): what _step_microbatches runs
        self.pipeline_order_with_comms = {
            rank: prefetch_receives(actions, recv_lookahead)
            for rank, actions in self.pipeline_order_with_comms.items()
        }
        group = stages[0].group if stages[0].group is not None else dist.group.WORLD
        assert group is not None
        self._p2p_groups: dict[tuple[str, int], dist.ProcessGroup]
        if p2p_groups is None:
            on_gloo = "gloo" in str(dist.get_backend(group))
            if on_gloo and all(torch.device(s.device).type == "cpu" for s in stages):
                self._p2p_groups = {}  # the stages' group for every stream; tags tell them apart
            else:
                self._p2p_groups = stream_p2p_groups(group, self._num_stages)
        else:
            want = dist.get_process_group_ranks(group)
            for key, g in p2p_groups.items():
                if dist.get_process_group_ranks(g) != want:
                    raise ValueError(
                        f"p2p_groups[{key}] must span the stages' group's ranks {want} in that order, got "
                        f"{dist.get_process_group_ranks(g)}"
                    )
            self._p2p_groups = dict(p2p_groups)

    def _post_stream(self, ops: list[dist.P2POp], direction: str, receiving_stage: int) -> list[dist.Work]:
        """Post ``ops`` one by one on the stream's tag and (if any) group."""
        tag = stream_tag(direction, receiving_stage)
        tagged = [
            dist.P2POp(op.op, op.tensor, group=op.group, tag=tag, group_peer=op.group_peer) for op in ops
        ]
        return _post(tagged, self._p2p_groups.get((direction, receiving_stage)))

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if self._comp_type_to_function_map:
            raise NotImplementedError(
                "custom functions are not supported by ScheduleDecoupledInterleaved1F1B"
            )
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)

        stages = {stage.stage_index: stage for stage in self._stages}
        n, has_backward = self._n_microbatches, self._has_backward
        received: dict[tuple[str, int, int], list[dist.Work]] = {}  # (direction, stage, mb) -> posted receive
        never = sys.maxsize  # no count bound on pending sends (see the header)
        fwd_sends = {s: _SendQueue(never, "F", self, s) for s in stages}
        bwd_sends = {s: _SendQueue(never, "B", self, s) for s in stages}
        backward_counter: Counter[int] = Counter()
        compute = compute_timer(self.wait_timer)

        for action in self.pipeline_order_with_comms[self.rank]:
            kind, s, mb = action.computation_type, action.stage_index, action.microbatch_index
            stage = stages[s]
            if kind in _BACKWARD_ONLY and not has_backward:
                if kind == _T.FULL_BACKWARD:
                    self._assert_unsharded(stage)  # as torch's no-op backward: completes a pending UNSHARD
                continue
            if kind in (_T.RECV_F, _T.RECV_B):
                assert mb is not None
                direction = "F" if kind == _T.RECV_F else "B"
                ops = stage.get_fwd_recv_ops(mb) if direction == "F" else stage.get_bwd_recv_ops(mb)
                received[(direction, s, mb)] = self._post_stream(ops, direction, s)
                tl = self.timeline
                if tl is not None and ops:
                    now = tl.clock()
                    tl.record(f"post_recv_{direction}", now, now, mb, s)
            elif kind == _T.SEND_F:
                assert mb is not None
                fwd_sends[s].push(mb, self._post_stream(stage.get_fwd_send_ops(mb), "F", s + 1))
            elif kind == _T.SEND_B:
                assert mb is not None
                bwd_sends[s].push(mb, self._post_stream(stage.get_bwd_send_ops(mb), "B", s - 1))
            elif kind == _T.FORWARD:
                assert mb is not None
                self._assert_unsharded(stage)
                if not stage.is_first and s - 1 not in stages:
                    if ("F", s, mb) not in received:
                        raise AssertionError(f"computing {action} before its receive was posted")
                    _timed_wait(received.pop(("F", s, mb)), self, "wait_recv_F", mb, s)
                with _computing(compute, "F", mb, s):
                    output = stage.forward_one_chunk(
                        mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs
                    )
                    self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)
                if s + 1 in stages:  # adjacent stages on one rank (P = 1): handed over, as torch does
                    stages[s + 1].set_local_fwd_input(output, mb)
                del output
            elif kind == _T.FULL_BACKWARD:
                assert mb is not None
                self._assert_unsharded(stage)
                if not stage.is_last and s + 1 not in stages:
                    if ("B", s, mb) not in received:
                        raise AssertionError(f"computing {action} before its receive was posted")
                    _timed_wait(received.pop(("B", s, mb)), self, "wait_recv_B", mb, s)
                    # stage s+1 sent this gradient after consuming F(s, mb)'s activations: that send is
                    # complete, waiting on it returns at once and releases the tensor
                    fwd_sends[s].wait_through(mb)
                backward_counter[s] += 1
                with _computing(compute, "B", mb, s):
                    stage.backward_one_chunk(
                        mb,
                        loss=self._maybe_get_loss(stage, mb),
                        full_backward=True,
                        last_backward=backward_counter[s] == n,
                    )
                if s - 1 in stages:
                    stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
            elif kind == _T.UNSHARD:
                self._unshard(stage)
            elif kind == _T.RESHARD:
                self._reshard(stage)
            elif kind == _T.REDUCE_GRAD:
                stage.perform_reduce_grad(n if self.scale_grads else 1)
            else:
                raise ValueError(f"{action}: unsupported action for ScheduleDecoupledInterleaved1F1B")

        # Leave nothing in flight. Not done when a computation raised: the peers would never send what this
        # rank still expects, and waiting would turn the error into a timeout.
        for queue in (*fwd_sends.values(), *bwd_sends.values()):
            queue.drain()
        if received:
            raise AssertionError(f"receives posted but never consumed: {sorted(received)}")
        if self.unshard_ops:
            raise AssertionError("unused unshard operations")
        self._update_losses(self._stages, losses)

    def _unshard(self, stage: _PipelineStageBase) -> None:
        """UNSHARD, as torch's runtime: start the all-gather of every FSDP module of the stage."""
        if not isinstance(stage.submod, FSDPModule):
            return
        s = stage.stage_index
        if s in self.unsharded_stages or s in self.unshard_ops:
            raise AssertionError(f"unsharding stage {s} twice")
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                self.unshard_ops[s].append(cast(UnshardHandle, module.unshard(async_op=True)))

    def _reshard(self, stage: _PipelineStageBase) -> None:
        """RESHARD, as torch's runtime: free the stage's unsharded parameters."""
        if not isinstance(stage.submod, FSDPModule):
            return
        s = stage.stage_index
        if s not in self.unsharded_stages or s in self.unshard_ops:
            raise AssertionError(f"resharding stage {s} that is not (fully) unsharded")
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self.unsharded_stages.remove(s)
