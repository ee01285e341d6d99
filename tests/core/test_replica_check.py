"""The run-time replica check (``replica_check.py``) on real gloo ranks.

``check_replicas`` at dp2 × tp2: equal replicas pass, float noise of an ulp passes, one rank's perturbed
tensor is named with its group and ranks, a tensor absent on one rank is named, a tensor compared over dp only
may differ over tp. ``ReplicaGuard`` around a plain training loop of ``parallelize``: a norm left unsummed in
the sequence-parallel region (the first-forward check opted out with 'replicated_unsummed') is stopped at the
first step, naming it; the correct plan is not.
"""

from __future__ import annotations

from typing import Any

import torch

from megascale.core.parallel.replica_check import (
    ReplicaEntry,
    ReplicaGuard,
    ReplicaMismatchError,
    check_replicas,
)
from tests._dist import run_distributed


def _entries(rank: int, case: str) -> list[ReplicaEntry]:
    a = torch.linspace(-1, 1, 10)
    b = torch.arange(6.0).view(2, 3)
    tp_rank = rank % 2
    split = torch.full((3,), float(tp_rank))  # this tp rank's shard: differs over tp, equal over dp
    if case == "perturbed" and rank == 3:
        b = b + 1e-3
    if case == "noise" and rank == 2:
        a = torch.nextafter(a, torch.full_like(a, 2.0))  # one ulp
    entries = [ReplicaEntry("a", a, ("dp", "tp")), ReplicaEntry("b", b, ("dp", "tp")),
               ReplicaEntry("split", split, ("dp",))]  # fmt: skip
    if case == "absent":
        entries.append(ReplicaEntry("c", None if rank == 1 else torch.ones(2), ("dp", "tp")))
    return entries


def _check_worker(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
    out = {}
    for case in ("equal", "noise", "perturbed", "absent"):
        try:
            check_replicas(_entries(rank, case), groups, what="gradient", step=1)
            out[case] = "passed"
        except ReplicaMismatchError as e:
            out[case] = str(e)
    return out


def test_check_replicas_names_the_tensor_the_group_and_the_disagreeing_rank() -> None:
    results = run_distributed(_check_worker, 4)
    assert all(r == results[0] for r in results), "every rank reaches the same verdict"
    got = results[0]
    assert got["equal"] == "passed" and got["noise"] == "passed"
    perturbed = got["perturbed"]
    assert perturbed.startswith(
        "replica check at optimizer step 1: ranks that should hold the same gradients"
    )
    assert "b over dp ranks [1, 3]: rank 1 has sum 15, sum of squares 55, rank 3: sum 15.00599" in perturbed
    assert "b over tp ranks [2, 3]: rank 2 has sum 15" in perturbed
    assert "a over" not in perturbed and "split" not in perturbed
    assert "mark its module 'sequence_parallel'" in perturbed  # the usual cause over tp
    assert "the data-parallel gradient reduction missed the parameter" in perturbed  # over dp
    assert "c over dp ranks [1, 3]: rank 1 has none, rank 3: sum 2" in got["absent"]


# ---- the guard around a training loop ---------------------------------------------------------------------


def _guard_worker(rank: int, world: int, unsummed: bool) -> str:
    from megascale.core.parallel import ParallelPlan, parallelize
    from tests.core.test_tp_plan_contract import LM, plan

    class Model(LM):
        def tensor_parallel_plan(self) -> dict[str, Any]:
            return plan(**{"blocks.*.norm2": "replicated_unsummed"}) if unsummed else plan()

    the_plan = ParallelPlan(tp=2)
    mesh = the_plan.dims(world).build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Model()
    runtime = parallelize(model, the_plan, mesh, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.zero.attach_optimizers([optimizer])
    guard = ReplicaGuard(steps=2)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, 8), generator=gen)
            model(tokens, tokens).backward()
            runtime.zero.after_backward()
            guard.check_gradients(optimizer, model, runtime)
            runtime.zero.before_optimizer_step(optimizer)
            optimizer.step()
            runtime.zero.after_optimizer_step(optimizer)
            guard.check_values(optimizer, model, runtime)
            optimizer.zero_grad()
    except ReplicaMismatchError as e:
        return str(e)
    return f"passed {guard.done} checked steps"


def test_the_guard_stops_a_norm_left_unsummed_in_the_sequence_region_and_passes_a_correct_plan() -> None:
    for message in run_distributed(_guard_worker, 2, True):
        assert message.startswith(
            "replica check at optimizer step 1: ranks that should hold the same gradients"
        )
        assert "blocks.0.norm2.weight over tp ranks [0, 1]" in message
        assert "blocks.1.norm2.bias over tp ranks [0, 1]" in message
        assert "replica_check_steps=0" in message
    assert run_distributed(_guard_worker, 2, False) == ["passed 2 checked steps"] * 2
