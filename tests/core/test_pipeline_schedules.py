"""Tests of megascale.core.parallel.ScheduleDecoupled1F1B (1F1B with decoupled asynchronous P2P) and
ScheduleTimeline, on real gloo ranks (world 2 and 4).

The model is a stack of Linear+GELU blocks, two per stage, float32, split into P PipelineStages. For every
(P, M) the decoupled schedule must give the per-microbatch losses and the gradients of torch's Schedule1F1B
(bit for bit: it runs the same computations in the same order, only the communication differs) and of one
process running the whole model on the whole batch (MSE with mean reduction and scale_grads=True: the
gradient of the mean of the microbatch losses). Two steps run back to back, then eval() (forward only),
then another step, so state left over from a step or a mode switch would show.

That the decoupling is real is checked on the recorded timeline: between two computations a rank never
waits on its own activation send (torch's Schedule1F1B does, on every stage but the last: it fuses that send
with the next gradient receive into one blocking batch), and the receive for microbatch i+1 is posted before
microbatch i is computed.

Tolerance against the single process: it sums the microbatches' contributions in another order; the
values here are O(1), observed differences ~1e-7. ATOL = RTOL = 1e-5 leave a wide margin; the bugs guarded
against (a microbatch's gradient dropped or counted twice, wrong scaling, a message matched to the wrong
microbatch) move them by 10% or more.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining import schedules as torch_schedules

from megascale.core.parallel import ScheduleDecoupled1F1B, ScheduleTimeline, TimelineEvent
from megascale.core.parallel.pp.schedules import _one_f_one_b_order
from tests._dist import run_distributed

ATOL = RTOL = 1e-5
D, BLOCKS_PER_STAGE, MB_ROWS = 16, 2, 2


def _full_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(num_stages * BLOCKS_PER_STAGE)]
    )


def _stage_module(full: nn.Sequential, stage: int) -> nn.Module:
    return copy.deepcopy(full[stage * BLOCKS_PER_STAGE : (stage + 1) * BLOCKS_PER_STAGE])


def _batch(step: int, n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    rows = n_microbatches * MB_ROWS
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _reference(full: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int) -> dict[str, Any]:
    """One process, whole model, whole batch: per-microbatch losses and the gradient of their mean."""
    model = copy.deepcopy(full)
    out = model(x)
    _mse(out, y).backward()
    with torch.no_grad():
        mb_losses = [_mse(model(xm), ym) for xm, ym in zip(x.chunk(m), y.chunk(m))]
    return {
        "out": out.detach(),
        "losses": mb_losses,
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def _stage_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's gradients, under the full model's parameter names (slicing a Sequential keeps them)."""
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _parity_worker(rank: int, world: int, microbatch_counts: list[int]) -> list[str]:
    """Run torch's 1F1B and ours side by side; return the failures found (empty: all good)."""
    problems: list[str] = []
    for m in microbatch_counts:
        full = _full_model(world)
        modules = {name: _stage_module(full, rank) for name in ("torch", "ours")}
        schedules = {
            "torch": Schedule1F1B(PipelineStage(modules["torch"], rank, world, torch.device("cpu")), m, _mse),
            "ours": ScheduleDecoupled1F1B(
                PipelineStage(modules["ours"], rank, world, torch.device("cpu")), m, _mse
            ),
        }
        order = schedules["ours"].pipeline_order
        assert order is not None
        ir = [(a.computation_type.value, a.microbatch_index) for a in order[rank] if a is not None]
        if [a for a in ir if a[0] in "FB"] != _one_f_one_b_order(rank, world, m, True):
            problems.append(f"P={world} M={m} rank {rank}: schedule IR {ir}")
        ref_model = copy.deepcopy(full)  # the single process steps along: parameters never change here
        for step, mode in enumerate(("train", "train", "eval", "train")):
            x, y = _batch(step, m)
            ref = _reference(ref_model, x, y, m)
            results = {}
            for name, schedule in schedules.items():
                modules[name].zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                args = (x,) if rank == 0 else ()
                target = y if rank == world - 1 else None
                if mode == "train":
                    out = schedule.step(*args, target=target, losses=losses)
                else:
                    with torch.no_grad():
                        out = schedule.eval(*args, target=target, losses=losses)
                results[name] = (out, losses, _stage_grads(modules[name]) if mode == "train" else None)
            tag = f"P={world} M={m} step {step} ({mode}) rank {rank}"
            (t_out, t_losses, t_grads), (o_out, o_losses, o_grads) = results["torch"], results["ours"]
            if rank == world - 1:
                if len(o_losses) != m or not all(torch.equal(a, b) for a, b in zip(o_losses, t_losses)):
                    problems.append(f"{tag}: losses differ from torch's 1F1B")
                if not all(_close(a, b) for a, b in zip(o_losses, ref["losses"])):
                    problems.append(f"{tag}: losses differ from the single process")
                if not (torch.equal(o_out, t_out) and _close(o_out, ref["out"])):
                    problems.append(f"{tag}: merged output differs")
            elif o_out is not None or o_losses:
                problems.append(f"{tag}: a non-last stage returned outputs or losses")
            if mode == "train":
                assert o_grads is not None and t_grads is not None
                for n, g in o_grads.items():
                    if not torch.equal(g, t_grads[n]):
                        problems.append(f"{tag}: {n}.grad differs from torch's 1F1B")
                    if not _close(g, ref["grads"][n]):
                        problems.append(f"{tag}: {n}.grad differs from the single process")
            elif any(p.grad is not None for p in modules["ours"].parameters()):
                problems.append(f"{tag}: eval() produced gradients")
    return problems


@pytest.mark.parametrize(("world", "microbatch_counts"), [(2, [2, 4, 5]), (4, [4, 8])])
def test_matches_torch_1f1b_and_one_process(world: int, microbatch_counts: list[int]) -> None:
    """Losses, outputs, gradients; train, train, eval, train (mode switches re-run torch's stage setup)."""
    for rank, problems in enumerate(run_distributed(_parity_worker, world, microbatch_counts)):
        assert problems == [], f"rank {rank}: {problems}"


class _SpiedTorchP2P:
    """Record, into a timeline, each wait torch's schedules do on a batch holding an activation send, with
    the microbatch whose activations it sends (found by storage: the op sends a detached stage output)."""

    def __init__(self, timeline: ScheduleTimeline, stage: PipelineStage) -> None:
        self.timeline, self.stage = timeline, stage
        self._sends: dict[int, int] = {}  # id(works) -> microbatch

    def batch(self, ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
        works = _REAL_BATCH_P2P(ops, desc)
        for op in ops:
            if op.op is dist.isend and desc is not None and "fwd_send" in desc:
                for mb, (outputs, _) in self.stage.fwd_cache.items():
                    if any(o.data_ptr() == op.tensor.data_ptr() for o in outputs):
                        self._sends[id(works)] = mb
        return works

    def wait(self, works: list[dist.Work]) -> None:
        start = self.timeline.clock()
        _REAL_WAIT_BATCH_P2P(works)
        mb = self._sends.pop(id(works), None)
        if mb is not None:
            self.timeline.record("wait_send_F", start, self.timeline.clock(), mb, self.stage.stage_index)


_REAL_BATCH_P2P = torch_schedules._batch_p2p
_REAL_WAIT_BATCH_P2P = torch_schedules._wait_batch_p2p


def _timeline_worker(rank: int, world: int, m: int) -> dict[str, list[TimelineEvent]]:
    full = _full_model(world)
    x, y = _batch(0, m)
    out: dict[str, list[TimelineEvent]] = {}
    for name, cls in (("torch", Schedule1F1B), ("ours", ScheduleDecoupled1F1B)):
        stage = PipelineStage(_stage_module(full, rank), rank, world, torch.device("cpu"))
        schedule = cls(stage, m, _mse)
        args, target = ((x,) if rank == 0 else ()), (y if rank == world - 1 else None)
        schedule.step(*args, target=target)  # first step: metadata inference, not recorded
        timeline = ScheduleTimeline()
        spy = _SpiedTorchP2P(timeline, stage)
        with (
            timeline.attach(schedule),
            mock.patch.object(torch_schedules, "_batch_p2p", spy.batch),
            mock.patch.object(torch_schedules, "_wait_batch_p2p", spy.wait),
        ):
            schedule.step(*args, target=target)
        out[name] = timeline.events
    return out


def _blocking_send_waits(events: list[TimelineEvent]) -> list[TimelineEvent]:
    """Waits on an activation send that sit between two computations while the send may still be pending:
    before the backward of that microbatch has run (once its gradient is back, the activations were
    delivered, so a wait after that returns at once)."""
    compute = sorted((e for e in events if e.kind in ("F", "B")), key=lambda e: e.start)
    gaps = list(itertools.pairwise(compute))
    backward_end = {e.microbatch: e.end for e in compute if e.kind == "B"}
    return [
        e
        for e in events
        if e.kind == "wait_send_F"
        and any(a.end <= e.start and e.end <= b.start for a, b in gaps)
        and not backward_end[e.microbatch] <= e.start
    ]


@pytest.fixture(scope="module")
def timelines() -> list[dict[str, list[TimelineEvent]]]:
    return run_distributed(_timeline_worker, 4, 8)


def test_no_stage_waits_on_its_own_pending_activation_send_before_computing(
    timelines: list[dict[str, list[TimelineEvent]]],
) -> None:
    """Ours: never, on any rank. Torch's 1F1B: on every stage that sends activations (all but the last),
    where it waits on F(i)'s send fused with the next gradient receive (and, in warmup, on F(i-1)'s send
    after computing F(i))."""
    for rank, events in enumerate(timelines):
        assert _blocking_send_waits(events["ours"]) == [], f"rank {rank}"
        torch_blocking = _blocking_send_waits(events["torch"])
        assert (len(torch_blocking) > 0) == (rank < 3), f"rank {rank}: {torch_blocking}"
        assert all(e.kind != "wait_send_F" for e in events["torch"]) == (rank == 3)  # the spy saw them


def test_receives_are_posted_before_the_previous_microbatch_computes(
    timelines: list[dict[str, list[TimelineEvent]]],
) -> None:
    for rank, events in enumerate(timelines):
        ours = events["ours"]
        for direction, has_recvs in (("F", rank > 0), ("B", rank < 3)):
            posted = {e.microbatch: e.start for e in ours if e.kind == f"post_recv_{direction}"}
            computed = {e.microbatch: e.start for e in ours if e.kind == direction}
            assert len(computed) == 8
            if not has_recvs:
                assert posted == {}
                continue
            assert set(posted) == set(range(8)), (rank, direction)
            for i in range(1, 8):
                assert posted[i] < computed[i - 1], (rank, direction, i)


def _too_few_worker(rank: int, world: int) -> str:
    stage = PipelineStage(nn.Linear(D, D), rank, world, torch.device("cpu"))
    try:
        ScheduleDecoupled1F1B(stage, world - 1, _mse)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fewer_microbatches_than_stages_is_refused() -> None:
    for message in run_distributed(_too_few_worker, 2):
        assert (
            "Number of microbatches (1) must be greater than or equal to the number of stages (2)" in message
        )


def _directional_groups_worker(rank: int, world: int) -> bool:
    from megascale.core.parallel import directional_p2p_groups

    m = 4
    full = _full_model(world)
    x, y = _batch(0, m)
    ref = _reference(full, x, y, m)
    module = _stage_module(full, rank)
    schedule = ScheduleDecoupled1F1B(
        PipelineStage(module, rank, world, torch.device("cpu")),
        m,
        _mse,
        recv_lookahead=3,
        p2p_groups=directional_p2p_groups(),
    )
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    return all(_close(g, ref["grads"][n]) for n, g in _stage_grads(module).items())


def test_directional_groups_and_deeper_prefetch() -> None:
    """Activations and gradients on two process groups of their own (the default off gloo), with every
    receive of a direction posted three microbatches ahead."""
    assert run_distributed(_directional_groups_worker, 2) == [True, True]


def test_same_computation_order_as_torch_1f1b(timelines: list[dict[str, list[TimelineEvent]]]) -> None:
    """As run on each rank (P=4, M=8), and as _one_f_one_b_order and the schedule IR state it."""
    for rank, events in enumerate(timelines):
        runs = {
            name: [(e.kind, e.microbatch) for e in sorted(evs, key=lambda e: e.start) if e.kind in ("F", "B")]
            for name, evs in events.items()
        }
        assert runs["ours"] == runs["torch"] == _one_f_one_b_order(rank, 4, 8, True), rank
    assert _one_f_one_b_order(1, 4, 8, False) == [("F", i) for i in range(8)]


def test_timeline_bubble_arithmetic() -> None:
    timeline = ScheduleTimeline()
    for kind, start, end in [("F", 1.0, 2.0), ("B", 3.0, 5.0), ("wait_recv_B", 2.0, 3.0), ("F", 9.0, 12.0)]:
        timeline.record(kind, start, end)
    assert timeline.busy_time(0.0, 10.0) == pytest.approx(4.0)  # F 1-2, B 3-5, F 9-10 (clipped)
    assert timeline.bubble_fraction(0.0, 10.0) == pytest.approx(0.6)
    assert timeline.total("wait_") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="empty window"):
        timeline.bubble_fraction(1.0, 1.0)


def _pooled_receives_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Three AdamW steps of a small GPT (dropout on) per case, with the stages' receive buffers pooled and with
    torch's one per microbatch: the losses, the parameters and the receive buffers each stage held."""
    from megascale.core import GPT, GPTConfig
    from megascale.core.parallel import ParallelPlan, parallelize
    from megascale.core.parallel.pp import apply as pipeline_module

    out = []
    for case in cases:
        for pooled in (True, False):
            pipeline_module._LeanStage.pool_receives = pooled
            plan = ParallelPlan(**case)
            torch.manual_seed(0)
            with torch.device("meta"):
                model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=16,
                                      dropout=0.1))  # fmt: skip
            runtime = parallelize(model, plan, plan.dims(world).build_mesh("cpu"), device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
                losses.append(model(tokens, tokens.roll(-1, 1)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            assert runtime.pipeline is not None
            schedule = runtime.pipeline._schedules[("train", (8, 16))]
            stages = getattr(schedule, "_stages", None) or [schedule._stage]
            out.append({
                "case": case, "pooled": pooled, "losses": losses,
                "parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                "buffers": {s.stage_index: len(s.receive_buffers()) for s in stages},
                "most_lent": {(s.stage_index, d): p.most_lent for s in stages for d, p in s._pools.items()},
            })  # fmt: skip
    pipeline_module._LeanStage.pool_receives = True
    return out


def test_receive_buffers_are_pooled_and_results_unchanged() -> None:
    """torch's PipelineStage keeps an activation and a gradient receive buffer per microbatch; the pipeline's
    stages lend them to the microbatches in flight only. P=2, 1F1B at M=8: stage 1 holds 2 activation buffers
    (the one computing and the next, prefetched), stage 0 2 gradient buffers, not 8; GPipe all 8 activations
    (every forward before the first backward) but 1 gradient; interleaved (V=2, M=4) 2 to 4 of each stream's
    4. Losses and parameters after three AdamW steps with dropout are bitwise those of torch's buffers."""
    cases = [
        dict(pp=2, num_microbatches=8),
        dict(pp=2, num_microbatches=8, schedule="gpipe"),
        dict(pp=2, num_microbatches=4, schedule="interleaved", virtual_stages=2),
    ]
    # per rank: the most buffers lent at once, by (stage, "F" activations | "B" gradients)
    expected = [
        [{(0, "B"): 2}, {(0, "B"): 1}, {(0, "B"): 2, (2, "F"): 3, (2, "B"): 2}],
        [{(1, "F"): 2}, {(1, "F"): 8}, {(1, "F"): 4, (1, "B"): 2, (3, "F"): 2}],
    ]
    results = run_distributed(_pooled_receives_worker, 2, cases, timeout=300)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            pooled, unpooled = per_rank[2 * i], per_rank[2 * i + 1]
            tag = (case, rank)
            assert all(torch.equal(a, b) for a, b in zip(pooled["losses"], unpooled["losses"])), tag
            for name, p in pooled["parameters"].items():
                assert torch.equal(p, unpooled["parameters"][name]), (*tag, name)
            # unpooled: one buffer per microbatch for each stream into a stage (F into s > 0, B into s < S - 1)
            m, last = case["num_microbatches"], 2 * case.get("virtual_stages", 1) - 1
            assert unpooled["buffers"] == {s: m * ((s > 0) + (s < last)) for s in unpooled["buffers"]}, tag
            assert pooled["most_lent"] == expected[rank][i], tag
            # and a stage holds no more buffers than were lent at once
            lent = pooled["most_lent"].items()
            assert pooled["buffers"] == {
                s: sum(n for (t, _), n in lent if t == s) for s in pooled["buffers"]
            }, tag
