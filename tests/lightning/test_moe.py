"""A mixture-of-experts GPTModule under MegaScaleStrategy trains like one process under Lightning's default.

Same harness as test_strategy.py (real ``Trainer.fit`` on gloo ranks, the same global batch, AdamW with warmup,
weight decay and clipping active every step), with a GPT whose every block is a mixture of 4 experts (top 2)
and every balancing on: the sequence-wise auxiliary loss, the z-loss and the loss-free bias update, which the
GPTModule applies before each optimizer step from the tokens per expert summed over the data-parallel ranks.
Compared: the logged losses, the logged expert load (``moe/load``: it steers the biases, so a count summed
over the wrong ranks shows here first), and every weight and router bias. Tolerances as in test_strategy.py.
"""

from __future__ import annotations

import pytest

from tests.lightning._launch import fit
from tests.lightning.test_strategy import GLOBAL_BATCH, LOSS_TOL, MODULE, WEIGHT_TOL

MOE = dict(
    num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.05, z_loss_coef=1e-3, bias_update_rate=1e-3
)
CONFIG = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
              pad_vocab_to_multiple_of=64, parallel_block=True, moe=MOE)  # fmt: skip


def job(name: str, strategy: dict | None, dp: int, *, accumulate: int = 1, steps: int = 4, **extra) -> dict:
    micro = GLOBAL_BATCH // (dp * accumulate)
    return dict(
        name=name, strategy=strategy, config=CONFIG, module=MODULE,
        data=dict(source="random:100", seq_len=16, batch_size=micro, max_bytes=40_000, shuffle=True),
        trainer=dict(max_steps=steps, gradient_clip_val=0.05, accumulate_grad_batches=accumulate), **extra,
    )  # fmt: skip


def test_an_expert_parallel_fit_matches_one_process(tmp_path) -> None:
    reference = fit([job("single", None, 1)], 1, tmp_path / "one")["single"]
    assert len(reference["expert_load"]) == 4 and all(load > 1.0 for load in reference["expert_load"])
    jobs = [
        job("ep2", dict(ep=2, zero_stage=0), 2),
        job("ep2 accumulate=2", dict(ep=2, zero_stage=0), 2, accumulate=2),
        job("ep2/zero1 by parameters", dict(ep=2, zero_stage=1, zero1_sharding="parameters"), 2),
        job("ep2/zero3", dict(ep=2, zero_stage=3), 2),
        job("dp2/zero1", dict(zero_stage=1), 2),  # ep=1: the experts are ordinary parameters
        job("tp2+sp", dict(tp=2), 1),  # the MoE gathers whole sequences; its replica check over tp
        job("cp2", dict(cp=2), 1),  # likewise over cp; tokens per expert summed over dp only
    ]
    results = fit(jobs, 2, tmp_path / "two")
    for name, result in results.items():
        assert result["layout"]["ep"] == (2 if name.startswith("ep2") else 1), name
        assert result["layout"]["tp"] == (2 if name.startswith("tp2") else 1), name
        assert result["expert_load"] == pytest.approx(reference["expert_load"], rel=1e-6), name
        if "accumulate" not in name:  # Lightning logs each micro-batch's loss under accumulation
            assert result["losses"] == pytest.approx(reference["losses"], abs=LOSS_TOL), name
        assert result["weights"].keys() == reference["weights"].keys(), name
        assert any("expert_bias" in k for k in reference["weights"])
        worst, where = max(
            ((result["weights"][k] - reference["weights"][k]).abs().max().item(), k)
            for k in reference["weights"]
        )
        assert worst <= WEIGHT_TOL, f"{name}: weights differ by up to {worst:.2e} ({where})"


def test_an_expert_parallel_checkpoint_resumes_on_one_process_and_under_another_layout(tmp_path) -> None:
    """Saved after step 2 of 4 at ep2 ZeRO-1 (experts split over the ranks, their optimizer states by owner),
    resumed at dp2 with ep=1 and on one process: both end as one process running all 4 steps (losses of steps
    3-4, weights, router biases, AdamW's moments and step)."""
    saved = str(tmp_path / "ep2-step2.ckpt")
    ep2 = dict(ep=2, zero_stage=1, zero1_sharding="parameters")
    runs2 = fit(
        [
            job("save ep2", ep2, 2, steps=2, save_at_end=saved),
            job("dp2 <- ep2", dict(zero_stage=0), 2, resume_from=saved, optimizer_state=True),
        ],
        2,
        tmp_path / "two",
    )
    runs1 = fit(
        [job("one process", None, 1, optimizer_state=True),
         job("one process <- ep2", dict(), 1, resume_from=saved, optimizer_state=True)],
        1,
        tmp_path / "one",
    )  # fmt: skip
    reference = runs1.pop("one process")
    assert runs2["save ep2"]["losses"] == pytest.approx(reference["losses"][:2], abs=LOSS_TOL)
    for name, result in [
        ("dp2 <- ep2", runs2["dp2 <- ep2"]),
        ("one process <- ep2", runs1["one process <- ep2"]),
    ]:
        assert result["losses"] == pytest.approx(reference["losses"][2:], abs=LOSS_TOL), name
        worst = max(
            (result["weights"][k] - reference["weights"][k]).abs().max().item() for k in reference["weights"]
        )
        assert worst <= WEIGHT_TOL, f"{name}: weights differ by up to {worst:.2e}"
        state, want = result["optimizer"], reference["optimizer"]
        assert state.keys() == want.keys(), name
        for key, value in want.items():
            assert (state[key] - value).abs().max().item() <= 1e-4 * max(value.abs().max().item(), 1e-12), (
                f"{name}: {key}"
            )
