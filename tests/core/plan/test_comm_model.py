"""The communication model's latency term (alpha in t = alpha + bytes / bandwidth, per call): NCCL's ring model
for GPU clusters, calls counted as the runtime issues them, and the CPU calibration's measured latencies."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from megascale.core import GPTConfig
from megascale.core.parallel import ParallelPlan
from megascale.core.plan import A100_80GB, ClusterSpec, Kernels, Layout, Workload, predict_step
from megascale.core.plan.calibrate import Calibration, cpu_cluster
from megascale.core.plan.comm import Group, all_reduce_time, call_latency, gather_time, p2p_time
from megascale.core.plan.throughput import tp_collective_calls
from tests._dist import run_distributed
from tests.core.plan._measure import count_tp_calls

US = 1e-6


def test_call_latency_is_nccls_ring_model() -> None:
    """NVIDIA/nccl src/graph/tuning.cc, ring / Simple: 8.4 µs a call, 3.4 µs a step over NVLink, 9.6 µs a step
    between nodes; an all-reduce takes 2(n-1) steps, an all-gather n-1."""
    cluster = ClusterSpec(A100_80GB, gpus=64)
    node = Group.of(8, 1, 8)  # tp 8: one node
    assert call_latency(node, cluster, all_reduce=True) == pytest.approx((8.4 + 14 * 3.4) * US)
    assert call_latency(node, cluster) == pytest.approx((8.4 + 7 * 3.4) * US)
    dp = Group.of(8, 8, 8)  # one GPU on each of 8 nodes
    assert (dp.per_node, dp.nodes) == (1, 8)
    assert call_latency(dp, cluster, all_reduce=True) == pytest.approx((8.4 + 14 * 9.6) * US)
    assert call_latency(Group.of(1, 1, 8), cluster) == 0.0
    assert p2p_time(0, False, cluster) == pytest.approx((8.4 + 3.4) * US)
    assert p2p_time(0, True, cluster) == pytest.approx((8.4 + 3.4 + 9.6) * US)


def test_splitting_bytes_into_calls_costs_their_latency_only() -> None:
    cluster = ClusterSpec(A100_80GB, gpus=8)
    group = Group.of(8, 1, 8)
    one = gather_time(64e6, group, cluster)
    assert gather_time(64e6, group, cluster, calls=4) - one == pytest.approx(3 * call_latency(group, cluster))
    ar = all_reduce_time(64e6, group, cluster, calls=2) - all_reduce_time(64e6, group, cluster)
    assert ar == pytest.approx(call_latency(group, cluster, all_reduce=True))


def _cpu(call: float, p2p: float = 0.0) -> ClusterSpec:
    return cpu_cluster(Calibration(100e9, 10e9, 1e9, 1, 2, "float32", call, p2p), ranks=2, memory_bytes=8e9)


def test_cpu_ranks_pay_the_measured_latency_per_call_and_hide_nothing() -> None:
    config = GPTConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
    workload = Workload(config, seq_len=256, global_batch=8, precision="32-true", kernels=Kernels.cpu())
    layout = Layout(ParallelPlan(tp=2), dp=1, micro_batch_size=8)
    calls = tp_collective_calls(config, layout.plan)
    n = config.n_layers * calls["block"].total + calls["embedding"].total + calls["head"].total
    base = predict_step(workload, layout, _cpu(0.0))
    slow = predict_step(workload, layout, _cpu(1e-3))
    assert slow.tp_comm - base.tp_comm == pytest.approx(n * 1e-3)
    # gloo's transfers run on the ranks' own cores: more chunks only add calls, nothing is hidden
    more = predict_step(workload, layout.with_plan(tp_comm_chunks=8), _cpu(1e-3))
    assert more.tp_comm > slow.tp_comm
    hidden = predict_step(workload, layout, replace(_cpu(0.0), gpu=replace(_cpu(0.0).gpu, overlap=True)))
    assert hidden.tp_comm == pytest.approx(base.tp_comm / 4)
    pp = Layout(ParallelPlan(pp=2, num_microbatches=4), dp=1, micro_batch_size=2)
    assert predict_step(workload, pp, _cpu(0.0, 1e-3)).pp_comm - predict_step(
        workload, pp, _cpu(0.0)
    ).pp_comm == pytest.approx((2 + 2 * 4) * 1e-3)  # fill and drain, then every transfer waited for


def test_gpu_latency_grows_with_chunks_and_layers() -> None:
    config = GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=2048)
    workload = Workload(config, seq_len=2048, global_batch=64)
    cluster = ClusterSpec(A100_80GB, gpus=8)
    layout = Layout(ParallelPlan(tp=8, overlap_tp_comm=False), dp=1, micro_batch_size=1, accumulation=64)
    none = replace(cluster, gpu=replace(A100_80GB, call_latency=0.0, nvlink_latency=0.0))
    extra = predict_step(workload, layout, cluster).tp_comm - predict_step(workload, layout, none).tp_comm
    calls = tp_collective_calls(config, layout.plan)
    per_microbatch = config.n_layers * calls["block"].total + calls["embedding"].total + calls["head"].total
    group = Group.of(8, 1, 8)
    assert extra == pytest.approx(
        64 * per_microbatch * call_latency(group, cluster), rel=0.25
    )  # gathers and all-reduces mixed: between the two latencies
    assert extra > 64 * per_microbatch * call_latency(group, cluster)


@pytest.mark.parametrize(
    ("zero", "pieces_over_dp"),
    [(dict(zero_stage=0), False), (dict(zero_stage=1, zero1_sharding="elements"), True), (dict(zero_stage=2), False)],
)  # fmt: skip
def test_tied_embeddings_under_pp_pay_the_embedding_groups_all_reduce(
    zero: dict, pieces_over_dp: bool
) -> None:
    """The first and last stage all-reduce the tied embedding's fp32 gradient (pp/tied.py): V·D/t elements over
    two ranks, within a node at pp4 × tp2 and across nodes at pp8 × tp2; ZeRO-2 sums its 1/dp shard, ZeRO-1 by
    elements first makes its piece whole over dp."""
    config = GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=2048)
    workload = Workload(config, seq_len=2048, global_batch=64)
    tied = Workload(replace(config, tie_embeddings=True), seq_len=2048, global_batch=64)
    cluster = ClusterSpec(A100_80GB, gpus=128)
    grads = 4 * config.padded_vocab_size * config.d_model / 2
    for pp, group in ((4, Group(2, 1)), (8, Group(1, 2))):
        layout = Layout(ParallelPlan(tp=2, pp=pp, num_microbatches=8, **zero), dp=4, micro_batch_size=1)
        extra = predict_step(tied, layout, cluster).pp_comm - predict_step(workload, layout, cluster).pp_comm
        want = all_reduce_time(grads / (4 if zero["zero_stage"] == 2 else 1), group, cluster)
        if pieces_over_dp:
            want += all_reduce_time(grads, Group.of(4, 2 * pp, 8), cluster)
        assert extra == pytest.approx(want), (pp, zero)
        assert extra > 0


SMALL = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_multiple_of=32, max_seq_len=64,
             pad_vocab_to_multiple_of=64)  # fmt: skip
GPT3 = dict(SMALL, parallel_block=False, activation="gelu", norm="layernorm", bias=True)
QWEN = dict(SMALL, parallel_block=False, qk_norm=True, qkv_bias=True)
CASES = {
    "sp, 4 chunks": dict(config=SMALL, plan=dict(tp=2)),
    "sp, no overlap, gpt-3 block": dict(config=GPT3, plan=dict(tp=2, overlap_tp_comm=False)),
    "no sp, 2 chunks, gpt-3 block": dict(config=GPT3, plan=dict(tp=2, sequence_parallel=False, tp_comm_chunks=2)),
    "no sp, q/k norms": dict(config=QWEN, plan=dict(tp=2, sequence_parallel=False)),
    "sp, 2 chunks, q/k norms": dict(config=QWEN, plan=dict(tp=2, tp_comm_chunks=2)),
}  # fmt: skip


def test_tp_calls_are_counted_as_the_runtime_issues_them() -> None:
    """One forward and backward of a small GPT on 2 gloo ranks: the c10d calls the profiler sees equal the
    model's count, block by block, embedding and head."""
    counted: list[list[dict[str, Any]]] = run_distributed(
        count_tp_calls, 2, list(CASES.values()), 2, 32, timeout=240
    )
    for (name, case), got in zip(CASES.items(), counted[0]):
        config, plan = GPTConfig(**case["config"]), ParallelPlan(**case["plan"])
        calls = tp_collective_calls(config, plan)
        want = config.n_layers * calls["block"].total + calls["embedding"].total + calls["head"].total
        assert sum(got.values()) == want, f"{name}: counted {got}, model {want}"


@pytest.mark.parametrize(
    ("shape", "bucket_mb"),
    [(dict(d_model=1024, n_layers=8, n_heads=16), 25.0), (dict(d_model=512, n_layers=6, n_heads=8), 25.0)],
)
def test_gradient_buckets_are_counted_as_the_reducer_packs_them(shape: dict, bucket_mb: float) -> None:
    """megascale's block (no biases): the bucket count of ``zero.grad_reduce`` on the model's own parameters.
    (Biases and norms between matrices larger than a bucket open buckets of their own, which the planner does
    not count: a GPT-3 block of width 2048 at 10 MB buckets has 51, the planner counts 26.)"""
    from types import SimpleNamespace

    import torch

    from megascale.core import GPT
    from megascale.core.parallel.zero.grad_reduce import BucketedGradReduce
    from megascale.core.plan.shapes import stages_of_rank
    from megascale.core.plan.throughput import _dp_calls

    config = GPTConfig(vocab_size=32000, **shape)
    with torch.device("meta"):
        params = list(GPT(config).parameters())
    reducer = SimpleNamespace(reduce_dtype=torch.float32, scatter=False)
    real = BucketedGradReduce._make_buckets(reducer, params[::-1], int(bucket_mb * 2**20))  # type: ignore[arg-type]
    layout = Layout(ParallelPlan(bucket_size_mb=bucket_mb), dp=2)
    workload = Workload(config, seq_len=128, global_batch=2)
    assert _dp_calls(workload, layout, stages_of_rank(config, 1, 1, 0)) == len(real)
