"""Bytes a megascale GPT saves for backward, per microbatch and layer, on one rank of a layout.

The terms are Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, §4: activations per layer with tensor and sequence parallelism, with and without selective
recomputation), taken tensor by tensor from what megascale's code saves, so that they can be checked exactly
against ``torch.autograd.graph.saved_tensors_hooks`` (``tests/core/plan``). With N = b·s tokens of a
microbatch, Nr = N/tp under sequence parallelism (else N), D the width, F the MLP width, H/KV the query/key
heads of width hd, t = tp, C the matmul dtype's bytes and R the residual stream's:

    block input (saved by the first norm)        Nr·D·R   (an fp32 copy, Nr·D·4, with the torch norm)
    norm statistics / normalised rows (torch)    Nr·4 per statistic; RMSNorm also Nr·D·4
    each matmul input (one per input tensor)     Nr·D·C   (the shard under SP: re-gathered in backward)
    q, k, v after rotary; attention output       N·(H + 2·KV)·hd/t·C;  N·H·hd/t·C
    log-sum-exp (flash/SDPA)                     b·H/t·s·4
    unfused attention (Megatron-LM)              b·H/t·s²·C (probabilities; ×2 + mask with dropout), no lse
    unfused attention (torch reference)          3·N·H·hd/t·4 + b·H/t·s²·4 (probabilities; ×2 + mask with dropout)
    MLP: gate and up (SwiGLU), silu (torch)      2·N·F/t·C (+ N·F/t·C); GeLU: its input N·F/t·C
    MLP output (the down projection's input)     N·F/t·C
    dropout masks                                Nr·D per site (1 byte, or C bytes on CPU)

For GPT-3's block (sequential, GeLU, LayerNorm, fused kernels, 16-bit stream, dropout, Megatron-LM's unfused
attention) the terms add up to Korthikanti's 34·s·b·h + 5·a·s²·b per layer (their equation 1) plus the norms'
statistics, and with tp and SP everything divides by t (their equation 4): ``tests/core/plan`` checks it.
Flash attention replaces the 5·a·s²·b (softmax, its dropout mask and output) by the log-sum-exp. Under
autocast without tensor parallelism, each projection casts the normed input again (autocast caches only
parameters' casts), and the bf16 copies of the weights are saved once per step (``weight_copies``).

Checkpointing: "full" keeps only each block's input (Nr·D·R, equation 5's 2·s·b·h per layer) and recomputes
the rest one block at a time in backward; "selective" recomputes the attention core (q/k norms, rotary,
softmax), keeping its inputs q, k, v instead, which drops the quadratic terms (their §4.2). Embedding: the token
ids (int64; with tp also a mask); head: the final norm, its matmul input and the loss's saved tensors (fp32
log-softmax, the fused kernel's logits and log-sum-exp, or under tp the vocabulary-parallel loss's fp32
softmax of its columns).

Context parallelism (cp > 1, ``parallel/cp``): N is the rank's tokens, b·s/cp, and s in the log-sum-exp its
s/cp queries per sequence. The attention core then saves q after rotary (N·H·hd/t·C), the keys/values it
attends, gathered into one tensor (b·K·2·KV·hd/t·C, K the keys it holds: s for a full layer, s/cp plus the
sliding window's halo for a windowed one; the rank's own rotated k and v are not kept), the output, the
log-sum-exp and the rotary tables at its positions (s/cp·hd·4 per layer); no mask (``cp/block_attention.py``
computes block by block).

Mixture of experts (``GPTConfig.moe``, ``model/moe.py``) in the MLP's place, E experts of width F_e, top-k,
E_r = E/ep of them on this rank. The router and the routed experts are whole on every tp and cp rank, and
route whole sequences: N_m = b·s tokens (under sequence parallelism and under cp the layer all-gathers the
sequences' shards and chunks first, and keeps its own part of the output; without SP every tp rank holds
them all). R_k = N_m·k the routed rows a rank computes: its own under ep = 1, and under ep > 1 on average
the same number from its peers (uniform routing: every expert receives N_m·k/E rows of each rank; a skewed
router gives the busiest rank more):

    norm output (matmul input)                   as above, read by the shared experts and, unless gathered,
                                                 the router (autocast casts it once per reader; under tp the
                                                 router's autocast copy beside the tp matmuls' one)
    gathered input (SP or cp: the router's)      N_m·D·C
    router: fp32 scores (softmax or sigmoid)     N_m·E·4;  with z-loss the fp32 logits and their lse, + N_m·4
    chosen experts (int64); routing weights      N_m·k·8;  N_m·k·C (+ N_m·k·4 + N_m·4 normalised to sum to 1)
    balancing loss (sequence-wise)               b·E·4 (sigmoid scores: + N_m·4, their sum)
    rows sorted by expert (the experts' input)   R_k·D·C, once per projection reading them under autocast
    sort and un-sort indices (int64)             2·R_k·8;  under ep the rows' parts (ep_comm_chunks of them)
                                                 and the received rows' regrouping: 3·R_k·8 more (and the
                                                 parts' reassembly, R_k·8, with more than one part)
    expert hidden states: as the MLP's           R_k·F_e·C each (gate, up, silu with the torch kernel, output)
    experts' outputs un-sorted (the combination) R_k·D·C
    expert weights cast by autocast              (2 or 3)·E_r·D·F_e·C per microbatch (and per part under ep:
                                                 the experts run once per part): the stacks are sliced
                                                 (or transposed) before the matmul, so autocast's cache of
                                                 parameter casts misses them; none in fp32 or under ZeRO-2/3
    shared experts                               an MLP of width shared·F_e on N tokens, split over tp

Under "full" checkpointing the MoE is recomputed with its block; "selective" recomputes attention only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megascale.core.config import GPTConfig
from megascale.core.parallel.cp.kv_exchange import choose
from megascale.core.plan.layout import Layout, Workload
from megascale.core.plan.shapes import Stage, block_parameters, expert_parameters

__all__ = ["ActivationModel"]

Terms = dict[str, float]


@dataclass(frozen=True)
class ActivationModel:
    """Saved bytes per microbatch of each layer of ``workload.model`` on one rank of ``layout``."""

    workload: Workload
    layout: Layout

    # ---- sizes -----------------------------------------------------------------------------------------

    @property
    def config(self) -> GPTConfig:
        return self.workload.model

    @property
    def tokens(self) -> int:
        """N: tokens of one microbatch on this rank (1/cp of each sequence under context parallelism)."""
        return self.layout.micro_batch_size * self.local_seq

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence this rank holds: s, or s/cp."""
        return self.workload.seq_len // self.layout.plan.cp

    def keys(self, layer: int) -> int:
        """Keys per sequence that a query of block ``layer`` may be given on this rank: the whole sequence
        (cp = 1, or a full layer under cp), or the rank's tokens and the window's halo (the most any cp rank
        receives)."""
        cp, s = self.layout.plan.cp, self.workload.seq_len
        window = self.config.window_for_layer(layer)
        halo = choose(self.local_seq, cp, window) if cp > 1 else None
        if halo is None:
            return s
        return self.local_seq + max(halo.received(r) for r in range(cp))

    @property
    def stream_tokens(self) -> float:
        """Nr: tokens of the residual stream on this rank (split over tp under sequence parallelism)."""
        p = self.layout.plan
        return self.tokens / p.tp if p.tp > 1 and p.sequence_parallel else float(self.tokens)

    @property
    def compute_bytes(self) -> int:
        """C: bytes per element of matmul operands."""
        return self.workload.compute_bytes

    @property
    def residual_bytes(self) -> int:
        """R: bytes per element of the residual stream."""
        return self.workload.residual_bytes(self.layout.plan.zero_stage if self.layout.replicas > 1 else 0)

    def _mask(self, elements: float, dtype_bytes: int) -> float:
        return elements * (1 if self.workload.kernels.dropout_mask == "bool" else dtype_bytes)

    # ---- pieces ----------------------------------------------------------------------------------------

    def _norm(self, rows: float, width: int, input_bytes: int, name: str) -> Terms:
        """A norm over ``rows`` × ``width`` whose input has ``input_bytes`` per element."""
        k = self.workload.kernels
        stats = 2 if self.config.norm == "layernorm" else 1  # mean and rstd, or rstd
        out = {f"{name}.input": rows * width * (4 if k.norm == "torch" else input_bytes)}
        out[f"{name}.stats"] = rows * 4 * stats
        if k.norm == "torch" and self.config.norm == "rmsnorm":
            out[f"{name}.normalised"] = rows * width * 4
        return out

    def _attention_core(self, prefix: str, layer: int = 0) -> Terms:
        """The attention core (q/k norms, rotary, softmax attention) on this rank's heads."""
        cfg, p, c = self.config, self.layout.plan, self.compute_bytes
        n, t, b, s = self.tokens, p.tp, self.layout.micro_batch_size, self.local_seq
        heads, kv, hd = cfg.n_heads / t, cfg.kv_heads / t, cfg.head_dim
        out: Terms = {}
        if cfg.qk_norm:
            out.update(self._norm(n * heads, hd, c, f"{prefix}.q_norm"))
            out.update(self._norm(n * kv, hd, c, f"{prefix}.k_norm"))
        if p.cp > 1:  # SDPA over the keys brought in (see the module docstring)
            out[f"{prefix}.q"] = n * heads * hd * c
            out[f"{prefix}.kv_held"] = b * self.keys(layer) * 2 * kv * hd * c
            out[f"{prefix}.out"] = n * heads * hd * c
            out[f"{prefix}.lse"] = b * heads * s * 4
            out[f"{prefix}.rope_tables"] = s * hd * 4
            return out
        if self.workload.kernels.attention == "flash":
            out[f"{prefix}.qkv"] = n * (heads + 2 * kv) * hd * c
            out[f"{prefix}.out"] = n * heads * hd * c  # also what the output projection saves: one storage
            out[f"{prefix}.lse"] = b * heads * s * 4
        elif self.workload.kernels.attention == "unfused":  # Megatron-LM: q, k; softmax out; v; the output
            out[f"{prefix}.qkv"] = n * (heads + 2 * kv) * hd * c
            probs = b * heads * s * s
            out[f"{prefix}.probs"] = probs * c
            if cfg.dropout > 0:
                out[f"{prefix}.probs_dropout"] = probs * c + self._mask(probs, c)
            out[f"{prefix}.out"] = n * heads * hd * c
        else:  # fp32 q, and k, v repeated to every query head; the probabilities; the output (a new tensor)
            out[f"{prefix}.qkv"] = 3 * n * heads * hd * 4
            probs = b * heads * s * s
            out[f"{prefix}.probs"] = probs * 4
            if cfg.dropout > 0:
                out[f"{prefix}.probs_dropout"] = probs * 4 + self._mask(probs, 4)
            out[f"{prefix}.out"] = n * heads * hd * c
        return out

    def _attention(self, prefix: str, layer: int = 0) -> Terms:
        """The attention core as saved under this layout's checkpointing."""
        if self.layout.plan.activation_checkpointing != "selective":
            return self._attention_core(prefix, layer)
        cfg, t = self.config, self.layout.plan.tp
        heads, kv = cfg.n_heads / t, cfg.kv_heads / t
        # the core's inputs q, k, v (before rotary) are kept to recompute from; its output is saved by the
        # output projection
        n, c, hd = self.tokens, self.compute_bytes, cfg.head_dim
        return {f"{prefix}.qkv_inputs": n * (heads + 2 * kv) * hd * c, f"{prefix}.out": n * heads * hd * c}

    def _matmul_input(self, name: str, readers: int, modules: int = 1, plain: int = 0) -> Terms:
        """A norm's output as the matmul inputs save it: cast to the compute dtype once per tensor-parallel
        module (``modules`` of them: one gather serves all its projections), but once per projection
        (``readers``) by autocast (it caches only the casts of parameters). ``plain``: readers that stay plain
        matmuls under tp (a MoE's router), each with its autocast copy. Without a cast (the residual's dtype)
        every reader saves the norm output itself: one storage."""
        copies = readers + plain if self.layout.plan.tp == 1 else modules + plain
        if self.compute_bytes == self.residual_bytes:
            copies = min(copies, 1)
        if copies == 0:
            return {}
        return {
            f"{name}.matmul_input": copies * self.stream_tokens * self.config.d_model * self.compute_bytes
        }

    def _mlp(
        self, prefix: str, rows: float | None = None, width: float | None = None, experts: bool = False
    ) -> Terms:
        """A dense MLP on this rank's tokens, ``width`` wide (default: the MLP's), split over tp; or the
        routed ``experts`` (whole, no biases) on ``rows``."""
        cfg, t, c = self.config, self.layout.plan.tp, self.compute_bytes
        n = self.tokens if rows is None else rows
        f = (cfg.ffn_dim if width is None else width) / (1 if experts else t)
        k = self.workload.kernels
        out: Terms = {}
        if cfg.activation == "swiglu":
            out[f"{prefix}.gate_up"] = 2 * n * f * c
            if k.activation == "torch":
                out[f"{prefix}.silu"] = n * f * c
        else:  # the GeLU's input; x + bias in fp32 when the reference adds an fp32 bias to bf16
            promoted = k.activation == "torch" and cfg.bias and c < 4 and not experts
            out[f"{prefix}.gelu_input"] = n * f * (4 if promoted else c)
        out[f"{prefix}.act_out"] = n * f * c
        return out

    @property
    def moe_tokens(self) -> int:
        """N_m: tokens a MoE layer routes per microbatch on this rank: whole sequences, b·s (every tp and cp
        rank routes them all alike)."""
        return self.layout.micro_batch_size * self.workload.seq_len

    @property
    def moe_gathers(self) -> bool:
        """The MoE layer all-gathers its input (sequence parallelism, context parallelism)."""
        p = self.layout.plan
        return p.cp > 1 or (p.tp > 1 and p.sequence_parallel)

    @property
    def routed_rows(self) -> float:
        """R_k: rows the experts of this rank compute per microbatch, N_m·top_k (uniform routing under ep)."""
        moe = self.config.moe
        return float(self.moe_tokens * moe.top_k) if moe is not None else 0.0

    def _expert_weights_cast(self) -> bool:
        """Autocast casts the expert stacks at every forward (mixed precision with fp32 parameters)."""
        plan = self.layout.plan
        return self.compute_bytes != 4 and not (plan.zero_stage >= 2 and self.layout.replicas > 1)

    def _moe_readers(self) -> tuple[int, int, int]:
        """Matmuls reading the norm output in the MoE: the shared experts' projections and their module (split
        over tp), and the router (a plain matmul under autocast), unless it reads the gathered input instead."""
        moe = self.config.moe
        assert moe is not None
        shared = (2 if self.config.activation == "swiglu" else 1) if moe.shared_experts else 0
        return shared, 1 if shared else 0, 0 if self.moe_gathers else 1

    def _moe(self, prefix: str) -> Terms:
        """A mixture-of-experts layer's saved bytes (module docstring), its input excluded."""
        cfg, c, n, b = self.config, self.compute_bytes, self.moe_tokens, self.layout.micro_batch_size
        moe = cfg.moe
        assert moe is not None
        e, k, rows, d = moe.num_experts, moe.top_k, self.routed_rows, cfg.d_model
        mlp_in = 2 if cfg.activation == "swiglu" else 1
        out: Terms = {}
        if self.moe_gathers:  # the router's input: the gathered sequences (autocast's cast of them)
            out[f"{prefix}.gathered_input"] = n * d * float(c)
        out[f"{prefix}.router_scores"] = n * e * 4.0
        if moe.z_loss_coef > 0:
            out[f"{prefix}.router_logits"] = n * e * 4.0 + n * 4.0
        if moe.aux_loss_coef > 0:
            out[f"{prefix}.balancing"] = b * e * 4.0 + (n * 4.0 if moe.score == "sigmoid" else 0.0)
        out[f"{prefix}.chosen"] = n * k * 8.0
        out[f"{prefix}.weights"] = n * k * c + ((n * k * 4.0 + n * 4.0) if moe.normalize_top_k else 0.0)
        copies = mlp_in if c != self.residual_bytes else 1
        out[f"{prefix}.rows"] = copies * rows * d * c
        plan = self.layout.plan
        dispatch = (3 + (1 if plan.ep_comm_chunks > 1 else 0)) if plan.ep > 1 else 0  # ``parallel/ep``
        out[f"{prefix}.indices"] = (2 + dispatch) * rows * 8.0
        out.update(self._mlp(f"{prefix}.experts", rows=rows, width=cfg.expert_dim, experts=True))
        out[f"{prefix}.outputs"] = rows * d * c
        if self._expert_weights_cast():
            parts = plan.ep_comm_chunks if plan.ep > 1 else 1  # the experts run once per part
            out[f"{prefix}.expert_weight_casts"] = parts * expert_parameters(cfg, plan.ep) * float(c)
        if moe.shared_experts:
            out.update(self._mlp(f"{prefix}.shared", width=moe.shared_experts * cfg.expert_dim))
        return out

    def _dropout(self, name: str) -> Terms:
        if self.config.dropout <= 0:
            return {}
        return {
            f"{name}.dropout_mask": self._mask(self.stream_tokens * self.config.d_model, self.residual_bytes)
        }

    # ---- layers ----------------------------------------------------------------------------------------

    def block_without_checkpointing(self, layer: int = 0) -> Terms:
        """One block's saved bytes per microbatch if nothing were recomputed (what the attention core saves
        under "selective" is replaced by its inputs there, but not here)."""
        return self._block(checkpoint_attention=False, layer=layer)

    def _block(self, checkpoint_attention: bool, layer: int = 0) -> Terms:
        cfg, r = self.config, self.residual_bytes
        nr, d = self.stream_tokens, cfg.d_model
        attention = (
            self._attention("attn", layer) if checkpoint_attention else self._attention_core("attn", layer)
        )
        out: Terms = {}
        # the MLP's projections (of one module with q, k, v in the parallel block), or the MoE's (its shared
        # experts' module, and the router unless it reads the gathered input)
        mlp_in, modules, plain = 2 if cfg.activation == "swiglu" else 1, 1, 0
        moe = cfg.moe is not None
        if moe:
            mlp_in, modules, plain = self._moe_readers()
        if cfg.parallel_block:
            out.update(self._norm(nr, d, r, "norm"))
            out.update(self._matmul_input("norm", 3 + mlp_in, 1 + modules * moe, plain))
            out.update(attention)
            out.update(self._moe("moe") if moe else self._mlp("mlp"))
            out.update(self._dropout("out"))
            return out
        out.update(self._norm(nr, d, r, "attn_norm"))
        out.update(self._matmul_input("attn_norm", 3))
        out.update(attention)
        out.update(self._dropout("attn"))
        out.update(self._norm(nr, d, r, "mlp_norm"))  # its input: the residual after attention
        out.update(self._matmul_input("mlp_norm", mlp_in, modules, plain))
        out.update(self._moe("moe") if moe else self._mlp("mlp"))
        out.update(self._dropout("mlp"))
        return out

    def block(self, layer: int = 0) -> Terms:
        """Block ``layer``'s saved bytes per microbatch under the layout's activation checkpointing (the
        block input under "full": the rest is recomputed in backward). Blocks differ only under context
        parallelism (a windowed layer holds fewer keys)."""
        if self.layout.plan.activation_checkpointing == "full":
            return {"block_input": self.stream_tokens * self.config.d_model * self.residual_bytes}
        return self._block(checkpoint_attention=True, layer=layer)

    def embedding(self) -> Terms:
        """The embedding's saved bytes per microbatch: token ids (int64), with tp a mask, and dropout."""
        n = self.tokens
        out: Terms = {"embed.ids": n * 8}
        if self.layout.plan.tp > 1:
            out["embed.outside_mask"] = n
        out.update(self._dropout("embed"))
        return out

    def head(self) -> Terms:
        """The final norm, the output projection's input and the loss's saved tensors, per microbatch."""
        cfg, c, r = self.config, self.compute_bytes, self.residual_bytes
        nr, n, t = self.stream_tokens, self.tokens, self.layout.plan.tp
        out = self._norm(nr, cfg.d_model, r, "head.norm")
        out.update(self._matmul_input("head", 1))
        if t > 1:  # vocabulary-parallel loss: fp32 softmax of this rank's columns, target index, two masks
            out["loss.softmax"] = n * cfg.padded_vocab_size / t * 4
            out["loss.index"] = n * (8 + 1 + 1)
        elif self.workload.kernels.cross_entropy == "torch":
            out["loss.log_softmax"] = n * cfg.vocab_size * 4
            out["loss.targets"] = n * 8
        else:
            out["loss.logits"] = n * cfg.padded_vocab_size * c
            out["loss.lse_targets"] = n * (4 + 8)
        return out

    def weight_copies(self, stages: list[Stage]) -> float:
        """Compute-dtype copies of the matmul weights that autocast makes (and autograd saves) once per step:
        none under tensor parallelism (its matmuls cast inside, keeping nothing; but a MoE's routers, plain
        matmuls on every tp rank), in fp32, or under ZeRO-2/3 (parameters are gathered in the compute dtype).
        Under "full" checkpointing the blocks' copies are not saved (``cached_weight_copies``): only the
        head's."""
        if self.layout.plan.activation_checkpointing == "full":
            return self._weight_copies(stages, blocks=False)
        return self._weight_copies(stages)

    def cached_weight_copies(self, stages: list[Stage]) -> float:
        """Under "full" checkpointing, the blocks' weight copies: autocast's cache holds them to the end of the
        forward (where every block input is saved), though nothing saves them; recomputation casts them again."""
        if self.layout.plan.activation_checkpointing != "full":
            return 0.0
        return self._weight_copies(stages) - self._weight_copies(stages, blocks=False)

    def _weight_copies(self, stages: list[Stage], blocks: bool = True) -> float:
        plan, c, cfg = self.layout.plan, self.compute_bytes, self.config
        if c == 4 or (plan.zero_stage >= 2 and self.layout.replicas > 1):
            return 0.0
        if plan.tp > 1:
            router = cfg.d_model * cfg.moe.num_experts if cfg.moe is not None and blocks else 0
            return float(sum(len(s.blocks) for s in stages) * router * c)
        norms = (
            (2 if cfg.norm == "layernorm" and cfg.bias else 1)
            * cfg.d_model
            * (1 if cfg.parallel_block else 2)
        )
        out_biases = 1 if cfg.parallel_block else 2
        if cfg.moe is not None:  # the attention output's, and the shared experts' MLP's
            out_biases = 1 + (1 if cfg.moe.shared_experts else 0)
        out_bias = cfg.d_model * out_biases if cfg.bias else 0
        qk = 2 * cfg.head_dim * (2 if cfg.norm == "layernorm" and cfg.bias else 1) if cfg.qk_norm else 0
        # the expert stacks are cast at every forward instead (``_moe``)
        block = block_parameters(cfg, 1) - norms - out_bias - qk - expert_parameters(cfg)
        n = 0
        for s in stages:
            n += len(s.blocks) * block if blocks else 0
            if s.last and not (cfg.tie_embeddings and s.first):
                n += cfg.padded_vocab_size * cfg.d_model
        return float(n * c)

    @cached_property
    def block_without_checkpointing_bytes(self) -> float:
        """``sum(block_without_checkpointing().values())``: what one block's recomputation saves again."""
        return sum(self.block_without_checkpointing().values())

    @cached_property
    def _sums(self) -> tuple[float, float, float]:
        return sum(self.block().values()), sum(self.embedding().values()), sum(self.head().values())

    def stage(self, stage: Stage) -> float:
        """Saved bytes of one microbatch through ``stage``."""
        block, embedding, head = self._sums
        if self.layout.plan.cp > 1:  # blocks differ by their keys
            blocks = sum(sum(self.block(layer).values()) for layer in stage.blocks)
        else:
            blocks = len(stage.blocks) * block
        return blocks + stage.first * embedding + stage.last * head

    def stage_terms(self, stage: Stage) -> Terms:
        """``stage``'s saved bytes per microbatch by term (block terms summed over its blocks)."""
        out: Terms = {}
        if stage.first:
            out.update(self.embedding())
        if self.layout.plan.cp == 1:
            for k, v in self.block().items():
                out[f"blocks.{k}"] = v * len(stage.blocks)
        for layer in stage.blocks if self.layout.plan.cp > 1 else ():
            for k, v in self.block(layer).items():
                out[f"blocks.{k}"] = out.get(f"blocks.{k}", 0.0) + v
        if stage.last:
            out.update(self.head())
        return out
