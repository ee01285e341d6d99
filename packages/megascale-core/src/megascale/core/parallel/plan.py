"""ParallelPlan: the whole parallel layout of a training run, every rule checked before any process group.

A plan says how many ranks split each layer (``tp``), how many stages a model is cut into (``pp``), what
ZeRO shards over the data-parallel replicas (``zero_stage``), and the switches of each (sequence parallelism,
communication overlap, pipeline schedule, activation checkpointing). It holds no process group and no model:
``dims(world_size)`` checks the sizes against a world, ``check_model(module)`` against a model (shapes only,
meta-device models too). ``megascale.core.parallel.parallelize`` applies it; ``MegaScaleStrategy`` builds one
from its arguments, so a bad argument fails where it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torch import nn

from megascale.core.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from megascale.core.config import GPTConfig

__all__ = ["ACTIVATION_CHECKPOINTING", "SCHEDULES", "ParallelPlan", "split_blocks"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p")
#: schedules splitting each backward into its input-gradient (B) and weight-gradient (W) halves
SPLIT_BACKWARD_SCHEDULES = ("zb1p",)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class ParallelPlan:
    """Sizes and switches of tensor × pipeline × context × ZeRO data parallelism (``dp`` = world / (tp·pp·cp)).

    Args:
        tp: tensor-parallel size (ranks splitting every layer; keep it within a node).
        pp: pipeline-parallel size (ranks each holding a run of layers).
        cp: context-parallel size (ranks each holding two chunks of every sequence, ``parallel/cp``); the
            data-parallel gradient reduction and ZeRO span dp × cp ranks.
        ep: expert-parallel size: a mixture of experts' experts split over ``ep`` of the data-parallel ranks,
            tokens moved to them by all-to-all (``parallel/ep``); must divide dp.
        ep_comm_chunks: with ep > 1, each MoE layer's rows go in this many parts, so that the all-to-all of
            one overlaps the experts' computation of another (1: no overlap).
        zero_stage: 0 replicate everything (DDP-like); 1 shard optimizer state; 2 also gradients;
            3 also parameters (refused with pp > 1: it would gather every stage's parameters again for each
            microbatch).
        zero1_sharding: how ZeRO-1 splits the optimizer state: "elements" (gradients reduce-scattered, each
            rank steps 1/dp of every bucket, new values all-gathered: DDP's bytes; elementwise optimizers such
            as AdamW, and LAMB) or "parameters" (each parameter stepped whole by one rank, gradients
            all-reduced and new values broadcast: 1.5x DDP's bytes; any optimizer). None (the default): the
            layout's choice, "parameters" with ep > 1 (which "elements" cannot run), else "elements".
        num_microbatches: microbatches per step with pp > 1 (None: pp).
        schedule: pipeline schedule, one of ``SCHEDULES``: "1f1b", "interleaved" (1F1B over several stages per
            rank), "gpipe", or "zb1p" (zero bubble, arXiv 2401.10241: each backward split into its
            input-gradient and weight-gradient halves, the latter filling the bubble; one or more stages per
            rank).
        virtual_stages: stages per pipeline rank (the interleaved and zb1p schedules).
        pipeline_split: layers per stage (pp · virtual_stages numbers); None: as even as possible.
        sequence_parallel: with tp > 1, run norms, dropout and residuals on sequence shards.
        overlap_tp_comm: split TP all-gathers/reduce-scatters into ``tp_comm_chunks`` chunks overlapped with
            the GEMMs.
        tp_comm_chunks: how many chunks.
        overlap_grad_reduce: reduce each bucket's gradients during backward (False: after it).
        overlap_param_gather: ZeRO-1: gather updated parameters during the next forward; ZeRO-2/3: prefetch
            the next unit's parameters while the current one computes.
        bucket_size_mb: size of the gradient-reduction buckets / ZeRO-2/3 units.
        activation_checkpointing: "none", "full" (recompute each block) or "selective" (the attention core
            of a megascale GPT).
        checkpoint_modules: what "full"/"selective" recompute instead of the defaults: class names or
            module-name patterns (``fnmatch``, e.g. ``"model.layers.*"``).
        compile: compile each block the model lists in ``pipeline_layers()`` with ``torch.compile``, in place
            (``megascale.core.parallel.compile``).
    """

    tp: int = 1
    pp: int = 1
    zero_stage: int = 1
    cp: int = 1
    ep: int = 1
    ep_comm_chunks: int = 2
    zero1_sharding: Literal["elements", "parameters"] | None = None
    num_microbatches: int | None = None
    schedule: Literal["1f1b", "interleaved", "gpipe", "zb1p"] = "1f1b"
    virtual_stages: int = 1
    pipeline_split: tuple[int, ...] | None = None
    sequence_parallel: bool = True
    overlap_tp_comm: bool = True
    tp_comm_chunks: int = 4
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    bucket_size_mb: float = 25.0
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    checkpoint_modules: tuple[str, ...] = field(default_factory=tuple)
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "tp_comm_chunks", "ep_comm_chunks", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage={self.zero_stage!r}: ZeRO stages are 0 (replicate), 1 (shard optimizer state), "
                "2 (+ gradients) and 3 (+ parameters)"
            )
        if self.zero1_sharding is None:  # the layout's choice (see the docstring)
            object.__setattr__(self, "zero1_sharding", "parameters" if self.ep > 1 else "elements")
        if self.zero1_sharding not in ("elements", "parameters"):
            raise ValueError(
                f"zero1_sharding={self.zero1_sharding!r} must be 'elements' (reduce-scatter + all-gather) or "
                "'parameters' (whole parameters by owner)"
            )
        if self.zero_stage == 3 and self.pp > 1:
            raise ValueError(
                f"zero_stage=3 with pp={self.pp}: ZeRO-3 would gather every stage's parameters again for each "
                "microbatch; use zero_stage=2 (gradients and optimizer state sharded) with pipelines"
            )
        if self.pipeline_split is not None:
            object.__setattr__(self, "pipeline_split", tuple(self.pipeline_split))
        object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules or ()))
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} must be 'none', 'full' or "
                "'selective'"
            )
        if self.checkpoint_modules and self.activation_checkpointing == "none":
            raise ValueError(
                f"checkpoint_modules={list(self.checkpoint_modules)} with activation_checkpointing='none': "
                "nothing would be recomputed; set activation_checkpointing='full' (or drop checkpoint_modules)"
            )
        if self.bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb} must be >= 0")
        if self.pp > 1 or self.virtual_stages > 1:
            # what can be checked without the model; layer counts are checked in check_model
            n = max(self.pp * self.virtual_stages, sum(self.pipeline_split or ()))
            self.check_pipeline(n)

    @property
    def microbatches(self) -> int:
        """Microbatches per step of a pipeline (``num_microbatches``, default pp)."""
        return self.pp if self.num_microbatches is None else self.num_microbatches

    # ---- against a world ----------------------------------------------------------------------------------

    def dims(self, world_size: int) -> ParallelDims:
        """dp × pp × cp × tp for ``world_size`` ranks; ValueError naming what fits otherwise."""
        dims = ParallelDims.infer(world_size, tp=self.tp, pp=self.pp, cp=self.cp)
        if dims.dp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide the data-parallel size dp={dims.dp} (world {world_size} / "
                f"(tp·pp·cp) = {self.tp}·{self.pp}·{self.cp}): the expert-parallel ranks are data-parallel ranks; "
                f"choose ep among {[n for n in range(1, dims.dp + 1) if dims.dp % n == 0]}"
            )
        return dims

    # ---- against a model ----------------------------------------------------------------------------------

    def check_pipeline(self, n_layers: int) -> None:
        """Raise ValueError, with what to change, for a pipeline of ``n_layers`` cuttable layers (blocks)
        that cannot run under this plan."""
        m, pp, v = self.microbatches, self.pp, self.virtual_stages
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} must be one of {SCHEDULES}")
        if v > 1 and self.schedule not in ("interleaved", "zb1p"):
            raise ValueError(
                f"virtual_stages={v} needs schedule='interleaved' or 'zb1p' (got {self.schedule!r}): only "
                "those run several stages per rank"
            )
        if self.schedule == "interleaved" and v < 2:
            raise ValueError("schedule='interleaved' needs virtual_stages >= 2 (stages per rank)")
        if m < 1:
            raise ValueError(f"num_microbatches={m} must be >= 1")
        if pp > 1 and self.schedule in ("1f1b", "interleaved", "zb1p") and m < pp:
            raise ValueError(
                f"the {self.schedule} schedule needs at least as many microbatches as pipeline ranks: "
                f"num_microbatches={m} < pp={pp}"
            )
        if self.schedule == "interleaved" and m % pp:
            raise ValueError(
                f"the interleaved schedule runs microbatches in rounds of pp: num_microbatches={m} is not a "
                f"multiple of pp={pp}; use {pp * max(1, round(m / pp))}"
            )
        if self.schedule == "zb1p" and m % max(1, m // pp):
            raise ValueError(
                f"the zb1p schedule runs microbatches in num_microbatches // pp = {m // pp} rounds of equal "
                f"size: num_microbatches={m} is not a multiple of {m // pp}; use a multiple of pp={pp}"
            )
        if self.schedule in SPLIT_BACKWARD_SCHEDULES:
            self._check_split_backward()
        split_blocks(n_layers, pp * v, self.pipeline_split)

    def _check_split_backward(self) -> None:
        """What the weight-gradient split does not carry yet, refused by name."""
        refused = [
            (self.ep > 1, f"ep={self.ep}"),
            (self.cp > 1, f"cp={self.cp}"),
            (self.compile, "compile=True (torch's split backward does not take compiled graphs)"),
            (
                self.activation_checkpointing != "none",
                f"activation_checkpointing={self.activation_checkpointing!r} (torch's checkpoint enters its "
                "recomputation context once, and the split backward recomputes in both halves)",
            ),
        ]
        for hit, what in refused:
            if hit:
                raise ValueError(
                    f"schedule={self.schedule!r} with {what}: the split backward (input gradients, then weight "
                    "gradients) is not carried by this layout yet; use schedule='1f1b' or 'interleaved'"
                )

    def check_model(self, module: nn.Module, *, sum_tied_gradients: bool = False) -> None:
        """Check this plan against ``module``'s megascale GPTs (shapes only: no collective, no allocation).

        The rules of other modules (tensor-parallel plans, pipeline layers) are checked by ``parallelize``
        as it finds them, before any collective.
        """
        from megascale.core.model.gpt import GPT

        for gpt in (m for m in module.modules() if isinstance(m, GPT)):
            self.check_gpt_config(gpt.config, sum_tied_gradients=sum_tied_gradients)

    def check_gpt_config(self, config: GPTConfig, *, sum_tied_gradients: bool = False) -> None:
        """Check this plan against a GPT's configuration (before the GPT exists). ``sum_tied_gradients``: the
        training loop sums the gradients of tied embeddings across the first and last pipeline stage
        (``ParallelRuntime.sum_tied_gradients``), so they may be tied under pp."""
        config.check_tensor_parallel(self.tp)
        if config.moe is not None or self.ep > 1:
            from megascale.core.parallel.ep.apply import check_expert_parallel

            check_expert_parallel(config, self)
        if self.cp > 1:
            from megascale.core.parallel.cp.apply import check_context_parallel

            check_context_parallel(config, self.cp)
        if self.pp > 1:
            if config.moe is not None and self.schedule in SPLIT_BACKWARD_SCHEDULES:
                raise ValueError(
                    f"schedule={self.schedule!r} with a mixture of experts (GPTConfig.moe): the split backward "
                    "is not carried by the experts' balancing losses yet; use schedule='1f1b' or 'interleaved'"
                )
            if config.tie_embeddings and not sum_tied_gradients:
                raise ValueError(
                    "tie_embeddings=True with pp > 1: the embedding (first stage) and the output projection "
                    "(last stage) would live on different ranks; set tie_embeddings=False or pp=1"
                )
            self.check_pipeline(config.n_layers)


def split_blocks(n_layers: int, n_stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """Layer (block) indices of each stage: ``split`` (layers per stage) if given, else as even as possible,
    with the remainder going to the middle stages first (the first and last also carry the embedding and the
    head)."""
    if split is not None:
        if len(split) != n_stages or any(n < 0 for n in split) or sum(split) != n_layers:
            raise ValueError(
                f"pipeline_split={list(split)} must give {n_stages} non-negative block counts (one per stage) "
                f"summing to the model's {n_layers} blocks"
            )
        counts = list(split)
    else:
        if n_stages > n_layers:
            raise ValueError(
                f"{n_stages} pipeline stages but the model has only {n_layers} blocks: each stage needs at "
                "least one; lower pp (or virtual_stages), or give more layers"
            )
        base, extra = divmod(n_layers, n_stages)
        counts = [base] * n_stages
        middle_first = sorted(
            range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(2 * s - n_stages + 1))
        )
        for s in middle_first[:extra]:
            counts[s] += 1
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out
