"""Step time of a layout on a cluster: compute, exposed communication, pipeline bubble, optimizer.

Per microbatch and block on one GPU (N = b·s tokens, t = tp; Narayanan et al. 2021 §3 for the structure):

- GEMMs: 2·N·(matmul parameters)/t FLOPs forward, twice that backward, at ``matmul_efficiency`` of peak
  (the one calibrated constant). Attention's two batched GEMMs: 4·b·s·k·H·hd/t, with k the keys a query
  attends (s for unfused attention, which computes the whole square; (s+1)/2 causal for flash).
- Elementwise kernels (norms, residual adds with dropout, the activation, rotary, and for unfused attention
  the softmax and its dropout over b·H/t·s² scores) by the bytes they read and write, at
  ``memory_efficiency`` of HBM bandwidth; backward moves twice the forward's bytes.
- Recomputation: "full" repeats each block's forward in backward, "selective" the attention core's.
- Tensor parallelism: per block, one all-reduce forward and one backward per column/row pair without sequence
  parallelism (two pairs in a sequential block, one in a parallel block), all-gather + reduce-scatter with it
  (plus the backward's re-gather of the saved input shard); ``overlap_tp_comm`` hides all but one chunk.
- Pipeline: a step takes (M + (P-1)/V)·t_mb, t_mb being the slowest pipeline rank's time per microbatch (the
  last stage also computes the logits): the bubble (P-1)/(V·M) of Narayanan et al. 2021 §2.2, taken on the
  mean rank. Activations between stages go tp-scattered over the network (their §4.1); megascale's decoupled
  schedules overlap them with compute, so only the fill and drain pay.
- Data parallelism / ZeRO (``comm.py``): an all-reduce of the gradients (ZeRO-1: reduce-scatter, then an
  all-gather of the new values that the next forward overlaps; ZeRO-2/3: reduce-scatter, and parameter
  all-gathers per step, or per microbatch forward and backward for ZeRO-3, prefetched). With
  ``overlap_grad_reduce`` the reduction runs under the last microbatch's backward, and only what exceeds it
  (at least one bucket) is exposed.
- Optimizer: 32 bytes of HBM traffic per fp32 parameter it steps (read parameter, gradient, two moments,
  write three, and the clipping norm's read).

Model FLOPs (what tokens/s, TFLOP/s per GPU and MFU are computed from) are ``GPT.flops_per_token``'s: the
training FLOPs of the model, without recomputation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megascale.core.config import GPTConfig
from megascale.core.model.gpt import flops_per_token
from megascale.core.plan.cluster import ClusterSpec
from megascale.core.plan.comm import Group, all_reduce_time, gather_time, p2p_time
from megascale.core.plan.layout import OPTIMIZER_STATES, Layout, Workload
from megascale.core.plan.schedule import bubble_fraction
from megascale.core.plan.shapes import Stage, stages_of_rank

__all__ = ["StepEstimate", "block_matmul_parameters", "predict_step"]


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
        parts = {"bubble": self.bubble, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
                 "dp_comm": self.dp_comm, "recompute": self.recompute, "optimizer": self.optimizer}  # fmt: skip
        worst = max(parts, key=lambda k: parts[k])
        return worst if parts[worst] >= 0.02 * self.step_time else "compute"

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out.update(tokens_per_s=self.tokens_per_s, tflops_per_gpu=self.tflops_per_gpu, mfu=self.mfu,
                   limiter=self.limiter)  # fmt: skip
        return out


def block_matmul_parameters(config: GPTConfig) -> int:
    """Weights of one block's projections (q, k, v, o, the MLP), as ``flops_per_token`` counts them."""
    d, f = config.d_model, config.ffn_dim
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    return d * (q + 2 * kv) + q * d + (3 if config.activation == "swiglu" else 2) * d * f


def _keys(config: GPTConfig, layer: int, seq_len: int, full_square: bool) -> float:
    """Keys per query the attention GEMMs compute for block ``layer``."""
    if full_square:
        return float(seq_len)
    w = config.window_for_layer(layer)
    return (seq_len + 1) / 2 if w is None or w >= seq_len else w - (w * (w - 1)) / (2 * seq_len)


@dataclass(frozen=True)
class _Costs:
    """Forward FLOPs and HBM bytes of one microbatch through a piece of the model on one GPU."""

    gemm: float = 0.0
    attention: float = 0.0  # the attention core's GEMM FLOPs (recomputed under "selective")
    bytes: float = 0.0
    attention_bytes: float = 0.0  # the attention core's elementwise bytes (softmax, rotary)

    def __add__(self, other: _Costs) -> _Costs:
        return _Costs(self.gemm + other.gemm, self.attention + other.attention, self.bytes + other.bytes,
                      self.attention_bytes + other.attention_bytes)  # fmt: skip


class _Model:
    """The per-microbatch costs of ``workload`` under ``layout`` on ``cluster``."""

    def __init__(self, workload: Workload, layout: Layout, cluster: ClusterSpec) -> None:
        self.w, self.l, self.c = workload, layout, cluster
        cfg, plan = workload.model, layout.plan
        self.cfg, self.plan = cfg, plan
        self.t = plan.tp
        self.b, self.s = layout.micro_batch_size, workload.seq_len
        self.n = self.b * self.s
        self.nr = self.n / self.t if self.t > 1 and plan.sequence_parallel else float(self.n)
        self.cb = workload.compute_bytes
        self.rb = workload.residual_bytes(plan.zero_stage if layout.dp > 1 else 0)
        g = cluster.gpu
        self.flop_rate = g.peak_flops * g.matmul_efficiency
        self.byte_rate = g.memory_bandwidth * g.memory_efficiency
        self._blocks: dict[int | None, _Costs] = {}

    # ---- FLOPs and bytes -------------------------------------------------------------------------------

    def block(self, layer: int) -> _Costs:
        cfg, k, t, n, nr, c, r = self.cfg, self.w.kernels, self.t, self.n, self.nr, self.cb, self.rb
        d, f = cfg.d_model, cfg.ffn_dim / t
        heads, kv, hd = cfg.n_heads / t, cfg.kv_heads / t, cfg.head_dim
        gemm = 2 * n * block_matmul_parameters(cfg) / t
        keys = _keys(cfg, layer, self.s, full_square=k.attention != "flash")
        attention = 4 * n * keys * heads * hd
        norms, adds = (1, 1) if cfg.parallel_block else (2, 2)
        fused = k.norm == "fused"
        norm = nr * d * (2 * r + (r + c if c != r else 0)) * (1 if fused else 3)
        mask = 1 if cfg.dropout > 0 else 0
        add = nr * d * (2 * r + c + mask)
        if cfg.activation == "swiglu":
            act = n * f * c * (3 if k.activation == "fused" else 5)
        else:
            act = n * f * c * (2 if k.activation == "fused" else 4)
        rope = 2 * n * (heads + kv) * hd * c * (1 if k.norm == "fused" else 4)
        scores = self.b * heads * self.s * self.s
        if k.attention == "unfused":  # fused scale-mask-softmax, then dropout
            softmax = scores * (2 * c + (2 * c + 1 if cfg.dropout > 0 else 0))
        elif k.attention == "torch":  # fp32 scores through masked_fill, softmax (and dropout)
            softmax = scores * 4 * (6 + (3 if cfg.dropout > 0 else 0))
        else:
            softmax = 0.0
        return _Costs(gemm, attention, norms * norm + adds * add + act, rope + softmax)

    def embedding(self) -> _Costs:
        return _Costs(bytes=self.nr * self.cfg.d_model * self.rb * 2)

    def head(self) -> _Costs:
        cfg, n, t, c = self.cfg, self.n, self.t, self.cb
        v = cfg.padded_vocab_size / t
        norm = self.nr * cfg.d_model * 2 * self.rb
        loss = n * v * (2 * c if self.w.kernels.cross_entropy == "fused" else 2 * c + 3 * 4)
        return _Costs(gemm=2 * n * cfg.d_model * v, bytes=norm + loss)

    # ---- times -----------------------------------------------------------------------------------------

    def _time(self, flops: float, nbytes: float) -> float:
        return flops / self.flop_rate + nbytes / self.byte_rate

    def tp_units_per_block(self) -> tuple[float, float]:
        """Tensor-parallel traffic per block, forward and backward, in all-gathers of one N·D activation."""
        pairs = 1 if self.cfg.parallel_block else 2
        if self.plan.sequence_parallel:
            return 2.0 * pairs, 3.0 * pairs  # AG + RS; RS + AG + the input's re-gather
        return 2.0 * pairs, 2.0 * pairs  # an all-reduce (two units) each way

    def stage_time(self, stage: Stage) -> tuple[float, float, float, float]:
        """(forward, backward, recomputation, exposed TP communication) seconds of one microbatch."""
        ac = self.plan.activation_checkpointing
        fwd = bwd = rec = 0.0
        tp_group = Group.of(self.t, 1, self.c.gpus_per_node)
        unit_time = gather_time(self.n * self.cfg.d_model * self.cb, tp_group, self.c)
        units_f, units_b = self.tp_units_per_block()
        tp_total = 0.0
        for layer in stage.blocks:
            window = self.cfg.window_for_layer(layer)  # blocks differ only by their attention window
            if window not in self._blocks:
                self._blocks[window] = self.block(layer)
            cost = self._blocks[window]
            tf = self._time(cost.gemm + cost.attention, cost.bytes + cost.attention_bytes)
            fwd += tf
            bwd += 2 * tf
            if ac == "full":
                rec += tf
                tp_total += units_f * unit_time
            elif ac == "selective":
                rec += self._time(cost.attention, cost.attention_bytes)
            tp_total += (units_f + units_b) * unit_time
        for piece, present in ((self.embedding(), stage.first), (self.head(), stage.last)):
            if present:
                tf = self._time(piece.gemm, piece.bytes)
                fwd += tf
                bwd += 2 * tf
                tp_total += 2 * unit_time
        exposed_tp = tp_total / self.plan.tp_comm_chunks if self.plan.overlap_tp_comm else tp_total
        return fwd, bwd, rec, exposed_tp

    def p2p_time(self) -> float:
        """Seconds of one activation (or gradient) crossing a stage boundary: each of the tp ranks sends its
        1/tp of it (Narayanan et al. 2021 §4.1's scatter/gather), over the network when a pipeline spans nodes."""
        across = self.plan.tp * self.plan.pp > self.c.gpus_per_node
        return p2p_time(self.n * self.cfg.d_model * self.rb / self.t, across, self.c)


def predict_step(workload: Workload, layout: Layout, cluster: ClusterSpec) -> StepEstimate:
    """Time of one optimizer step of ``layout`` training ``workload`` on ``cluster`` (module docstring)."""
    plan, cfg = layout.plan, workload.model
    plan.check_gpt_config(cfg)
    if layout.gpus > cluster.gpus:
        raise ValueError(f"the layout needs {layout.gpus} GPUs, the cluster has {cluster.gpus}")
    model = _Model(workload, layout, cluster)
    m, p, v = layout.microbatches, plan.pp, plan.virtual_stages if plan.pp > 1 else 1
    per_rank = []
    cache: dict[object, tuple[float, float, float, float, int]] = {}
    windows = cfg.sliding_window is not None
    for r in range(p):
        stages = stages_of_rank(cfg, p, plan.virtual_stages, r, plan.pipeline_split)
        # ranks holding alike stages (blocks, or their attention windows, and the ends) take alike time
        key = tuple((s.blocks if windows else len(s.blocks), s.first, s.last) for s in stages)
        if key not in cache:
            times = [model.stage_time(s) for s in stages]
            fwd, bwd, rec, tp = (sum(t[i] for t in times) for i in range(4))
            cache[key] = (fwd, bwd, rec, tp, sum(s.parameters(cfg, plan.tp) for s in stages))
        per_rank.append(cache[key])
    t_mb = [f + b + rc + tp for f, b, rc, tp, _ in per_rank]
    slowest = max(range(p), key=lambda r: t_mb[r])
    fwd, bwd, rec, tp, params = per_rank[slowest]
    bubble = bubble_fraction(plan.schedule, p, m, v) * m * sum(t_mb) / p  # the mean rank's idle time

    pp_comm = 0.0
    if p > 1:  # fill and drain: one activation and one gradient per boundary
        pp_comm = 2 * (p - 1) * model.p2p_time()
        if not workload.runtime.overlap_p2p:  # and every chunk waits for its input and its gradient
            pp_comm += m * v * 2 * model.p2p_time()

    dp_comm = _data_parallel(workload, layout, cluster, params, fwd, bwd)
    k = OPTIMIZER_STATES[workload.optimizer]
    stepped = params / layout.dp if (plan.zero_stage >= 1 and layout.dp > 1) else params
    hbm = cluster.gpu.memory_bandwidth * cluster.gpu.memory_efficiency
    optimizer = stepped * (4 * (3 + 2 * k) + 4) / hbm  # read p, g, states; write p, states; the clip's read
    compute = m * (fwd + bwd + rec)
    step = compute + m * tp + bubble + pp_comm + dp_comm + optimizer
    tokens = layout.global_batch * workload.seq_len
    return StepEstimate(
        step_time=step, compute=compute, recompute=m * rec, bubble=bubble, tp_comm=m * tp, pp_comm=pp_comm,
        dp_comm=dp_comm, optimizer=optimizer, tokens=tokens, model_flops=flops_per_token(cfg, workload.seq_len) * tokens,
        gpus=layout.gpus, peak_flops=cluster.gpu.peak_flops,
    )  # fmt: skip


def _data_parallel(
    workload: Workload, layout: Layout, cluster: ClusterSpec, params: float, fwd_mb: float, bwd_mb: float
) -> float:
    """Exposed seconds of the data-parallel (ZeRO) communication of one step on the slowest pipeline rank."""
    plan, dp = layout.plan, layout.dp
    if dp == 1:
        return 0.0
    group = Group.of(dp, plan.tp * plan.pp, cluster.gpus_per_node)
    grads = params * workload.runtime.reduce_bytes
    zero = plan.zero_stage
    if zero == 0 or (zero == 1 and plan.zero1_sharding == "parameters"):
        reduce = all_reduce_time(grads, group, cluster)
    else:
        reduce = gather_time(grads, group, cluster)
    bucket = min(1.0, plan.bucket_size_mb * 2**20 / max(grads, 1.0))
    if plan.overlap_grad_reduce:
        exposed = max(reduce - bwd_mb, reduce * bucket)
    else:
        exposed = reduce
    if zero == 1:  # new values: all-gathered (elements) or broadcast by owners (parameters)
        gather = gather_time(params * 4, group, cluster) * (2 if plan.zero1_sharding == "parameters" else 1)
        exposed += max(gather - fwd_mb, gather * bucket) if plan.overlap_param_gather else gather
    elif zero >= 2:
        gather = gather_time(params * workload.compute_bytes, group, cluster)
        times = 1 if zero == 2 else 2 * layout.microbatches
        per = max(gather - fwd_mb, gather * bucket) if plan.overlap_param_gather else gather
        exposed += times * per
    return exposed
