"""MegaScaleStrategy on LightningModules that are not megascale's GPTModule, against one process.

Each module (tests/lightning/_own_modules.py) trains five AdamW steps with gradient clipping under a layout
and on one process (``MegaScaleStrategy()`` on one rank: the same meta-device build and per-layer seeded
initialisation, so the same initial weights), same data and seed, as test_strategy.py does for the GPT, with
its tolerances and for the same reasons (float32, only the order of sums differs: losses 1e-5, weights 2e-5
after AdamW). A dropped reduction, a parameter left out of ZeRO or a stale ZeRO-1 update moves weights by
~1e-3 (one AdamW step is ~lr).
"""

from __future__ import annotations

import pytest

from tests.lightning._launch import fit
from tests.lightning.test_strategy import CONFIG, GLOBAL_BATCH, _compare

MODULES = "tests.lightning._own_modules"


def own_job(name: str, module: str, strategy: dict | None, dp: int, *, module_args: dict | None = None,
            steps: int = 5, **extra) -> dict:  # fmt: skip
    return dict(
        name=name,
        strategy=strategy,
        module_class=f"{MODULES}.{module}",
        module=module_args or {},
        data=dict(
            source="random:64", seq_len=16, batch_size=GLOBAL_BATCH // dp, max_bytes=40_000, shuffle=True
        ),
        trainer=dict(max_steps=steps, gradient_clip_val=0.05),
        **extra,
    )


def _replicas_agree(result: dict, name: str) -> None:
    sums = result["probe_by_rank"]
    assert all(s == pytest.approx(sums[0], rel=1e-9) for s in sums), f"{name}: replicas differ: {sums}"


def test_a_gpt_with_a_value_head_trains_like_one_process_under_every_zero_stage(tmp_path):
    """The value head lies outside the GPT: every ZeRO stage must average (and shard) it too, clip by one norm,
    and under ZeRO-1 a callback reading weights after a step (an EMA) must see this step's values."""
    value = dict(config=CONFIG)
    reference = fit([own_job("one", "GPTWithValueHead", {}, 1, module_args=value)], 1, tmp_path / "ref")[
        "one"
    ]
    jobs = [own_job(f"dp2/zero{z}", "GPTWithValueHead", dict(zero_stage=z), 2, module_args=value, probe=True)
            for z in (0, 1, 2, 3)]  # fmt: skip
    jobs.append(own_job("dp2/zero1 no overlap", "GPTWithValueHead", dict(zero_stage=1, overlap_param_gather=False),
                        2, module_args=value, probe=True))  # fmt: skip
    for name, result in fit(jobs, 2, tmp_path).items():
        _compare(result, reference, name)
        _replicas_agree(result, name)


def test_a_module_written_for_model_parallel_strategy_runs_unchanged(tmp_path):
    """Its configure_model indexes the mesh by ModelParallelStrategy's names, applies DTensor tensor
    parallelism and fully_shard itself: the strategy keeps that sharding and adds no ZeRO."""
    reference = fit([own_job("one", "ModelParallelStyleModule", {}, 1)], 1, tmp_path / "ref")["one"]
    result = fit([own_job("tp2×dp2", "ModelParallelStyleModule", dict(tp=2), 2)], 4, tmp_path)["tp2×dp2"]
    _compare(result, reference, "ModelParallelStrategy-style module at tp2×dp2")


def test_a_layer_without_reset_parameters_is_refused_under_meta_init_and_init_weights_initialises_it(
    tmp_path,
):
    with pytest.raises(RuntimeError) as info:
        fit([own_job("refused", "CustomLayerModule", {}, 1)], 1, tmp_path / "refused")
    assert "model.1 (Scale: gain)" in str(info.value) and "init_weights()" in str(info.value)
    results = fit(
        [own_job("dp2", "CustomLayerWithInitModule", dict(zero_stage=1), 2, probe=True)], 2, tmp_path
    )
    _replicas_agree(results["dp2"], "init_weights module")


def test_a_tie_the_pipeline_cannot_see_is_refused_by_name(tmp_path):
    """The last stage would project with a copy of the embedding nobody trains: refused after the first
    backward, on every rank, naming the parameter and both stages."""
    with pytest.raises(RuntimeError) as info:
        fit([own_job("pp2", "HiddenTieModule", dict(pp=2, num_microbatches=2), 1)], 2, tmp_path)
    assert "pipeline stage 1 used parameter 'embed.weight', which stage 0 holds" in str(info.value)


# The conformance matrix (tests/conformance) trains a transformer of a user's own under every layout of issue
# 22 (dp2 ZeRO-0/1/2/3, tp2 with and without SP, pp2, tp2×dp2, tp2×pp2, pp2×dp2); here what it lacks: tp
# without overlapped communication and activation checkpointing of the whole model or of named modules.
# examples/own_model.py (tp2 × pp2 on 4 processes) runs as docs/first-hour.md shows it, in
# tests/integration/test_doc_blocks.py.
OWN_WORLD2 = {
    "tp2 no sp, no overlap": (dict(tp=2, sequence_parallel=False, overlap_tp_comm=False), 1),
    "dp2/zero3 full AC": (dict(zero_stage=3, activation_checkpointing="full"), 2),
    "dp2/zero1 AC of Attention": (
        dict(zero_stage=1, activation_checkpointing="full", checkpoint_modules=["Attention"]),
        2,
    ),
}


def test_own_transformer_trains_like_one_process_without_overlap_and_with_activation_checkpointing(tmp_path):
    """A transformer written in the test (its own attention and MLP) joins by a tensor_parallel_plan and
    pipeline_layers()/pipeline_loss() only, and trains like one process with tp's communication not overlapped
    and with activation checkpointing under ZeRO."""
    reference = fit([own_job("one", "OwnTransformerModule", {}, 1)], 1, tmp_path / "ref")["one"]
    jobs = [own_job(name, "OwnTransformerModule", kw, dp) for name, (kw, dp) in OWN_WORLD2.items()]
    for name, result in fit(jobs, 2, tmp_path / "world2").items():
        _compare(result, reference, name)
