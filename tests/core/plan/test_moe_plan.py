"""The planner on a mixture of experts: parameters (total, active, per expert-parallel rank) against the model,
memory against measurement on gloo ranks (``_measure.py``, as ``test_memory_model.py``; under tp and cp every
rank routes whole sequences through whole experts), the all-to-all and the MoE's gathers in the step time, and
the search over ep."""

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
from megascale.core.plan.shapes import block_parameters, model_parameters, stages_of_rank
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
    # tp and cp: the router and routed experts whole on every rank, on whole sequences (gathered under SP and
    # cp), the shared experts split over tp
    "tp2 sp": dict(plan=dict(tp=2), config=dict(moe=MOE)),
    "tp2 no-sp shared bf16": dict(plan=dict(tp=2, sequence_parallel=False), config=dict(moe=SHARED), precision="bf16-mixed"),
    "tp2 sp sequential gelu shared selective": dict(plan=dict(tp=2, activation_checkpointing="selective"), config=dict(moe=SHARED, **GELU)),
    "cp2": dict(plan=dict(cp=2, zero_stage=0), config=dict(moe=MOE)),
    "cp2 zero1 shared bf16": dict(plan=dict(cp=2), config=dict(moe=SHARED), precision="bf16-mixed"),
}  # fmt: skip
# four ranks: ep2 beside tp2 or cp2 (the all-to-all carries whole sequences' rows), and tp2 × cp2
CASES_4 = {
    # expert states over edp = 2 beside the dense ones over dp = 4
    "ep2 edp2 zero1 by parameters": dict(plan=dict(ep=2, zero_stage=1, zero1_sharding="parameters"), config=dict(moe=MOE)),
    "ep2 edp2 zero3": dict(plan=dict(ep=2, zero_stage=3), config=dict(moe=MOE)),
    "ep2 tp2 sp shared": dict(plan=dict(tp=2, ep=2, zero_stage=0), config=dict(moe=SHARED)),
    "ep2 cp2 bf16": dict(plan=dict(cp=2, ep=2, zero_stage=0), config=dict(moe=MOE), precision="bf16-mixed"),
    "tp2 cp2 sp": dict(plan=dict(tp=2, cp=2, zero_stage=0), config=dict(moe=MOE)),
}  # fmt: skip
# routing is uneven: an ep rank's activations follow the rows it receives, the prediction the mean (uniform
# routing), which the ep ranks' mean must match
EP_MEAN_TOLERANCE = 1e-4


def _cases(cases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**c, "config": {**SMALL_GPT, **c.get("config", {})}} for c in cases.values()]


@pytest.mark.parametrize(
    ("world", "cases"), [(1, CASES_1), (2, CASES_2), (4, CASES_4)], ids=["1 rank", "2 ranks", "4 ranks"]
)
def test_predicted_moe_memory_matches_measured(world: int, cases: dict[str, dict[str, Any]]) -> None:
    measured = run_distributed(measure_layouts, world, _cases(cases), BATCH, SEQ, timeout=600)
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
        if case["plan"].get("ep", 1) > 1:
            mean = sum(per_rank[i]["activations"] for per_rank in measured) / world
            error = _predicted(full, world, 0).activations / mean - 1
            report.append(f"{name} activations, mean over ranks: measured {mean:.0f} ({error:+.4%})")
            if abs(error) > EP_MEAN_TOLERANCE:
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


def test_tp_and_cp_run_whole_sequences_through_whole_experts() -> None:
    from megascale.core.plan.comm import Group, gather_time
    from megascale.core.plan.throughput import _Model, tp_collective_calls

    cfg = MIXTRAL_LIKE
    workload = Workload(cfg, seq_len=2048, global_batch=64, precision="bf16-mixed")
    cluster = ClusterSpec(gpu_spec("h100"), gpus=8)

    def model(**plan: Any) -> _Model:
        p = ParallelPlan(zero_stage=0, **plan)
        return _Model(workload, Layout(p, dp=8 // (p.tp * p.cp), micro_batch_size=1), cluster)

    # GEMMs: attention splits over tp, the router and the top-k routed experts do not
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = d * (q + 2 * kv) + q * d
    one, tp2 = model().block(0), model(tp=2).block(0)
    assert one.gemm - tp2.gemm == pytest.approx(2048 * attention)
    # cp: the attention's tokens halve, the routed experts' stay b·s
    assert one.gemm - model(cp=2).block(0).gemm == pytest.approx(2048 * attention)
    # SP: one more all-gather per block each way (the input; the output's gradient), unchunked; one
    # column/row pair (the attention's: no shared experts)
    sp = tp_collective_calls(cfg, ParallelPlan(tp=2))["block"]
    no_sp = tp_collective_calls(cfg, ParallelPlan(tp=2, sequence_parallel=False))["block"]
    c = ParallelPlan().tp_comm_chunks
    assert (sp.gathers_fwd, sp.gathers_bwd) == (2 * c + 1, 1 + 2 * c + 1)
    assert (no_sp.reduces_fwd, no_sp.reduces_bwd) == (c, 1)
    (tp_f, tp_b), (cp_f, cp_b) = model(tp=2).moe_gather_time()
    assert tp_f > 0 and tp_b > 0 and cp_f == cp_b == 0
    assert model(tp=2, sequence_parallel=False).moe_gather_time() == ((0.0, 0.0), (0.0, 0.0))
    # cp: the chunks gathered (b·s·D elements: fp32 input forward, bf16 gradient backward)
    (_, _), (cp_f, cp_b) = model(cp=2).moe_gather_time()
    group = Group.of(2, 1, cluster.gpus_per_node)
    assert cp_f == gather_time(2048 * d * 4, group, cluster)
    assert cp_b == gather_time(2048 * d * 2, group, cluster)
    # ep: every tp and cp rank of a replica sends whole sequences' rows
    assert model(ep=2, cp=2).ep_time() == pytest.approx(model(ep=2).ep_time())
    assert model(ep=2, tp=2).ep_time() == pytest.approx(model(ep=2).ep_time())
    # memory: under tp the routed experts are whole, the shared experts split; the MoE's activations are whole
    # sequences' under tp and cp alike
    moe = Workload(GPTConfig(**{**SMALL_GPT, "moe": SHARED}), seq_len=SEQ, global_batch=BATCH)
    small = moe.model
    q, kv, d = small.n_heads * small.head_dim, small.kv_heads * small.head_dim, small.d_model
    split = d * (q + 2 * kv) + q * d + 3 * d * small.expert_dim  # attention, one shared expert (SwiGLU)
    assert block_parameters(small, 1) - block_parameters(small, 2) == split // 2
    terms = {
        name: predict_memory(moe, Layout(ParallelPlan(**plan), dp=1, micro_batch_size=BATCH)).peak.activation_terms
        for name, plan in (("one", {}), ("tp2", dict(tp=2)), ("cp2", dict(cp=2)))
    }  # fmt: skip
    for key in ("blocks.moe.router_scores", "blocks.moe.experts.gate_up", "blocks.moe.outputs"):
        assert terms["one"][key] == terms["tp2"][key] == terms["cp2"][key]
    assert terms["tp2"]["blocks.moe.shared.gate_up"] == terms["one"]["blocks.moe.shared.gate_up"] / 2
    assert terms["tp2"]["blocks.moe.gathered_input"] == terms["cp2"]["blocks.moe.gathered_input"] > 0


def test_search_tries_ep_for_moe_and_emits_it() -> None:
    from megascale.core.plan.emit import cpu_trial, lightning_config

    workload = Workload(MIXTRAL_LIKE, seq_len=2048, global_batch=64)
    cluster = ClusterSpec(gpu_spec("h100"), gpus=8)
    ranked = search(workload, cluster, Fixed(pp=1, micro_batch_size=1, activation_checkpointing="full"))
    eps = {c.layout.plan.ep for c in ranked}
    assert eps == {1, 2, 4, 8}
    # check_expert_parallel's rule: ZeRO-1 beside ep > 1 by parameters (the search says so, and emits it)
    assert all(
        c.layout.plan.zero1_sharding == "parameters"
        for c in ranked
        if c.layout.plan.ep > 1 and c.layout.plan.zero_stage == 1
    )
    assert {c.layout.plan.zero_stage for c in ranked if c.layout.plan.ep > 1} == {0, 1, 2, 3}
    assert {c.layout.plan.tp for c in ranked} == {1, 2, 4}  # the MoE runs under tp too
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
