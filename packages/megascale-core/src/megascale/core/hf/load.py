"""Fill a GPT in place from a Hugging Face checkpoint, in whatever layout it is: each rank reads only its part.

    load_hf_weights_(model, "path/to/Llama-3.2-1B")

``model`` may be whole, tensor-parallel (DTensor parameters), one pipeline stage's part of the GPT (only the
layers that stage holds exist), or both. For each parameter this rank holds, the global box it covers (offset
and size per dimension) follows from the DTensor's mesh and placements
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, what DCP uses to reshard); that
box is read from the safetensors file that holds the tensor and nothing else (``safe_open(...).get_slice``
reads the slice's bytes from the memory-mapped file). So a rank of a tp × pp layout reads about 1/(tp·pp) of
the weights, plus the parts every tensor-parallel rank keeps whole (norm weights), and never holds more than
its own shards; loading on every rank the whole state dict and then splitting it needs the whole model's
memory on each (``benchmarks/hf_load.py``).

Mixtures of experts: a stack of experts (``experts.gate``/``up``/``down``, (experts, out, in)) is filled
expert by expert from the checkpoint's per-expert tensors, each rank reading only the experts of its box (a
stack sharded on its first dimension over expert-parallel ranks reads its own experts), and of those only
its box of the other dimensions.

No collective is used: every rank reads its own part from the shared files. Names and layouts map as
``weights.py`` says (tensors move unchanged); the rows of the padded vocabulary beyond ``vocab_size`` are
zeroed. The whole checkpoint is checked against ``model.config`` from the headers and config.json before
anything is read.

Where it runs: ``GPT.init_weights()`` calls it when ``GPT.weights_source`` is an ``HFWeights(path)`` (the
model's seam: the model does not import the HF side), so a GPT built on the meta device and materialised after it was split (``megascale.core.parallel.parallelize`` step 3, before
ZeRO shards anything) is loaded where random weights would otherwise be drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megascale.core._dtensor import is_dtensor, local
from megascale.core.hf.config import config_conflicts, gpt_config_from_hf
from megascale.core.hf.io import HFCheckpoint
from megascale.core.hf.weights import TensorMapping, check_hf_tensors
from megascale.core.model.gpt import GPT
from megascale.core.model.moe import reset_router_buffers

__all__ = ["HFWeights", "LoadReport", "load_hf_weights_", "local_box"]


@dataclass(frozen=True)
class LoadReport:
    """What ``load_hf_weights_`` did on this rank.

    Attributes:
        tensors: parameters filled (a tied embedding counts once).
        bytes_read: bytes read from the safetensors files.
        bytes_in_checkpoint: bytes of every tensor the checkpoint holds for the model: what reading it whole
            costs.
    """

    tensors: int
    bytes_read: int
    bytes_in_checkpoint: int


@dataclass(frozen=True)
class HFWeights:
    """A Hugging Face model directory as a GPT's weights (``GPT.weights_source``): ``init_weights()``, which
    ``parallelize`` calls once the model is split, loads them, each rank reading only the slices it holds.

        with torch.device("meta"):
            model = GPT(gpt_config_from_hf(HFCheckpoint(path).config))
        model.weights_source = HFWeights(path)
    """

    path: str | Path

    def load_into(self, model: GPT) -> None:
        load_hf_weights_(model, self.path)

    def __str__(self) -> str:
        return str(self.path)


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, global offset) of the part of ``param`` this rank holds: the whole tensor at offset 0 for a
    plain tensor, the local shard's box for a DTensor sharded (``Shard``) or replicated over any mesh."""
    if not is_dtensor(param):
        return tuple(param.shape), (0,) * param.ndim
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = param.placements  # type: ignore[attr-defined]
    # Partial holds no part of the values; FSDP2's _StridedShard (FSDP2 × TP) holds interleaved rows, no box
    if not all(type(p) in (Shard, Replicate) for p in placements):
        raise ValueError(
            f"a DTensor placed {placements} is not a box of the whole tensor: load the weights after the "
            "tensor/pipeline split and before ZeRO-2/3 (fully_shard), as parallelize does"
        )
    shape, offset = compute_local_shape_and_global_offset(
        param.shape,
        param.device_mesh,  # type: ignore[attr-defined]
        placements,
    )
    return tuple(shape), tuple(offset)


@torch.no_grad()
def load_hf_weights_(model: GPT, path: str | Path) -> LoadReport:
    """Fill every parameter ``model`` holds on this rank from the Hugging Face model directory ``path``,
    reading only this rank's slices, and recompute the rotary tables. See the module docstring.

    The parameters must be materialised (not on the meta device); their dtype is kept (values are cast).

    Raises:
        FileNotFoundError: naming what the directory lacks.
        ValueError: naming the GPTConfig fields on which ``model.config`` differs from config.json's
            architecture (``config_conflicts``; ``max_seq_len``, ``dropout``, ``pad_vocab_to_multiple_of``,
            ``kernels`` and ``init_std`` may differ); a parameter the checkpoint has no tensor for; a
            parameter on the meta device.
        KeyError, ValueError: for tensors missing from the checkpoint or of another shape
            (``check_hf_tensors``).
    """
    config = model.config
    with HFCheckpoint(path) as checkpoint:
        conflicts = config_conflicts(config, gpt_config_from_hf(checkpoint.config))
        if conflicts:
            raise ValueError(
                f"the GPT's config differs from {checkpoint.path / 'config.json'} in what the network computes: "
                + "; ".join(conflicts)
            )
        mapping = check_hf_tensors(config, checkpoint.keys(), checkpoint.shape)
        by_name: dict[str, list[TensorMapping]] = {}  # one mapping, or a stack's one per expert
        for m in mapping:
            by_name.setdefault(m.megascale, []).append(m)
        tensors = 0
        for name, param in model.named_parameters():  # a tied embedding once
            if name not in by_name:
                raise ValueError(
                    f"parameter {name} of the GPT has no tensor in the Hugging Face checkpoint {checkpoint.path}"
                )
            if param.is_meta:
                raise ValueError(
                    f"parameter {name} is on the meta device: materialise the model first (to_empty), or let "
                    "init_weights() load it (GPT.weights_source = HFWeights(path))"
                )
            mappings = by_name[name]
            if mappings[0].expert is None:
                _fill(local(param), *local_box(param), mappings[0], checkpoint, config.vocab_size)
            else:
                _fill_experts(local(param), *local_box(param), mappings, checkpoint)
            tensors += 1
        model.rope.reset_parameters()
        reset_router_buffers(model)  # balancing biases and token counts start at zero, as init_weights sets
        total = sum(checkpoint.nbytes(m.hf) for m in mapping)
        return LoadReport(tensors=tensors, bytes_read=checkpoint.bytes_read, bytes_in_checkpoint=total)


def _fill(
    target: torch.Tensor,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    mapping: TensorMapping,
    checkpoint: HFCheckpoint,
    vocab_size: int,
) -> None:
    """Copy the box (``offset``, ``shape``) of ``mapping``'s tensor into ``target``, the local part."""
    if tuple(target.shape) != shape:
        raise ValueError(
            f"{mapping.megascale}: the local tensor has shape {list(target.shape)}, its placements imply "
            f"{list(shape)}"
        )
    index = [slice(start, start + size) for start, size in zip(offset, shape, strict=True)]
    rows = shape[0] if shape else 0
    if mapping.vocab_rows:
        # the checkpoint has vocab_size rows; the GPT's rows beyond them are padding, zero
        stored = max(0, min(offset[0] + rows, vocab_size) - offset[0])
        target[stored:].zero_()
        if stored == 0:
            return
        index[0] = slice(offset[0], offset[0] + stored)
        rows = stored
    values = checkpoint.read(mapping.hf, tuple(index))
    target[:rows].copy_(values)


def _fill_experts(
    target: torch.Tensor,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    mappings: list[TensorMapping],
    checkpoint: HFCheckpoint,
) -> None:
    """Fill the box (``offset``, ``shape``) of a stack of experts (first dimension: the expert) into
    ``target`` from the per-expert tensors of ``mappings``, reading only the experts inside the box."""
    if tuple(target.shape) != shape:
        raise ValueError(
            f"{mappings[0].megascale}: the local tensor has shape {list(target.shape)}, its placements imply "
            f"{list(shape)}"
        )
    index = tuple(slice(start, start + size) for start, size in zip(offset[1:], shape[1:], strict=True))
    for m in mappings:
        assert m.expert is not None
        if offset[0] <= m.expert < offset[0] + shape[0]:
            target[m.expert - offset[0]].copy_(checkpoint.read(m.hf, index))
