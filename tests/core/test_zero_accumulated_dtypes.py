"""ZeRO-2/3 under bf16 compute with fp32 reduction, accumulating two micro-batches: a layer the first one skips
and the second runs gets its gradient in bf16 (an unused parameter zeros in bf16), beside gradients FSDP2 kept in
fp32 from the first, in one unit. Before ``fsdp._reduce_in_one_dtype`` FSDP2 failed with "FSDP reduce-scatter expects uniform gradient dtype".
Checked on gloo at dp2 against one process summing the same micro-batches in float32: the gradients, within
bf16's compute error (inputs and weights rounded to bf16: 2e-2 relative here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.parallel import UnitTree, apply_zero
from tests._dist import run_distributed

DP = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)  # the root's own, beside embed: one unit holds both
        self.head = nn.Linear(8, 3)
        self.never = nn.Linear(8, 8)  # no forward uses it: FSDP2 reduce-scatters zeros for it
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = self.embed(x)
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return F.mse_loss(self.head(h).float(), torch.ones(x.shape[0], 3))


def _batch(micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * micro + rank))


def _worker(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    net = Net()
    zero = apply_zero([UnitTree(net, [])], mesh["dp"], stage=stage, param_dtype=torch.bfloat16)
    with zero.no_sync():
        net(_batch(0, rank), use_sometimes=False).backward()
    net(_batch(1, rank), use_sometimes=True).backward()
    zero.after_backward()
    grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in net.named_parameters()}
    zero.remove()
    return grads


def _reference() -> dict[str, torch.Tensor]:
    net = Net()
    for rank in range(DP):
        for micro in range(2):
            (net(_batch(micro, rank), use_sometimes=micro == 1) / DP).backward()
    return {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layer_only_the_last_micro_batch_runs_is_reduced_with_the_accumulated_ones(stage: int) -> None:
    want = _reference()
    for rank, got in enumerate(run_distributed(_worker, DP, stage, timeout=120)):
        assert {n for n, g in got.items() if g is None} == {n for n, g in want.items() if g is None}
        for name, value in want.items():
            if value is None:
                continue
            assert got[name].dtype == torch.float32
            error = float((got[name] - value).abs().max() / value.abs().max())
            assert error < 2e-2, f"ZeRO-{stage} rank {rank}: {name} off by {error:.1e} (relative)"


def _worker_unfrozen(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    net = Net()
    net.sometimes.requires_grad_(False)  # frozen whole when FSDP2 first runs its unit (BaseFinetuning's way)
    zero = apply_zero([UnitTree(net, [[net.sometimes]])], mesh["dp"], stage=stage, param_dtype=torch.bfloat16)
    net(_batch(0, rank), use_sometimes=True).backward()
    zero.after_backward()
    net.zero_grad()
    net.sometimes.requires_grad_(True)  # unfrozen: its bf16 gradients are reduced in fp32 as the others'
    net(_batch(1, rank), use_sometimes=True).backward()
    zero.after_backward()
    grads = {n: p.grad.full_tensor() for n, p in net.named_parameters() if p.grad is not None}
    zero.remove()
    return grads


@pytest.mark.parametrize("stage", [2, 3])
def test_a_unit_frozen_when_first_run_and_unfrozen_later_reduces_in_fp32(stage: int) -> None:
    net = Net()
    for rank in range(DP):
        (net(_batch(1, rank), use_sometimes=True) / DP).backward()
    want = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    for rank, got in enumerate(run_distributed(_worker_unfrozen, DP, stage, timeout=120)):
        assert sorted(got) == sorted(want), f"rank {rank}"
        for name, value in want.items():
            assert got[name].dtype == torch.float32, f"ZeRO-{stage} rank {rank}: {name} {got[name].dtype}"
            error = float((got[name] - value).abs().max() / value.abs().max())
            assert error < 2e-2, f"ZeRO-{stage} rank {rank}: {name} off by {error:.1e} (relative)"
