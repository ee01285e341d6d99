"""GPTConfig: the architecture of a GPT, and nothing about how it is parallelised.

Parallel sizes (tp, pp, dp) live in the strategy; ``check_tensor_parallel`` tells whether this architecture
can be split ``tp`` ways, so a wrong layout fails before any process group is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, get_args

__all__ = ["GPTConfig", "MoEConfig", "RopeScaling"]

NormKind = Literal["rmsnorm", "layernorm"]
ActivationKind = Literal["swiglu", "gelu"]
RopeScalingKind = Literal["llama3"]
RouterScore = Literal["softmax", "sigmoid"]
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8Recipe)


@dataclass(frozen=True)
class RopeScaling:
    """Rescaled rotary frequencies for contexts longer than the model was pretrained on.

    ``kind="llama3"`` (Llama 3.1/3.2, Hugging Face's ``rope_scaling`` of ``rope_type: "llama3"``): frequencies
    whose wavelength is shorter than ``original_max_seq_len / high_freq_factor`` are kept, those longer than
    ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, and those between are interpolated
    smoothly between the two.

    Args:
        factor: how much the low frequencies are slowed down (Llama 3.1: 8).
        low_freq_factor: bound of the slowed-down band, as a divisor of ``original_max_seq_len`` (Llama 3.1: 1).
        high_freq_factor: bound of the kept band, likewise (Llama 3.1: 4); must exceed ``low_freq_factor``.
        original_max_seq_len: context length of pretraining (Llama 3.1: 8192).
        kind: the scaling rule; "llama3" is the one implemented.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int
    kind: RopeScalingKind = "llama3"

    def __post_init__(self) -> None:
        problems = []
        if self.kind != "llama3":
            problems.append(f"kind={self.kind!r} is not a known rope scaling; known: ['llama3']")
        if not self.factor > 0:
            problems.append(f"factor={self.factor} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            problems.append(
                f"low_freq_factor={self.low_freq_factor} and high_freq_factor={self.high_freq_factor} must "
                "satisfy 0 < low_freq_factor < high_freq_factor"
            )
        if self.original_max_seq_len < 1:
            problems.append(f"original_max_seq_len={self.original_max_seq_len} must be >= 1")
        if problems:
            raise ValueError("invalid RopeScaling: " + "; ".join(problems))


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward in place of every block's MLP (Mixtral, Qwen3-MoE, DeepSeek-V3).

    Each token goes to the ``top_k`` experts its router scores highest and gets their outputs summed, weighted
    by those scores; no token is ever dropped (each expert takes however many tokens chose it). Shared experts,
    if any, see every token.

    Args:
        num_experts: routed experts per layer.
        top_k: experts each token goes to.
        expert_hidden: width of one expert's MLP; None = ``GPTConfig.ffn_dim``.
        shared_experts: experts every token goes to besides the routed ones (DeepSeek-V3: 1), computed as one
            MLP ``shared_experts·expert_hidden`` wide.
        score: "softmax" over all experts (Mixtral, Qwen3-MoE) or a "sigmoid" per expert (DeepSeek-V3).
        normalize_top_k: rescale the chosen experts' scores to sum to 1 (Mixtral: always; Qwen3-MoE:
            ``norm_topk_prob``; DeepSeek-V3: yes).
        aux_loss_coef: weight of the load-balancing loss α·Σᵢ fᵢ·Pᵢ (Switch Transformer), computed per
            sequence and averaged over sequences (DeepSeek-V3's sequence-wise form: the same whatever the
            micro-batching or data-parallel split); 0 turns it off.
        z_loss_coef: weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE);
            0 turns it off.
        bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3): each expert has a bias added to its score
            for choosing experts only, moved by this much after every optimizer step, up for experts that got
            fewer tokens than the mean in that step, down for those that got more; 0 turns it off.
    """

    num_experts: int
    top_k: int = 2
    expert_hidden: int | None = None
    shared_experts: int = 0
    score: RouterScore = "softmax"
    normalize_top_k: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.num_experts < 1:
            problems.append(f"num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= max(self.num_experts, 1):
            problems.append(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.expert_hidden is not None and self.expert_hidden < 1:
            problems.append(f"expert_hidden={self.expert_hidden} must be >= 1 (or None for ffn_dim)")
        if self.shared_experts < 0:
            problems.append(f"shared_experts={self.shared_experts} must be >= 0")
        if self.score not in ("softmax", "sigmoid"):
            problems.append(f"score={self.score!r} must be 'softmax' or 'sigmoid'")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if problems:
            raise ValueError("invalid MoEConfig: " + "; ".join(problems))


@dataclass
class GPTConfig:
    """Architecture of a decoder-only transformer.

    Args:
        vocab_size: tokens in the vocabulary. The embedding is padded up to ``pad_vocab_to_multiple_of`` so
            tensor parallelism can shard it; padded rows are never looked up and padded logits never enter
            the loss or sampling.
        d_model: width of the residual stream.
        n_layers: transformer blocks.
        n_heads: query heads; ``d_model`` must be divisible by it unless ``head_size`` is given.
        n_kv_heads: key/value heads (grouped-query attention); None = ``n_heads`` (multi-head), 1 = multi-query.
        head_size: width of one attention head; None = d_model / n_heads. Given, the attention is
            n_heads·head_size wide whatever d_model is (Qwen3: 16 heads of 128 on a 1024-wide stream).
        ffn_hidden: width of the MLP; None = 4·d_model for GeLU, or ⅔·4·d_model rounded up to
            ``ffn_multiple_of`` for SwiGLU (same parameter count, as in LLaMA).
        ffn_multiple_of: rounding of the default SwiGLU width.
        max_seq_len: longest sequence (sizes the rotary tables).
        norm: "rmsnorm" or "layernorm".
        activation: "swiglu" or "gelu" (tanh approximation).
        parallel_block: True = attention and MLP read one shared norm of the input and their outputs are
            summed (GPT-J, PaLM, MegaScale); False = the sequential pre-norm block (GPT-2, LLaMA).
        sliding_window: None = full causal attention; w = each token attends to itself and the w-1 before it.
        full_attention_every: with a sliding window, every n-th layer (layers n-1, 2n-1, ...) attends fully,
            Gemma-style local/global interleaving; None = every layer uses the window.
        rope_theta: base of the rotary position embedding frequencies.
        rope_scaling: rescaled rotary frequencies for long contexts (``RopeScaling``; a dict of its fields is
            accepted too, as a saved config holds it); None = plain RoPE.
        tie_embeddings: share the input embedding with the output projection.
        dropout: on embeddings and on each sub-block's output before the residual add.
        init_std: standard deviation of weight init; output projections are scaled by 1/sqrt(2·n_layers).
        norm_eps: epsilon of the norms.
        bias: biases in every linear layer (and in LayerNorm).
        qkv_bias: biases in the query, key and value projections only (Qwen2); implied by ``bias``.
        qk_norm: normalise each query and key head over its ``head_dim`` features (a norm of kind ``norm``
            with one weight of ``head_dim`` shared by all heads) before the rotary embedding (Qwen3).
        pad_vocab_to_multiple_of: embedding rows are padded to a multiple of this (128 covers tp up to 128).
        moe: a mixture of experts in place of every block's MLP (``MoEConfig``; a dict of its fields is accepted
            too, as a saved config holds it); None = dense MLPs.
        kernels: force kernel backends, e.g. {"attention": "sdpa", "rms_norm": "triton"}; empty = fastest
            available (see ``megascale.core.kernels``).
        fp8: FP8 training of the blocks' projections with torchao's float8 recipe of this name
            ("tensorwise", "rowwise" or "rowwise_with_gw_hp"; ``megascale.core.fp8``), applied by
            ``parallelize``; None = the projections run in the training precision. Needs torchao
            (``megascale-core[fp8]``) and a CUDA GPU of compute capability >= 8.9, or the CPU (for tests).
    """

    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None
    head_size: int | None = None
    ffn_hidden: int | None = None
    ffn_multiple_of: int = 256
    max_seq_len: int = 1024
    norm: NormKind = "rmsnorm"
    activation: ActivationKind = "swiglu"
    parallel_block: bool = True
    sliding_window: int | None = None
    full_attention_every: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    norm_eps: float = 1e-5
    bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    pad_vocab_to_multiple_of: int = 128
    moe: MoEConfig | None = None
    kernels: dict[str, str] = field(default_factory=dict)
    fp8: Float8Recipe | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "max_seq_len",
            "ffn_multiple_of",
            "pad_vocab_to_multiple_of",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))
        if isinstance(self.rope_scaling, Mapping):  # a saved config (to_dict) holds it as a dict
            self.rope_scaling = _rope_scaling_from_dict(self.rope_scaling)
        if isinstance(self.moe, Mapping):
            self.moe = _from_dict(MoEConfig, "moe", self.moe)
        if self.head_size is not None:
            if self.head_size < 2 or self.head_size % 2:
                problems.append(f"head_size={self.head_size} must be even (rotary embeddings) and >= 2")
        elif self.d_model % self.n_heads:
            problems.append(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: choose n_heads among "
                f"{_divisors(self.d_model)[:12]}, or set head_size"
            )
        elif self.head_dim % 2:
            problems.append(
                f"head_dim = d_model/n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            problems.append(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: each key/value "
                f"head must serve a whole number of query heads; choose n_kv_heads among {_divisors(self.n_heads)}"
            )
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            problems.append(f"ffn_hidden={self.ffn_hidden} must be >= 1 (or None for the default)")
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm={self.norm!r} must be 'rmsnorm' or 'layernorm'")
        if self.activation not in ("swiglu", "gelu"):
            problems.append(f"activation={self.activation!r} must be 'swiglu' or 'gelu'")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(
                f"sliding_window={self.sliding_window} must be >= 1 token (None = full attention)"
            )
        if self.full_attention_every is not None:
            if self.sliding_window is None:
                problems.append("full_attention_every needs a sliding_window (otherwise every layer is full)")
            elif self.full_attention_every < 1:
                problems.append(f"full_attention_every={self.full_attention_every} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if self.init_std <= 0 or self.norm_eps <= 0 or self.rope_theta <= 0:
            problems.append("init_std, norm_eps and rope_theta must be > 0")
        unknown = set(self.kernels) - _KERNEL_NAMES
        if unknown:
            problems.append(
                f"kernels names unknown kernels {sorted(unknown)}; known: {sorted(_KERNEL_NAMES)}"
            )
        if self.fp8 is not None and self.fp8 not in FLOAT8_RECIPES:
            problems.append(
                f"fp8={self.fp8!r} is not a float8 recipe; choose one of {list(FLOAT8_RECIPES)} or None"
            )
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_size``, or d_model / n_heads."""
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation == "gelu":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)

    @property
    def expert_dim(self) -> int:
        """Width of one expert's MLP (``moe.expert_hidden``, default ``ffn_dim``); ``ffn_dim`` without MoE."""
        if self.moe is None or self.moe.expert_hidden is None:
            return self.ffn_dim
        return self.moe.expert_hidden

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple_of
        return m * math.ceil(self.vocab_size / m)

    def window_for_layer(self, layer: int) -> int | None:
        """The attention window of block ``layer`` (None = full causal)."""
        if self.sliding_window is None:
            return None
        if self.full_attention_every is not None and (layer + 1) % self.full_attention_every == 0:
            return None
        return self.sliding_window

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError, naming the numbers and what to change, unless this model splits ``tp`` ways."""
        if tp < 1:
            raise ValueError(f"tensor parallel size tp={tp} must be >= 1")
        problems = []
        if self.n_heads % tp:
            problems.append(f"n_heads={self.n_heads} is not divisible by tp={tp}")
        if self.kv_heads % tp:
            problems.append(
                f"n_kv_heads={self.kv_heads} is not divisible by tp={tp} (each rank needs whole key/value heads)"
            )
        if self.ffn_dim % tp:
            problems.append(f"the MLP width {self.ffn_dim} is not divisible by tp={tp}; set ffn_hidden")
        if self.padded_vocab_size % tp:
            problems.append(
                f"the padded vocabulary {self.padded_vocab_size} is not divisible by tp={tp}; set "
                f"pad_vocab_to_multiple_of to a multiple of {tp}"
            )
        if problems:
            ok = _divisors(math.gcd(self.n_heads, self.kv_heads, self.ffn_dim, self.padded_vocab_size))
            raise ValueError(
                f"this model cannot be split tp={tp} ways: "
                + "; ".join(problems)
                + f". Tensor parallel sizes that fit it: {ok}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_scaling_from_dict(d: Mapping) -> RopeScaling:
    return _from_dict(RopeScaling, "rope_scaling", d)


def _from_dict(cls: type, field_name: str, d: Mapping):  # type: ignore[no-untyped-def]
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(
            f"invalid GPTConfig: {field_name} has unknown keys {sorted(unknown)}; known: {sorted(known)}"
        )
    return cls(**d)


_KERNEL_NAMES = {
    "attention",
    "rms_norm",
    "layer_norm",
    "bias_gelu",
    "swiglu",
    "rope",
    "cross_entropy",
    "grouped_mm",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
