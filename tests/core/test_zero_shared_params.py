"""Two optimizers sharing a parameter under ZeRO-1, stepped one after the other after one backward (a Muon +
AdamW loop): each steps the shared parameter with its own state from the other's new values, as on one
process (real gloo ranks at dp2 against one process on the union batch).

Under ZeRO-1 by parameters the shared weight ``d.weight`` is owned by rank 1 in the first optimizer and rank 0
in the second (greedy by size), so the second owner must wait for the first one's broadcast before it steps:
without the wait it steps its stale copy, ~lr off. Tolerance as in ``test_zero_contract.py``.
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
STEPS = 5
LR = 1e-2
TOL = 2e-6


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.d(torch.tanh(self.b(torch.tanh(self.a(x))))), torch.zeros(x.shape[0], 5))


def _optimizers(model: Toy) -> list[torch.optim.Optimizer]:
    # d.weight in both: the first's second-largest (owner: rank 1), the second's largest (owner: rank 0)
    first = torch.optim.AdamW([model.b.weight, model.d.weight], lr=LR)
    second = torch.optim.SGD([model.d.weight, model.d.bias, model.a.bias], lr=0.1, momentum=0.9)
    return [first, second]


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference() -> dict[str, torch.Tensor]:
    model = Toy()
    optimizers = _optimizers(model)
    for step in range(STEPS):
        (sum(model(_batch(step, r)) for r in range(DP)) / DP).backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return {sharding: _run(rank, mesh, sharding) for sharding in ("elements", "parameters")}


def _run(rank: int, mesh: Any, sharding: str) -> dict[str, torch.Tensor]:
    model = Toy()
    zero = apply_zero(
        [UnitTree(model, [])], mesh["dp"], stage=1, zero1_sharding=sharding, bucket_size_mb=1e-6
    )
    optimizers = _optimizers(model)
    zero.attach_optimizers(optimizers)
    for step in range(STEPS):
        model(_batch(step, rank)).backward()  # the forward waits for the last step's gathers
        zero.after_backward()
        for opt in optimizers:
            zero.before_optimizer_step(opt)
            opt.step()
            zero.after_optimizer_step(opt)
        for opt in optimizers:
            opt.zero_grad()
    zero.wait_for_params()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero.remove()
    return weights


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_distributed(_worker, DP, timeout=300)


@pytest.mark.parametrize("sharding", ["elements", "parameters"])
def test_optimizers_sharing_a_parameter_step_it_in_turn_as_on_one_process(sharding, runs) -> None:
    want = _reference()
    for rank, run in enumerate(r[sharding] for r in runs):
        for name, w in run.items():
            worst = (w - want[name]).abs().max().item()
            assert worst <= TOL, (
                f"ZeRO-1 {sharding}, rank {rank}: {name} differs from one process by {worst:.2e}"
            )
