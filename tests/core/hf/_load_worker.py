"""A rank that loads a Hugging Face checkpoint into a GPT split by ``parallelize``, counting what it reads.

Counting sits below megascale: ``safetensors.safe_open`` is wrapped, so every byte handed out by a file
(a whole tensor or a slice) is recorded whoever asked for it; the loader's own counter is not trusted here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist

from megascale.core import GPT
from megascale.core.hf import HFWeights, gpt_config_from_hf
from megascale.core.parallel import ParallelPlan, parallelize
from tests._models import full_weights

BATCH, SEQ = 4, 16


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step-0 batch: (inputs, targets) of BATCH sequences of SEQ tokens."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


class _Slice:
    def __init__(self, inner: Any, name: str, log: list[tuple[str, int]]) -> None:
        self._inner, self._name, self._log = inner, name, log

    def get_shape(self) -> Any:
        return self._inner.get_shape()

    def get_dtype(self) -> Any:
        return self._inner.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self._inner[index]
        self._log.append((self._name, out.numel() * out.element_size()))
        return out


class _File:
    def __init__(self, inner: Any, log: list[tuple[str, int]]) -> None:
        self._inner, self._log = inner, log

    def keys(self) -> Any:
        return self._inner.keys()

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._inner.get_slice(name), name, self._log)

    def get_tensor(self, name: str) -> torch.Tensor:
        out = self._inner.get_tensor(name)
        self._log.append((name, out.numel() * out.element_size()))
        return out


@contextmanager
def counting_reads() -> Iterator[list[tuple[str, int]]]:
    """Within: every tensor or slice a safetensors file returns is logged as (name, bytes)."""
    log: list[tuple[str, int]] = []
    real = safetensors.safe_open

    def safe_open(*args: Any, **kwargs: Any) -> _File:
        return _File(real(*args, **kwargs), log)

    safetensors.safe_open = safe_open  # type: ignore[assignment]
    try:
        yield log
    finally:
        safetensors.safe_open = real  # type: ignore[assignment]


def load_and_evaluate(rank: int, world: int, hf_dir: str, layouts: dict[str, dict[str, Any]]) -> dict:
    """For each layout: build the GPT on meta, point it at ``hf_dir``, ``parallelize`` (which loads it), and
    return the step-0 loss of ``batch`` (mean over dp), what this rank read, what it holds, and the whole
    weights gathered from every rank."""
    torch.manual_seed(0)
    config = gpt_config_from_hf(json.loads((Path(hf_dir) / "config.json").read_text()))
    out = {}
    for name, kw in layouts.items():
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = GPT(config)
        model.weights_source = HFWeights(hf_dir)
        with counting_reads() as reads:
            runtime = parallelize(model, plan, mesh, device="cpu")
        inputs, targets = batch(config.vocab_size)
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        share = BATCH // dp
        with torch.no_grad():
            loss = model(
                inputs[dp_rank * share : (dp_rank + 1) * share],
                targets[dp_rank * share : (dp_rank + 1) * share],
            ).detach()
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        out[name] = {
            "loss": float(loss),
            "reads": reads,
            "tp": (mesh["tp"].get_local_rank(), mesh["tp"].size()),
            "layers": sorted(int(i) for i in model.blocks),
            "first": model.embed is not None,
            "last": model.head is not None,
            "weights": full_weights(model, exclude="rope"),
        }
        runtime.zero.remove()
    return out
