"""Layout and Workload: what the planner predicts for — a parallel layout of a training step, and the run.

``Layout`` is a ``ParallelPlan`` (the strategy's own layout type: tp, pp, ZeRO stage, schedule, checkpointing,
sequence parallelism, overlap switches) completed by what the plan leaves to the world and the data: the
data-parallel size and the micro-batch size (sequences per forward on one rank). ``Workload`` is the model and
the run around it: sequence length, global batch, precision, optimizer and the kernels in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import ParallelPlan

__all__ = ["OPTIMIZER_STATES", "Kernels", "Layout", "Runtime", "Workload"]

#: fp32 tensors an optimizer keeps per parameter (AdamW, LAMB: two moments; SGD with momentum: one)
OPTIMIZER_STATES = {"adamw": 2, "lamb": 2, "sgd": 1}


@dataclass(frozen=True)
class Kernels:
    """Which implementation of each memory-relevant kernel runs, which decides what it saves for backward.

    Args:
        norm: "fused" (apex/Triton: the input and per-row statistics) or "torch" (the reference: also an fp32
            copy of the input when the stream is narrower, and, for RMSNorm, the normalised rows in fp32).
        attention: "flash" (flash-attn, or torch's SDPA: q, k, v, the output and the log-sum-exp per row;
            causal, so half the score FLOPs), "unfused" (Megatron-LM's batched GEMMs around a fused
            scale-mask-softmax: 16-bit scores and probabilities in memory, the full square computed) or "torch"
            (megascale's unfused reference: fp32 copies of q, k, v and fp32 probabilities).
        activation: "fused" (SwiGLU saves gate and up) or "torch" (also silu(gate)).
        cross_entropy: "fused" (Triton: the logits and a log-sum-exp per row) or "torch" (fp32 log-softmax).
        dropout_mask: what dropout keeps per element: "bool" (CUDA's native dropout, one byte) or "float" (the
            CPU's, a mask in the input's dtype).
    """

    norm: Literal["fused", "torch"] = "fused"
    attention: Literal["flash", "unfused", "torch"] = "flash"
    activation: Literal["fused", "torch"] = "fused"
    cross_entropy: Literal["fused", "torch"] = "fused"
    dropout_mask: Literal["bool", "float"] = "bool"

    @classmethod
    def gpu(cls) -> Kernels:
        """What a CUDA machine with flash-attn and Triton runs (the registry's first choices)."""
        return cls()

    @classmethod
    def cpu(cls) -> Kernels:
        """What a CPU runs: the torch references, attention by SDPA."""
        return cls(
            norm="torch", attention="flash", activation="torch", cross_entropy="torch", dropout_mask="float"
        )


@dataclass(frozen=True)
class Runtime:
    """Where the training code around the kernels decides memory or time, and implementations differ.

    Args:
        residual: the residual stream's dtype: "fp32" (megascale: the master weights' dtype, which the
            embedding runs in; bf16 only where ZeRO-2/3 gathers bf16 parameters) or "compute" (16-bit
            parameters, as Megatron-LM 2021 ran).
        pipeline_buffers: "pooled" (megascale's pipeline stages lend a microbatch receive buffers from a
            pool while it is in flight, ``schedule.receive_buffers``) or "per_transfer" (Megatron-LM
            allocates one per transfer).
        overlap_p2p: pipeline transfers overlap compute (megascale's decoupled schedules) or each is waited
            for before the next computation (Megatron-LM 2021).
        reduce_bytes: bytes per gradient element in the data-parallel reduction (megascale reduces fp32;
            Megatron-LM 2021's fp16 runs reduced 16-bit gradients).
    """

    residual: Literal["fp32", "compute"] = "fp32"
    pipeline_buffers: Literal["pooled", "per_transfer"] = "pooled"
    overlap_p2p: bool = True
    reduce_bytes: int = 4

    @classmethod
    def megatron_2021(cls) -> Runtime:
        """Megatron-LM as Narayanan et al. 2021 ran it (fp16 parameters and gradient all-reduce)."""
        return cls(residual="compute", pipeline_buffers="per_transfer", overlap_p2p=False, reduce_bytes=2)


@dataclass(frozen=True)
class Workload:
    """The model and the run a layout is planned for.

    Args:
        model: the architecture.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step, over all data-parallel ranks.
        precision: "bf16-mixed" (fp32 master weights and gradients, bf16 matmuls and activations between
            them; the residual stream stays fp32 unless ZeRO-2/3 gathers bf16 parameters) or "32-true".
        optimizer: "adamw", "lamb" or "sgd" (with momentum): how many fp32 states per parameter.
        kernels: the kernel implementations (``Kernels.gpu()`` or ``Kernels.cpu()``).
        runtime: what the training code does around them (``Runtime()``: megascale's).
    """

    model: GPTConfig
    seq_len: int
    global_batch: int
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed"
    optimizer: Literal["adamw", "lamb", "sgd"] = "adamw"
    kernels: Kernels = field(default_factory=Kernels.gpu)
    runtime: Runtime = field(default_factory=Runtime)

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.global_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and global_batch={self.global_batch} must be >= 1")
        if self.precision not in ("bf16-mixed", "32-true"):
            raise ValueError(f"precision={self.precision!r} must be 'bf16-mixed' or '32-true'")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {sorted(OPTIMIZER_STATES)}")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul operands and outputs (bf16 under mixed precision)."""
        return 2 if self.precision == "bf16-mixed" else 4

    def residual_bytes(self, zero_stage: int) -> int:
        """Bytes per element of the residual stream: the parameters' dtype where the embedding runs. fp32 master
        weights keep it fp32; ZeRO-2/3 under mixed precision gather bf16 parameters, so the stream is bf16."""
        if self.runtime.residual == "compute" or zero_stage >= 2:
            return self.compute_bytes
        return 4


@dataclass(frozen=True)
class Layout:
    """A ``ParallelPlan`` with the sizes it leaves open: data parallelism and the micro-batch.

    Args:
        plan: tp, pp, ZeRO stage, schedule, virtual stages, checkpointing, sequence parallelism, overlap.
            Its ``num_microbatches`` is the pipeline's microbatches per step (pp > 1).
        dp: data-parallel size (the plan's cp ranks of a replica share its sequences: ``replicas`` = dp × cp
            ranks hold the same parameters).
        micro_batch_size: sequences per microbatch on one data-parallel rank (a cp rank holds 1/cp of each).
        accumulation: gradient-accumulation steps per optimizer step (Lightning's ``accumulate_grad_batches``):
            with pp = 1 the microbatches of a step; with pp > 1 whole pipeline steps.
    """

    plan: ParallelPlan
    dp: int = 1
    micro_batch_size: int = 1
    accumulation: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "micro_batch_size", "accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def cp(self) -> int:
        return self.plan.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are averaged and ZeRO shards: dp × cp."""
        return self.dp * self.plan.cp

    @property
    def gpus(self) -> int:
        return self.plan.tp * self.plan.pp * self.plan.cp * self.dp

    @property
    def microbatches(self) -> int:
        """Microbatches each pipeline (each data-parallel replica) runs per optimizer step."""
        per_pipeline_step = self.plan.microbatches if self.plan.pp > 1 else 1
        return per_pipeline_step * self.accumulation

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size * self.microbatches

    def with_plan(self, **changes: object) -> Layout:
        """This layout with fields of its plan changed."""
        return replace(self, plan=replace(self.plan, **changes))  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: the sizes and the switches that differ from the defaults that matter."""
        p = self.plan
        parts = [
            f"tp{p.tp}",
            f"pp{p.pp}",
            f"dp{self.dp}",
            *([f"cp{p.cp}"] if p.cp > 1 else []),
            *([f"ep{p.ep}"] if p.ep > 1 else []),
            f"zero{p.zero_stage}",
            f"mbs{self.micro_batch_size}",
        ]
        if p.pp > 1:
            parts.append(f"m{p.microbatches}")
            parts.append(p.schedule if p.schedule != "interleaved" else f"interleaved×{p.virtual_stages}")
        if self.accumulation > 1:
            parts.append(f"acc{self.accumulation}")
        if p.tp > 1 and p.sequence_parallel:
            parts.append("sp")
        if p.activation_checkpointing != "none":
            parts.append(f"ac={p.activation_checkpointing}")
        return " ".join(parts)
