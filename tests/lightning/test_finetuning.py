"""BaseFinetuning's "already in the optimizer" on split models decides what one process decides.

Lightning compares by value (``torch.equal``): a parameter merely equal to one in the optimizer is left out.
The fits under every layout are in the conformance matrix (the *finetuning* row); here the filter itself,
against Lightning's on one process, with DTensor shards, plain tensors and pipeline stages that each hold
part of the optimizer.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning

from megascale.lightning.finetuning import adapt, filter_on_optimizer
from tests._dist import run_distributed


def _kept(kept: list[torch.Tensor], given: list[torch.Tensor]) -> list[int]:
    return [i for i, p in enumerate(given) if any(p is k for k in kept)]


def test_one_process_keeps_what_lightning_keeps() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    bias = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([w, bias], lr=0.1)
    given = [
        w,  # in the optimizer
        torch.nn.Parameter(w.detach().clone()),  # equal to w by value: Lightning leaves it out
        torch.nn.Parameter(-torch.zeros(4)),  # -0.0 == 0.0
        torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)),  # values compared across dtypes
        torch.nn.Parameter(torch.zeros(2, 2)),  # same values, another shape
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.full((4,), float("nan"))),  # NaN equals nothing
    ]
    with pytest.warns(UserWarning, match="already exist within another group"):
        ours = _kept(filter_on_optimizer(optimizer, given), given)
    with pytest.warns(UserWarning, match="already exist within another group"):
        lightnings = _kept(BaseFinetuning.filter_on_optimizer(optimizer, given), given)
    assert ours == lightnings == [4, 5, 6]


def _tensor_parallel(rank: int, world_size: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same whole values on every rank
    whole = torch.randn(8, 4)
    w = torch.nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]))
    bias = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([w, bias], lr=0.1)
    given = [
        torch.nn.Parameter(whole.clone()),  # plain, equal to the DTensor w
        torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)])),  # a shard equal to bias
        torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])),
        bias,
        torch.nn.Parameter(distribute_tensor(whole.clone(), mesh, [Shard(1)])),  # other placement, equal
    ]
    return _kept(filter_on_optimizer(optimizer, given), given)


def test_tensor_parallel_shards_and_plain_tensors_compare_by_whole_value() -> None:
    assert run_distributed(_tensor_parallel, 2) == [[2], [2]]


def _pipeline_stages(rank: int, world_size: int) -> list[int]:
    import torch.distributed as dist

    # stage 0's optimizer holds a zero bias; stage 1's holds a weight; each is given parameters of its own
    held = torch.nn.Parameter(torch.zeros(4) if rank == 0 else torch.ones(2, 3))
    optimizer = torch.optim.SGD([held], lr=0.1)
    if rank == 0:  # the first equals stage 1's weight, the second nothing
        given = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    else:  # the first equals stage 0's bias (one process would leave it out), then the held weight itself
        given = [torch.nn.Parameter(torch.zeros(4)), held, torch.nn.Parameter(torch.zeros(2, 3))]
    return _kept(filter_on_optimizer(optimizer, given, pp_group=dist.group.WORLD), given)


def test_pipeline_stages_see_the_whole_models_optimizer() -> None:
    assert run_distributed(_pipeline_stages, 2) == [[1], [2]]


def test_adapted_callback_unfreezes_through_lightnings_method_and_restores_it() -> None:
    class Finetune(BaseFinetuning):
        calls = 0

        def freeze_before_training(self, pl_module: object) -> None: ...

        def finetune_function(self, pl_module: object, epoch: int, optimizer: object) -> None: ...

        def unfreeze_and_add_param_group(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            self.calls += 1  # a callback's own override stays in charge
            BaseFinetuning.unfreeze_and_add_param_group(*args, **kwargs)  # type: ignore[arg-type]

    torch.manual_seed(0)
    head, body = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    body.requires_grad_(False)
    with torch.no_grad():
        body.bias.copy_(head.bias)  # equal by value to a parameter in the optimizer
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    callback = Finetune()
    original = BaseFinetuning.__dict__["filter_on_optimizer"]
    adapt(callback, pp_group=object())  # type: ignore[arg-type]  # an earlier fit's group, gone since
    adapt(
        callback, pp_group=None
    )  # this fit's: the earlier wrapper must not run (it would use the old group)
    with pytest.warns(UserWarning, match="already exist within another group"):
        callback.unfreeze_and_add_param_group(body, optimizer, lr=0.01)
    assert BaseFinetuning.__dict__["filter_on_optimizer"] is original and callback.calls == 1
    assert body.weight.requires_grad and body.bias.requires_grad
    added = optimizer.param_groups[1]
    assert added["params"] == [body.weight] and added["lr"] == 0.01  # the equal bias left out, as Lightning
