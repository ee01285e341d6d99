import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed


def _all_reduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def test_run_distributed_returns_each_rank_result():
    assert run_distributed(_all_reduce_rank, 2) == [1.0, 1.0]


def test_run_distributed_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_distributed(_fail_on_rank_one, 2)
