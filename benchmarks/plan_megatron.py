"""Benchmark the planner against measured steps: Megatron-LM 2021's weak-scaling table (A100) and one H200.

For every row of Narayanan et al. 2021 (arXiv 2104.04473), Table 1 (1.7B to 1T parameters on 32 to 3,072
A100-80GB), at its published layout with the assumptions ``megascale.core.plan.published`` states (micro-batch
1, 1F1B, full recomputation, Megatron-LM's 2021 kernels and runtime), it prints the predicted TFLOP/s per GPU
(counted as the paper counts them: its equation 3, recomputation included) next to the published figure, the
error, the predicted memory per GPU, and where the predicted step goes; then the least-squares fit of the one
calibration constant (``matmul_efficiency``) over the table, against the shipped one; then, per row, the
planner's own first choice for the same workload and cluster, its predicted speed-up over the published
layout (bounded by the A100's MFU cap, ``megascale.core.plan.rates``; the speed-up the model's parts alone
would claim beside it), and what it changes. Last, the training steps measured on one H200
(``megascale/core/plan/data/h200_2026_11_26.csv``): predicted vs measured seconds per step, the fit of the
H200's matmul efficiency over them, and the kernel-rate table's sources.

    python benchmarks/plan_megatron.py            # everything (about 20 s: the searches)
    python benchmarks/plan_megatron.py --no-search
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megascale.core.plan import A100_80GB, H200, MATMUL_EFFICIENCY, predict_memory, predict_step, search
from megascale.core.plan.published import (
    best_measured_mfu,
    fit_matmul_efficiency,
    h200_steps,
    megatron_2021_table,
)

LIGHTNING_STEP_S = 0.2656
"""The sequential 1.1B step on the H200 through Lightning's Trainer + MegaScaleStrategy(zero_stage=0)."""


def _changes(published, best) -> str:  # type: ignore[no-untyped-def]
    a, b = published.plan, best.layout.plan
    out = []
    for name in ("tp", "pp", "zero_stage", "schedule", "virtual_stages", "sequence_parallel",
                 "activation_checkpointing"):  # fmt: skip
        if name == "sequence_parallel" and b.tp == 1:
            continue
        if getattr(a, name) != getattr(b, name):
            out.append(f"{name} {getattr(a, name)}→{getattr(b, name)}")
    if published.micro_batch_size != best.layout.micro_batch_size:
        out.append(f"micro-batch {published.micro_batch_size}→{best.layout.micro_batch_size}")
    if best.layout.dp != published.dp:
        out.append(f"dp {published.dp}→{best.layout.dp}")
    out.append("overlapped TP/DP communication (megascale's defaults)")
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-search", action="store_true", help="skip the planner's own choices")
    args = parser.parse_args()
    rows = megatron_2021_table()
    print(f"A100-80GB, matmul_efficiency {MATMUL_EFFICIENCY} (shipped); TFLOP/s per GPU as Narayanan et al. 2021 "
          "count them (eq. 3)")  # fmt: skip
    print(f"{'model':>8} {'tp':>3} {'pp':>3} {'dp':>4} {'GPUs':>5} {'batch':>5} | {'published':>9} {'predicted':>9} "
          f"{'error':>7} | {'memory':>8} | step: compute / recompute / bubble / TP / PP / DP / optimizer (s)")  # fmt: skip
    errors = []
    for r in rows:
        workload, layout, cluster = r.workload(), r.layout(), r.cluster()
        step = predict_step(workload, layout, cluster)
        predicted = r.tflops_at(step.step_time)
        errors.append(predicted / r.tflops_per_gpu - 1)
        memory = predict_memory(workload, layout).total / 1e9
        parts = " / ".join(f"{v:.2f}" for v in (step.compute - step.recompute, step.recompute, step.bubble,
                                                 step.tp_comm, step.pp_comm, step.dp_comm, step.optimizer))  # fmt: skip
        print(f"{r.params_billion:>7g}B {r.tp:>3} {r.pp:>3} {r.dp:>4} {r.gpus:>5} {r.global_batch:>5} | "
              f"{r.tflops_per_gpu:>9.0f} {predicted:>9.1f} {errors[-1]:>+7.1%} | {memory:>5.1f} GB | {parts}")  # fmt: skip
    worst = max(errors, key=abs)
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    print(
        f"errors: worst {worst:+.1%}, mean |error| {mean_abs:.1%} (bound ±10%); every published layout "
        f"predicted to fit in 80 GB: {all(predict_memory(r.workload(), r.layout()).total <= 80e9 for r in rows)}"
    )
    fit = fit_matmul_efficiency(rows)
    print(f"least-squares fit of matmul_efficiency over the table: {fit:.3f} (shipped {MATMUL_EFFICIENCY})")
    refit = [r.tflops_at(predict_step(r.workload(), r.layout(), r.cluster(replace(A100_80GB, matmul_efficiency=fit)))
                         .step_time) / r.tflops_per_gpu - 1 for r in rows]  # fmt: skip
    print(
        f"  at the fit: worst {max(refit, key=abs):+.1%}, mean |error| {sum(abs(e) for e in refit) / len(refit):.1%}"
    )
    if not args.no_search:
        _first_choices(rows)
    _h200()


def _first_choices(rows) -> None:  # type: ignore[no-untyped-def]
    print("\nthe planner's first choice (same model, kernels, runtime, cluster and global batch); MFU by the "
          "planner's count (causal attention halved), capped per size by Megatron-LM's published A100 MFU:")  # fmt: skip
    print(f"{'model':>8} {'first choice':<52} {'speed-up':>8} {'uncapped':>8} {'MFU':>6} {'cap':>6} "
          f"{'published MFU':>13} | memory, what changes")  # fmt: skip
    for r in rows:
        workload, layout, cluster = r.workload(), r.layout(), r.cluster()
        published = predict_step(workload, layout, cluster)
        (best,) = search(workload, cluster, top=1)
        uncapped = best.step.uncapped_step_time or best.step.step_time
        measured_mfu = (
            published.model_flops * r.tflops_per_gpu * 1e12 / r.paper_flops() / A100_80GB.peak_flops
        )
        print(
            f"{r.params_billion:>7g}B {best.layout.describe():<52} {published.step_time / best.step.step_time:7.2f}x "
            f"{published.step_time / uncapped:7.2f}x {best.step.mfu:6.1%} {best.step.mfu_cap or 0:6.1%} "
            f"{measured_mfu:13.1%} | {best.memory.total / 1e9:.0f} GB: {_changes(layout, best)}"
        )  # fmt: skip


def _h200() -> None:
    steps = h200_steps()
    rates = H200.kernel_rates
    print(f"\nH200 (one GPU, tp1 pp1 dp1 ZeRO-0, no recomputation): kernel rates '{rates.name}', matmul_efficiency "
          f"{rates.matmul_efficiency}, MFU cap {rates.mfu_cap:.1%}")  # fmt: skip
    print(f"{'step':<40} {'measured':>9} {'predicted':>9} {'error':>7} | {'memory':>7} {'predicted':>9} | "
          "step parts (s)")  # fmt: skip
    for s in steps:
        est = predict_step(s.workload(), s.layout(), s.cluster())
        memory = predict_memory(s.workload(), s.layout()).total / 1e9
        print(f"{s.label:<40} {s.s_per_step:9.4f} {est.step_time:9.4f} {est.step_time / s.s_per_step - 1:+7.1%} | "
              f"{s.peak_memory_gb:5.1f} GB {memory:6.1f} GB | compute {est.compute:.4f}, optimizer {est.optimizer:.4f}")  # fmt: skip
    lightning = LIGHTNING_STEP_S
    first = predict_step(steps[0].workload(), steps[0].layout(), steps[0].cluster()).step_time
    print(
        f"{'  the same 1.1B through Lightning':<40} {lightning:9.4f} {first:9.4f} {first / lightning - 1:+7.1%}"
    )
    fit = fit_matmul_efficiency(steps, H200)
    print(f"least-squares fit of the H200 matmul_efficiency over these steps: {fit:.3f} (shipped "
          f"{rates.matmul_efficiency}); best measured MFU {best_measured_mfu(steps):.1%} (the cap)")  # fmt: skip
    for what, source in rates.sources:
        print(f"  {what}: {source}")


if __name__ == "__main__":
    main()
