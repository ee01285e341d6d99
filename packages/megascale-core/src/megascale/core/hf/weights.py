"""Tensor names and layouts: a Hugging Face Llama-family checkpoint ↔ megascale GPT's state dict.

Every projection keeps its own (out_features, in_features) weight in both, and both lay out heads the same
way (q_proj's rows are head after head; RoPE rotates the pairs (x[i], x[i + hd/2]), transformers'
``rotate_half``), so tensors move unchanged: no transposes, no fusing or splitting, no permutations. The one
difference of layout is the vocabulary: megascale pads the embedding (and an untied output projection) to
``padded_vocab_size`` rows so tensor parallelism can split it; the import appends zero rows, the export
drops them. With tied embeddings transformers stores only the embedding (as megascale's state dict holds the
one tensor under both names).

``tensor_map(config)`` lists every tensor with both names and its Hugging Face shape, so a loader can check a
checkpoint before reading it, or read only the slices a rank needs.

Mixtures of experts (``config.moe``): megascale stacks each layer's experts into one tensor per projection,
``experts.gate``/``up``/``down`` of shape (experts, out, in); the checkpoint holds each expert's nn.Linear weight
(out, in) apart, as the Hub's checkpoints do and transformers' ``save_pretrained`` writes them (transformers 5
fuses them into ``gate_up_proj``/``down_proj`` stacks in memory and splits them again on saving):

    megascale                          Mixtral                                         Qwen3-MoE
    blocks.{i}.mlp.router.weight       model.layers.{i}.block_sparse_moe.gate.weight   model.layers.{i}.mlp.gate.weight
    blocks.{i}.mlp.experts.gate[j]     ....block_sparse_moe.experts.{j}.w1.weight      ....mlp.experts.{j}.gate_proj.weight
    blocks.{i}.mlp.experts.up[j]       ....block_sparse_moe.experts.{j}.w3.weight      ....mlp.experts.{j}.up_proj.weight
    blocks.{i}.mlp.experts.down[j]     ....block_sparse_moe.experts.{j}.w2.weight      ....mlp.experts.{j}.down_proj.weight

Each expert's tensor is one ``TensorMapping`` with ``expert=j``: row j (first dimension) of the megascale stack.
The family follows from the config: q/k norms are Qwen3-MoE's, their absence Mixtral's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from megascale.core.config import GPTConfig

__all__ = ["TensorMapping", "check_hf_tensors", "from_hf_tensors", "tensor_map", "to_hf_tensors"]

# tensors some checkpoints carry that no model reads (transformers < 4.31 saved the rotary frequencies)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorMapping:
    """One tensor: its megascale name, its Hugging Face name and shape, and whether its rows are the
    vocabulary (padded to ``padded_vocab_size`` in megascale, ``vocab_size`` in Hugging Face). ``expert``: the
    Hugging Face tensor is expert ``expert``'s weight, row ``expert`` of the megascale stack (None: the whole
    megascale tensor)."""

    megascale: str
    hf: str
    hf_shape: tuple[int, ...]
    vocab_rows: bool = False
    expert: int | None = None


# per expert: megascale stack -> (Mixtral's name, Qwen3-MoE's name)
_EXPERT_NAMES = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}


def tensor_map(config: GPTConfig) -> list[TensorMapping]:
    """Every tensor of ``config``'s model, in the order transformers stores them.

    Raises:
        ValueError: for an architecture Hugging Face's Llama family does not have (a parallel block,
            LayerNorm, GeLU).
    """
    problems = []
    if config.parallel_block:
        problems.append("parallel_block=True")
    if config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r}")
    if config.activation != "swiglu":
        problems.append(f"activation={config.activation!r}")
    if problems:
        raise ValueError(
            "Hugging Face's Llama-family models are sequential pre-norm blocks with RMSNorm and SwiGLU; this "
            "GPTConfig has " + ", ".join(problems)
        )
    d, hd, ffn = config.d_model, config.head_dim, config.ffn_dim
    q, kv = config.n_heads * hd, config.kv_heads * hd
    out = [TensorMapping("embed.weight", "model.embed_tokens.weight", (config.vocab_size, d), True)]
    for i in range(config.n_layers):
        ms, hf = f"blocks.{i}.", f"model.layers.{i}."

        def add(ms_name: str, hf_name: str, shape: tuple[int, ...], ms: str = ms, hf: str = hf) -> None:
            out.append(TensorMapping(ms + ms_name, hf + hf_name, shape))

        add("attn_norm.weight", "input_layernorm.weight", (d,))
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            add(f"attn.in_proj.{name}.weight", f"self_attn.{name}_proj.weight", (rows, d))
            if config.bias or config.qkv_bias:
                add(f"attn.in_proj.{name}.bias", f"self_attn.{name}_proj.bias", (rows,))
        if config.qk_norm:
            add("attn.core.q_norm.weight", "self_attn.q_norm.weight", (hd,))
            add("attn.core.k_norm.weight", "self_attn.k_norm.weight", (hd,))
        add("attn.out_proj.o.weight", "self_attn.o_proj.weight", (d, q))
        if config.bias:
            add("attn.out_proj.bias", "self_attn.o_proj.bias", (d,))
        add("mlp_norm.weight", "post_attention_layernorm.weight", (d,))
        if config.moe is not None:
            out.extend(_moe_map(config, ms, hf))
            continue
        for name in ("gate", "up"):
            add(f"mlp.in_proj.{name}.weight", f"mlp.{name}_proj.weight", (ffn, d))
            if config.bias:
                add(f"mlp.in_proj.{name}.bias", f"mlp.{name}_proj.bias", (ffn,))
        add("mlp.out_proj.down.weight", "mlp.down_proj.weight", (d, ffn))
        if config.bias:
            add("mlp.out_proj.bias", "mlp.down_proj.bias", (d,))
    out.append(TensorMapping("head.norm.weight", "model.norm.weight", (d,)))
    if not config.tie_embeddings:
        out.append(TensorMapping("head.proj.logits.weight", "lm_head.weight", (config.vocab_size, d), True))
    return out


def _moe_map(config: GPTConfig, ms: str, hf: str) -> list[TensorMapping]:
    """A layer's router and experts (prefixes ``ms``, ``hf``): Mixtral's names, or Qwen3-MoE's with q/k norms."""
    assert config.moe is not None
    if config.moe.shared_experts:
        raise ValueError(
            f"moe.shared_experts={config.moe.shared_experts}: Mixtral and Qwen3-MoE have no shared experts"
        )
    qwen = config.qk_norm
    moe = hf + ("mlp." if qwen else "block_sparse_moe.")
    d, f = config.d_model, config.expert_dim
    out = [TensorMapping(ms + "mlp.router.weight", moe + "gate.weight", (config.moe.num_experts, d))]
    for j in range(config.moe.num_experts):
        for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            hf_name = _EXPERT_NAMES[name][1 if qwen else 0]
            out.append(TensorMapping(ms + f"mlp.experts.{name}", moe + f"experts.{j}.{hf_name}.weight", shape,
                                     expert=j))  # fmt: skip
    return out


def _megascale_shape(m: TensorMapping, config: GPTConfig) -> tuple[int, ...]:
    """The shape of ``m``'s whole megascale tensor (a stack of every expert's; padded vocabulary rows)."""
    if m.expert is not None:
        assert config.moe is not None
        return (config.moe.num_experts, *m.hf_shape)
    if m.vocab_rows:
        return (config.padded_vocab_size, *m.hf_shape[1:])
    return m.hf_shape


def check_hf_tensors(
    config: GPTConfig, names: Iterable[str], shape_of: Callable[[str], tuple[int, ...]]
) -> list[TensorMapping]:
    """``tensor_map(config)``, once the checkpoint's names and shapes (headers only, nothing read) are checked
    against it.

    Args:
        names: the tensor names the checkpoint holds.
        shape_of: a tensor's shape without reading it.

    Raises:
        KeyError: naming the tensor, for one the config needs that the checkpoint lacks.
        ValueError: naming the tensor and both shapes, for a shape the config does not imply; naming them,
            for tensors the config has no place for.
    """
    mapping = tensor_map(config)
    available = set(names)
    missing = [m for m in mapping if m.hf not in available]
    if missing:
        m = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        fused = sorted(n for n in available if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
        hint = (
            f"; it holds experts fused ({fused[0]}, ...), as transformers 5 keeps them in memory: megascale reads "
            "each expert's tensor apart, as save_pretrained writes them"
            if fused and m.expert is not None
            else ""
        )
        raise KeyError(
            f"the checkpoint has no tensor {m.hf}{more}, which config.json implies (shape {list(m.hf_shape)}, "
            f"megascale's {m.megascale}){hint}"
        )
    expected = {m.hf for m in mapping}
    # transformers ignores a stored lm_head when the embeddings are tied (it ties them on load)
    extra = sorted(
        n
        for n in available - expected
        if not n.endswith(_IGNORED_SUFFIXES) and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"the checkpoint holds tensors config.json has no place for: {extra[:8]}"
            + (f" (and {len(extra) - 8} more)" if len(extra) > 8 else "")
        )
    for m in mapping:
        shape = tuple(shape_of(m.hf))
        if shape != m.hf_shape:
            raise ValueError(
                f"tensor {m.hf} has shape {list(shape)}, but config.json implies {list(m.hf_shape)}"
            )
    return mapping


def from_hf_tensors(
    config: GPTConfig,
    names: Iterable[str],
    shape_of: Callable[[str], tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """megascale's state dict from a Hugging Face checkpoint's tensors, checked before anything is read
    (``check_hf_tensors``).

    Args:
        names: the tensor names the checkpoint holds.
        shape_of: a tensor's shape without reading it.
        read: a tensor's values.

    Raises:
        KeyError, ValueError: as ``check_hf_tensors``.
    """
    state: dict[str, torch.Tensor] = {}
    experts: dict[
        str, list[torch.Tensor]
    ] = {}  # a stack's experts, in order (tensor_map lists j = 0, 1, ...)
    for m in check_hf_tensors(config, names, shape_of):
        tensor = read(m.hf)
        if m.expert is not None:
            experts.setdefault(m.megascale, []).append(tensor)
            continue
        state[m.megascale] = _pad_rows(tensor, config.padded_vocab_size) if m.vocab_rows else tensor
    for name, tensors in experts.items():
        state[name] = torch.stack(tensors)
    if config.tie_embeddings:
        state["head.proj.logits.weight"] = state["embed.weight"]
    return state


def to_hf_tensors(state_dict: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors (names, unpadded vocabulary) from megascale's state dict of ``config``.

    Raises:
        KeyError: naming a tensor the config implies that ``state_dict`` lacks.
        ValueError: for tensors ``state_dict`` holds beyond the config's, a wrong shape, or split (DTensor)
            tensors: gather a tensor-parallel model first; for routers' balancing biases that are not zero
            (``MoEConfig.bias_update_rate``): they change which experts are chosen, and neither family has them.
    """
    from megascale.core._dtensor import is_dtensor

    mapping = tensor_map(config)
    known = {m.megascale for m in mapping} | {"head.proj.logits.weight"}
    for name in sorted(set(state_dict) - known):
        if name.endswith(".router.expert_bias") and name.startswith("blocks."):
            bias = state_dict[name]
            bias = bias.full_tensor() if is_dtensor(bias) else bias  # type: ignore[attr-defined]
            if bias.any():
                raise ValueError(
                    f"{name} is not zero: auxiliary-loss-free balancing (bias_update_rate) moved the experts' "
                    "biases, which change which experts each token goes to; Hugging Face's Mixtral and "
                    "Qwen3-MoE route without them, so the export would compute another model"
                )
            known.add(name)  # zero: routes as without it
    extra = sorted(set(state_dict) - known)
    if extra:
        raise ValueError(f"the state dict holds tensors this GPTConfig has no place for: {extra[:8]}")
    out: dict[str, torch.Tensor] = {}
    for m in mapping:
        if m.megascale not in state_dict:
            raise KeyError(f"the state dict has no tensor {m.megascale} (Hugging Face's {m.hf})")
        tensor = state_dict[m.megascale]
        if is_dtensor(tensor):
            raise ValueError(
                f"{m.megascale} is split (a DTensor): export a model on one process, or gather it first "
                "(DTensor.full_tensor())"
            )
        tensor = tensor.detach()
        if m.expert is not None:
            if tuple(tensor.shape) != _megascale_shape(m, config):
                raise ValueError(
                    f"tensor {m.megascale} has shape {list(tensor.shape)}, expected "
                    f"{list(_megascale_shape(m, config))} (experts stacked on the first dimension)"
                )
            out[m.hf] = tensor[m.expert].clone()  # its own storage: safetensors refuses shared ones
            continue
        if m.vocab_rows:
            if tensor.shape[0] != config.padded_vocab_size:
                raise ValueError(
                    f"tensor {m.megascale} has {tensor.shape[0]} rows, expected the padded vocabulary "
                    f"{config.padded_vocab_size}"
                )
            tensor = tensor[: config.vocab_size]
        if tuple(tensor.shape) != m.hf_shape:
            raise ValueError(
                f"tensor {m.megascale} has shape {list(tensor.shape)}, expected {list(m.hf_shape)}"
            )
        # safetensors stores contiguous tensors that share no storage: the unpadded rows become their own
        out[m.hf] = (
            tensor.clone() if m.vocab_rows and config.vocab_size != config.padded_vocab_size else tensor
        )
        out[m.hf] = out[m.hf].contiguous()
    return out


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded
