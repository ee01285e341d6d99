"""The planner's pieces against their sources, without processes: parameter counts against the model itself,
the activation terms against Korthikanti et al. 2022's formula, the pipeline orders against torch's, and the
memory warning a strategy can raise."""

from __future__ import annotations

import random

import pytest
import torch

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan
from megascale.core.plan import ActivationModel, Kernels, Layout, Workload, memory_warning, predict_memory
from megascale.core.plan.schedule import bubble_fraction, peak_in_flight, rank_order, receive_buffers
from megascale.core.plan.shapes import stages_of_rank

CONFIGS = {
    "megascale block": dict(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2),
    "gpt-3 block": dict(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, parallel_block=False, activation="gelu",
                        norm="layernorm", bias=True),
    "qwen-like": dict(vocab_size=1000, d_model=96, n_layers=2, n_heads=4, n_kv_heads=2, head_size=32, qkv_bias=True,
                      qk_norm=True, parallel_block=False),
    "tied": dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, tie_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("kw", CONFIGS.values(), ids=CONFIGS.keys())
def test_parameter_counts_match_the_model(kw: dict) -> None:
    config = GPTConfig(**kw)
    with torch.device("meta"):
        model = GPT(config)
    (stage,) = stages_of_rank(config, pp=1, virtual_stages=1, pp_rank=0)
    assert stage.parameters(config, tp=1) == model.num_parameters()


def test_activations_add_up_to_korthikanti_for_a_gpt3_block() -> None:
    """Korthikanti et al. 2022, eq. 1: 34·s·b·h + 5·a·s²·b bytes per layer (16-bit, no parallelism); eq. 4:
    everything / t with tensor and sequence parallelism. The norms' statistics (fp32 per row) come on top."""
    s, b, h, a = 512, 2, 256, 8
    config = GPTConfig(vocab_size=1024, d_model=h, n_layers=4, n_heads=a, max_seq_len=s, parallel_block=False,
                       activation="gelu", norm="layernorm", bias=True, dropout=0.1)  # fmt: skip
    kernels = Kernels(attention="unfused")  # fused norms and GeLU, Megatron's attention, bool dropout masks
    stats = 2 * 2 * s * b * 4  # two LayerNorms, mean and rstd per row
    for tp in (1, 4):
        # ZeRO-2 under bf16-mixed keeps the residual stream 16-bit, as Megatron's fp16 runs did
        layout = Layout(ParallelPlan(tp=tp, zero_stage=2), dp=2, micro_batch_size=b)
        model = ActivationModel(Workload(config, seq_len=s, global_batch=2 * b, kernels=kernels), layout)
        want = (34 * s * b * h + 5 * a * s * s * b) / tp + stats / tp
        assert sum(model.block().values()) == pytest.approx(want, rel=1e-12)
    full = Layout(ParallelPlan(tp=4, zero_stage=2, activation_checkpointing="full"), dp=2, micro_batch_size=b)
    model = ActivationModel(Workload(config, seq_len=s, global_batch=2 * b, kernels=kernels), full)
    assert sum(model.block().values()) == 2 * s * b * h / 4  # eq. 5 with sequence parallelism: the input


def test_selective_recomputation_drops_the_quadratic_terms() -> None:
    config = GPTConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, max_seq_len=2048, parallel_block=False,
                       activation="gelu", norm="layernorm", bias=True, dropout=0.1)  # fmt: skip
    kernels = Kernels(attention="unfused")
    bytes_at = {}
    for seq in (1024, 2048):
        layout = Layout(ParallelPlan(activation_checkpointing="selective"), micro_batch_size=1)
        model = ActivationModel(Workload(config, seq_len=seq, global_batch=1, kernels=kernels), layout)
        bytes_at[seq] = sum(model.block().values())
    assert bytes_at[2048] == pytest.approx(2 * bytes_at[1024])  # linear in s: nothing s² is kept


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_order_is_torchs(pp: int, v: int) -> None:
    from torch.distributed.pipelining import schedules

    for m in (pp, 2 * pp, 4 * pp):
        for rank in range(pp):
            plan = type("Plan", (), {})()
            plan.n_local_stages, plan.pp_group_size, plan._n_microbatches = v, pp, m
            plan.microbatches_per_round = m // max(1, m // pp)
            actions = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(plan, rank)
            forward = schedules._ComputationType.FORWARD
            want = [
                ("F" if a.computation_type == forward else "B", a.stage_index // pp) for a in actions if a
            ]
            assert rank_order("interleaved", pp, rank, m, v) == want
            chunk = [random.random() for _ in range(v)]
            held = peak = 0.0
            for kind, c in want:
                held += chunk[c] if kind == "F" else -chunk[c]
                peak = max(peak, held)
            assert peak_in_flight("interleaved", pp, rank, m, chunk) == pytest.approx(peak)


def test_one_stage_schedules_and_bubbles() -> None:
    assert peak_in_flight("1f1b", 4, 0, 8, [1.0]) == 4 and peak_in_flight("1f1b", 4, 3, 8, [1.0]) == 1
    assert peak_in_flight("gpipe", 4, 3, 8, [1.0]) == 8
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    # zb1p, in theory (part of issue 35 still to check against benchmarks/pipeline.py): (p-1)(F+B-2W) of
    # 1F1B's (p-1)(F+B), a third at B = 2F, W = F; 1F1B's activations held, torch's receive buffers per microbatch
    assert bubble_fraction("zb1p", 4, 8) == pytest.approx(3 / 8 / 3)
    assert bubble_fraction("zb1p", 4, 8, 2) == pytest.approx(3 / 16 / 3)
    assert peak_in_flight("zb1p", 4, 0, 8, [1.0]) == 4
    assert receive_buffers("zb1p", 4, 1, 8) == ((8, 8),)


def test_memory_warning_names_what_to_change() -> None:
    config = GPTConfig(vocab_size=50304, d_model=4096, n_layers=32, n_heads=32, max_seq_len=4096)
    assert memory_warning(config, ParallelPlan(tp=8, zero_stage=1, activation_checkpointing="full"), 64,
                          micro_batch_size=1, seq_len=4096, device_memory=80e9) is None  # fmt: skip
    message = memory_warning(config, ParallelPlan(zero_stage=0), 8, micro_batch_size=8, seq_len=4096,
                             device_memory=80e9)  # fmt: skip
    assert message is not None and "predicted to need" in message and "activation_checkpointing" in message


def test_a_pipeline_holds_receive_buffers_for_the_microbatches_in_flight() -> None:
    """The pipeline's stages pool their receive buffers (torch's PipelineStage keeps one per microbatch): at
    1F1B, rank r of P holds min(P - r + 1, M) activation and 2 gradient buffers, so smaller microbatches
    hold less; GPipe holds every microbatch's activation and one gradient (measured in
    tests/core/plan/test_memory_model.py and tests/core/test_pipeline_schedules.py)."""
    config = GPTConfig(vocab_size=1024, d_model=256, n_layers=8, n_heads=8, max_seq_len=1024)
    workload = Workload(config, seq_len=1024, global_batch=32)
    sample = 1024 * 256 * 4  # one sequence's residual stream, fp32

    def receive(m: int, schedule: str = "1f1b") -> float:
        plan = ParallelPlan(pp=4, num_microbatches=m, schedule=schedule)
        return (
            predict_memory(workload, Layout(plan, micro_batch_size=32 // m), all_ranks=True)
            .ranks[1]
            .receive_buffers
        )

    assert receive(4) == (4 + 2) * 8 * sample  # min(4 - 1 + 1, 4) activations, 2 gradients of 8 sequences
    assert receive(8) == (4 + 2) * 4 * sample
    assert receive(32) == (4 + 2) * 1 * sample
    assert receive(8, "gpipe") == (8 + 1) * 4 * sample


@pytest.mark.parametrize(("P", "V", "M"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (4, 4, 8), (8, 2, 16)])
def test_interleaved_receive_buffers_match_the_runtimes_plan(P: int, V: int, M: int) -> None:
    """Replaying the plan ScheduleDecoupledInterleaved1F1B runs (torch's, receives prefetched), a buffer taken
    at each receive and given back after that stage's backward: every stream as receive_buffers counts it,
    but the last rank's gradient streams, where torch's lockstep placement posts receives earlier."""
    from collections import Counter

    from megascale.core.parallel.pp.interleaved import prefetch_receives
    from tests.core.test_pipeline_interleaved import T, _torch_plan

    for rank, actions in _torch_plan(P, V, M).items():
        held: Counter[tuple[int, str]] = Counter()
        most: Counter[tuple[int, str]] = Counter()
        for a in prefetch_receives(actions):
            if a.computation_type in (T.RECV_F, T.RECV_B):
                key = (a.stage_index, a.computation_type.value[-1])
                held[key] += 1
                most[key] = max(most[key], held[key])
            elif a.computation_type == T.FULL_BACKWARD:  # gives back its activation and gradient buffers
                for key in ((a.stage_index, "F"), (a.stage_index, "B")):
                    if held[key]:
                        held[key] -= 1
        replayed = [(most[(rank + c * P, "F")], most[(rank + c * P, "B")]) for c in range(V)]
        modelled = receive_buffers("interleaved", P, rank, M, V)
        for c, ((f, b), (mf, mb)) in enumerate(zip(replayed, modelled)):
            assert f == mf, (rank, c)
            assert b == mb or (rank == P - 1 and mb <= b <= M), (rank, c, b, mb)
