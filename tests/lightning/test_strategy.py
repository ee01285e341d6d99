"""MegaScaleStrategy against one process: every layout trains the same model on the same data identically.

Layouts: dp × ZeRO 1-3, tp with and without sequence parallelism, pipelines (1F1B, GPipe, interleaved, zb1p), and
context parallelism (cp2, cp2 × dp2, cp2 × tp2, cp2 × pp2); each job's name is checked against the layout
that ran.

Each layout runs as a real ``Trainer.fit`` on gloo ranks (torchrun, one launch per world size for all its
layouts) and is compared with the same ``GPTModule``/``TokenDataModule`` fitted on one process with
Lightning's default strategy: same seed, same global batch (8 sequences per step), five AdamW steps with
warmup, weight decay and gradient clipping at a norm small enough to be active every step (so clipping by the
true global norm is tested too).

Tolerance. Everything is float32; layouts differ only in the order of sums (gradients averaged over dp,
partial products over tp, norms combined across shards): ~1e-7 relative per gradient. Losses and the step
count see that directly: they agree to 1e-5. Weights go through AdamW, whose update m/(sqrt(v)+eps) turns a
relative gradient difference into an absolute update difference of up to ~lr for elements whose gradient is
near zero; observed ≤ 1.5e-6 after five steps at lr 1e-3, so weights must agree to 2e-5 absolute. A layout
that drops a reduction, double counts a norm or mis-splits the batch moves weights by ~1e-3 and losses by
~1e-2.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.lightning._launch import fit

LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5

CONFIG = dict(vocab_size=100, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32,
              pad_vocab_to_multiple_of=64, parallel_block=True, sliding_window=8, full_attention_every=2)  # fmt: skip
# decay_steps fixed: it would otherwise follow each run's max_steps, and a 3-step run saved for resuming would
# have decayed its learning rate over 3 steps instead of the whole run's
MODULE = dict(optimizer="adamw", lr=1e-3, warmup_steps=2, decay_steps=20, weight_decay=0.1)
GLOBAL_BATCH = 8


def job(name: str, strategy: dict | None, dp: int, *, steps: int = 5, accumulate: int = 1, **extra) -> dict:
    micro = GLOBAL_BATCH // (dp * accumulate)
    return dict(
        name=name,
        strategy=strategy,
        config=CONFIG,
        module=MODULE,
        data=dict(source="random:100", seq_len=16, batch_size=micro, max_bytes=40_000, shuffle=True),
        trainer=dict(max_steps=steps, gradient_clip_val=0.05, accumulate_grad_batches=accumulate),
        **extra,
    )


def overlap(on: bool) -> dict:
    return dict(overlap_tp_comm=on, overlap_grad_reduce=on, overlap_param_gather=on)


WORLD2 = {
    "dp2/zero1": (dict(zero_stage=1), 2),
    "dp2/zero2": (dict(zero_stage=2), 2),
    "dp2/zero3": (dict(zero_stage=3), 2),
    "tp2": (dict(tp=2, sequence_parallel=False), 1),
    "tp2+sp": (dict(tp=2, sequence_parallel=True), 1),
    "cp2": (dict(cp=2), 1),  # windows of 8 over chunks of 4: the halo spans two chunks
}
WORLD4 = {
    "tp2×dp2/zero2": (dict(tp=2, zero_stage=2), 2),
    "tp2×dp2/zero3": (dict(tp=2, zero_stage=3), 2),
    "cp2×dp2/zero1": (dict(cp=2, zero_stage=1), 2),
    "cp2×tp2+sp": (dict(cp=2, tp=2), 1),
}
# pipeline layouts (overlap flags concern tp/dp communication: run with the defaults)
PIPELINE2 = {
    "pp2 1f1b": (dict(pp=2), 1),
    "pp2 gpipe M=4": (dict(pp=2, schedule="gpipe", num_microbatches=4), 1),
    "pp2 interleaved V=2": (dict(pp=2, schedule="interleaved", virtual_stages=2, num_microbatches=4), 1),
    "pp2 zb1p M=4": (dict(pp=2, schedule="zb1p", num_microbatches=4), 1),
}
PIPELINE4 = {
    "pp4": (dict(pp=4, num_microbatches=4), 1),
    "tp2×pp2": (dict(tp=2, pp=2), 1),
    "pp2×dp2/zero1": (dict(pp=2, zero_stage=1), 2),
    "pp2×dp2/zero2": (dict(pp=2, zero_stage=2), 2),
    "pp2×dp2/zero2 zb1p": (dict(pp=2, zero_stage=2, schedule="zb1p"), 2),
    "cp2×pp2": (dict(cp=2, pp=2), 1),
}


def _compare(result: dict, reference: dict, name: str, losses: bool = True) -> None:
    assert len(result["losses"]) == len(reference["losses"]), name
    for rank, seen in enumerate(result.get("losses_by_rank", [])):
        # what every rank's callbacks and loggers see: the global loss, not a local or a placeholder one
        assert seen == result["losses"], f"{name}: rank {rank} logged {seen}, rank 0 {result['losses']}"
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        if losses:
            assert got == pytest.approx(want, abs=LOSS_TOL), (
                f"{name}: loss at step {step + 1}: {got} vs {want}"
            )
    assert result["weights"].keys() == reference["weights"].keys(), name
    worst = max(
        (result["weights"][k] - reference["weights"][k]).abs().max().item() for k in reference["weights"]
    )
    assert worst <= WEIGHT_TOL, f"{name}: final weights differ by up to {worst:.2e}"


def _check_layout(result: dict, name: str) -> None:
    """The layout a job's name claims ("cp2×dp2/zero1 ...") is the one that ran (a size the strategy ignored
    would fall back to data parallelism, which matches one process too)."""
    claimed = dict(re.findall(r"(dp|pp|cp|tp)(\d+)", name.split()[0]))
    ran = result["layout"]
    assert all(ran[dim] == int(size) for dim, size in claimed.items()), f"{name}: ran {ran}"
    assert all(ran[dim] == 1 for dim in ("pp", "cp", "tp") if dim not in claimed), f"{name}: ran {ran}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    jobs = [job("single", None, 1), job("single-6", None, 1, steps=6), job("single-accum", None, 1)]
    return fit(jobs, 1, tmp)


def test_every_two_rank_layout_matches_one_process(reference, tmp_path):
    jobs = [job(f"{name} overlap={on}", {**kw, **overlap(on)}, dp) for name, (kw, dp) in WORLD2.items() for on in (True, False)]  # fmt: skip
    jobs.append(job("dp2/zero1 accumulate=2", dict(zero_stage=1), 2, accumulate=2))
    jobs += [job(name, kw, dp) for name, (kw, dp) in PIPELINE2.items()]
    jobs.append(job("pp2 accumulate=2", dict(pp=2), 1, accumulate=2))
    results = fit(jobs, 2, tmp_path)
    for name, result in results.items():
        # with gradient accumulation Lightning logs each micro-batch's loss (half the global batch here):
        # only the weights are comparable
        _compare(result, reference["single"], name, losses="accumulate" not in name)
        _check_layout(result, name)


def test_every_four_rank_layout_matches_one_process(reference, tmp_path):
    jobs = [job(f"{name} overlap={on}", {**kw, **overlap(on)}, dp) for name, (kw, dp) in WORLD4.items() for on in (True, False)]  # fmt: skip
    jobs += [job(name, kw, dp) for name, (kw, dp) in PIPELINE4.items()]
    # zb1p reduces at its own end of backward: not inside an accumulation's first step
    jobs.append(
        job("pp2×dp2/zero2 zb1p accumulate=2", dict(pp=2, zero_stage=2, schedule="zb1p"), 2, accumulate=2)
    )
    results = fit(jobs, 4, tmp_path)
    for name, result in results.items():
        _compare(result, reference["single"], name, losses="accumulate" not in name)
        _check_layout(result, name)


def test_checkpoints_continue_identically_across_layouts(reference, tmp_path):
    """Saved after 3 steps under tp2×dp2/zero2, resumed for 3 more on one process: the resumed steps and final
    weights are those of an uninterrupted single-process run. (Resuming under other layouts:
    test_resume_layouts.py for the GPT, the conformance matrix for every pair of its layouts.)"""
    ckpt = str(tmp_path / "step3.ckpt")
    saved = fit([job("save", dict(tp=2, zero_stage=2), 2, steps=3, save_at_end=ckpt)], 4, tmp_path)["save"]
    uninterrupted = reference["single-6"]
    assert saved["losses"] == pytest.approx(uninterrupted["losses"][:3], abs=LOSS_TOL)
    resumed = fit([job("one process", dict(), 1, steps=6, resume_from=ckpt)], 1, tmp_path / "c")
    tail = {"losses": uninterrupted["losses"][3:], "weights": uninterrupted["weights"]}
    for name, result in resumed.items():
        _compare(result, tail, f"resumed under {name}")


def test_pipeline_checkpoints_continue_identically_under_other_layouts(reference, tmp_path):
    """Saved after 3 steps at pp2, resumed at pp1 (one process) and at tp2: the uninterrupted run's steps."""
    ckpt = str(tmp_path / "pp2-step3.ckpt")
    fit([job("save", dict(pp=2), 1, steps=3, save_at_end=ckpt)], 2, tmp_path)
    resumed = fit([job("tp2", dict(tp=2), 1, steps=6, resume_from=ckpt)], 2, tmp_path / "a")
    resumed |= fit([job("pp1", dict(), 1, steps=6, resume_from=ckpt)], 1, tmp_path / "b")
    uninterrupted = reference["single-6"]
    tail = {"losses": uninterrupted["losses"][3:], "weights": uninterrupted["weights"]}
    for name, result in resumed.items():
        _compare(result, tail, f"pp2 checkpoint resumed under {name}")


def test_pipeline_validation_prediction_and_generation(tmp_path):
    """Validation loss, trainer.predict, greedy generation and RunSummary's sampled text (temperature 1, the same
    seeded generator on every rank) with pp > 1 equal one process's, on every rank."""
    summary = dict(prompt="\x05", max_new_tokens=8, temperature=1.0, top_k=None, loss_curve=None)
    extra = dict(trainer=dict(max_steps=5, gradient_clip_val=0.05, limit_val_batches=2, val_check_interval=5),
                 generate=[5, 17, 3], predict=True, summary=summary)  # fmt: skip
    reference = fit([{**job("one", None, 1), **extra}], 1, tmp_path / "ref")["one"]
    results = fit([{**job("pp2", dict(pp=2), 1), **extra}], 2, tmp_path / "a")
    results |= fit([{**job("tp2×pp2", dict(tp=2, pp=2), 1), **extra}], 4, tmp_path / "b")
    for name, result in results.items():
        assert result["val_loss"] == pytest.approx(reference["val_loss"], abs=LOSS_TOL), name
        assert all(g == reference["generated"][0] for g in result["generated"]), (name, result["generated"])
        assert all(t == reference["sample"][0] for t in result["sample"]), (name, result["sample"])
        assert torch.allclose(result["predicted"], reference["predicted"], atol=1e-5), name
    assert reference["sample"][0].startswith("\x05") and len(reference["sample"][0]) == 9
