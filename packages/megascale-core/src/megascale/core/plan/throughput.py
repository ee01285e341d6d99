"""Step time of a layout on a cluster: compute, exposed communication, pipeline bubble, optimizer.

Per microbatch and block on one GPU (N = b·s tokens, t = tp; Narayanan et al. 2021 §3 for the structure),
each kind of kernel at its own rate from the GPU kind's kernel-rate table (``rates.py``, ``GPUSpec.kernel_rates``):

- GEMMs: 2·N·(matmul parameters)/t FLOPs forward, twice that backward, at ``matmul_efficiency`` of peak
  (the table's one fitted constant). Attention: 4·b·s·k·H·hd/t FLOPs forward, with k the keys a query attends
  (s for unfused attention, which computes the whole square; (s+1)/2 causal, or the window's, for flash):
  a fused kernel at its measured useful rates, forward and backward (2.5x the forward's FLOPs; a sliding
  window at the table's window rate); unfused, two batched GEMMs at the GEMM rate, backward twice.
- Memory-bound kernels (norms, residual adds with dropout and the casts around the norms, the activation,
  rotary, the loss, and for unfused attention the softmax and its dropout over b·H/t·s² scores) by the bytes
  they read and write, each kind at its fraction of HBM bandwidth, its backward at its multiple of the
  forward's time.
- Weight casts: under bf16 autocast over fp32 weights (below ZeRO-2), 6 bytes a parameter forward (fp32 read,
  bf16 written) and backward (the gradient's cast back), at the table's elementwise rate.
- Recomputation: "full" repeats each block's forward in backward, "selective" the attention core's.
- Tensor parallelism: per block, one all-reduce forward and one backward per column/row pair without sequence
  parallelism (two pairs in a sequential block, one in a parallel block), all-gather + reduce-scatter with it
  (plus the backward's re-gather of the saved input shard); ``overlap_tp_comm`` hides all but one chunk
  (on a cluster whose GPUs overlap communication at all: not CPU ranks, whose gloo threads share their cores).
  Every collective call also pays the cluster's latency (``comm.py``), counted as ``parallel.tp.overlap`` and
  ``tp_comm`` issue them: per column/row pair, with c chunks, SP runs c all-gathers + c reduce-scatters
  forward and 1 + 2c backward, no SP c all-reduces forward and one backward; the replicated norm weights (and
  row-parallel biases) under SP and q/k norms always all-reduce their gradients; the embedding one or two
  calls, the head its column-parallel projection's and the vocab-parallel loss's two all-reduces.
- Context parallelism (cp > 1): N is the rank's b·s/cp tokens, whose queries see as many keys on average as
  one process's (the chunks are balanced), so every FLOP and byte above divides by cp. Per block the keys and
  values are brought in before attention, not overlapped (``parallel/cp``): a full layer all-gathers
  b·s·2·KV·hd/t elements over the cp group forward and reduce-scatters their gradients backward; a windowed
  layer sends and receives the halo's tails point to point (at most 2·(w − 1) tokens, both ways). The
  gradients are reduced, and ZeRO shards, over dp × cp ranks.
- Mixture of experts (``GPTConfig.moe``): the GEMMs of the active parameters (router, top-k routed experts
  of width F_e on each token, shared experts), the experts' activation over the N_m·k routed rows and the
  dispatch's row copies (gather, un-sort, weighted combination). The router and the routed experts run whole
  sequences (N_m = b·s tokens) on every tp and cp rank alike: their FLOPs and bytes divide by neither; the
  shared experts split over tp like an MLP. Under sequence parallelism the layer all-gathers its input over tp
  forward and its output's gradient backward (one N·D unit each, not overlapped), under cp likewise over the
  cp ranks (b·s·D elements each: ``cp_comm``). Expert parallelism (ep > 1, ``parallel/ep``):
  per MoE layer and microbatch, forward an all-to-all of the routing counts and two of the routed rows (out to
  the experts' ranks and back), backward two of their gradients, each N_m·k·D elements of the compute dtype
  per rank of which (ep - 1)/ep leave it (every tp and cp rank of a replica sends the same rows in its own ep
  group); under uniform routing (every rank computes N_m·k rows on average; a skewed router makes the busiest
  rank wait longer). Not overlapped with compute yet: all exposed (``ep_comm``), and
  repeated by full recomputation. The ep ranks are consecutive data-parallel ranks (tp·pp·cp apart); the
  experts' gradients are all-reduced over the edp = dp/ep ranks holding the same experts, beside the dense
  ones' reduction over dp.
- Pipeline: a step takes (M + (P-1)/V)·t_mb, t_mb being the slowest pipeline rank's time per microbatch (the
  last stage also computes the logits): the bubble (P-1)/(V·M) of Narayanan et al. 2021 §2.2, taken on the
  mean rank. Activations between stages go tp-scattered over the network (their §4.1); megascale's decoupled
  schedules overlap them with compute, so only the fill and drain pay.
  Tied embeddings (``pp/tied.py``): after the data-parallel reduction the first and last stage all-reduce the
  embedding's fp32 gradient, V·D/t elements (ZeRO-2: their 1/dp shard; ZeRO-1 by elements first all-reduces
  its piece over dp to make it whole), not overlapped: counted in ``pp_comm``.
- Data parallelism / ZeRO (``comm.py``): an all-reduce of the gradients (ZeRO-1: reduce-scatter, then an
  all-gather of the new values that the next forward overlaps; ZeRO-2/3: reduce-scatter, and parameter
  all-gathers per step, or per microbatch forward and backward for ZeRO-3, prefetched). With
  ``overlap_grad_reduce`` the reduction runs under the last microbatch's backward, and only what exceeds it
  (at least one bucket) is exposed. One call per gradient bucket (ZeRO-0/1) or ZeRO unit (ZeRO-2/3; ZeRO-3
  gathers each unit forward and backward of every microbatch).
- Optimizer: 32 bytes of HBM traffic per fp32 parameter it steps (read parameter, gradient, two moments,
  write three, and the clipping norm's read), at the table's optimizer rate.
- The cap: a step is never predicted faster than the table's MFU cap allows (the best model-FLOP utilisation
  measured on the GPU kind, ``rates.py``): ``step_time`` is then the cap's, ``uncapped_step_time`` the sum of
  the parts above.

Model FLOPs (what tokens/s, TFLOP/s per GPU and MFU are computed from) are ``GPT.flops_per_token``'s: the
training FLOPs of the model, without recomputation (on the active parameters of a mixture of experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megascale.core.config import GPTConfig
from megascale.core.model.gpt import flops_per_token
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.plan.cluster import ClusterSpec
from megascale.core.plan.comm import (
    Group,
    all_reduce_time,
    all_to_all_time,
    call_latency,
    gather_time,
    p2p_time,
)
from megascale.core.plan.layout import OPTIMIZER_STATES, Layout, Workload
from megascale.core.plan.schedule import bubble_fraction
from megascale.core.plan.shapes import Stage, block_parameters, model_parameters, stages_of_rank

__all__ = ["StepEstimate", "TPCalls", "block_matmul_parameters", "predict_step", "tp_collective_calls"]


@dataclass(frozen=True)
class StepEstimate:
    """Predicted time of one optimizer step, in seconds, with its breakdown (exposed parts only)."""

    step_time: float
    compute: float  # GEMMs and elementwise kernels of the slowest pipeline rank, recomputation included
    recompute: float  # of which recomputation
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    tokens: int  # per step
    model_flops: float  # per step, over all GPUs (no recomputation)
    gpus: int
    peak_flops: float  # per GPU
    cp_comm: float = 0.0  # the key/value exchange of context parallelism
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (not overlapped)
    uncapped_step_time: float | None = None  # the sum of the parts, before the MFU cap (None: the same)
    mfu_cap: float | None = None  # the GPU kind's best measured MFU that bounds ``step_time`` (rates.py)

    @property
    def capped(self) -> bool:
        """Whether the parts summed to a step faster than the cap allows (``step_time`` is then the cap's)."""
        return self.uncapped_step_time is not None and self.uncapped_step_time < self.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time / self.gpus / self.peak_flops

    @property
    def limiter(self) -> str:
        """The largest cost beside the model's own compute (what to attack next), or "compute" when none
        reaches 2% of the step."""
        if self.capped:
            return "mfu_cap"
        parts = {"bubble": self.bubble, "tp_comm": self.tp_comm, "cp_comm": self.cp_comm, "ep_comm": self.ep_comm, "pp_comm": self.pp_comm,
                 "dp_comm": self.dp_comm, "recompute": self.recompute, "optimizer": self.optimizer}  # fmt: skip
        worst = max(parts, key=lambda k: parts[k])
        return worst if parts[worst] >= 0.02 * self.step_time else "compute"

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out.update(tokens_per_s=self.tokens_per_s, tflops_per_gpu=self.tflops_per_gpu, mfu=self.mfu, capped=self.capped,
                   limiter=self.limiter)  # fmt: skip
        return out


def block_matmul_parameters(config: GPTConfig) -> int:
    """Weights of one block's projections (q, k, v, o, the MLP), as ``flops_per_token`` counts them: with a
    mixture of experts the active ones (the router, top_k routed and the shared experts)."""
    d, f = config.d_model, config.ffn_dim
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    projections = 3 if config.activation == "swiglu" else 2
    if config.moe is None:
        return d * (q + 2 * kv) + q * d + projections * d * f
    experts = config.moe.top_k + config.moe.shared_experts
    return (
        d * (q + 2 * kv) + q * d + projections * d * config.expert_dim * experts + d * config.moe.num_experts
    )


def _keys(config: GPTConfig, layer: int, seq_len: int, full_square: bool) -> float:
    """Keys per query the attention GEMMs compute for block ``layer``."""
    if full_square:
        return float(seq_len)
    w = config.window_for_layer(layer)
    return (seq_len + 1) / 2 if w is None or w >= seq_len else w - (w * (w - 1)) / (2 * seq_len)


@dataclass(frozen=True)
class _Costs:
    """Forward FLOPs and HBM bytes of one microbatch through a piece of the model on one GPU; the bytes per
    kind of memory-bound kernel (a ``KernelRates`` field name: each runs at its own rate)."""

    gemm: float = 0.0
    attention: float = 0.0  # the attention core's FLOPs (recomputed under "selective")
    bytes: dict[str, float] = field(default_factory=dict)
    attention_bytes: dict[str, float] = field(default_factory=dict)  # the attention core's (softmax, rotary)
    window: bool = False  # the attention is over a sliding window shorter than the sequence


@dataclass(frozen=True)
class TPCalls:
    """Tensor-parallel collective calls one microbatch issues through a piece of the model, forward and
    backward: all-gathers and reduce-scatters (``gathers``), all-reduces (``reduces``)."""

    gathers_fwd: int
    reduces_fwd: int
    gathers_bwd: int
    reduces_bwd: int

    @property
    def total(self) -> int:
        return self.gathers_fwd + self.reduces_fwd + self.gathers_bwd + self.reduces_bwd


def _tp_pairs(config: GPTConfig) -> int:
    """Column/row-parallel pairs per block: the attention's and the MLP's (one in the parallel block); with a
    mixture of experts the attention's and the shared experts' (the router and routed experts are not split)."""
    if config.moe is not None:
        return 1 + (1 if config.moe.shared_experts else 0)
    return 1 if config.parallel_block else 2


def tp_collective_calls(config: GPTConfig, plan: ParallelPlan) -> dict[str, TPCalls]:
    """The calls of one block, the embedding and the head on a tp rank, as ``parallel.tp.overlap``,
    ``parallel.tp.apply`` and ``parallel.tp.cross_entropy`` issue them (no recomputation; module docstring).
    Empty without tensor parallelism."""
    if plan.tp <= 1:
        return {}
    c = plan.tp_comm_chunks if plan.overlap_tp_comm else 1
    pairs = _tp_pairs(config)  # column/row-parallel pairs per block
    norm_tensors = 2 if config.norm == "layernorm" and config.bias else 1
    # q/k norms see this rank's heads only: their gradients are summed with or without SP
    qk = 2 * norm_tensors if config.qk_norm else 0
    # a MoE under SP all-gathers its input forward and its output's gradient backward, one call each
    moe = 1 if config.moe is not None and plan.sequence_parallel else 0
    if plan.sequence_parallel:
        # replicated weights applied to sequence shards: each sums its gradient over tp
        norms = (1 if config.parallel_block else 2) * norm_tensors + (pairs if config.bias else 0)
        return {
            # column: c all-gathers; backward re-gathers the input once and reduce-scatters c pieces;
            # row: c reduce-scatters; backward all-gathers c pieces of the output gradient
            "block": TPCalls(2 * c * pairs + moe, 0, (1 + 2 * c) * pairs + moe, norms + qk),
            "embedding": TPCalls(1, 0, 1, 0),  # reduce-scatter the partial rows; all-gather their gradient
            "head": TPCalls(c, 2, 1 + c, norm_tensors),  # the projection, the loss's max and sums; final norm
        }
    return {
        # row: c all-reduces forward; column: one all-reduce of its replicated input's gradient
        "block": TPCalls(0, c * pairs, 0, pairs + qk),
        "embedding": TPCalls(0, 1, 0, 0),
        "head": TPCalls(0, 2, 0, 1),
    }


class _Model:
    """The per-microbatch costs of ``workload`` under ``layout`` on ``cluster``."""

    def __init__(self, workload: Workload, layout: Layout, cluster: ClusterSpec) -> None:
        self.w, self.l, self.c = workload, layout, cluster
        cfg, plan = workload.model, layout.plan
        self.cfg, self.plan = cfg, plan
        self.t = plan.tp
        self.b, self.s = layout.micro_batch_size, workload.seq_len
        self.n = self.b * self.s / plan.cp  # this rank's tokens
        self.nr = self.n / self.t if self.t > 1 and plan.sequence_parallel else float(self.n)
        self.cb = workload.compute_bytes
        self.rb = workload.residual_bytes(plan.zero_stage if layout.replicas > 1 else 0)
        g = cluster.gpu
        self.rates = g.kernel_rates
        self.flop_rate = g.peak_flops * self.rates.matmul_efficiency
        self._blocks: dict[int | None, _Costs] = {}

    # ---- FLOPs and bytes -------------------------------------------------------------------------------

    def block(self, layer: int) -> _Costs:
        cfg, k, t, n, nr, c, r = self.cfg, self.w.kernels, self.t, self.n, self.nr, self.cb, self.rb
        d, f = cfg.d_model, cfg.ffn_dim / t
        heads, kv, hd = cfg.n_heads / t, cfg.kv_heads / t, cfg.head_dim
        gemm = 2 * n * block_matmul_parameters(cfg) / t
        dispatch = 0.0
        if cfg.moe is not None:  # the router and top-k routed experts whole, on whole sequences
            moe, nm = cfg.moe, self.b * self.s
            projections = 3 if cfg.activation == "swiglu" else 2
            routed = projections * d * cfg.expert_dim * moe.top_k + d * moe.num_experts
            gemm += 2 * routed * (nm - n / t)
            rows = nm * moe.top_k
            # rows gathered (read, write), outputs un-sorted (read, write), combined (read); fp32 scores
            dispatch = 5 * rows * d * c + 3 * nm * moe.num_experts * 4
        keys = _keys(cfg, layer, self.s, full_square=k.attention != "flash")
        attention = 4 * n * keys * heads * hd
        norms, adds = (1, 1) if cfg.parallel_block else (2, 2)
        fused = k.norm == "fused"
        norm_kind = "rms_norm" if cfg.norm == "rmsnorm" else "layer_norm"
        # the kernel reads and writes the residual's dtype; a narrower compute dtype adds a cast (elementwise)
        norm = nr * d * 2 * r * (1 if fused else 3)
        cast = nr * d * (r + c) if c != r else 0.0
        mask = 1 if cfg.dropout > 0 else 0
        add = nr * d * (2 * r + c + mask)
        # the MLP's hidden elements; with a MoE the experts' over the routed rows and the shared experts'
        hidden = n * f
        if cfg.moe is not None:
            routed_rows, shared = self.b * self.s * cfg.moe.top_k, cfg.moe.shared_experts
            hidden = (routed_rows + n * shared / t) * cfg.expert_dim
        if cfg.activation == "swiglu":
            act = hidden * c * (3 if k.activation == "fused" else 5)
        else:
            act = hidden * c * (2 if k.activation == "fused" else 4)
        rope = 2 * n * (heads + kv) * hd * c * (1 if k.norm == "fused" else 4)
        scores = self.b * heads * self.s * self.s / self.plan.cp
        if k.attention == "unfused":  # fused scale-mask-softmax, then dropout
            softmax = scores * (2 * c + (2 * c + 1 if cfg.dropout > 0 else 0))
        elif k.attention == "torch":  # fp32 scores through masked_fill, softmax (and dropout)
            softmax = scores * 4 * (6 + (3 if cfg.dropout > 0 else 0))
        else:
            softmax = 0.0
        w = cfg.window_for_layer(layer)
        return _Costs(
            gemm, attention,
            {norm_kind: norms * norm, "elementwise": adds * add + norms * cast + dispatch,
             "swiglu" if cfg.activation == "swiglu" else "gelu": act},
            {"rope": rope, "elementwise": softmax}, window=w is not None and w < self.s,
        )  # fmt: skip

    def embedding(self) -> _Costs:
        return _Costs(bytes={"elementwise": self.nr * self.cfg.d_model * self.rb * 2})

    def head(self) -> _Costs:
        cfg, n, t, c = self.cfg, self.n, self.t, self.cb
        v = cfg.padded_vocab_size / t
        norm = self.nr * cfg.d_model * 2 * self.rb
        loss = n * v * (2 * c if self.w.kernels.cross_entropy == "fused" else 2 * c + 3 * 4)
        norm_kind = "rms_norm" if cfg.norm == "rmsnorm" else "layer_norm"
        return _Costs(gemm=2 * n * cfg.d_model * v, bytes={norm_kind: norm, "cross_entropy": loss})

    def weight_casts(self, parameters: float) -> tuple[float, float]:
        """Seconds of one microbatch's weight casts on a rank holding ``parameters``, (forward, backward):
        under bf16 autocast over fp32 weights (megascale's runtime below ZeRO-2) every forward reads each
        weight and writes a bf16 copy, every backward reads the bf16 gradient and writes the fp32 one
        (6 bytes a parameter each way); none with 16-bit weights (Megatron-LM 2021, ZeRO-2/3's gathers)."""
        if self.cb == 4 or self.rb != 4:
            return 0.0, 0.0
        t = 6 * parameters / (self.c.gpu.memory_bandwidth * self.rates.elementwise.fraction)
        return t, t

    # ---- times -----------------------------------------------------------------------------------------

    def _memory_time(self, nbytes: dict[str, float]) -> tuple[float, float]:
        """(forward, backward) seconds of memory-bound kernels, each kind at its own rate."""
        fwd = bwd = 0.0
        bandwidth = self.c.gpu.memory_bandwidth
        for kind, count in nbytes.items():
            rate = getattr(self.rates, kind)
            t = count / (bandwidth * rate.fraction)
            fwd, bwd = fwd + t, bwd + rate.backward * t
        return fwd, bwd

    def _attention_time(self, cost: _Costs) -> tuple[float, float]:
        """(forward, backward) seconds of the attention core's FLOPs: a fused kernel at its measured rates
        (its backward does 2.5x the forward's FLOPs), else batched GEMMs (backward twice the forward)."""
        rate = None
        if self.w.kernels.attention == "flash":
            rate = (self.rates.window_attention if cost.window else None) or self.rates.attention
        if rate is None:
            t = cost.attention / self.flop_rate
            return t, 2 * t
        peak = self.c.gpu.peak_flops
        return cost.attention / (peak * rate.forward), 2.5 * cost.attention / (peak * rate.backward)

    def times(self, cost: _Costs) -> tuple[float, float, float]:
        """(forward, backward, selective recomputation) seconds of one microbatch through ``cost``: GEMMs at
        the matmul rate (backward twice the forward), attention and memory-bound kernels at their own."""
        gemm = cost.gemm / self.flop_rate
        att_f, att_b = self._attention_time(cost)
        mem_f, mem_b = self._memory_time(cost.bytes)
        core_f, core_b = self._memory_time(cost.attention_bytes)
        return gemm + att_f + mem_f + core_f, 2 * gemm + att_b + mem_b + core_b, att_f + core_f

    def tp_units_per_block(self) -> tuple[float, float]:
        """Tensor-parallel traffic per block, forward and backward, in all-gathers of one N·D activation."""
        pairs = _tp_pairs(self.cfg)
        if self.plan.sequence_parallel:
            return 2.0 * pairs, 3.0 * pairs  # AG + RS; RS + AG + the input's re-gather
        return 2.0 * pairs, 2.0 * pairs  # an all-reduce (two units) each way

    def tp_latency(self) -> dict[str, tuple[float, float]]:
        """Seconds of call latency of one microbatch's tensor-parallel collectives, (forward, backward), per
        block, embedding and head (``tp_collective_calls``)."""
        group = Group.of(self.t, 1, self.c.gpus_per_node)
        g, ar = call_latency(group, self.c), call_latency(group, self.c, all_reduce=True)
        return {
            name: (c.gathers_fwd * g + c.reduces_fwd * ar, c.gathers_bwd * g + c.reduces_bwd * ar)
            for name, c in tp_collective_calls(self.cfg, self.plan).items()
        }

    def cp_time(self, layer: int) -> float:
        """Seconds of block ``layer``'s key/value exchange of one microbatch, forward and backward (0 at cp 1)."""
        cp = self.plan.cp
        if cp == 1:
            return 0.0
        from megascale.core.parallel.cp.kv_exchange import choose

        per_token = 2 * self.cfg.kv_heads / self.t * self.cfg.head_dim * self.cb
        local = self.s // cp
        halo = choose(local, cp, self.cfg.window_for_layer(layer))
        if halo is None:  # all-gather forward, reduce-scatter backward, over the cp ranks (next to tp)
            group = Group.of(cp, self.t, self.c.gpus_per_node)
            return 2 * gather_time(self.b * self.s * per_token, group, self.c)
        tokens = max(halo.received(r) for r in range(cp))
        across = self.t * cp > self.c.gpus_per_node
        return 2 * p2p_time(self.b * tokens * per_token, across, self.c)

    def ep_time(self) -> tuple[float, float]:
        """Seconds of one MoE block's all-to-alls of one microbatch, (forward, backward); 0 at ep 1. Forward:
        the routing counts (latency only), the routed rows out and their outputs back; backward: their
        gradients both ways."""
        ep, moe = self.plan.ep, self.cfg.moe
        if ep == 1 or moe is None:
            return 0.0, 0.0
        group = Group.of(ep, self.t * self.plan.pp * self.plan.cp, self.c.gpus_per_node)
        # whole sequences' rows: every tp and cp rank of a replica sends the same ones in its own ep group
        rows = all_to_all_time(self.b * self.s * moe.top_k * self.cfg.d_model * self.cb, group, self.c)
        return all_to_all_time(0.0, group, self.c) + 2 * rows, 2 * rows

    def moe_gather_time(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """Seconds of one MoE block's all-gathers of one microbatch, ((tp forward, backward), (cp forward,
        backward)): its input (the residual's dtype) forward and its output's gradient (the compute dtype)
        backward, over tp under sequence parallelism (N·D elements gathered), then over cp (b·s·D); the tp
        calls' latency is in ``tp_latency``."""
        if self.cfg.moe is None:
            return (0.0, 0.0), (0.0, 0.0)
        d, tp, cp = self.cfg.d_model, (0.0, 0.0), (0.0, 0.0)
        if self.t > 1 and self.plan.sequence_parallel:
            group = Group.of(self.t, 1, self.c.gpus_per_node)
            n = self.n * d
            tp = (
                gather_time(n * self.rb, group, self.c, calls=0),
                gather_time(n * self.cb, group, self.c, calls=0),
            )
        if self.plan.cp > 1:
            group = Group.of(self.plan.cp, self.t, self.c.gpus_per_node)
            n = self.b * self.s * d
            cp = gather_time(n * self.rb, group, self.c), gather_time(n * self.cb, group, self.c)
        return tp, cp

    def stage_time(self, stage: Stage) -> tuple[float, float, float, float, float, float]:
        """(forward, backward, recomputation, exposed TP communication, CP communication, EP communication)
        seconds of one microbatch."""
        ac = self.plan.activation_checkpointing
        fwd = bwd = rec = 0.0
        tp_group = Group.of(self.t, 1, self.c.gpus_per_node)
        # bytes of one N·D all-gather; the latency of every call is added from tp_latency
        unit_time = gather_time(self.n * self.cfg.d_model * self.cb, tp_group, self.c, calls=0)
        units_f, units_b = self.tp_units_per_block()
        calls = self.tp_latency()
        lat_f, lat_b = calls.get("block", (0.0, 0.0))
        tp_total = cp_total = 0.0
        ep_f, ep_b = self.ep_time()  # full recomputation repeats the forward's
        ep_total = len(stage.blocks) * (ep_f * (2 if ac == "full" else 1) + ep_b)
        # a MoE's gathers: repeated by full recomputation, not split into chunks to overlap
        (moe_tp_f, moe_tp_b), (moe_cp_f, moe_cp_b) = self.moe_gather_time()
        forwards = 2 if ac == "full" else 1
        moe_tp = len(stage.blocks) * (moe_tp_f * forwards + moe_tp_b)
        cp_total = len(stage.blocks) * (moe_cp_f * forwards + moe_cp_b)
        for layer in stage.blocks:
            cp_total += self.cp_time(layer) * (1.5 if ac == "full" or ac == "selective" else 1.0)
            window = self.cfg.window_for_layer(layer)  # blocks differ only by their attention window
            if window not in self._blocks:
                self._blocks[window] = self.block(layer)
            cost = self._blocks[window]
            tf, tb, core = self.times(cost)
            fwd += tf
            bwd += tb
            if ac == "full":
                rec += tf
                tp_total += units_f * unit_time + lat_f
            elif ac == "selective":
                rec += core
            tp_total += (units_f + units_b) * unit_time + lat_f + lat_b
        for name, piece, present in (
            ("embedding", self.embedding(), stage.first),
            ("head", self.head(), stage.last),
        ):
            if present:
                tf, tb, _ = self.times(piece)
                fwd += tf
                bwd += tb
                tp_total += 2 * unit_time + sum(calls.get(name, (0.0, 0.0)))
        hidden = self.plan.overlap_tp_comm and self.c.gpu.overlap
        exposed_tp = (tp_total / self.plan.tp_comm_chunks if hidden else tp_total) + moe_tp
        return fwd, bwd, rec, exposed_tp, cp_total, ep_total

    def p2p_time(self) -> float:
        """Seconds of one activation (or gradient) crossing a stage boundary: each of the tp ranks sends its
        1/tp of it (Narayanan et al. 2021 §4.1's scatter/gather), over the network when a pipeline spans nodes."""
        across = self.plan.tp * self.plan.pp > self.c.gpus_per_node
        return p2p_time(self.n * self.cfg.d_model * self.rb / self.t, across, self.c)


def predict_step(workload: Workload, layout: Layout, cluster: ClusterSpec) -> StepEstimate:
    """Time of one optimizer step of ``layout`` training ``workload`` on ``cluster`` (module docstring)."""
    plan, cfg = layout.plan, workload.model
    plan.check_gpt_config(cfg, sum_tied_gradients=True)
    if layout.gpus > cluster.gpus:
        raise ValueError(f"the layout needs {layout.gpus} GPUs, the cluster has {cluster.gpus}")
    model = _Model(workload, layout, cluster)
    m, p, v = layout.microbatches, plan.pp, plan.virtual_stages if plan.pp > 1 else 1
    per_rank = []
    cache: dict[object, tuple[float, float, float, float, float, float, int]] = {}
    windows = cfg.sliding_window is not None
    for r in range(p):
        stages = stages_of_rank(cfg, p, plan.virtual_stages, r, plan.pipeline_split)
        # ranks holding alike stages (blocks, or their attention windows, and the ends) take alike time
        key = tuple((s.blocks if windows else len(s.blocks), s.first, s.last) for s in stages)
        if key not in cache:
            times = [model.stage_time(s) for s in stages]
            fwd, bwd, rec, tp, cpc, epc = (sum(t[i] for t in times) for i in range(6))
            params = sum(s.parameters(cfg, plan.tp, plan.ep) for s in stages)
            cast_f, cast_b = model.weight_casts(params)
            rec += cast_f if plan.activation_checkpointing == "full" else 0.0
            cache[key] = (fwd + cast_f, bwd + cast_b, rec, tp, cpc, epc, params)
        per_rank.append(cache[key])
    t_mb = [f + b + rc + tp + cpc + epc for f, b, rc, tp, cpc, epc, _ in per_rank]
    slowest = max(range(p), key=lambda r: t_mb[r])
    fwd, bwd, rec, tp, cpc, epc, params = per_rank[slowest]
    bubble = bubble_fraction(plan.schedule, p, m, v) * m * sum(t_mb) / p  # the mean rank's idle time

    pp_comm = 0.0
    if p > 1:  # fill and drain: one activation and one gradient per boundary
        pp_comm = 2 * (p - 1) * model.p2p_time()
        if not (workload.runtime.overlap_p2p and cluster.gpu.overlap):  # every chunk waits for its transfers
            pp_comm += m * v * 2 * model.p2p_time()

    if p > 1 and cfg.tie_embeddings:
        pp_comm += _tied_embedding_time(workload, layout, cluster)

    slowest_stages = stages_of_rank(cfg, p, plan.virtual_stages, slowest, plan.pipeline_split)
    calls = _dp_calls(workload, layout, slowest_stages)
    experts = sum(s.expert_parameters(cfg, plan.ep) for s in slowest_stages) if plan.ep > 1 else 0
    dp_comm = _data_parallel(workload, layout, cluster, params - experts, fwd, bwd, calls)
    if experts:  # the experts' gradients, all-reduced over the edp ranks holding the same ones (ZeRO-0)
        edp = Group.of(
            layout.replicas // plan.ep, plan.tp * plan.pp * plan.cp * plan.ep, cluster.gpus_per_node
        )
        reduce = all_reduce_time(experts * workload.runtime.reduce_bytes, edp, cluster)
        bucket = min(1.0, plan.bucket_size_mb * 2**20 / max(experts * workload.runtime.reduce_bytes, 1.0))
        overlap = plan.overlap_grad_reduce and cluster.gpu.overlap
        dp_comm += max(reduce - bwd, reduce * bucket) if overlap else reduce
    k = OPTIMIZER_STATES[workload.optimizer]
    if plan.zero_stage >= 1 and layout.replicas > 1:  # dense over the replicas, experts over edp = dp / ep
        stepped = (params - experts) / layout.replicas + experts / max(layout.dp // plan.ep, 1)
    else:
        stepped = params
    hbm = cluster.gpu.memory_bandwidth * model.rates.optimizer.fraction
    optimizer = stepped * (4 * (3 + 2 * k) + 4) / hbm  # read p, g, states; write p, states; the clip's read
    compute = m * (fwd + bwd + rec)
    step = compute + m * tp + m * cpc + m * epc + bubble + pp_comm + dp_comm + optimizer
    tokens = layout.global_batch * workload.seq_len
    model_flops = flops_per_token(cfg, workload.seq_len) * tokens
    rates = model.rates
    cap = rates.cap(model_parameters(cfg, active=True)) if rates.mfu_cap_by_size else rates.mfu_cap
    # no layout faster than the best model-FLOP utilisation measured on this GPU kind (rates.py)
    floor = model_flops / layout.gpus / (cluster.gpu.peak_flops * cap) if cap else 0.0
    return StepEstimate(
        step_time=max(step, floor), compute=compute, recompute=m * rec, bubble=bubble, tp_comm=m * tp,
        pp_comm=pp_comm, dp_comm=dp_comm, optimizer=optimizer, tokens=tokens, model_flops=model_flops,
        gpus=layout.gpus, peak_flops=cluster.gpu.peak_flops, cp_comm=m * cpc, ep_comm=m * epc,
        uncapped_step_time=step, mfu_cap=cap,
    )  # fmt: skip


def _tied_embedding_time(workload: Workload, layout: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the tied embedding's gradient sum over the first and last pipeline stage (module docstring)."""
    cfg, plan, dp = workload.model, layout.plan, layout.replicas
    grads = 4.0 * cfg.padded_vocab_size * cfg.d_model / plan.tp
    # the first and last rank of a pipeline share a node where the whole pipeline (tp·cp·pp ranks) fits in one
    ends = Group(2, 1) if plan.tp * plan.cp * plan.pp <= cluster.gpus_per_node else Group(1, 2)
    seconds = 0.0
    if plan.zero_stage >= 2:
        grads /= dp
    elif plan.zero_stage == 1 and plan.zero1_sharding == "elements" and dp > 1:
        seconds += all_reduce_time(grads, Group.of(dp, plan.tp * plan.pp, cluster.gpus_per_node), cluster)
    return seconds + all_reduce_time(grads, ends, cluster)


def _dp_calls(workload: Workload, layout: Layout, stages: list[Stage]) -> int:
    """Data-parallel collective calls per reduction on a rank holding ``stages``: ZeRO-2/3 one per unit
    (consecutive blocks up to the bucket size, the embedding, the head: ``zero.fsdp.group_layers``); ZeRO-0/1
    one per gradient bucket, packed as ``zero.grad_reduce`` packs them: weight matrices in backward order up to
    the bucket size, a larger one alone. Norms and biases are left out: exact for megascale's bias-free block;
    where biases sit between matrices larger than a bucket they open buckets of their own, which this undercounts
    (up to 2x: a GPT-3 block of width 2048 at 10 MB buckets has 51, counted 26; tests/core/plan/test_comm_model.py)."""
    cfg, plan = workload.model, layout.plan
    capacity = plan.bucket_size_mb * 2**20
    if plan.zero_stage >= 2:
        block_bytes = 4 * block_parameters(cfg, plan.tp)
        per_unit = max(1, int(capacity // block_bytes)) if capacity > 0 else 1
        return sum(-(-len(s.blocks) // per_unit) + s.first + s.last for s in stages)
    d, t, el = cfg.d_model, plan.tp, workload.runtime.reduce_bytes
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    # elements per tp rank: split over tp, but a MoE's router and routed experts are whole on every tp rank
    block = [d * f / t, d * f / t] + ([d * f / t] if cfg.activation == "swiglu" else [])
    block += [q * d / t, d * kv / t, d * kv / t, d * q / t]
    if cfg.moe is not None:  # shared experts, routed experts (with ep > 1 in a reducer of their own), router
        mlp = (3 if cfg.activation == "swiglu" else 2) * d
        experts = [] if plan.ep > 1 else [cfg.moe.num_experts * cfg.expert_dim * d] * (mlp // d)
        shared = (
            [cfg.moe.shared_experts * cfg.expert_dim * d / t] * (mlp // d) if cfg.moe.shared_experts else []
        )
        block = shared + experts + [cfg.moe.num_experts * d] + block[-4:]
    vocab = cfg.padded_vocab_size * d / t
    tensors: list[float] = []
    for s in reversed(stages):
        if s.last and not (cfg.tie_embeddings and s.first):
            tensors.append(vocab)
        tensors += [n for _ in s.blocks for n in block]
        if s.first:
            tensors.append(vocab)
    buckets, filled = 0, capacity + 1.0
    for n in tensors:
        size = n * el
        if filled + size > capacity:
            buckets, filled = buckets + 1, 0.0
        filled += size
    return max(1, buckets)


def _data_parallel(
    workload: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    params: float,
    fwd_mb: float,
    bwd_mb: float,
    buckets: int = 1,
) -> float:
    """Exposed seconds of the data-parallel (ZeRO) communication of one step on the slowest pipeline rank,
    ``buckets`` calls per reduction or gather (the latency is paid per call)."""
    plan, dp = layout.plan, layout.replicas
    if dp == 1:
        return 0.0
    group = Group.of(dp, plan.tp * plan.pp, cluster.gpus_per_node)
    if plan.cp > 1:  # dp × cp: the cp ranks of a pipeline rank side by side (tp apart), replicas far apart
        per_node = max(1, min(plan.cp, cluster.gpus_per_node // plan.tp))
        group = Group(per_node, -(-dp // per_node))
    grads = params * workload.runtime.reduce_bytes
    zero = plan.zero_stage
    if zero == 0 or (zero == 1 and plan.zero1_sharding == "parameters"):
        reduce = all_reduce_time(grads, group, cluster, calls=buckets)
    else:
        reduce = gather_time(grads, group, cluster, calls=buckets)
    bucket = min(1.0, plan.bucket_size_mb * 2**20 / max(grads, 1.0))
    overlap = cluster.gpu.overlap  # CPU ranks: gloo moves the bytes on the cores that compute
    if plan.overlap_grad_reduce and overlap:
        exposed = max(reduce - bwd_mb, reduce * bucket)
    else:
        exposed = reduce
    if zero == 1:  # new values: all-gathered (elements) or broadcast by owners (parameters)
        gather = gather_time(params * 4, group, cluster, calls=buckets) * (
            2 if plan.zero1_sharding == "parameters" else 1
        )
        exposed += max(gather - fwd_mb, gather * bucket) if plan.overlap_param_gather and overlap else gather
    elif zero >= 2:
        gather = gather_time(params * workload.compute_bytes, group, cluster, calls=buckets)
        times = 1 if zero == 2 else 2 * layout.microbatches
        per = max(gather - fwd_mb, gather * bucket) if plan.overlap_param_gather and overlap else gather
        exposed += times * per
    return exposed
