"""Tests of megascale.core.optim.LAMB: the foreach and per-tensor backends, a textbook reference, trust-ratio
edge cases, LR schedulers, state-dict round trips, argument checks, the apex glue (against a Python model of
apex FusedLAMB, since apex cannot be installed here), and sharded DTensor parameters on 2 and 4 gloo ranks
against one unsharded process.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, ClassVar
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from megascale.core.optim import LAMB
from megascale.core.optim import lamb as lamb_module
from tests._dist import run_distributed

# ---- shared problem: a few tensors of different shapes, two parameter groups, fixed gradients ----------

SHAPES = [(6, 5), (7,), (3, 4, 2), (4, 4)]
WEIGHT_DECAYS = [0.1, 0.0, 0.1, 0.0]  # groups: {0, 2} decay, {1, 3} no decay (norms/biases)


def _initial_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    weights = [torch.randn(shape, generator=gen) for shape in SHAPES]
    weights[3] *= 100.0  # no decay, trust ratio ≫ 10: the default clamp engages
    return weights


def _grads(step: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    return [torch.randn(shape, generator=gen) * (0.5 + i) for i, shape in enumerate(shapes)]


def _groups(params: list[torch.Tensor], wds: list[float] = WEIGHT_DECAYS) -> list[dict[str, Any]]:
    decay = [p for p, wd in zip(params, wds) if wd != 0]
    no_decay = [p for p, wd in zip(params, wds) if wd == 0]
    return [
        {"params": decay, "weight_decay": max(wds)},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _run_lamb(steps: int, weights: list[torch.Tensor] | None = None, **kwargs: Any) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(w.clone()) for w in (weights or _initial_weights())]
    opt = LAMB(_groups(params), **kwargs)
    for step in range(steps):
        for p, g in zip(params, _grads(step, [tuple(p.shape) for p in params])):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _textbook_lamb(
    weights: list[torch.Tensor],
    grads: Callable[[int], list[torch.Tensor]],
    steps: int,
    wds: list[float],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    bias_correction: bool = True,
    max_trust_ratio: float | None = 10.0,
) -> tuple[list[torch.Tensor], list[float]]:
    """LAMB straight from the formulas, in float64, one tensor at a time. Returns weights and all ratios."""
    b1, b2 = betas
    ws = [w.double().clone() for w in weights]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    ratios = []
    for t in range(1, steps + 1):
        for i, g in enumerate(grads(t - 1)):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2**t) if bias_correction else vs[i]
            u = m_hat / (v_hat.sqrt() + eps) + wds[i] * ws[i]
            w_norm, u_norm = ws[i].norm().item(), u.norm().item()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            ratios.append(ratio)
            if max_trust_ratio is not None:
                ratio = min(ratio, max_trust_ratio)
            ws[i] = ws[i] - lr * ratio * u
    return ws, ratios


# ---- single process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_trust_ratio", [10.0, None, 0.5])
def test_foreach_equals_for_loop(bias_correction: bool, max_trust_ratio: float | None) -> None:
    kwargs = {"lr": 0.05, "bias_correction": bias_correction, "max_trust_ratio": max_trust_ratio}
    foreach = _run_lamb(5, foreach=None, **kwargs)
    loop = _run_lamb(5, foreach=False, **kwargs)
    # On CPU the foreach ops run the same kernels tensor by tensor, so the results are bitwise equal.
    for a, b in zip(foreach, loop):
        assert torch.equal(a, b)


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_trust_ratio", [10.0, None, 0.5])
def test_matches_textbook(foreach: bool | None, bias_correction: bool, max_trust_ratio: float | None) -> None:
    steps, lr = 5, 0.02
    kwargs = {"lr": lr, "bias_correction": bias_correction, "max_trust_ratio": max_trust_ratio}
    ours = _run_lamb(steps, foreach=foreach, **kwargs)
    expected, ratios = _textbook_lamb(_initial_weights(), _grads, steps, WEIGHT_DECAYS, **kwargs)
    if max_trust_ratio is not None:  # the clamp is exercised, not just present
        assert max(ratios) > max_trust_ratio
    # fp32 against float64: a few ulp per op over 5 steps on values of size ≤ ~100.
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b.float(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_trust_ratio", [10.0, None])
def test_trust_ratio_edge_cases(foreach: bool | None, max_trust_ratio: float | None) -> None:
    lr, wd = 0.1, 0.01
    # zero weights; zero grad (decay); zero grad (no decay); zero weights and zero grad
    weights = [torch.zeros(4, 3), torch.randn(5), torch.randn(3, 2), torch.zeros(6)]
    grads = [torch.randn(4, 3), torch.zeros(5), torch.zeros(3, 2), torch.zeros(6)]
    wds = [wd, wd, 0.0, wd]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = LAMB(
        [{"params": [p], "weight_decay": d} for p, d in zip(params, wds)],
        lr=lr,
        max_trust_ratio=max_trust_ratio,
        foreach=foreach,
    )
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    w0, w1, w2, w3 = (p.detach() for p in params)
    # ‖w‖ = 0: r = 1; first bias-corrected Adam step is g/(|g| + eps).
    torch.testing.assert_close(w0, -lr * grads[0] / (grads[0].abs() + 1e-6))
    # g = 0: u = wd·w, so r = 1/wd = 100, clamped to 10 unless unbounded: w·(1 - lr·r·wd).
    ratio = 1 / wd if max_trust_ratio is None else min(1 / wd, max_trust_ratio)
    torch.testing.assert_close(w1, weights[1] * (1 - lr * ratio * wd))
    # g = 0 and no decay: ‖u‖ = 0, r = 1, nothing moves.
    assert torch.equal(w2, weights[2])
    # Everything zero: stays zero, no NaN from 0/0.
    assert torch.equal(w3, weights[3])
    expected, _ = _textbook_lamb(weights, lambda _: grads, 1, wds, lr=lr, max_trust_ratio=max_trust_ratio)
    for a, b in zip((w0, w1, w2, w3), expected):
        torch.testing.assert_close(a, b.float(), rtol=2e-6, atol=2e-6)


def test_lr_scheduler_changes_the_step() -> None:
    lr, factor = 0.05, 0.25
    finals = []
    for use_scheduler in (True, False):
        params = [torch.nn.Parameter(w.clone()) for w in _initial_weights()]
        opt = LAMB(_groups(params), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else factor)
        before = []
        for step in range(2):
            for p, g in zip(params, _grads(step)):
                p.grad = g
            before = [p.detach().clone() for p in params]
            opt.step()
            if use_scheduler:
                scheduler.step()
        if use_scheduler:
            assert all(group["lr"] == pytest.approx(lr * factor) for group in opt.param_groups)
        finals.append([p.detach() - b for p, b in zip(params, before)])
    # Weights, moments and so trust ratios agree after the first step: the second step scales with lr.
    # (atol: the steps are differences of fp32 weights up to ~300, whose ulp is ~3e-5.)
    for scheduled, plain in zip(*finals):
        torch.testing.assert_close(scheduled, factor * plain, rtol=1e-5, atol=6e-5)
        assert (plain - scheduled).abs().max() > 0.1 * plain.abs().max()


def test_state_dict_round_trip_is_bitwise() -> None:
    kwargs = {"lr": 0.05, "max_trust_ratio": 10.0}
    uninterrupted = _run_lamb(5, **kwargs)

    params = [torch.nn.Parameter(w.clone()) for w in _initial_weights()]
    opt = LAMB(_groups(params), **kwargs)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].item() == 3 for s in state["state"].values())

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = LAMB(_groups(resumed), lr=1.0, max_trust_ratio=None)  # hyperparameters come from the state dict
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.05
    assert fresh.param_groups[0]["max_trust_ratio"] == 10.0
    for step in range(3, 5):
        for p, g in zip(resumed, _grads(step)):
            p.grad = g
        fresh.step()
    for a, b in zip(resumed, uninterrupted):
        assert torch.equal(a.detach(), b)


def test_backend_choice_on_cpu() -> None:
    params = [torch.nn.Parameter(torch.randn(3))]
    assert LAMB(params).backend == "foreach"
    assert LAMB(params, foreach=False).backend == "for-loop"
    # No apex here (and CPU tensors): auto never picks it, even without a clamp.
    assert LAMB(params, max_trust_ratio=None).backend == "foreach"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"lr": torch.tensor(0.1)}, "lr must be a float"),
        ({"eps": -1e-8}, "Invalid epsilon"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"betas": (0.9,)}, "pair"),
        ({"weight_decay": -0.01}, "Invalid weight_decay"),
        ({"max_trust_ratio": 0.0}, "Invalid max_trust_ratio"),
        ({"bias_correction": "yes"}, "bias_correction must be a bool"),
        ({"foreach": True, "fused": True}, "cannot be True together"),
        ({"fused": True}, "no trust-ratio clamp"),
        ({"fused": True, "max_trust_ratio": None}, "needs CUDA parameters"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LAMB([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_bad_group_hyperparameters() -> None:
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Invalid weight_decay"):
        LAMB([{"params": [p]}, {"params": [q], "weight_decay": -1.0}])
    opt = LAMB([p])
    with pytest.raises(ValueError, match="Invalid max_trust_ratio"):
        opt.add_param_group({"params": [q], "max_trust_ratio": -2.0})
    assert len(opt.param_groups) == 1


def test_fused_true_without_apex_is_a_runtime_error() -> None:
    # Here apex is absent anyway; the patches make the check independent of that and of the CPU tensors.
    with (
        mock.patch.object(lamb_module._optional, "apex_optimizers", return_value=None),
        mock.patch.object(LAMB, "_apex_blocker", return_value=None),
        pytest.raises(RuntimeError, match="needs NVIDIA apex"),
    ):
        LAMB([torch.nn.Parameter(torch.randn(3))], max_trust_ratio=None, fused=True)


# ---- apex glue, against a Python model of apex FusedLAMB -------------------------------------------------


class _ModelFusedLAMB(torch.optim.Optimizer):
    """apex FusedLAMB's arithmetic in Python, transcribed from apex/optimizers/fused_lamb.py and
    csrc/multi_tensor_lamb.cu (global grad-norm clipping, per-group step, use_nvlamb, update written into
    .grad). Only to check how LAMB drives it; it is no substitute for running apex on a GPU."""

    last_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        type(self).last_kwargs = {
            "adam_w_mode": adam_w_mode,
            "max_grad_norm": max_grad_norm,
            "use_nvlamb": use_nvlamb,
            "grad_averaging": grad_averaging,
        }
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        global_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        max_norm = self.defaults["max_grad_norm"]
        clip = global_norm / max_norm if global_norm > max_norm else 1.0
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            t, wd = group["step"], group["weight_decay"]
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                state = self.state[p]
                g = p.grad / clip
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (state["exp_avg"] / bc1) / ((state["exp_avg_sq"] / bc2).sqrt() + group["eps"])
                update = update + wd * p
                ratio = group["lr"]
                if self.use_nvlamb or wd != 0:
                    pn, un = p.norm(), update.norm()
                    ratio = group["lr"] * (pn / un) if pn != 0 and un != 0 else group["lr"]
                p.sub_(ratio * update)
                p.grad.copy_(update)


def test_apex_glue_against_a_model_of_fused_lamb() -> None:
    fake_apex = mock.Mock(FusedLAMB=_ModelFusedLAMB)
    with (
        mock.patch.object(lamb_module._optional, "apex_optimizers", return_value=fake_apex),
        mock.patch.object(LAMB, "_apex_blocker", return_value=None),
    ):
        params = [torch.nn.Parameter(w.clone()) for w in _initial_weights()]
        opt = LAMB(_groups(params), lr=0.02, max_trust_ratio=None, fused=True)
        assert opt.backend == "apex"
        for step in range(4):
            for p, g in zip(params, _grads(step)):
                p.grad = g * 10  # global grad norm ≫ 1: apex's default max_grad_norm=1.0 would clip
            opt.step()
    assert _ModelFusedLAMB.last_kwargs == {
        "adam_w_mode": True,
        "max_grad_norm": math.inf,
        "use_nvlamb": True,
        "grad_averaging": True,
    }
    assert all(s["step"].item() == 4 for s in opt.state.values())  # our state format, shared with apex
    # Our own backend on the same problem: same trajectory, i.e. no clipping and NVLAMB on no-decay groups.
    reference = [torch.nn.Parameter(w.clone()) for w in _initial_weights()]
    reference_opt = LAMB(_groups(reference), lr=0.02, max_trust_ratio=None)
    for step in range(4):
        for p, g in zip(reference, _grads(step)):
            p.grad = g * 10
        reference_opt.step()
    for a, b in zip(params, reference):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


# ---- sharded parameters on real gloo ranks ---------------------------------------------------------------
#
# Each worker runs LAMB twice on the same problem: as shipped ("global") and with the norm all-reduce
# patched out ("local-norms", i.e. trust ratios from local shards: the bug these tests must catch). The
# weights grow in magnitude along every dimension, so a shard's local ‖w‖/‖u‖ is far from the global one.
#
# Tolerance: elementwise math is identical per element whatever the sharding; only ‖w‖ and ‖u‖ are summed in
# another order (local partial sums, then the all-reduce) and through a square root of a sum of squares: a
# few ulp in r per step, i.e. ~1e-7 relative on the weights after DIST_STEPS steps, against differences
# ≫ 1e-3 for local norms. The FSDP2 × TP case also computes its gradients through TP (other summation order).

DIST_STEPS, DIST_LR = 4, 0.05
DIST_SHAPES = {"rows": (6, 4), "cols": (4, 6), "uneven": (5, 3), "bias": (8,), "plain": (3, 3)}
DIST_DECAY = {"rows": 0.01, "cols": 0.01, "uneven": 0.01, "bias": 0.0, "plain": 0.0}
# None: a plain tensor (every rank holds all of it). "uneven" has 5 rows: 3+2 on 2 ranks, 2+2+1+0 on 4
# (an empty shard), and (2+1)+(1+1) under [Shard(0), Shard(0)] on 2×2.
DIST_PLACEMENTS: dict[str, dict[str, list[Placement] | None]] = {
    "1d": {
        "rows": [Shard(0)],
        "cols": [Shard(1)],
        "uneven": [Shard(0)],
        "bias": [Replicate()],
        "plain": None,
    },
    "2d": {
        "rows": [Shard(0), Shard(1)],
        "cols": [Replicate(), Shard(0)],
        "uneven": [Shard(0), Shard(0)],
        "bias": [Shard(0), Replicate()],  # FSDP-style: sharded on dp, replicated on tp
        "plain": None,
    },
}
# all-reduces per step: one per (mesh, mesh dimension) some tensor is sharded on, not one per tensor.
EXPECTED_ALL_REDUCES = {"1d": 1, "2d": 2, "fsdp_tp": 2}


def _scaled_randn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    scale = torch.ones(())
    for d, n in enumerate(shape):
        profile = [n if i == d else 1 for i in range(len(shape))]
        scale = scale * torch.linspace(0.2, 3.0, n).reshape(profile)
    return torch.randn(shape, generator=gen) * scale


def _dist_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {name: _scaled_randn(shape, gen) for name, shape in DIST_SHAPES.items()}


def _dist_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) for name, shape in DIST_SHAPES.items()}


def _decay_groups(named: dict[str, torch.Tensor], decays: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {"params": [p for name, p in named.items() if decays[name] != 0]},
        {"params": [p for name, p in named.items() if decays[name] == 0], "weight_decay": 0.0},
    ]


def _unsharded_reference() -> dict[str, torch.Tensor]:
    params = {name: torch.nn.Parameter(w) for name, w in _dist_weights().items()}
    opt = LAMB(_decay_groups(params, DIST_DECAY), lr=DIST_LR, weight_decay=0.01)
    for step in range(DIST_STEPS):
        for name, g in _dist_grads(step).items():
            params[name].grad = g
        opt.step()
    return {name: p.detach() for name, p in params.items()}


@contextmanager
def _stepping(variant: str, calls: list[int]) -> Iterator[None]:
    """Count dist.all_reduce calls; for "local-norms", also skip LAMB's norm reduction."""
    real_all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "all_reduce", counting))
        if variant == "local-norms":
            stack.enter_context(mock.patch.object(lamb_module, "_reduce_sharded_norms", return_value=None))
        yield


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _distribute_tensor_run(layout: str, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,) if layout == "1d" else (2, world_size // 2))

    def shard(name: str, full: torch.Tensor) -> torch.Tensor:
        placements = DIST_PLACEMENTS[layout][name]
        return full.clone() if placements is None else distribute_tensor(full.clone(), mesh, placements)

    results: dict[str, Any] = {}
    for variant in ("global", "local-norms"):
        params = {name: torch.nn.Parameter(shard(name, w)) for name, w in _dist_weights().items()}
        opt = LAMB(_decay_groups(params, DIST_DECAY), lr=DIST_LR, weight_decay=0.01)
        calls: list[int] = []
        for step in range(DIST_STEPS):
            for name, g in _dist_grads(step).items():
                params[name].grad = shard(name, g)
            with _stepping(variant, calls):
                opt.step()
        results[variant] = {name: _full(p) for name, p in params.items()}
        if variant == "global":
            results["all_reduces_per_step"] = len(calls) / DIST_STEPS
            results["state_like_params"] = all(
                isinstance(opt.state[p]["exp_avg"], DTensor) == isinstance(p, DTensor)
                and (not isinstance(p, DTensor) or opt.state[p]["exp_avg_sq"].placements == p.placements)
                for p in params.values()
            )
    return results


class _TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 8)
        self.down = torch.nn.Linear(8, 5)  # 5 output rows: 3 + 2 on the dp ranks
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(_scaled_randn(tuple(p.shape), gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


MLP_DECAY = {"up.weight": 0.01, "up.bias": 0.0, "down.weight": 0.01, "down.bias": 0.0}


def _mlp_run(model: torch.nn.Module, variant: str = "global", calls: list[int] | None = None) -> None:
    opt = LAMB(_decay_groups(dict(model.named_parameters()), MLP_DECAY), lr=DIST_LR, weight_decay=0.01)
    for step in range(DIST_STEPS):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(200 + step))
        model(x).square().mean().backward()
        with _stepping(variant, calls if calls is not None else []):
            opt.step()
        opt.zero_grad()


def _mlp_reference() -> dict[str, torch.Tensor]:
    model = _TinyMLP()
    _mlp_run(model)
    return {name: p.detach() for name, p in model.named_parameters()}


def _fsdp_tp_run() -> dict[str, Any]:
    # The real FSDP2 × TP layout on dp × tp = 2 × 2: parallelize_module, then fully_shard over dp. In torch
    # 2.13 up.weight becomes [_StridedShard(0, sf=2), Shard(0)] and down.bias [Shard(0), Replicate()].
    # Every rank feeds the same batch, so the dp-averaged gradients equal the single-process ones.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results: dict[str, Any] = {}
    for variant in ("global", "local-norms"):
        model = _TinyMLP()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        calls: list[int] = []
        _mlp_run(model, variant, calls)
        results[variant] = {name: _full(p) for name, p in model.named_parameters()}
        if variant == "global":
            results["all_reduces_per_step"] = len(calls) / DIST_STEPS
            results["placements"] = {name: p.placements for name, p in model.named_parameters()}
    return results


def _sharded_lamb_worker(rank: int, world_size: int, layouts: tuple[str, ...]) -> dict[str, Any]:
    return {
        layout: _fsdp_tp_run() if layout == "fsdp_tp" else _distribute_tensor_run(layout, world_size)
        for layout in layouts
    }


def _check_sharded(results: list[dict[str, Any]], layouts: tuple[str, ...]) -> None:
    for layout in layouts:
        reference = _mlp_reference() if layout == "fsdp_tp" else _unsharded_reference()
        for rank, per_layout in enumerate(results):
            result = per_layout[layout]
            where = f"rank {rank}, {layout}"
            assert result["all_reduces_per_step"] == EXPECTED_ALL_REDUCES[layout], where
            if layout == "fsdp_tp":
                sharded = {
                    name: not all(pl.is_replicate() for pl in pls)
                    for name, pls in result["placements"].items()
                }
                # FSDP2 shards every tensor on dp; up.weight on both mesh dims (_StridedShard on dp).
                assert not any(pl.is_replicate() for pl in result["placements"]["up.weight"]), where
            else:
                assert result["state_like_params"], where
                sharded = {
                    name: any(isinstance(pl, Shard) for pl in pls or [])
                    for name, pls in DIST_PLACEMENTS[layout].items()
                }
            for name, expected in reference.items():
                torch.testing.assert_close(
                    result["global"][name], expected, rtol=1e-5, atol=1e-5, msg=f"{where}, {name}"
                )
                wrong = result["local-norms"][name]
                if sharded[name]:
                    assert (wrong - expected).abs().max() > 1e-3, f"local norms pass? {where}, {name}"
                else:  # whole on every rank: local norms are global norms
                    torch.testing.assert_close(wrong, expected, rtol=1e-5, atol=1e-5)


def test_sharded_matches_unsharded_world2() -> None:
    layouts = ("1d",)
    _check_sharded(run_distributed(_sharded_lamb_worker, 2, layouts), layouts)


def test_sharded_matches_unsharded_world4() -> None:
    layouts = ("1d", "2d", "fsdp_tp")
    _check_sharded(run_distributed(_sharded_lamb_worker, 4, layouts), layouts)
