"""Random streams of a model-parallel run: dropout that is independent where activations are split and equal
where they are replicated (Megatron-LM's RNG tracker, Shoeybi et al. 2019, §3).

Every rank of a tensor-parallel group starts from the same seed, so that dropout on a replicated activation
draws the same mask on every rank — it must, or the replicas diverge. On an activation a rank holds only a
part of (its attention heads, its sequence shard under sequence parallelism) the same seed is wrong in
another way: every rank draws the same mask pattern for a different part, so the masks of the whole tensor
repeat tp times, and the regularisation is not the one a single process applies. Pipeline stages all
starting from one seed likewise draw identical streams for different layers.

``ModelParallelRNG`` keeps two streams on the device's default generator:

    "default"          torch's own generator: replicated regions. With pp > 1 each stage re-seeds it with
                       seed + 100 × pp_rank (Megatron's offset), so stages draw different streams; with
                       pp = 1 it is left alone, and such layouts draw what one process draws.
    "tensor_parallel"  seed + 2718 + tp_rank (+ 100 × pp_rank): split regions. ``fork()`` swaps it into the
                       generator for the duration of a block, and out again, so the default stream advances
                       alike on every tp rank whatever the split regions drew.

``fork_around(module)`` forks for every forward of ``module`` (hooks). Activation checkpointing recomputes a
forward in backward: ``checkpoint_context`` (the ``context_fn`` of torch's checkpoint) gives the recomputation
the tensor-parallel stream as it was at the original forward — torch's checkpoint restores the default
generator itself (``preserve_rng_state``). ``state_dict()``/``load_state_dict()`` carry both streams into a
checkpoint, so a resumed run draws what an uninterrupted one would.

dp ranks share their streams (Megatron's and Lightning's default): they see different data anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PIPELINE_SEED_OFFSET", "TENSOR_PARALLEL_SEED_OFFSET", "ModelParallelRNG"]

TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron-LM's, so seeds mean the same in both
PIPELINE_SEED_OFFSET = 100


def _get_state(device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _seeded_state(device: torch.device, seed: int) -> Tensor:
    """The generator state ``seed`` gives on ``device``, without disturbing the generator."""
    saved = _get_state(device)
    try:
        if device.type == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            torch.get_device_module(device.type).manual_seed(seed)
        return _get_state(device)
    finally:
        _set_state(device, saved)


class ModelParallelRNG:
    """The default and the tensor-parallel random streams of one rank (see the module docstring).

    Args:
        seed: the run's seed (the same on every rank).
        tp_rank: this rank's coordinate in the tensor-parallel group.
        pp_rank: this rank's pipeline stage; with ``pp > 1`` the default generator is re-seeded here.
        pp: the pipeline size.
        device: whose default generator the streams live on (CPU, or the rank's GPU).
    """

    def __init__(self, seed: int, *, tp_rank: int, pp_rank: int, pp: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu" and self.device.index is None:
            self.device = torch.device(
                self.device.type, torch.get_device_module(self.device.type).current_device()
            )
        self.seed, self.tp_rank, self.pp_rank = seed, tp_rank, pp_rank
        offset = PIPELINE_SEED_OFFSET * pp_rank
        if pp > 1:
            _set_state(self.device, _seeded_state(self.device, seed + offset))
        self._tensor_parallel = _seeded_state(
            self.device, seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank + offset
        )
        self._forked = 0

    # ---- the split-region stream ---------------------------------------------------------------------------

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from the tensor-parallel stream inside; the default stream is untouched by what is drawn."""
        if self._forked:  # nested (a forked module inside another): already on the stream
            yield
            return
        default = _get_state(self.device)
        _set_state(self.device, self._tensor_parallel)
        self._forked += 1
        try:
            yield
        finally:
            self._forked -= 1
            self._tensor_parallel = _get_state(self.device)
            _set_state(self.device, default)

    def fork_around(self, module: nn.Module) -> list[Any]:
        """Run every forward of ``module`` on the tensor-parallel stream; returns the hook handles."""
        contexts: list[AbstractContextManager[None]] = []

        def enter(_module: nn.Module, _args: Any) -> None:
            context = self.fork()
            context.__enter__()
            contexts.append(context)

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            if contexts:
                contexts.pop().__exit__(None, None, None)

        return [
            module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True),
        ]

    # ---- activation checkpointing ----------------------------------------------------------------------------

    def checkpoint_context(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """``context_fn`` for torch's checkpoint: the recomputation draws the tensor-parallel stream from where
        the original forward drew it, and leaves the stream where it was before the recomputation."""
        at_forward: list[Tensor] = []

        @contextmanager
        def forward() -> Iterator[None]:
            at_forward.append(self._tensor_parallel.clone())
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            now = self._tensor_parallel
            self._tensor_parallel = at_forward[0].clone()
            try:
                yield
            finally:
                self._tensor_parallel = now

        return forward(), recompute()

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        """Both streams' generator states (CPU byte tensors)."""
        return {"default": _get_state(self.device).cpu(), "tensor_parallel": self._tensor_parallel.cpu()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue both streams from ``state`` (``state_dict()`` of the same rank of the same layout)."""
        missing = {"default", "tensor_parallel"} - set(state)
        if missing:
            raise KeyError(f"RNG state lacks {sorted(missing)}")
        _set_state(self.device, state["default"])
        self._tensor_parallel = state["tensor_parallel"].clone()
