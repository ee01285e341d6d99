"""The planner on a mixture of experts: parameters (total, active, per expert-parallel rank) against the model,
memory against measurement on gloo ranks (``_measure.py``, as ``test_memory_model.py``), the all-to-all in
the step time, and the search over ep."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megascale.core import GPT, GPTConfig
from megascale.core.model.gpt import flops_per_token
from megascale.core.parallel import ParallelPlan
from megascale.core.plan import (
    ClusterSpec,
    Fixed,
    Layout,
    Workload,
    gpu_spec,
    predict_memory,
    predict_step,
    search,
)
from megascale.core.plan.shapes import model_parameters, stages_of_rank
from tests._dist import run_distributed
from tests.core.plan._measure import measure_layouts
from tests.core.plan.test_memory_model import BATCH, CATEGORIES, SEQ, SMALL_GPT, TOLERANCE, _predicted

MOE = dict(num_experts=4, top_k=2)
SHARED = dict(num_experts=4, top_k=2, shared_experts=1, z_loss_coef=1e-3)
SIGMOID = dict(
    num_experts=4, top_k=1, score="sigmoid", normalize_top_k=False, bias_update_rate=1e-3, aux_loss_coef=0.0
)
GELU = dict(parallel_block=False, activation="gelu", norm="layernorm", bias=True)

# one process: the MoE's experts are ordinary parameters
CASES_1 = {
    "moe": dict(plan={}, config=dict(moe=MOE)),
    "moe shared z-loss bf16": dict(plan={}, config=dict(moe=SHARED), precision="bf16-mixed"),
    "moe sequential gelu sigmoid selective": dict(
        plan=dict(activation_checkpointing="selective"), config=dict(moe=SIGMOID, **GELU)
    ),
    "moe full-ac bf16": dict(plan=dict(activation_checkpointing="full"), config=dict(moe=MOE), precision="bf16-mixed"),
}  # fmt: skip
# two ranks: experts split over ep = 2, or (ep = 1) sharded by ZeRO like every parameter
CASES_2 = {
    "ep2": dict(plan=dict(ep=2, zero_stage=0), config=dict(moe=MOE)),
    "ep2 shared bf16": dict(plan=dict(ep=2, zero_stage=0), config=dict(moe=SHARED), precision="bf16-mixed"),
    "ep2 sequential gelu full-ac": dict(plan=dict(ep=2, zero_stage=0, activation_checkpointing="full"), config=dict(moe=MOE, **GELU)),
    "dp2 ep1 zero1 bf16": dict(plan=dict(zero_stage=1), config=dict(moe=MOE), precision="bf16-mixed"),
    "dp2 ep1 zero2": dict(plan=dict(zero_stage=2), config=dict(moe=SHARED)),
}  # fmt: skip


def _cases(cases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**c, "config": {**SMALL_GPT, **c.get("config", {})}} for c in cases.values()]


@pytest.mark.parametrize(("world", "cases"), [(1, CASES_1), (2, CASES_2)], ids=["1 rank", "2 ranks"])
def test_predicted_moe_memory_matches_measured(world: int, cases: dict[str, dict[str, Any]]) -> None:
    measured = run_distributed(measure_layouts, world, _cases(cases), BATCH, SEQ, timeout=300)
    failures, report = [], []
    for i, (name, case) in enumerate(cases.items()):
        full = _cases({name: case})[0]
        for rank, per_rank in enumerate(measured):
            got = per_rank[i]
            want = _predicted(full, world, got["coords"]["pp"])
            for cat in CATEGORIES:
                error = getattr(want, cat) / got[cat] - 1
                report.append(f"{name} rank {rank} {cat}: measured {got[cat]}, predicted {getattr(want, cat):.0f} ({error:+.2%})")  # fmt: skip
                if abs(error) > TOLERANCE:
                    failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)


MOE_CONFIGS = {
    "parallel swiglu": dict(vocab_size=1000, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, moe=dict(num_experts=4, top_k=2, expert_hidden=48)),
    "sequential gelu bias shared": dict(vocab_size=1000, d_model=96, n_layers=2, n_heads=6, parallel_block=False, activation="gelu",
                                        norm="layernorm", bias=True, moe=dict(num_experts=8, top_k=2, shared_experts=1)),
}  # fmt: skip


@pytest.mark.parametrize("kw", MOE_CONFIGS.values(), ids=MOE_CONFIGS.keys())
def test_total_and_active_parameters_match_the_model(kw: dict[str, Any]) -> None:
    config = GPTConfig(**kw)
    with torch.device("meta"):
        model = GPT(config)
    assert model_parameters(config) == model.num_parameters()
    assert model_parameters(config, active=True) == model.num_parameters(active=True)
    # an ep rank holds 1/ep of the routed experts, everything else whole
    (stage,) = stages_of_rank(config, pp=1, virtual_stages=1, pp_rank=0)
    experts = stage.expert_parameters(config)
    assert stage.parameters(config, 1, ep=2) == model.num_parameters() - experts // 2


MIXTRAL_LIKE = GPTConfig(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=3584,
                         parallel_block=False, max_seq_len=2048, moe=dict(num_experts=8, top_k=2, aux_loss_coef=0.0))  # fmt: skip


def test_expert_parallel_all_to_all_is_an_exposed_step_term() -> None:
    workload = Workload(MIXTRAL_LIKE, seq_len=2048, global_batch=64)
    cluster = ClusterSpec(gpu_spec("h100"), gpus=16)
    steps = {
        ep: predict_step(workload, Layout(ParallelPlan(ep=ep, zero_stage=0), dp=16, micro_batch_size=1, accumulation=4), cluster)
        for ep in (1, 2, 4, 8)
    }  # fmt: skip
    assert steps[1].ep_comm == 0.0
    assert (
        0 < steps[2].ep_comm < steps[4].ep_comm < steps[8].ep_comm
    )  # (ep - 1)/ep of the rows leave the rank
    # per layer and microbatch 4 all-to-alls of N·k·D bf16 elements, 7/8 of them sent over NVLink, and the
    # counts' one: 5 calls' latency
    g = cluster.gpu
    rows = 2048 * 2 * 1024 * 2
    per_call = 7 / 8 * rows / (g.nvlink_bandwidth * g.link_efficiency)
    latency = g.call_latency + g.nvlink_latency
    assert steps[8].ep_comm == pytest.approx(4 * 8 * (4 * per_call + 5 * latency), rel=1e-6)
    for s in steps.values():  # MFU on active parameters; the all-to-alls add to the step, not overlapped
        assert s.model_flops == flops_per_token(MIXTRAL_LIKE, 2048) * s.tokens
        assert s.step_time == pytest.approx(
            s.compute + s.tp_comm + s.cp_comm + s.ep_comm + s.bubble + s.pp_comm + s.dp_comm + s.optimizer
        )


def test_search_tries_ep_for_moe_and_emits_it() -> None:
    from megascale.core.plan.emit import cpu_trial, lightning_config

    workload = Workload(MIXTRAL_LIKE, seq_len=2048, global_batch=64)
    cluster = ClusterSpec(gpu_spec("h100"), gpus=8)
    ranked = search(workload, cluster, Fixed(pp=1, micro_batch_size=1, activation_checkpointing="full"))
    eps = {c.layout.plan.ep for c in ranked}
    assert eps == {1, 2, 4, 8}
    assert all(
        c.layout.plan.zero_stage == 0 for c in ranked if c.layout.plan.ep > 1
    )  # check_expert_parallel's rule
    best = next(c for c in ranked if c.layout.plan.ep == 8)
    assert "ep8" in best.layout.describe() and best.to_dict()["layout"]["ep"] == 8
    emitted = lightning_config(best, MIXTRAL_LIKE, 2048, cluster)
    assert emitted["trainer"]["strategy"]["init_args"]["ep"] == 8
    trial = cpu_trial(emitted, best, MIXTRAL_LIKE)
    assert trial["trainer"]["strategy"]["init_args"]["ep"] == 4  # 4 experts on 4 CPU ranks
    assert trial["model"]["config"]["moe"]["num_experts"] == 4
    fixed = search(workload, cluster, Fixed(ep=2, pp=1, micro_batch_size=1, activation_checkpointing="full"))
    assert {c.layout.plan.ep for c in fixed} == {2}


def test_planner_refuses_what_expert_parallelism_refuses() -> None:
    cluster = ClusterSpec(gpu_spec("h100"), gpus=8)
    dense = Workload(
        GPTConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4), seq_len=128, global_batch=8
    )
    with pytest.raises(ValueError, match="has none"):
        search(dense, cluster, Fixed(ep=2))
    moe = Workload(MIXTRAL_LIKE, seq_len=2048, global_batch=64)
    with pytest.raises(ValueError, match="cannot be split over ep=3"):
        search(moe, ClusterSpec(gpu_spec("h100"), gpus=6), Fixed(ep=3))
    with pytest.raises(ValueError, match="tp=2"):
        predict_memory(moe, Layout(ParallelPlan(tp=2), dp=4))
    assert all(c.layout.plan.tp == 1 for c in search(moe, cluster, Fixed(pp=1, micro_batch_size=1)))
