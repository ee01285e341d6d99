"""Published training runs the planner is checked against: Megatron-LM 2021's weak-scaling table.

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
from dataclasses import dataclass, replace
from importlib.resources import files

from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.plan.cluster import A100_80GB, ClusterSpec, GPUSpec
from megascale.core.plan.layout import Kernels, Layout, Runtime, Workload
from megascale.core.plan.throughput import predict_step

__all__ = ["MegatronRow", "fit_matmul_efficiency", "megatron_2021_table", "predicted_tflops"]

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


def fit_matmul_efficiency(rows: list[MegatronRow], gpu: GPUSpec = A100_80GB) -> float:
    """The one ``matmul_efficiency`` that best predicts every row: least squares of log(predicted/published)
    over the table, by golden-section search on [0.3, 1] (the error is unimodal in it)."""

    def loss(eff: float) -> float:
        g = replace(gpu, matmul_efficiency=eff)
        return sum(math.log(predicted_tflops(r, g) / r.tflops_per_gpu) ** 2 for r in rows)

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
