"""What ``self.log(..., sync_dist=True)`` and ``self.all_gather`` reduce over: the data-parallel ranks (those
reading different samples), not the world; a DTensor value is made whole first. The conformance matrix's
"log-sum" cells prove the sums inside a fit; this checks the strategy's collectives themselves. Under pp a
value the stages disagree on (computed from one stage's parameters) is refused on every rank ("log-l2")."""

from __future__ import annotations

from tests._dist import run_distributed


def _collectives(rank: int, world_size: int) -> tuple[float, float, float, tuple[int, ...], bool]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from megascale.lightning import MegaScaleStrategy

    strategy = MegaScaleStrategy(tp=2)  # dp=1 x tp=2: both ranks hold the same samples
    strategy._mesh = strategy.plan.dims(world_size).build_mesh("cpu")
    strategy.parallel_devices = [torch.device("cpu")] * world_size
    total = strategy.reduce(torch.tensor(3.0), reduce_op="sum")  # over the world: 6
    # a value computed from split parameters: a DTensor of this rank's half's sum (Partial over tp)
    partial = distribute_tensor(torch.arange(4.0), strategy._mesh["tp"], [Shard(0)]).sum()
    whole = strategy.reduce(partial, reduce_op="mean")
    gathered = strategy.all_gather(torch.tensor([1.0]))
    world = strategy.reduce(torch.tensor(1.0), group=torch.distributed.group.WORLD, reduce_op="sum")
    decided = strategy.reduce_boolean_decision(rank == 0, all=False)  # any: every rank's own decision counts
    return float(total), float(whole), float(world), tuple(gathered.shape), decided


def test_logged_values_reduce_over_the_data_parallel_ranks() -> None:
    # 3 summed once (one replica), 0+1+2+3 whole, the world when named, one entry per replica, rank 0's "yes"
    assert run_distributed(_collectives, 2) == [(3.0, 6.0, 2.0, (1, 1), True)] * 2


def _stage_values(rank: int, world_size: int) -> tuple[float, str]:
    import torch

    from megascale.lightning import MegaScaleStrategy

    strategy = MegaScaleStrategy(pp=2)
    strategy._mesh = strategy.plan.dims(world_size).build_mesh("cpu")
    strategy.parallel_devices = [torch.device("cpu")] * world_size
    same = strategy.reduce(torch.tensor(2.5))  # the loss: every stage holds the last stage's
    try:
        strategy.reduce(torch.tensor(float(rank + 1)))  # this stage's share only
    except ValueError as error:
        return float(same), str(error)
    return float(same), ""


def test_a_value_the_pipeline_stages_disagree_on_is_refused_on_every_rank() -> None:
    for same, error in run_distributed(_stage_values, 2):
        assert same == 2.5
        assert "differs between the pipeline stages (1.0 on stage 0, 2.0 on stage 1)" in error
