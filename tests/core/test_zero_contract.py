"""ZeRO-0/1 keep Lightning's parameter contract in a plain loop (``apply_zero`` on real gloo ranks at dp2),
against one process that runs every rank's forward and averages their losses, step by step:

- parameters frozen when ZeRO is set up are covered once unfrozen and added to the optimizer mid-run
  (``add_param_group``: ZeRO-1 rebuilds its pieces / ownership and keeps the states it has);
- a parameter that got a gradient on no rank (unused, skipped on every rank, frozen mid-run) keeps
  ``p.grad`` None, so AdamW leaves it alone; one that only some ranks used gets their sum / size;
- a trainable parameter outside every optimizer accumulates its gradient across steps as on one process (the
  optimizer never zeroes it; under ZeRO-1 "elements" its bucket is all-reduced, not cut into pieces);
- gradients are whole where ``set_whole_gradients(True)`` asks, and the global norm is right either way;
- a bucket of frozen parameters costs no collective; the flags cost one small all-reduce per step.

Tolerance: float32, the same sums in another order (≤ 4 terms); observed ≤ 1e-7 on weights and gradients;
bound 2e-6 (AdamW divides by sqrt(v), which amplifies where a gradient element is tiny). A zero gradient
instead of None moves a weight by ~lr = 1e-2 through weight decay and momentum; an unaveraged unfrozen
parameter or a piece taken for a whole gradient by ~1e-3 or more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.comm_meter import CollectiveMeter
from megascale.core.parallel import UnitTree, apply_zero, clip_grad_norm_
from tests._dist import run_distributed

DP = 2
STEPS = 8
LR = 1e-2
TOL = 2e-6
TINY_BUCKETS = 1e-6  # MiB: every parameter a bucket of its own, so skipped buckets can be counted


class Toy(nn.Module):
    """``b`` is used on some steps by some ranks only, ``c`` frozen until step 2, ``e`` trains outside the
    optimizer until step 3, ``a`` is frozen at step 4, ``u`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.e, self.u, self.d = nn.Linear(16, 16), nn.Linear(16, 3), nn.Linear(16, 5)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.c.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + self.b(h)
        h = h + self.c(h)
        h = h + torch.tanh(self.e(h))
        return F.mse_loss(self.d(h), torch.zeros(x.shape[0], 5))


def _uses_b(step: int, rank: int) -> bool:
    return (step < 2 and rank == 1) or 2 <= step < 5 or (step == 7 and rank == 0)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _change(step: int, model: Toy, opt: torch.optim.Optimizer) -> None:
    """What a user's code (BaseFinetuning, a callback) does before the forward of ``step``."""
    if step == 2:
        model.c.requires_grad_(True)
        opt.add_param_group({"params": list(model.c.parameters()), "lr": LR / 2})
    elif step == 3:
        opt.add_param_group({"params": list(model.e.parameters())})
    elif step == 4:
        model.a.requires_grad_(False)


def _optimizer(model: Toy) -> torch.optim.Optimizer:
    params = [p for m in (model.a, model.b, model.u, model.d) for p in m.parameters()]
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _record(model: Toy, opt: torch.optim.Optimizer, norm: torch.Tensor) -> dict[str, Any]:
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return {"grads": grads, "norm": float(norm)}


def _stepped(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _reference() -> list[dict[str, Any]]:
    model = Toy()
    opt = _optimizer(model)
    out = []
    for step in range(STEPS):
        _change(step, model, opt)
        loss = sum(model(_batch(step, r), _uses_b(step, r)) for r in range(DP)) / DP
        loss.backward()
        params = _stepped(opt)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        record = _record(model, opt, norm)
        opt.step()
        opt.zero_grad()
        record["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(record)
    return out


def _worker(rank: int, world: int) -> dict[str, list[dict[str, Any]]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return {name: _run(rank, mesh, *layout) for name, layout in LAYOUTS.items()}


def _run(rank: int, mesh: Any, stage: int, sharding: str, whole: bool) -> list[dict[str, Any]]:
    model = Toy()
    zero = apply_zero(
        [UnitTree(model, [])], mesh["dp"], stage=stage, zero1_sharding=sharding, bucket_size_mb=TINY_BUCKETS
    )
    opt = _optimizer(model)
    zero.attach_optimizers([opt])
    zero.set_whole_gradients(whole)
    meter = CollectiveMeter()
    out = []
    for step in range(STEPS):
        _change(step, model, opt)
        meter.records.clear()
        with meter:
            model(_batch(step, rank), _uses_b(step, rank)).backward()
            zero.after_backward()
        reductions = meter.count("all_reduce") + meter.count("reduce_scatter")
        norm = clip_grad_norm_(_stepped(opt), 1e9, sum_group=zero.grad_sum_group())  # measures, clips nothing
        record = _record(model, opt, norm)
        record["reductions"] = reductions
        zero.before_optimizer_step(opt)
        opt.step()
        zero.after_optimizer_step(opt)
        opt.zero_grad()
        zero.wait_for_params()
        record["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(record)
    zero.remove()
    return out


LAYOUTS = {
    "ZeRO-0": (0, "elements", False),
    "ZeRO-1 elements": (1, "elements", False),
    "ZeRO-1 elements, whole gradients": (1, "elements", True),
    "ZeRO-1 parameters": (1, "parameters", False),
}


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    return _reference()


@pytest.fixture(scope="module")
def runs() -> list[dict[str, list[dict[str, Any]]]]:
    return run_distributed(_worker, DP, timeout=300)  # every layout in one launch


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_frozen_late_unused_and_partly_used_parameters_step_as_on_one_process(layout, reference, runs):
    stage, sharding, whole = LAYOUTS[layout]
    pieces = stage == 1 and sharding == "elements" and not whole
    for rank, run in enumerate(r[layout] for r in runs):
        for step, (got, want) in enumerate(zip(run, reference)):
            where = f"{layout}, rank {rank}, step {step}"
            absent = sorted(n for n, g in want["grads"].items() if g is None)
            assert sorted(n for n, g in got["grads"].items() if g is None) == absent, where
            assert got["norm"] == pytest.approx(want["norm"], rel=1e-6), where
            # whole gradients everywhere but ZeRO-1's pieces (where only what no optimizer steps is whole)
            for name, g in got["grads"].items():
                if g is not None and (not pieces or (name.startswith("e.") and step < 3)):
                    worst = (g - want["grads"][name]).abs().max().item()
                    assert worst <= TOL, f"{where}: gradient of {name} differs by {worst:.2e}"
            for name, w in got["weights"].items():
                worst = (w - want["weights"][name]).abs().max().item()
                assert worst <= TOL, f"{where}: {name} differs from one process by {worst:.2e}"
            # one collective per bucket holding a trainable parameter (c frozen before step 2, a from step
            # 4: two buckets each), and one for the flags
            frozen = 2 if step < 2 or step >= 4 else 0
            assert got["reductions"] == 12 - frozen + 1, f"{where}: {got['reductions']} reductions"
