"""Measured training runs the planner is checked against: Megatron-LM 2021's weak-scaling table (A100) and
the steps measured on one H200 (``data/h200_2026_11_26.csv``: ``MeasuredStep``, at the end).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC'21, arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters on 32 to 3,072 A100-80GB GPUs
(Selene: DGX A100 nodes of 8, eight 200 Gb/s HDR adapters each), sequence 2,048, vocabulary 51,200, mixed
precision, activation recomputation. The table ships as ``data/megatron_lm_2021_table1.csv``.

What the table gives: hidden size, heads, layers, tp, pp, GPUs (dp = GPUs / (tp·pp)), global batch, and the
achieved TFLOP/s per GPU counted by the paper's equation 3, 96·B·s·l·h²·(1 + s/6h + V/16lh) per step
(recomputation included). What it does not, and what is assumed here (the same for every row):

- the model: GPT-3's block — sequential attention then MLP, GeLU, LayerNorm, biases, dropout 0.1 — with the
  MLP 4h wide; megascale's GPT uses rotary positions where GPT-3 learns them (2,048·h parameters, no
  matmul FLOPs: negligible here);
- micro-batch size 1 and the non-interleaved 1F1B schedule, full recomputation of every block, no sequence
  parallelism (2022), tensor-parallel all-reduces and the gradient all-reduce not overlapped, no ZeRO;
- the implementation: Megatron-LM's kernels of 2021 (fused LayerNorm, bias-GeLU and bias-dropout-add; the
  attention as two batched GEMMs around a fused softmax: ``Kernels(attention="unfused")``) and runtime (fp16
  parameters and gradient all-reduce, pipeline transfers waited on: ``Runtime.megatron_2021()``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib.resources import files

from megascale.core.config import GPTConfig
from megascale.core.model.gpt import flops_per_token
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.plan.cluster import A100_80GB, H200, ClusterSpec, GPUSpec
from megascale.core.plan.layout import Kernels, Layout, Runtime, Workload
from megascale.core.plan.throughput import predict_step

__all__ = [
    "MeasuredStep",
    "MegatronRow",
    "best_measured_mfu",
    "fit_matmul_efficiency",
    "h200_steps",
    "megatron_2021_table",
    "predicted_tflops",
]

SEQ_LEN = 2048
VOCAB = 51200


@dataclass(frozen=True)
class MegatronRow:
    """One row of the table, and the workload, layout and cluster it describes (module docstring)."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def workload(self) -> Workload:
        config = GPTConfig(
            vocab_size=VOCAB, d_model=self.hidden, n_layers=self.layers, n_heads=self.heads, max_seq_len=SEQ_LEN,
            parallel_block=False, activation="gelu", norm="layernorm", bias=True, dropout=0.1,
        )  # fmt: skip
        return Workload(config, seq_len=SEQ_LEN, global_batch=self.global_batch,
                        kernels=Kernels(attention="unfused"), runtime=Runtime.megatron_2021())  # fmt: skip

    def layout(self) -> Layout:
        """The published layout (tp, pp, dp, batch) with the assumptions of the module docstring."""
        m = self.global_batch // self.dp
        plan = ParallelPlan(
            tp=self.tp, pp=self.pp, zero_stage=0, num_microbatches=m if self.pp > 1 else None,
            sequence_parallel=False, overlap_tp_comm=False, overlap_grad_reduce=False, overlap_param_gather=False,
            activation_checkpointing="full",
        )  # fmt: skip
        return Layout(plan, dp=self.dp, micro_batch_size=1, accumulation=1 if self.pp > 1 else m)

    def cluster(self, gpu: GPUSpec = A100_80GB) -> ClusterSpec:
        return ClusterSpec(gpu, gpus=self.gpus, gpus_per_node=8)

    def paper_flops(self) -> float:
        """FLOPs of one step as the paper counts them (its equation 3, recomputation included)."""
        b, s, layers, h, v = self.global_batch, SEQ_LEN, self.layers, self.hidden, VOCAB
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))

    def tflops_at(self, step_time: float) -> float:
        """TFLOP/s per GPU, as the paper counts them, of a step taking ``step_time`` seconds."""
        return self.paper_flops() / step_time / self.gpus / 1e12

    def error(self, gpu: GPUSpec = A100_80GB) -> float:
        """predicted / published TFLOP/s per GPU − 1 at the published layout on ``gpu``."""
        return predicted_tflops(self, gpu) / self.tflops_per_gpu - 1


def megatron_2021_table() -> list[MegatronRow]:
    """The rows of Narayanan et al. 2021, Table 1, in order."""
    text = files("megascale.core.plan").joinpath("data/megatron_lm_2021_table1.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return [
        MegatronRow(
            params_billion=float(r["params_billion"]),
            heads=int(r["attention_heads"]),
            hidden=int(r["hidden_size"]),
            layers=int(r["layers"]),
            tp=int(r["tensor_parallel"]),
            pp=int(r["pipeline_parallel"]),
            gpus=int(r["gpus"]),
            global_batch=int(r["global_batch"]),
            tflops_per_gpu=float(r["tflops_per_gpu"]),
        )
        for r in rows
    ]


def predicted_tflops(row: MegatronRow, gpu: GPUSpec = A100_80GB) -> float:
    """The planner's TFLOP/s per GPU (the paper's count) for ``row``'s published layout on ``gpu``."""
    return row.tflops_at(predict_step(row.workload(), row.layout(), row.cluster(gpu)).step_time)


def fit_matmul_efficiency(rows: Sequence[MegatronRow | MeasuredStep], gpu: GPUSpec = A100_80GB) -> float:
    """The one ``matmul_efficiency`` that best predicts every row (table rows or measured steps): least squares
    of log(predicted / measured) over them, by golden-section search on [0.3, 1] (the error is unimodal), with
    the MFU cap lifted (it bounds predictions; it is not part of the fit)."""

    uncapped = None if gpu.rates is None else replace(gpu.rates, mfu_cap=None, mfu_cap_by_size=())

    def loss(eff: float) -> float:
        g = replace(gpu, matmul_efficiency=eff, rates=uncapped)
        return sum(math.log(r.error(g) + 1) ** 2 for r in rows)

    lo, hi = 0.3, 1.0
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > 1e-4:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = loss(b)
    return (lo + hi) / 2


@dataclass(frozen=True)
class MeasuredStep:
    """One training step measured on one GPU (``data/h200_2026_11_26.csv``: megascale GPT, sequential or
    parallel blocks, fp32 weights under bf16 autocast, fused AdamW, tp = pp = dp = 1, no recomputation)."""

    label: str
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    micro_batch: int
    parallel_block: bool
    s_per_step: float
    tokens_per_s: float
    peak_memory_gb: float

    def workload(self) -> Workload:
        config = GPTConfig(
            vocab_size=self.vocab, d_model=self.d_model, n_layers=self.layers, n_heads=self.heads,
            n_kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden, max_seq_len=self.seq_len,
            parallel_block=self.parallel_block, norm="rmsnorm", activation="swiglu", tie_embeddings=False,
        )  # fmt: skip
        return Workload(config, seq_len=self.seq_len, global_batch=self.micro_batch)

    def layout(self) -> Layout:
        plan = ParallelPlan(tp=1, pp=1, zero_stage=0, activation_checkpointing="none")
        return Layout(plan, dp=1, micro_batch_size=self.micro_batch)

    def cluster(self, gpu: GPUSpec = H200) -> ClusterSpec:
        return ClusterSpec(gpu, gpus=1)

    def predicted(self, gpu: GPUSpec = H200) -> float:
        """The planner's seconds per step for this step on ``gpu``."""
        return predict_step(self.workload(), self.layout(), self.cluster(gpu)).step_time

    def error(self, gpu: GPUSpec = H200) -> float:
        """predicted / measured step time − 1 (negative: the planner is optimistic)."""
        return self.predicted(gpu) / self.s_per_step - 1

    def mfu(self, peak_flops: float = H200.peak_flops) -> float:
        """The measured step's model-FLOP utilisation by ``StepEstimate.mfu``'s count (``flops_per_token``)."""
        return flops_per_token(self.workload().model, self.seq_len) * self.tokens_per_s / peak_flops


def h200_steps() -> list[MeasuredStep]:
    """The steps measured on one H200 on 2026-11-26, in order."""
    text = files("megascale.core.plan").joinpath("data/h200_2026_11_26.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return [
        MeasuredStep(
            label=r["label"],
            d_model=int(r["d_model"]),
            layers=int(r["layers"]),
            heads=int(r["heads"]),
            kv_heads=int(r["kv_heads"]),
            ffn_hidden=int(r["ffn_hidden"]),
            vocab=int(r["vocab"]),
            seq_len=int(r["seq_len"]),
            micro_batch=int(r["micro_batch"]),
            parallel_block=r["parallel_block"] == "1",
            s_per_step=float(r["s_per_step"]),
            tokens_per_s=float(r["tokens_per_s"]),
            peak_memory_gb=float(r["peak_memory_gb"]),
        )
        for r in rows
    ]


def best_measured_mfu(steps: Sequence[MeasuredStep]) -> float:
    """The highest model-FLOP utilisation among ``steps`` (the H200's ``mfu_cap``)."""
    return max(s.mfu() for s in steps)
