"""ZeRO-2/3 units (one per layer) that some ranks' forward does not call, in a plain loop on real gloo ranks at
dp2, against one process that runs every rank's forward (each with its own skips) and averages their losses.

Each rank skips its own blocks each step: a middle one, two in a row, the first, the last (after the last
unit that runs, so only the root's output is left to carry its backward), none, or all; the blocks are
all of one size, so a gather paired with another unit's goes through silently on NCCL. Before
``skipped_units.py`` the ranks issued different collectives (gloo: "Received data size doesn't match";
NCCL: a hang or another unit's values). Checked: the loss, every weight after every step, and ``p.grad``
None where no rank ran a block (AdamW then leaves it alone, as on one process). The manual case runs the
backward inside the root's forward, so the blocks left after the last one run are passed over on the loss
(``before_backward``).

Tolerance: float32, the same sums in another order; bound 2e-6 as in test_zero_contract.py (a block skipped
where it ran, or zero gradients for None, moves a weight by ~lr = 1e-2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.parallel import UnitTree, apply_zero
from tests._dist import run_distributed

DP = 2
LR = 1e-2
TOL = 2e-6
BLOCKS = 4
# blocks each rank skips, step by step: (rank 0's, rank 1's)
SKIPS: list[tuple[set[int], set[int]]] = [
    (set(), {1}),  # a middle block
    ({3}, set()),  # the last block: only the root's output is left after it
    ({1, 2}, {0}),  # two in a row; the first
    (set(), set()),
    ({0, 1, 2, 3}, {2, 3}),  # all of them; the last two
    ({2}, {2}),  # the same on both: no gradient anywhere, p.grad stays None
]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(8, 3)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def forward(self, x: torch.Tensor, skip: set[int]) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                h = block(h)
        return F.mse_loss(self.head(h).float(), torch.ones(x.shape[0], 3))


class Manual(nn.Module):
    """The root whose forward runs the backward itself (a LightningModule's manual training_step)."""

    def __init__(self, zero_box: list[Any]) -> None:
        super().__init__()
        self.net = Net()
        self.zero_box = zero_box

    def forward(self, x: torch.Tensor, skip: set[int]) -> torch.Tensor:
        loss = self.net(x, skip)
        zero = self.zero_box[0]
        zero.before_backward(loss).backward()
        zero.after_backward()
        return loss.detach()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _reference() -> list[dict[str, Any]]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = []
    for step, skips in enumerate(SKIPS):
        loss = sum(model(_batch(step, r), skips[r]) for r in range(DP)) / DP
        loss.backward()
        grads = {n: p.grad is not None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append({"loss": float(loss.detach()), "grads": grads, "weights": _weights(model)})
    return out


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        value = p.detach()
        out[name.removeprefix("net.")] = (
            value.full_tensor() if hasattr(value, "full_tensor") else value
        ).clone()
    return out


def _worker(rank: int, world: int, stage: int, manual: bool) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    box: list[Any] = []
    root = Manual(box) if manual else Net()
    net = root.net if manual else root
    layers = [[net.embed], list(net.blocks)]  # the head the root's own: nothing after the last block
    zero = apply_zero([UnitTree(root, layers)], mesh["dp"], stage=stage, bucket_size_mb=0)
    box.append(zero)
    opt = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=0.1)
    out = []
    for step, skips in enumerate(SKIPS):
        if manual:
            loss = root(_batch(step, rank), skips[rank])
        else:
            loss = root(_batch(step, rank), skips[rank])
            loss.backward()
            zero.after_backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        grads = {n.removeprefix("net."): p.grad is not None for n, p in root.named_parameters()}
        zero.before_optimizer_step(opt)
        opt.step()
        zero.after_optimizer_step(opt)
        opt.zero_grad()
        out.append({"loss": float(total) / world, "grads": grads, "weights": _weights(root)})
    zero.remove()
    return out


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    return _reference()


@pytest.mark.parametrize("manual", [False, True], ids=["backward-after-forward", "backward-inside-forward"])
@pytest.mark.parametrize("stage", [2, 3])
def test_units_some_ranks_skip_step_as_on_one_process(stage: int, manual: bool, reference) -> None:
    runs = run_distributed(_worker, DP, stage, manual, timeout=240)
    for rank, run in enumerate(runs):
        for step, (got, want) in enumerate(zip(run, reference)):
            where = f"ZeRO-{stage} rank {rank} step {step} (skips {SKIPS[step]})"
            assert got["loss"] == pytest.approx(want["loss"], abs=TOL), where
            differ = sorted(n for n in want["grads"] if got["grads"][n] != want["grads"][n])
            assert not differ, f"{where}: a gradient where one process has none, or the other way: {differ}"
            for name, value in want["weights"].items():
                diff = float((got["weights"][name] - value).abs().max())
                assert diff <= TOL, f"{where}: {name} off by {diff:.2e}"


def _worker_bf16(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    net = Net()
    layers = [[net.embed], list(net.blocks)]  # the head the root's own: nothing after the last block
    zero = apply_zero(
        [UnitTree(net, layers)], mesh["dp"], stage=3, bucket_size_mb=0, param_dtype=torch.bfloat16
    )
    skips = ({3}, set())  # rank 0 passes over the last block on the root's output: the loss
    loss = net(_batch(0, rank), skips[rank])
    loss.backward()
    zero.after_backward()
    zero.remove()
    return [str(loss.dtype), str(net.head.weight.grad.dtype)]


def test_a_unit_passed_over_on_the_root_output_leaves_its_dtype_alone() -> None:
    # FSDP casts a unit's inputs to the compute dtype; the identity must not (the loss stays what the root made)
    for rank, got in enumerate(run_distributed(_worker_bf16, DP, timeout=120)):
        assert got == ["torch.float32", "torch.float32"], f"rank {rank}: {got}"
