"""The interleaved (virtual-stage) 1F1B schedule with its receives prefetched: MegaScale's decoupled
communication (Jiang et al. 2024, §3.2) for the schedule torch runs with V stages per rank.

What torch's ``ScheduleInterleaved1F1B`` already does (torch 2.13, ``_PipelineScheduleRuntime``): every send and
receive is an action of its own (SEND_F, RECV_F, SEND_B, RECV_B), so activations and gradients never share a
blocking batch, and sends are waited only at the end of the step. Where it posts a receive is decided by a
lockstep simulation (``_add_send_recv``): in the receiver's list right after the action it runs at the
simulated moment the sender computes — often immediately before the computation that needs it (rank 1 of
P=2, V=2 runs ``1RECV_F0 1F0``, ``3RECV_F0 3F0``), so the transfer does not overlap compute.

``ScheduleDecoupledInterleaved1F1B`` runs torch's runtime on the same computation order, with each receive
moved earlier: the receive of microbatch i+1 for a (stage, direction) stream right after the computation that
consumed microbatch i's (the first of each stream at the start of the step) — ``recv_lookahead=1`` of
``ScheduleDecoupled1F1B``. Computations are unchanged, so losses and gradients are bitwise torch's.

Matching. Between two ranks one direction now carries several streams (rank r receives activations for each
of its V stages from rank r−1, and gradients for each from rank r+1), and moving receives reorders them
across streams, so first-posted-first-matched would hand one stream's data to another's buffer (same shapes:
silently). Each stream therefore gets its own tag (``stream_tag``): gloo matches sends to receives per
(peer, tag) in posting order, and within one stream both sides post in microbatch order (a stage runs its
forwards, and its backwards, in microbatch order). NCCL ignores tags and orders P2P per communicator, so on
other backends each stream gets a process group of its own (``stream_groups``, 2·V groups over the pipeline
ranks; reasoned, not run here: CI has no GPUs).

Progress. Posting a receive never blocks; the only waits are a receive just before the computation that reads
it, and every send at the end of the step. Posting receives earlier removes no operation and adds no wait, so
torch's runtime order, which completes, still completes: each awaited receive matches a send its peer posts
after a computation that depends only on earlier actions of the pipeline DAG.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    _Action,
    _ComputationType,
)

__all__ = ["ScheduleDecoupledInterleaved1F1B", "prefetch_receives", "stream_groups", "stream_tag"]

_RECV = {
    _ComputationType.RECV_F: _ComputationType.FORWARD,
    _ComputationType.RECV_B: _ComputationType.FULL_BACKWARD,
}


def stream_tag(direction: str, receiving_stage: int) -> int:
    """The P2P tag of the stream delivering ``direction`` ("F" activations, "B" gradients) to a stage."""
    return 2 * receiving_stage + (direction == "B")


def stream_groups(group: dist.ProcessGroup, virtual_stages: int) -> dict[tuple[str, int], dist.ProcessGroup]:
    """A process group per (direction, virtual stage index of the receiving stage), over ``group``'s ranks in
    the same order: for backends that order P2P per communicator and ignore tags (NCCL). Collective over the
    pipeline ranks; every one calls it at the same point."""
    ranks = dist.get_process_group_ranks(group)
    out = {}
    for direction in ("F", "B"):
        for v in range(virtual_stages):
            g = dist.new_group(ranks, use_local_synchronization=True, group_desc=f"pp_{direction}{v}_p2p",
                               sort_ranks=False)  # fmt: skip
            assert isinstance(g, dist.ProcessGroup)
            out[(direction, v)] = g
    return out


def prefetch_receives(actions: list[_Action], lookahead: int = 1) -> list[_Action]:
    """``actions`` (one rank's, with communication) with every receive moved to right after the computation
    that consumed the receive ``lookahead`` microbatches before it in its (stage, direction) stream, or to the
    start for the first ``lookahead`` of each stream; everything else keeps its order."""
    receives = [a for a in actions if a.computation_type in _RECV]
    others = [a for a in actions if a.computation_type not in _RECV]
    streams: dict[tuple[int, Any], list[_Action]] = {}
    for a in receives:
        streams.setdefault((a.stage_index, a.computation_type), []).append(a)
    after: dict[_Action, list[_Action]] = {}  # computation -> receives posted right after it
    first: list[_Action] = []
    for (stage, kind), stream in streams.items():
        for i, recv in enumerate(stream):
            if i < lookahead:
                first.append(recv)
            else:
                consumer = _Action(stage, _RECV[kind], stream[i - lookahead].microbatch_index)
                after.setdefault(consumer, []).append(recv)
    out = list(first)
    for a in others:
        out.append(a)
        out.extend(after.pop(a, []))
    if after:  # a receive whose predecessor's consumer is not in the list: keep torch's place for it
        raise AssertionError(f"receives without a consuming computation: {after}")
    return out


class ScheduleDecoupledInterleaved1F1B(ScheduleInterleaved1F1B):
    """torch's ``ScheduleInterleaved1F1B`` with receives prefetched (see the module docstring).

    Same arguments as torch's; the stages must tag their P2P ops per stream (megascale's pipeline stages do,
    see ``Pipeline``): otherwise reordered receives could match another stream's sends. ``recv_lookahead``:
    how many receives of one stream are posted ahead of the one being waited.
    """

    def __init__(self, *args: Any, recv_lookahead: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be ≥ 1, got {recv_lookahead}")
        assert self.pipeline_order_with_comms is not None
        self.pipeline_order_with_comms = {
            rank: prefetch_receives(list(actions), recv_lookahead)
            for rank, actions in self.pipeline_order_with_comms.items()
        }
