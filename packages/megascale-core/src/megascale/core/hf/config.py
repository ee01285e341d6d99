"""Hugging Face ``config.json`` ↔ ``GPTConfig`` for the Llama family: model types llama, qwen2, qwen3, mistral,
and the mixtures of experts mixtral and qwen3_moe (``GPTConfig.moe``).

Every field of a config.json is either understood (mapped to a GPTConfig option, or checked to hold the only
value megascale's GPT computes, e.g. ``hidden_act: "silu"``), or on an explicit list of fields that do not
change the network (token ids, dtype, bookkeeping). Anything else is a ValueError naming the field: a
converter that guessed would load weights into a network that computes something else.

Both spellings of the rotary settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4.x, most
checkpoints on the Hub) and ``rope_parameters`` (transformers 5). The 4.x spelling is written, which both
read. Defaults of absent fields are those of transformers' config classes for that model type.

Attention windows follow transformers' masks: a sliding window of w lets a token see itself and the w-1
tokens before it, as GPTConfig's ``sliding_window`` does. Qwen2/Qwen3 choose per layer (``layer_types``, or
``use_sliding_window`` with the first ``max_window_layers`` layers full); GPTConfig expresses "every layer"
and "every n-th layer full" (``full_attention_every``), and a pattern outside those is refused. Mixtral and
Qwen3-MoE (transformers 5) window every layer or none.

Mixtures of experts: every layer's MLP is a ``MoEConfig`` of softmax-routed SwiGLU experts (Mixtral: top-k
weights renormalised; Qwen3-MoE: when ``norm_topk_prob``). What megascale's MoE cannot compute is refused:
Qwen3-MoE's dense layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` != 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megascale.core.config import GPTConfig, MoEConfig, RopeScaling

__all__ = ["MODEL_TYPES", "OVERRIDABLE", "config_conflicts", "gpt_config_from_hf", "hf_config_from_gpt"]

# Fields that do not change what the network computes from its weights, whatever the model type.
_NOT_ARCHITECTURE = frozenset(
    {
        "architectures",
        "_name_or_path",
        "transformers_version",
        "torch_dtype",  # the stored dtype; the tensors say it themselves
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",  # only stops the embedding row's gradient in transformers; same forward
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "tokenizer_class",
        "_attn_implementation_autoset",
    }
)
# Understood by every model type here.
_COMMON = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "attention_dropout",
    }
)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
    }
)


@dataclass(frozen=True)
class _Family:
    architecture: str
    fields: frozenset[str]  # understood beyond _COMMON
    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' defaults of absent fields
    per_layer_windows: bool = False  # Qwen2/Qwen3: use_sliding_window, max_window_layers, layer_types
    moe: bool = False  # a mixture of experts in every layer (mixtral, qwen3_moe); the others are dense


_BASE_DEFAULTS = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
_QWEN_WINDOWS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
_QWEN_DEFAULTS = {
    **_BASE_DEFAULTS,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
# Fields of both MoE families that only concern training with transformers: output_router_logits makes
# transformers add its load-balancing loss (router_aux_loss_coef, mapped to MoEConfig.aux_loss_coef).
_MOE_COMMON = {"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"}
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(
        "LlamaForCausalLM",
        frozenset({"attention_bias", "mlp_bias", "head_dim", "pretraining_tp"}),
        {**_BASE_DEFAULTS, "max_position_embeddings": 2048},
    ),
    "qwen2": _Family(
        "Qwen2ForCausalLM", frozenset({*_QWEN_WINDOWS, "use_mrope"}), _QWEN_DEFAULTS, per_layer_windows=True
    ),
    "qwen3": _Family(
        "Qwen3ForCausalLM",
        frozenset({*_QWEN_WINDOWS, "attention_bias", "head_dim"}),
        {**_QWEN_DEFAULTS, "head_dim": 128},
        per_layer_windows=True,
    ),
    "mistral": _Family(
        "MistralForCausalLM",
        frozenset({"head_dim", "sliding_window"}),
        {
            **_BASE_DEFAULTS,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "sliding_window": 4096,
        },
    ),
    "mixtral": _Family(
        "MixtralForCausalLM",
        # router_jitter_noise: multiplicative noise on the router's input in training only (inference and
        # the weights are unaffected); megascale has none, so it is accepted and dropped
        frozenset({"head_dim", "sliding_window", "num_local_experts", "router_jitter_noise", *_MOE_COMMON}),
        {
            **_BASE_DEFAULTS,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.001,
        },
        moe=True,
    ),
    "qwen3_moe": _Family(
        "Qwen3MoeForCausalLM",
        frozenset(
            {
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "attention_bias",
                "head_dim",
                "num_experts",
                "num_local_experts",  # transformers 5 writes num_experts under this name
                "moe_intermediate_size",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
                *_MOE_COMMON,
            }
        ),
        {
            **_QWEN_DEFAULTS,
            "num_key_value_heads": 4,
            "head_dim": None,  # absent: hidden_size / num_attention_heads (Qwen3's dense default is 128)
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001,
        },
        moe=True,
    ),
}
MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)
"""The Hugging Face model types converted both ways."""

OVERRIDABLE: frozenset[str] = frozenset(
    {"max_seq_len", "pad_vocab_to_multiple_of", "kernels", "dropout", "init_std", "fp8"}
)
"""GPTConfig fields that only say how to train or run the model (not what its weights compute), which a
caller may set on import."""


def _family(model_type: object) -> _Family:
    if model_type not in _FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(MODEL_TYPES)}"
        )
    return _FAMILIES[str(model_type)]


# ---- config.json -> GPTConfig -----------------------------------------------------------------------------


def gpt_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """The GPTConfig computing what transformers computes for ``config`` (a parsed config.json).

    Args:
        config: the config.json of a llama, qwen2, qwen3, mistral, mixtral or qwen3_moe model.
        overrides: GPTConfig fields that do not change the network, set on the result: ``max_seq_len`` (the
            rotary tables' length; default ``max_position_embeddings``), ``pad_vocab_to_multiple_of``,
            ``kernels``, ``dropout``, ``init_std``.

    Raises:
        ValueError: naming the field, for an unsupported ``model_type``, a field this converter does not know,
            or a value megascale's GPT cannot compute (e.g. ``hidden_act`` other than silu, a rope scaling
            other than llama3, a per-layer window pattern GPTConfig cannot express, Qwen3-MoE's dense layers
            among the sparse ones).
    """
    family = _family(config.get("model_type"))
    model_type = str(config["model_type"])
    unknown = sorted(set(config) - _COMMON - family.fields - _NOT_ARCHITECTURE)
    if unknown:
        raise ValueError(
            f"config.json of model_type {model_type!r} has field(s) {unknown} that megascale's converter does "
            f"not understand; converting anyway could build a network other than the checkpoint's"
        )
    missing = [k for k in _REQUIRED if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks the required field(s) {missing}")
    bad_overrides = sorted(set(overrides) - OVERRIDABLE)
    if bad_overrides:
        raise ValueError(
            f"gpt_config_from_hf cannot override {bad_overrides}: they are set by config.json; overridable: "
            f"{sorted(OVERRIDABLE)}"
        )

    def get(key: str) -> Any:  # an absent field takes transformers' default; an explicit null stays null
        return config[key] if key in config else family.defaults.get(key)

    _expect(config, "hidden_act", get("hidden_act"), "silu", "megascale's SwiGLU MLP uses silu")
    _expect(config, "attention_dropout", float(get("attention_dropout")), 0.0,
            "megascale's dropout also drops residuals and embeddings; set dropout after converting")  # fmt: skip
    if "use_mrope" in config:
        _expect(
            config, "use_mrope", config["use_mrope"], False, "multimodal rotary embeddings are not supported"
        )

    d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = get("head_dim")  # null: d_model / n_heads, as transformers fills it in
    head_size = None
    if head_dim is not None and (d_model % n_heads or int(head_dim) != d_model // n_heads):
        head_size = int(head_dim)
    n_kv = get("num_key_value_heads")  # null: n_heads
    qkv_bias, bias = _biases(config, model_type)
    theta, scaling = _rope(config, family)
    window, full_every = _windows(config, family, int(config["num_hidden_layers"]))
    moe = _moe(config, family, get, model_type) if family.moe else None
    kwargs: dict[str, Any] = dict(
        vocab_size=int(config["vocab_size"]),
        d_model=d_model,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=None if n_kv is None or int(n_kv) == n_heads else int(n_kv),
        head_size=head_size,
        ffn_hidden=int(config["intermediate_size"]),
        max_seq_len=int(get("max_position_embeddings")),
        norm="rmsnorm",
        activation="swiglu",
        parallel_block=False,
        sliding_window=window,
        full_attention_every=full_every,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(get("tie_word_embeddings")),
        dropout=0.0,
        init_std=float(get("initializer_range")),
        norm_eps=float(get("rms_norm_eps")),
        bias=bias,
        qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=moe,
    )
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def _expect(config: Mapping[str, Any], key: str, value: Any, wanted: Any, why: str) -> None:
    if value != wanted:
        raise ValueError(f"config.json has {key}={value!r}; megascale converts only {key}={wanted!r} ({why})")


def _biases(config: Mapping[str, Any], model_type: str) -> tuple[bool, bool]:
    """(qkv_bias, bias) of the family's linear layers."""
    if model_type == "qwen2":
        return True, False  # Qwen2: q, k, v always biased; o and the MLP never
    if model_type == "qwen3_moe":  # q, k, v and o; its experts and router have no biases, as megascale's
        return False, bool(config.get("attention_bias", False))
    if model_type == "mixtral":
        return False, False
    attention = bool(config.get("attention_bias", False))  # llama, qwen3: q, k, v and o
    mlp = bool(config.get("mlp_bias", False))  # llama only
    if attention == mlp:
        return False, attention
    raise ValueError(
        f"config.json has attention_bias={attention} and mlp_bias={mlp}: GPTConfig has biases on every linear "
        "(bias) or on q, k, v only (qkv_bias), not on the attention projections (o included) alone or on the "
        "MLP alone"
    )


def _rope(config: Mapping[str, Any], family: _Family) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either spelling."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # 4.x, then 5.x (which wins where both are given)
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"config.json has {key}={value!r}: expected an object or null")
        unknown = sorted(set(value) - _ROPE_KEYS)
        if unknown:
            raise ValueError(
                f"config.json has {key} with field(s) {unknown} that megascale's converter does not understand "
                f"(known: {sorted(_ROPE_KEYS)})"
            )
        params.update(value)
    theta = float(
        params.get("rope_theta", config.get("rope_theta", family.defaults.get("rope_theta", 10000.0)))
    )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"config.json has partial_rotary_factor={params['partial_rotary_factor']}: megascale rotates "
            "whole heads"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"config.json has rope_type={kind!r}: megascale supports the rope types 'default' and 'llama3'"
        )
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"config.json's llama3 rope scaling lacks {missing}")
    original = params.get(
        "original_max_position_embeddings",
        config.get("max_position_embeddings", family.defaults.get("max_position_embeddings")),
    )
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_seq_len=int(original),
    )


def _windows(config: Mapping[str, Any], family: _Family, n_layers: int) -> tuple[int | None, int | None]:
    """(sliding_window, full_attention_every) giving each layer the window transformers gives it."""
    if "use_sliding_window" in family.fields and not family.per_layer_windows:  # qwen3_moe
        # transformers 5 gives every layer the window when use_sliding_window (max_window_layers is not read);
        # earlier versions kept the first max_window_layers layers full, so that combination is ambiguous
        if not bool(config.get("use_sliding_window", family.defaults["use_sliding_window"])):
            return None, None
        window = config["sliding_window"] if "sliding_window" in config else family.defaults["sliding_window"]
        if window is not None and "max_window_layers" in config:
            raise ValueError(
                f"config.json has use_sliding_window=true and max_window_layers={config['max_window_layers']}: "
                "transformers 5 windows every layer of a qwen3_moe model, earlier versions kept the first "
                "max_window_layers full; remove max_window_layers to window every layer"
            )
        return (None if window is None else int(window)), None
    if not family.per_layer_windows:  # mistral, mixtral: every layer; llama: none
        window = (
            config["sliding_window"] if "sliding_window" in config else family.defaults.get("sliding_window")
        )
        return (None if window is None else int(window)), None
    use = bool(config.get("use_sliding_window", family.defaults["use_sliding_window"]))
    window = config["sliding_window"] if "sliding_window" in config else family.defaults["sliding_window"]
    window = window if use else None
    if window is None:
        return None, None  # transformers sets sliding_window None then: every layer full
    types = config.get("layer_types")
    if types is None:
        first_full = int(config.get("max_window_layers", family.defaults["max_window_layers"]))
        types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"config.json has layer_types={types}: expected {n_layers} entries of 'sliding_attention' or "
            "'full_attention'"
        )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        return int(window), None
    if len(full) == n_layers:
        return None, None
    every = full[0] + 1
    if full == list(range(every - 1, n_layers, every)):
        return int(window), every
    raise ValueError(
        f"config.json gives a sliding window of {window} to layers "
        f"{[i for i, t in enumerate(types) if t == 'sliding_attention']} and full attention to layers {full} "
        "(layer_types / max_window_layers): GPTConfig expresses a window on every layer or full attention on "
        "every n-th layer (full_attention_every) only"
    )


def _moe(config: Mapping[str, Any], family: _Family, get: Any, model_type: str) -> MoEConfig:
    """The MoEConfig of a mixtral or qwen3_moe config.json (``get``: a field or transformers' default)."""
    if model_type == "mixtral":
        experts, hidden, normalize = get("num_local_experts"), config["intermediate_size"], True
    else:  # qwen3_moe: the Hub's configs say num_experts, transformers 5 writes num_local_experts
        spelled = {k: config[k] for k in ("num_experts", "num_local_experts") if k in config}
        if len(set(spelled.values())) > 1:
            raise ValueError(f"config.json has {spelled}: two different numbers of experts")
        experts = next(iter(spelled.values())) if spelled else get("num_experts")
        hidden, normalize = get("moe_intermediate_size"), bool(get("norm_topk_prob"))
        # a dense MLP (intermediate_size wide) in the layers listed or off the sparse step: megascale puts the
        # same feed-forward in every layer
        dense = list(config.get("mlp_only_layers") or [])
        if dense:
            raise ValueError(
                f"config.json has mlp_only_layers={dense}: megascale's GPT has a mixture of experts in every "
                "layer, not dense MLPs in some; only mlp_only_layers=[] converts"
            )
        step = int(get("decoder_sparse_step"))
        if step != 1:
            raise ValueError(
                f"config.json has decoder_sparse_step={step}: only every {step}-th layer is a mixture of "
                "experts, the others dense MLPs; megascale's GPT has one in every layer "
                "(decoder_sparse_step=1)"
            )
    if experts is None or int(experts) < 1:
        raise ValueError(
            f"config.json has {experts!r} experts: a {model_type} model without experts is dense; convert it as "
            "its dense family"
        )
    top_k = int(get("num_experts_per_tok"))
    if not 1 <= top_k <= int(experts):
        raise ValueError(f"config.json has num_experts_per_tok={top_k} for {int(experts)} experts")
    return MoEConfig(
        num_experts=int(experts),
        top_k=top_k,
        expert_hidden=int(hidden),
        shared_experts=0,
        score="softmax",  # both route by a softmax over every expert's logit, in fp32, as megascale's Router
        normalize_top_k=normalize,
        # transformers' coefficient weights its own form of the Switch loss (k·E·Σᵢ fᵢ·Pᵢ over the batch's
        # tokens, one for the whole model: the mean over layers, added only with output_router_logits);
        # megascale's is per sequence, 1 at perfect balance, summed over layers. The number is kept as the
        # training option it is (it does not change the network): scale it to taste when continuing training.
        aux_loss_coef=float(get("router_aux_loss_coef")),
        z_loss_coef=0.0,
        bias_update_rate=0.0,
    )


def _moe_meaning(c: GPTConfig) -> dict[str, Any] | None:
    """What a MoEConfig changes in the network (the balancing options only change training)."""
    if c.moe is None:
        return None
    m = c.moe
    return dict(num_experts=m.num_experts, top_k=m.top_k, expert_hidden=c.expert_dim,
                shared_experts=m.shared_experts, score=m.score, normalize_top_k=m.normalize_top_k)  # fmt: skip


def config_conflicts(config: GPTConfig, reference: GPTConfig) -> list[str]:
    """The GPTConfig fields on which ``config`` builds another network than ``reference`` (e.g. the one
    ``gpt_config_from_hf`` reads from a checkpoint), each as ``"field=value (reference: value)"``; empty when
    the two compute the same function of the same weights. Fields in ``OVERRIDABLE`` (how to train or run:
    ``max_seq_len``, ``dropout``, ...) are not compared; fields spelled two ways are compared by what they
    mean (``n_kv_heads`` None and equal to ``n_heads``; ``ffn_hidden`` against the width ``ffn_multiple_of``
    gives; windows layer by layer; a mixture of experts by what routes and computes, its balancing-loss and
    bias options being training options; ``ffn_hidden`` not at all with one: no layer has a dense MLP)."""

    def windows(c: GPTConfig) -> list[int | None]:
        return [c.window_for_layer(i) for i in range(c.n_layers)]

    # (field as the user writes it, what it means, read from a config)
    meanings: list[tuple[str, Any]] = [
        ("vocab_size", lambda c: c.vocab_size),
        ("d_model", lambda c: c.d_model),
        ("n_layers", lambda c: c.n_layers),
        ("n_heads", lambda c: c.n_heads),
        ("n_kv_heads", lambda c: c.kv_heads),
        ("head_size", lambda c: c.head_dim),
        ("ffn_hidden", lambda c: c.ffn_dim if c.moe is None else None),
        ("norm", lambda c: c.norm),
        ("activation", lambda c: c.activation),
        ("parallel_block", lambda c: c.parallel_block),
        ("sliding_window", windows),
        ("rope_theta", lambda c: c.rope_theta),
        ("rope_scaling", lambda c: c.rope_scaling),
        ("tie_embeddings", lambda c: c.tie_embeddings),
        ("norm_eps", lambda c: c.norm_eps),
        ("bias", lambda c: c.bias),
        ("qkv_bias", lambda c: c.qkv_bias),
        ("qk_norm", lambda c: c.qk_norm),
        ("moe", _moe_meaning),
    ]
    out = []
    for name, meaning in meanings:
        mine, theirs = meaning(config), meaning(reference)
        if mine != theirs:
            if name == "sliding_window":
                out.append(
                    f"sliding_window={config.sliding_window}, full_attention_every={config.full_attention_every} "
                    f"(reference: {reference.sliding_window}, {reference.full_attention_every})"
                )
            else:
                out.append(f"{name}={mine!r} (reference: {theirs!r})")
    return out


# ---- GPTConfig -> config.json -----------------------------------------------------------------------------


def hf_config_from_gpt(config: GPTConfig, model_type: str = "llama") -> dict[str, Any]:
    """The config.json of ``config`` as a Hugging Face ``model_type`` model (4.x spelling, read by 4.x and 5.x).

    Raises:
        ValueError: naming the GPTConfig option, when ``model_type`` cannot express the architecture (a
            parallel block, LayerNorm, GeLU, biases or q/k norms the family does not have, a window pattern, a
            mixture of experts in a dense family or its absence in mixtral/qwen3_moe, shared experts, sigmoid
            routing, Mixtral without renormalised top-k weights).
    """
    family = _family(model_type)
    problems = []
    if config.parallel_block:
        problems.append("parallel_block=True (Hugging Face's models run attention then MLP: set False)")
    if config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r} (needs 'rmsnorm')")
    if config.activation != "swiglu":
        problems.append(f"activation={config.activation!r} (needs 'swiglu')")
    has_qkv_bias = config.qkv_bias and not config.bias
    if model_type == "qwen2":
        if not has_qkv_bias:
            problems.append(
                f"bias={config.bias}, qkv_bias={config.qkv_bias} (qwen2 has biases on q, k, v only: "
                "qkv_bias=True, bias=False)"
            )
        if config.head_size is not None and config.head_size * config.n_heads != config.d_model:
            problems.append(f"head_size={config.head_size} (qwen2's heads are d_model/n_heads wide)")
    elif has_qkv_bias:
        problems.append(f"qkv_bias=True ({model_type} has no biases on q, k, v alone)")
    if model_type in ("qwen3", "mistral") and config.bias:
        problems.append(f"bias=True ({model_type} has no MLP biases)")
    if model_type == "mixtral" and config.bias:
        problems.append("bias=True (mixtral has no biases)")
    if config.qk_norm != (model_type in ("qwen3", "qwen3_moe")):
        problems.append(f"qk_norm={config.qk_norm} ({model_type} {'has' if not config.qk_norm else 'has no'} "
                        "per-head q/k norms)")  # fmt: skip
    if model_type == "llama" and config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window} (llama attends fully: try mistral or qwen2)")
    if model_type in ("mistral", "mixtral", "qwen3_moe") and config.full_attention_every is not None:
        problems.append(
            f"full_attention_every={config.full_attention_every} ({model_type} windows every layer"
            + (": try qwen2)" if model_type == "mistral" else ")")
        )
    problems += _moe_problems(config, model_type, family)
    if problems:
        raise ValueError(f"this GPTConfig cannot be written as a {model_type} model: " + "; ".join(problems))

    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": _rope_scaling_dict(config.rope_scaling),
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if "head_dim" in family.fields:
        out["head_dim"] = config.head_dim
    if "attention_bias" in family.fields:
        out["attention_bias"] = config.bias
    if model_type == "llama":
        out.update(mlp_bias=config.bias, pretraining_tp=1)
    elif model_type in ("mistral", "mixtral"):
        out["sliding_window"] = config.sliding_window
    if config.moe is not None:  # mixtral, qwen3_moe
        out.update(
            num_experts_per_tok=config.moe.top_k,
            router_aux_loss_coef=config.moe.aux_loss_coef,  # see _moe: transformers' form of the loss
            output_router_logits=False,
        )
    if model_type == "mixtral":
        out.update(
            intermediate_size=config.expert_dim,
            num_local_experts=config.moe.num_experts,  # type: ignore[union-attr]
            router_jitter_noise=0.0,
        )
    elif model_type == "qwen3_moe":
        assert config.moe is not None
        out.update(
            # the Hub's spelling (transformers 4.x reads only this one; 5.x maps it to num_local_experts)
            num_experts=config.moe.num_experts,
            moe_intermediate_size=config.expert_dim,
            norm_topk_prob=config.moe.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=config.sliding_window is not None,
            sliding_window=config.sliding_window,
        )
    elif model_type in ("qwen2", "qwen3"):
        windows = [config.window_for_layer(i) for i in range(config.n_layers)]
        out.update(
            use_sliding_window=config.sliding_window is not None,
            sliding_window=config.sliding_window,
            # windows are given per layer by layer_types; max_window_layers (first layers full) is what
            # readers without layer_types use, right whenever full_attention_every is None
            max_window_layers=0 if config.sliding_window is not None else config.n_layers,
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        )
    return dict(sorted(out.items()))


def _moe_problems(config: GPTConfig, model_type: str, family: _Family) -> list[str]:
    """Why ``config``'s feed-forward cannot be written as a ``model_type`` model (empty: it can)."""
    moe = config.moe
    if not family.moe:
        return [] if moe is None else [f"moe={moe} ({model_type} is dense: try mixtral or qwen3_moe)"]
    if moe is None:
        return [
            f"moe=None ({model_type} is a mixture of experts: set moe=MoEConfig(...) or try a dense family)"
        ]
    problems = []
    if moe.shared_experts:
        problems.append(f"moe.shared_experts={moe.shared_experts} ({model_type} has no shared experts)")
    if moe.score != "softmax":
        problems.append(f"moe.score={moe.score!r} ({model_type} routes by a softmax over the experts)")
    if model_type == "mixtral" and not moe.normalize_top_k:
        problems.append(
            "moe.normalize_top_k=False (mixtral always renormalises the top-k weights: try qwen3_moe)"
        )
    return problems


def _rope_scaling_dict(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    return {
        "rope_type": scaling.kind,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_seq_len,
    }
