"""Memory per rank of a layout: training state by ZeRO stage, saved activations by schedule, buffers.

Per pipeline rank (tensor- and data-parallel ranks of one pipeline rank hold the same amounts), with P this
rank's parameters (``shapes``: its stages, split over tp), dp the data-parallel size (times cp: context-parallel
ranks hold the same parameters and ZeRO shards over dp × cp) and k the optimizer's states per parameter:

    ZeRO stage          parameters      gradients      optimizer state    (fp32 each: megascale keeps fp32
    0                   4·P             4·P            4·k·P               master weights and gradients under
    1                   4·P             4·P            4·k·P/dp            bf16-mixed; ZeRO-1 gradients stay
    2, 3                4·P/dp          4·P/dp         4·k·P/dp            whole tensors, zero outside the
                                                                           rank's share: sharded_step.py)

(Rajbhandari et al. 2020, ZeRO, §5 with fp32 gradients.) A mixture of experts' routed experts count in P at E/ep
of them under expert parallelism (``parallel/ep``: split over ep, replicated over the edp = dp/ep ranks, which
average their gradients beside the dense parameters' and, at ZeRO ≥ 1, shard over those edp ranks: ZeRO-1 by
parameters, ZeRO-2/3 as FSDP2 units of their own); with ep = 1 they are parameters like the others, sharded by
every ZeRO stage over dp. ZeRO-2 keeps every gathered parameter from forward
to backward (P in the compute dtype), ZeRO-3 about two units at a time (the one computing and the prefetched).
Saved activations: ``ActivationModel`` per microbatch and stage, and ``schedule.peak_in_flight`` for the
microbatches a rank holds at once. Buffers: the gradient-reduction buckets (``grad_reduce.IN_FLIGHT`` in flight
and one being filled; reduce-scattered, each one's output piece too) or the units
reduce-scattered (ZeRO-1 "elements" all-gathers every bucket's new values in place: its parameters are views
of the buckets); the pipeline's stages receive activations (every stage but
the first) and gradients (every stage but the last) into buffers pooled over the microbatches in flight
(``schedule.receive_buffers``: torch's ``PipelineStage`` would keep one per microbatch), and cache each stage
output until that microbatch's backward. Workspace: what exists only while one layer runs
(the logits and their gradient, one block's recomputation under full checkpointing), and under full
checkpointing with autocast the blocks' weight copies its cache holds to the end of the forward.

The total adds the persistent state to the larger of two phases — forward/backward (activations, gathered
parameters, pipeline buffers, buckets, workspace) and the optimizer step (its temporaries) — and assumes gradients exist throughout (they do from the first backward of a step on, and across
microbatches of an accumulation): conservative by design. Not counted: the CUDA context, NCCL's own buffers and
the caching allocator's fragmentation; ``ClusterSpec.usable_memory`` leaves room for them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from megascale.core.parallel.zero.grad_reduce import IN_FLIGHT
from megascale.core.plan.activations import ActivationModel
from megascale.core.plan.layout import OPTIMIZER_STATES, Layout, Workload
from megascale.core.plan.schedule import microbatches_in_flight, peak_in_flight, receive_buffers
from megascale.core.plan.shapes import Stage, block_parameters, embedding_parameters, stages_of_rank

__all__ = ["MemoryEstimate", "RankMemory", "predict_memory"]

_MIB = 2**20


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on one rank of pipeline rank ``pp_rank``."""

    pp_rank: int
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float  # saved for backward, at the schedule's peak
    gathered_parameters: float  # ZeRO-2/3: unsharded copies in the compute dtype
    pipeline_buffers: float  # receive buffers, and stage outputs cached until their backward
    receive_buffers: float  # of which the receive buffers
    comm_buffers: float
    workspace: float
    step_temporaries: float
    activation_terms: dict[str, float] = field(default_factory=dict)  # per microbatch, summed over stages

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        running = (
            self.activations
            + self.gathered_parameters
            + self.pipeline_buffers
            + self.comm_buffers
            + self.workspace
        )
        return self.states + max(running, self.step_temporaries)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of pipeline ranks (every one, or one of each kind: see ``predict_memory``); ``peak``
    is the fullest (what must fit)."""

    ranks: tuple[RankMemory, ...]

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def total(self) -> float:
        return self.peak.total


def _stage_io(model: ActivationModel) -> float:
    """Bytes of one microbatch's activation (or gradient) crossing a stage boundary: the residual stream."""
    return model.stream_tokens * model.config.d_model * model.residual_bytes


def predict_memory(workload: Workload, layout: Layout, all_ranks: bool = False) -> MemoryEstimate:
    """Memory of the pipeline ranks of ``layout`` training ``workload`` (see the module docstring).

    ``all_ranks``: every pipeline rank, in order. Otherwise one of each kind: ranks holding alike stages
    (blocks per stage, embedding, head) differ only in the microbatches in flight, which every schedule gives
    the lower ranks more of, so the first rank of each kind holds the most.
    """
    layout.plan.check_gpt_config(workload.model, sum_tied_gradients=True)
    cfg, plan = workload.model, layout.plan
    acts = ActivationModel(workload, layout)
    chosen, seen = [], set()
    for r in range(layout.pp):
        stages = stages_of_rank(cfg, plan.pp, plan.virtual_stages, r, plan.pipeline_split)
        key = tuple((len(s.blocks), s.first, s.last) for s in stages)
        if all_ranks or key not in seen:
            seen.add(key)
            chosen.append(r)
    ranks = [rank_memory(workload, layout, r, terms=False, activations=acts) for r in chosen]
    peak = max(range(len(ranks)), key=lambda i: ranks[i].total)
    ranks[peak] = rank_memory(workload, layout, chosen[peak], terms=True, activations=acts)
    return MemoryEstimate(tuple(ranks))


def rank_memory(
    workload: Workload,
    layout: Layout,
    pp_rank: int,
    terms: bool = True,
    activations: ActivationModel | None = None,
) -> RankMemory:
    """Memory of one rank of pipeline rank ``pp_rank`` (``terms``: with the activations' breakdown)."""
    # ZeRO shards over the ranks holding the same parameters: dp × cp (``Layout.replicas``)
    cfg, plan, dp = workload.model, layout.plan, layout.replicas
    stages = stages_of_rank(cfg, plan.pp, plan.virtual_stages, pp_rank, plan.pipeline_split)
    p = sum(s.parameters(cfg, plan.tp, plan.ep) for s in stages)
    experts = sum(s.expert_parameters(cfg, plan.ep) for s in stages) if plan.ep > 1 else 0
    zero = plan.zero_stage if dp > 1 else 0
    c = workload.compute_bytes
    k = OPTIMIZER_STATES[workload.optimizer]
    # dense parameters shard over the replicas (dp × cp), the experts under ep over edp = dp / ep
    edp = max(layout.dp // plan.ep, 1)
    sharded = math.ceil((p - experts) / dp) + math.ceil(experts / edp)
    parameters = 4.0 * (sharded if zero >= 2 else p)
    gradients = 4.0 * (sharded if zero >= 2 else p)
    optimizer_state = 4.0 * k * (p if zero == 0 else sharded)

    acts = activations if activations is not None else ActivationModel(workload, layout)
    chunk_bytes = [acts.stage(s) for s in stages]
    schedule = plan.schedule if plan.pp > 1 else "1f1b"
    m = layout.microbatches if plan.pp > 1 else 1
    weight_copies = acts.weight_copies(stages)
    saved = peak_in_flight(schedule, plan.pp, pp_rank, m, chunk_bytes) + weight_copies
    breakdown: dict[str, float] = {"weights.compute_copies": weight_copies} if weight_copies else {}
    for s in stages if terms else ():
        for name, v in acts.stage_terms(s).items():
            breakdown[name] = breakdown.get(name, 0.0) + v

    gathered = 0.0
    if zero == 2:
        gathered = p * c
    elif zero == 3:
        gathered = 2 * _largest_unit(workload, layout, stages) * c
    bucket = plan.bucket_size_mb * _MIB
    if zero in (0, 1):
        # the reducer's flat buffers alive at once (IN_FLIGHT launched and the one being filled, fp32) and,
        # reduce-scattered (ZeRO-1 "elements", dp > 1), each one's output piece (1/dp of it)
        scattered = zero == 1 and plan.zero1_sharding == "elements" and dp > 1
        comm = min((IN_FLIGHT + 1) * bucket, 4.0 * (p - experts)) * (1.0 + (1.0 / dp if scattered else 0.0))
        if experts and dp > plan.ep:  # the experts' own reducer over edp (ZeRO-0)
            comm += min((IN_FLIGHT + 1) * bucket, 4.0 * experts)
    else:  # a unit's unsharded gradient before its reduce-scatter
        comm = 4.0 * _largest_unit(workload, layout, stages)
    step = 4.0 * (p if zero == 0 else sharded)  # the optimizer's elementwise temporaries (foreach)
    # (ZeRO-1 "elements" gathers the new values straight into the parameters: views of flat buckets)

    pipeline = receive = 0.0
    if plan.pp > 1:
        io = _stage_io(acts)
        in_flight = microbatches_in_flight(schedule, plan.pp, pp_rank, m, len(stages)) * len(stages)
        # receive buffers: one per transfer in flight (Megatron-LM), or megascale's pool of the microbatches
        # in flight, per chunk and direction
        if workload.runtime.pipeline_buffers == "per_transfer":
            receive = io * sum((not s.first) + (not s.last) for s in stages)
        else:
            held = receive_buffers(schedule, plan.pp, pp_rank, m, len(stages))
            receive = io * sum(f + b for f, b in held)
        pipeline = receive + io * in_flight * (not stages[-1].last)  # outputs cached until their backward

    workspace = _workspace(acts, stages) + acts.cached_weight_copies(stages)
    return RankMemory(
        pp_rank=pp_rank,
        parameters=parameters,
        gradients=gradients,
        optimizer_state=optimizer_state,
        activations=saved,
        gathered_parameters=gathered,
        pipeline_buffers=pipeline,
        receive_buffers=receive,
        comm_buffers=comm,
        workspace=workspace,
        step_temporaries=step,
        activation_terms=breakdown,
    )


def _largest_unit(workload: Workload, layout: Layout, stages: list[Stage]) -> float:
    """Parameters of the largest ZeRO-2/3 unit on this rank: consecutive blocks up to the bucket size, or the
    embedding, or the head (``zero.fsdp.group_layers``)."""
    cfg, tp = workload.model, layout.tp
    block = block_parameters(cfg, tp)
    per_unit = max(1, int(layout.plan.bucket_size_mb * _MIB // (4 * block)))
    blocks = max((len(s.blocks) for s in stages), default=0)
    largest = block * min(per_unit, max(blocks, 1))
    if any(s.first or s.last for s in stages):
        largest = max(largest, embedding_parameters(cfg, tp))
    return float(largest)


def _workspace(acts: ActivationModel, stages: list[Stage]) -> float:
    """Bytes alive only while one layer runs: the logits with their gradient (a last stage), or one block's
    recomputation and the gradients flowing through it."""
    cfg, plan, c = acts.config, acts.layout.plan, acts.workload.compute_bytes
    n = acts.tokens
    widest = n * max(cfg.ffn_dim / plan.tp, cfg.d_model)
    if cfg.moe is not None:  # the gathered sequences, the experts' hidden states over the routed rows, the
        # shared experts' (split over tp)
        shared = n * cfg.moe.shared_experts * cfg.expert_dim / plan.tp
        widest = max(acts.moe_tokens * cfg.d_model, acts.routed_rows * cfg.expert_dim, shared)
    block = 2 * widest * c  # an activation and its gradient
    if plan.activation_checkpointing == "full":
        block += acts.block_without_checkpointing_bytes
    if plan.tp > 1:
        block += n * cfg.d_model * c  # an all-gathered input
    head = 0.0
    if any(s.last for s in stages):
        head = n * cfg.padded_vocab_size / plan.tp * (c + 4 + c)  # logits, fp32 loss working copy, gradient
    return max(block, head)
