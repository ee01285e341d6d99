"""The throughput model on Hopper and its honesty bound: per-kernel rates measured on one H200, the MFU cap.

- Every training step measured on one H200 (``megascale/core/plan/data/h200_2026_11_26.csv``, from
  ``/work/shared/data/gpu-h200-2026-11-26.md``) predicted within ±10%, with the shipped H200 matmul efficiency
  the steps' own least-squares fit (the one constant fitted there; every other H200 rate is a kernel measured).
- No layout the search returns is predicted above its GPU kind's MFU cap (the best measured), and the cap binds
  where the model's parts alone would claim more.
- The kernel-rate table and its sources are reported (``megascale plan`` text and ``--json``).
Pure arithmetic: no process, no GPU.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megascale.core import GPTConfig
from megascale.core.plan import A100_80GB, H100_SXM, H200, ClusterSpec, Workload, predict_step, search
from megascale.core.plan.cli import main
from megascale.core.plan.published import (
    MeasuredStep,
    best_measured_mfu,
    fit_matmul_efficiency,
    h200_steps,
    megatron_2021_table,
)
from megascale.core.plan.rates import A100_RATES, H200_RATES, KernelRate

STEPS = h200_steps()
TOLERANCE = 0.10
LIGHTNING_S = 0.2656  # the sequential 1.1B step through Lightning's Trainer + MegaScaleStrategy(zero_stage=0)
TINYLLAMA = ["--hidden", "2048", "--layers", "22", "--heads", "32", "--kv-heads", "4", "--ffn-hidden", "5632",
             "--vocab", "32000", "--gpus", "1", "--global-batch", "8", "--seq-len", "2048", "--tp", "1", "--pp", "1",
             "--dp", "1", "--zero-stage", "0", "--micro-batch-size", "8", "--activation-checkpointing", "none"]  # fmt: skip


def test_the_measured_steps_are_complete() -> None:
    assert [(s.d_model, s.layers, s.parallel_block, s.s_per_step) for s in STEPS] == [
        (2048, 22, False, 0.2494), (2048, 22, True, 0.2431), (3072, 16, False, 0.3482), (4096, 8, False, 0.2222),
    ]  # fmt: skip


@pytest.mark.parametrize("step", STEPS, ids=[s.label for s in STEPS])
def test_h200_step_within_10_percent(step: MeasuredStep) -> None:
    predicted = step.predicted()
    assert abs(predicted / step.s_per_step - 1) <= TOLERANCE, f"{predicted:.4f} s vs {step.s_per_step} s"


def test_h200_tinyllama_within_10_percent_of_the_lightning_step_too() -> None:
    sequential = STEPS[0]
    assert abs(sequential.predicted() / LIGHTNING_S - 1) <= TOLERANCE


def test_h200_matmul_efficiency_is_the_steps_fit_and_the_cap_their_best() -> None:
    assert fit_matmul_efficiency(STEPS, H200) == pytest.approx(H200.matmul_efficiency, abs=0.005)
    assert best_measured_mfu(STEPS) == pytest.approx(H200_RATES.mfu_cap, abs=0.001)


def test_h200_rates_are_the_measured_kernels() -> None:
    rates = H200.kernel_rates
    assert rates.rms_norm == KernelRate(3860 / 4800, (0.255 - 0.070) / 0.070)
    assert rates.cross_entropy.fraction == pytest.approx(2220 / 4800)
    assert rates.attention is not None and rates.attention.forward * 989 == pytest.approx(590)
    # the backward's useful rate from the forward + backward time: 2.5 x the forward's FLOPs in 1.454 ms
    assert rates.attention.backward * 989 == pytest.approx(2.5 * 590 * 0.466 / (1.920 - 0.466), rel=1e-6)


def test_kernel_rates_are_used_each_on_its_own() -> None:
    """A slower norm or attention slows the step by its own share, not through one efficiency."""
    step, rates = STEPS[0], H200_RATES
    base = step.predicted()
    slow_norm = replace(rates, rms_norm=KernelRate(rates.rms_norm.fraction / 2, rates.rms_norm.backward))
    assert step.predicted(replace(H200, rates=slow_norm)) > base * 1.02
    assert rates.attention is not None
    slow_attention = replace(rates, attention=replace(rates.attention, forward=rates.attention.forward / 2))
    assert step.predicted(replace(H200, rates=slow_attention)) > base * 1.005
    cheap_loss = replace(rates, cross_entropy=KernelRate(1.0, 1.0))
    assert base * 0.95 < step.predicted(replace(H200, rates=cheap_loss)) < base


def test_h100_is_the_h200_with_less_bandwidth() -> None:
    """Same GEMM and attention rates (same chip and peak); memory-bound kernels 4.8 / 3.35 slower."""
    step = STEPS[0]
    h100, h200 = step.predicted(H100_SXM), step.predicted()
    assert H100_SXM.kernel_rates.matmul_efficiency == H200.kernel_rates.matmul_efficiency
    assert 1.03 < h100 / h200 < 4800 / 3350


def test_a100_cap_by_size() -> None:
    assert A100_RATES.cap(1e9) == A100_RATES.cap(22e9) == pytest.approx(0.404)
    assert A100_RATES.cap(1e12) == A100_RATES.cap(5e12) == pytest.approx(0.559)
    caps = [A100_RATES.cap(p) or 0.0 for p in (22e9, 50e9, 175e9, 300e9, 530e9, 800e9, 1e12)]
    assert caps == sorted(caps) and 0.404 < caps[1] < 0.507 and caps[2] == pytest.approx(0.507)


_MODELS = [
    (  # Megatron-LM 2021's 18.4B on its 256 A100s
        megatron_2021_table()[3].workload(), megatron_2021_table()[3].cluster(),
    ),
    (
        Workload(GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=4096),
                 seq_len=4096, global_batch=128),
        ClusterSpec(H100_SXM, gpus=32),
    ),
    (
        Workload(GPTConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                           max_seq_len=2048, parallel_block=False), seq_len=2048, global_batch=64),
        ClusterSpec(H200, gpus=8),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("workload", "cluster"), _MODELS, ids=["a100-18.4B", "h100-7B", "h200-1.1B"])
def test_no_layout_above_the_mfu_cap(workload: Workload, cluster: ClusterSpec) -> None:
    ranked = search(workload, cluster)
    caps = {c.step.mfu_cap for c in ranked}
    assert len(caps) == 1 and None not in caps
    (cap,) = caps
    assert cap is not None and all(c.step.mfu <= cap * (1 + 1e-9) for c in ranked)
    # layouts at the cap keep the order of their uncapped times
    fitting = [c for c in ranked if c.fits]
    key = [(c.step.step_time, c.step.uncapped_step_time) for c in fitting]
    assert key == sorted(key)


def test_the_cap_binds_where_the_parts_alone_claim_more() -> None:
    """Megatron 18.4B without recomputation: the model's parts sum to above the best A100 MFU at 22B."""
    row = megatron_2021_table()[3]
    (best,) = search(row.workload(), row.cluster(), top=1)
    assert best.step.capped and best.step.limiter == "mfu_cap"
    assert best.step.mfu == pytest.approx(A100_RATES.cap(18.4e9), rel=1e-9)
    published = predict_step(row.workload(), row.layout(), row.cluster()).step_time
    assert published / best.step.step_time < published / (best.step.uncapped_step_time or 0)


def test_no_cap_without_a_rate_table() -> None:
    gpu = replace(A100_80GB, rates=None)
    row = megatron_2021_table()[0]
    step = predict_step(row.workload(), row.layout(), row.cluster(gpu))
    assert step.mfu_cap is None and not step.capped


def test_cli_names_the_kernel_rate_table_and_its_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINYLLAMA, "--gpu", "h200", "--no-parallel-block"]) == 0
    text = capsys.readouterr().out
    assert "kernel rates: h200, measured 2026-11-26" in text and "MFU capped at 52.3%" in text
    assert main([*TINYLLAMA, "--gpu", "h200", "--no-parallel-block", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rates = out["cluster"]["kernel_rates"]
    assert rates["name"] == "h200, measured 2026-11-26" and rates["mfu_cap"] == pytest.approx(0.523)
    assert {"matmul_efficiency", "attention", "mfu_cap"} <= set(rates["sources"])
    assert "gpu-h200-2026-11-26.md" in rates["sources"]["attention"]
    step = out["layouts"][0]["step"]
    assert abs(step["step_time"] / STEPS[0].s_per_step - 1) <= TOLERANCE and step["capped"] is False
