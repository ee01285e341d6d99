"""Planning models other than a GPTConfig written by hand: a Hugging Face config.json (Llama, Qwen2, Qwen3,
Mistral: GQA, head sizes apart from d_model / heads, SwiGLU, q/k norms, q/k/v biases, tied embeddings), and a
module of the user's own (``megascale.core.plan.module``), against the parameters the models hold and against
what a run on gloo ranks holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megascale.core.plan.cli import main
from megascale.core.plan.module import measure_activations, module_memory, parameters_per_rank
from megascale.core.plan.presets import load_model
from megascale.core.plan.shapes import block_parameters, stages_of_rank
from megascale.core.plan.throughput import block_matmul_parameters
from tests._dist import run_distributed
from tests.core.plan._measure import PlannedLM, measure_layouts
from tests.core.plan.test_memory_model import BATCH, CATEGORIES, SEQ, SMALL_GPT, TOLERANCE, _cases, _predicted

# The architecture fields of the published config.json files; parameter counts as the model cards state them
# (Qwen3's from transformers' own model, checked below when transformers is installed).
HF_CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "llama-3-8b": (dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                        tie_word_embeddings=False), 8_030_261_248),
    "qwen2.5-7b": (dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072,
                        max_window_layers=28), 7_615_616_512),
    "qwen3-8b": (dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=None,
                      max_window_layers=36), 8_190_735_360),
    "qwen3-0.6b": (dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                        sliding_window=None, max_window_layers=28), 596_049_920),
    "mistral-7b": (dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                        tie_word_embeddings=False), 7_241_732_096),
}  # fmt: skip


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(HF_CONFIGS[name][0]))
    return path


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_a_hugging_face_config_counts_the_published_parameters(tmp_path: Path, name: str) -> None:
    config = load_model(str(_write(tmp_path, name)))
    (stage,) = stages_of_rank(config, pp=1, virtual_stages=1, pp_rank=0)
    assert stage.parameters(config, tp=1) == HF_CONFIGS[name][1]


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_a_hugging_face_config_counts_what_transformers_builds(tmp_path: Path, name: str) -> None:
    """Per layer too: every parameter, and the projections the FLOPs are counted from (q, k, v, o with GQA and
    head_dim, gate/up/down of SwiGLU), against transformers' model of the same config on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = load_model(str(_write(tmp_path, name)))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**HF_CONFIGS[name][0])
        )
    layer = model.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert block_parameters(config, tp=1) == sum(p.numel() for p in layer.parameters())
    assert block_matmul_parameters(config) == linear
    assert sum(p.numel() for p in model.parameters()) == HF_CONFIGS[name][1]


def test_megascale_plan_reads_a_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "qwen3-0.6b")  # head_dim 128 at width 1024 with 16 heads
    argv = [
        "--model",
        str(path),
        "--gpus",
        "16",
        "--gpu",
        "h100",
        "--global-batch",
        "64",
        "--seq-len",
        "4096",
    ]
    assert main([*argv, "--tp", "2", "--json"]) == 0  # (tied embeddings: no pipeline split)
    out = json.loads(capsys.readouterr().out)
    first = out["layouts"][0]
    assert out["model"]["head_size"] == 128 and out["model"]["n_kv_heads"] == 8 and out["model"]["qk_norm"]
    assert first["layout"]["tp"] == 2 and first["memory_per_gpu"]["total"] > 0


# ---- a module of the user's own --------------------------------------------------------------------------


def test_module_parameters_follow_its_tensor_parallel_plan() -> None:
    with torch.device("meta"):
        model = PlannedLM(vocab=128, width=64, layers=4)
    v, d, n = 128, 64, 4
    # split: embedding rows, up (weight, bias), down's weight, head projection (weight, bias); replicated:
    # the norms, down's bias, the head's norm
    split = v * d + n * (2 * d * d + 2 * d + 2 * d * d) + d * v + v
    replicated = n * (2 * d + d) + 2 * d
    assert parameters_per_rank(model) == split + replicated == sum(p.numel() for p in model.parameters())
    assert parameters_per_rank(model, tp=2) == split // 2 + replicated
    mem = module_memory(model, tp=2, dp=2, zero_stage=1, optimizer="adamw")
    p = split // 2 + replicated
    assert (mem.parameters, mem.gradients, mem.optimizer_state) == (4 * p, 4 * p, 4 * 2 * p / 2)
    assert mem.activations is None and mem.missing


def test_a_module_is_refused_where_the_planner_cannot_know() -> None:
    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
        model = PlannedLM()
    with pytest.raises(ValueError, match="declares no tensor_parallel_plan"):
        module_memory(plain, tp=2)
    with pytest.raises(ValueError, match="pipeline stages"):
        module_memory(model, pp=2)
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        module_memory(model, tp=3)  # 128 rows do not split over 3


def test_measured_activations_grow_with_the_micro_batch() -> None:
    torch.manual_seed(0)
    model = PlannedLM(vocab=128, width=64, layers=2)

    def saved(batch: int) -> int:
        tokens = torch.randint(0, 128, (batch, 32))
        return measure_activations(model, lambda: model(tokens, tokens.roll(-1, 1)))

    one, two = saved(1), saved(2)
    assert one > 0 and two == pytest.approx(2 * one, rel=0.05)
    assert module_memory(model, activations=one).total == module_memory(model).total + one


OWN = dict(vocab=128, width=64, layers=4)
CASES = {
    "own tp2 sp": dict(own=OWN, config={}, plan=dict(tp=2)),
    "own dp2 zero1": dict(own=OWN, config={}, plan=dict(zero_stage=1)),
    "own dp2 zero2": dict(own=OWN, config={}, plan=dict(zero_stage=2)),
    "own dp2 zero3": dict(own=OWN, config={}, plan=dict(zero_stage=3)),
    "qwen-like gpt tp2 sp": dict(plan=dict(tp=2), config=dict(parallel_block=False, qk_norm=True, head_size=32,
                                                              qkv_bias=True)),
}  # fmt: skip


def test_measured_states_and_activations_match_the_plan_on_gloo_ranks() -> None:
    """Two AdamW steps on 2 gloo ranks: parameters, gradients and optimizer state per rank of the user's module
    (tp2, ZeRO-1/2/3) within 10% of ``module_memory``, its activations at dp2 (tp = 1 per rank) within 10% of
    ``measure_activations`` on the dense module; and a Qwen-shaped GPT (GQA, head size 32 at width 64, q/k
    norms, q/k/v biases) within 10% in every category of ``predict_memory``."""
    cases = [{**c, "config": {**SMALL_GPT, **c["config"]}} if "own" not in c else c for c in CASES.values()]
    measured = run_distributed(measure_layouts, 2, cases, BATCH, SEQ, timeout=300)
    torch.manual_seed(0)
    dense = PlannedLM(**OWN)
    tokens = torch.randint(0, OWN["vocab"], (BATCH, SEQ))
    acts = measure_activations(dense, lambda: dense(tokens, tokens.roll(-1, 1)))
    failures, report = [], []
    for (name, case), *per_rank in zip(CASES.items(), *measured):
        for got in per_rank:
            if "own" in case:
                plan = case["plan"]
                want = module_memory(
                    dense, tp=plan.get("tp", 1), dp=2 // plan.get("tp", 1), zero_stage=plan.get("zero_stage", 0),
                    precision="32-true", activations=acts,
                )  # fmt: skip
                cats = ("parameters", "gradients", "optimizer_state") + (
                    ("activations",) if "zero_stage" in plan else ()
                )
            else:
                want, cats = _predicted(_cases({name: case})[0], 2, 0), CATEGORIES
            for cat in cats:
                error = getattr(want, cat) / got[cat] - 1
                report.append(
                    f"{name} {cat}: measured {got[cat]}, predicted {getattr(want, cat):.0f} ({error:+.2%})"
                )
                if abs(error) > TOLERANCE:
                    failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)
