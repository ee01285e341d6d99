"""The interleaved schedule with prefetched receives (``pipeline_interleaved.py``): every receive posted one
computation of its stream ahead, nothing else moved; the same losses and gradients as torch's
ScheduleInterleaved1F1B, bitwise (the computations and their order are torch's; only when receives are posted
differs), on real gloo ranks where one rank pair carries several streams.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    _add_send_recv,
    _ComputationType,
)

from megascale.core.parallel import ParallelPlan, parallelize
from megascale.core.parallel.pipeline_interleaved import prefetch_receives, stream_tag
from tests._dist import run_distributed
from tests._models import Head, LayeredLM
from tests.core.test_grad_reduction import Block

RECV = {
    _ComputationType.RECV_F: _ComputationType.FORWARD,
    _ComputationType.RECV_B: _ComputationType.FULL_BACKWARD,
}
COMPUTE = {_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD}


def _torch_actions(P: int, V: int, M: int) -> dict[int, list[Any]]:
    rounds = max(1, M // P)
    orders = {}
    for rank in range(P):
        fake = types.SimpleNamespace(n_local_stages=V, microbatches_per_round=M // rounds, pp_group_size=P,
                                     _n_microbatches=M, rank=rank)  # fmt: skip
        orders[rank] = [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank) if a]
    return _add_send_recv(orders, lambda s: s % P, P * V)


@pytest.mark.parametrize(("P", "V", "M"), [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 2, 4)])
def test_receives_move_one_computation_ahead_and_nothing_else_moves(P: int, V: int, M: int) -> None:
    for rank, actions in _torch_actions(P, V, M).items():
        moved = prefetch_receives(actions)
        assert Counter(moved) == Counter(actions), "actions added or lost"
        others = [a for a in actions if a.computation_type not in RECV]
        assert [a for a in moved if a.computation_type not in RECV] == others, "non-receive actions reordered"
        position = {a: i for i, a in enumerate(moved)}
        consumers = 0
        for a in moved:
            if a.computation_type not in RECV:
                continue
            consumer = (a.stage_index, RECV[a.computation_type], a.microbatch_index)
            use = next(
                i
                for b, i in position.items()
                if (b.stage_index, b.computation_type, b.microbatch_index) == consumer
            )
            assert position[a] < use, f"rank {rank}: {a} posted after its use"
            previous = (a.stage_index, RECV[a.computation_type], a.microbatch_index - 1)
            before = [
                i
                for b, i in position.items()
                if (b.stage_index, b.computation_type, b.microbatch_index) == previous
            ]
            if before:  # posted while the previous microbatch of its stream is still to be computed
                assert position[a] == before[0] + 1, f"rank {rank}: {a} not right after {previous}"
                consumers += 1
        # torch placed some of these right before their use; now every one after the first has a computation
        # of its own stream in between
        assert consumers > 0


def test_each_stream_has_its_own_tag() -> None:
    tags = {stream_tag(d, s) for d in "FB" for s in range(8)}
    assert len(tags) == 16


def _worker(rank: int, world: int, layout: dict[str, Any]) -> dict[str, Any]:
    from megascale.core.parallel import pipeline as pipeline_module

    out: dict[str, Any] = {}
    for name, schedule_class in (("decoupled", pipeline_module.ScheduleDecoupledInterleaved1F1B),
                                 ("torch", ScheduleInterleaved1F1B)):  # fmt: skip
        pipeline_module.ScheduleDecoupledInterleaved1F1B = schedule_class  # what Pipeline builds
        plan = ParallelPlan(**layout, schedule="interleaved", virtual_stages=2)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):  # 8 blocks: a stage each at pp4 x V2
            model = LayeredLM(64, 32, [Block(32) for _ in range(8)], Head(32, 64))
        runtime = parallelize(model, plan, mesh, device="cpu")
        gen = torch.Generator().manual_seed(7)
        losses = []
        for _ in range(2):
            tokens, targets = (
                torch.randint(0, 64, (8, 8), generator=gen),
                torch.randint(0, 64, (8, 8), generator=gen),
            )
            losses.append(model(tokens, targets).item())
        assert runtime.pipeline is not None
        kinds = {type(s).__name__ for s in runtime.pipeline._schedules.values()}
        out[name] = {
            "losses": losses,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "schedules": kinds,
        }
    return out


@pytest.mark.parametrize(
    "layout", [dict(pp=2, num_microbatches=4), dict(pp=4, num_microbatches=8)], ids=["pp2", "pp4"]
)
def test_prefetched_interleaved_equals_torchs_bitwise(layout: dict[str, Any]) -> None:
    world = layout["pp"]
    for rank, result in enumerate(run_distributed(_worker, world, layout, timeout=180)):
        ours, theirs = result["decoupled"], result["torch"]
        assert ours["schedules"] == {"ScheduleDecoupledInterleaved1F1B"}, ours["schedules"]
        assert theirs["schedules"] == {"ScheduleInterleaved1F1B"}
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        assert ours["grads"].keys() == theirs["grads"].keys() and ours["grads"]
        for k in ours["grads"]:
            assert torch.equal(ours["grads"][k], theirs["grads"][k]), f"rank {rank}: {k}"
