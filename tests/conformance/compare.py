"""How a cell is judged against the one-process reference, and the tolerances, with their reasons.

Tensors are judged per tensor by how far they are from one process relative to how far training moved them:
``||x - x_ref|| <= update_rtol · ||x_ref - x_init|| + atol · sqrt(numel)`` (weights and what callbacks keep
of them, from the initial weights; optimizer state from zero). A parameter that one process never moves
(frozen, unused) must then not move at all, and a defect that touches a whole tensor (a dropped or doubled
reduction, a stale gather, a norm taken of a piece) shows as tens of percent of its update.

float32 cells: layouts differ from one process only in the order of sums (gradients averaged over dp, partial
products over tp, microbatches of a pipeline), ~1e-7 relative per gradient. Logged losses and norms see that
directly: 1e-5 relative. AdamW (lr 1e-2, eps 1e-6) turns a gradient difference into an update difference of
at most ~lr·δg/eps for a near-zero gradient: a handful of elements then differ by up to ~1e-4 while the
tensor's update norm is ~1, so ``update_rtol`` 1e-3 holds with margin (observed ≤ 2e-4) and catches 1% of
an update. A gradient statistic logged after the first step (a user's sum of squared gradient norms, a
norm) sees those weights through the curvature, and within one batch of two manual optimizers the second
reads gradients of weights the first just stepped: 1.3e-4 relative observed over 1,000 generated cases, all
from the second step on (``grad_stat_rtol`` 1e-3; the first step's stays at 1e-5, where any defect of a
reduction already shows).

bf16-mixed cells: matmuls round to 8 bits of mantissa and a split GEMM rounds differently; ZeRO-2/3 gathers
every parameter in bf16 (FSDP2's param_dtype), so its norms also compute on bf16 weights where autocast keeps
fp32. SGD with momentum (lr 0.5) carries that into the weights linearly. Observed relative update errors ≤
2.5% per tensor (1.2% overall) for ZeRO-0/1, tp and pp, ≤ 13.5% for ZeRO-2/3 (a LayerNorm weight); a dropped
dp reduction is ~50%: ``update_rtol`` 0.2. The momentum buffer is the recent gradient itself, not a sum of
steps: a LayerNorm weight's differs by 20.4% under ZeRO-2/3 (``state_rtol`` 0.3). Losses to 1e-2 relative.
With experts (the ep layouts' model) top-k routing on bf16 scores also sends a token whose two best scores
round alike to another expert under another layout, which moves the router's update discontinuously: 10.5%
under ep2 in the bf16 row, 24% with LayerDrop and accumulation under ep2×dp2/zero3 (*bf16-accumulate-unused*):
``update_rtol`` 0.3 there, still short of a dropped reduction's ~50%. bf16 gradient statistics after the
first step, by the same token, follow weights 20% of an update apart (SGD at lr 0.5 with momentum): 6.5%
observed at a sixth step under tp2 (gen-580), ``grad_stat_rtol`` 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Tolerance:
    metric_rtol: float = 1e-5
    metric_atol: float = 1e-6
    update_rtol: float = 1e-3
    atol: float = 1e-7  # per element (RMS), the floor for tensors that hardly move
    state_rtol: float = 1e-3  # optimizer state, relative to its own size
    grad_stat_rtol: float = 1e-3  # logged gradient statistics after the first step


FLOAT32 = Tolerance()
BF16 = Tolerance(
    metric_rtol=1e-2, metric_atol=1e-3, update_rtol=0.2, atol=1e-5, state_rtol=0.3, grad_stat_rtol=0.1
)
BF16_EXPERTS = Tolerance(
    metric_rtol=1e-2, metric_atol=1e-3, update_rtol=0.3, atol=1e-5, state_rtol=0.3, grad_stat_rtol=0.1
)


def _close(
    what: str, got: torch.Tensor, want: torch.Tensor, start: torch.Tensor | None, tol: Tolerance
) -> list[str]:
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != one process's {tuple(want.shape)}"]
    moved = float((want - start).norm()) if start is not None else float(want.norm())
    diff = float((got - want).norm())
    rtol = tol.update_rtol if start is not None else tol.state_rtol  # state: relative to its own size
    bound = rtol * moved + tol.atol * want.numel() ** 0.5
    if diff <= bound:
        return []
    worst = int((got - want).abs().argmax())
    return [f"{what}: |Δ| {diff:.3g} > {bound:.3g} (one process moved it by {moved:.3g}; worst element {worst}: "
            f"{float(got.flatten()[worst]):.6g} vs {float(want.flatten()[worst]):.6g})"]  # fmt: skip


def _tensors(what: str, got: dict[str, Any], want: dict[str, Any], start: dict[str, Any] | None,
             tol: Tolerance) -> list[str]:  # fmt: skip
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"{what}: missing {missing}")
    if extra:
        problems.append(f"{what}: not in one process's {extra}")
    for key in sorted(set(want) & set(got)):
        first = start.get(key) if start is not None else None
        problems += _close(f"{what} {key}", got[key].float(), want[key].float(), first, tol)
    return problems


def _metrics(
    what: str, got: list[dict[str, float]], want: list[dict[str, float]], tol: Tolerance
) -> list[str]:
    if len(got) != len(want):
        return [f"{what}: {len(got)} entries, one process {len(want)}"]
    problems = []
    for i, (g, w) in enumerate(zip(got, want)):
        missing = sorted(set(w) - set(g))
        if missing:
            problems.append(f"{what}[{i}]: not logged {missing}")
        for key in sorted(set(w) & set(g)):
            rtol = tol.grad_stat_rtol if i > 0 and "grad" in key else tol.metric_rtol
            if abs(g[key] - w[key]) > tol.metric_atol + rtol * abs(w[key]):
                problems.append(f"{what}[{i}] {key}: {g[key]:.7g} vs one process {w[key]:.7g}")
    return problems


def _optimizer_state(got: dict[str, Any], want: dict[str, Any], tol: Tolerance) -> list[str]:
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"optimizer state: none for {missing}")
    if extra:
        problems.append(f"optimizer state: for {extra}, which one process never stepped")
    for name in sorted(set(want) & set(got)):
        for key, value in want[name].items():
            mine = got[name].get(key)
            if mine is None:
                problems.append(f"optimizer state {name}: no {key!r}")
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                problems += _close(f"optimizer state {name} {key}", mine.float(), value.float(), None, tol)
            elif float(mine) != float(value):  # step counts
                problems.append(f"optimizer state {name} {key}: {float(mine)} vs one process {float(value)}")
    return problems


def compare(got: dict[str, Any], want: dict[str, Any], tol: Tolerance, *, skip_steps: int = 0) -> list[str]:
    """Every difference from one process beyond ``tol``, as readable lines (empty: the cell is exact).
    ``skip_steps``: a resumed run logs only the steps after its checkpoint."""
    problems = _metrics("logged metrics per step", got["steps"], want["steps"][skip_steps:], tol)
    problems += _metrics("validation metrics", got["validations"], want["validations"], tol)
    init = want["init"]
    problems += _tensors("weight", got["weights"], want["weights"], init, tol)
    if "ema" in want:
        problems += _tensors("EMA of weight", got.get("ema", {}), want["ema"], init, tol)
    ckpt, ref = got.get("checkpoint"), want["checkpoint"]
    if ckpt is None:
        return [*problems, "no checkpoint read back"]
    problems += _tensors("checkpoint weight", ckpt["model"], ref["model"], init, tol)
    if len(ckpt["optimizers"]) != len(ref["optimizers"]):
        return [
            *problems,
            f"checkpoint holds {len(ckpt['optimizers'])} optimizers, one process {len(ref['optimizers'])}",
        ]
    for mine, theirs in zip(ckpt["optimizers"], ref["optimizers"]):
        problems += _optimizer_state(mine["state"], theirs["state"], tol)
        lrs, their_lrs = mine["lrs"], theirs["lrs"]
        wrong = [n for n in their_lrs if n in lrs and abs(lrs[n] - their_lrs[n]) > 1e-12 * abs(their_lrs[n])]
        if sorted(lrs) != sorted(their_lrs) or wrong:
            problems.append(f"learning rates differ for {wrong or sorted(set(lrs) ^ set(their_lrs))}")
    return problems
