"""User code that raises on some ranks only is raised on every rank.

Under pipeline parallelism each stage runs the user's hooks on its own part of the model: ``configure_optimizers``
of a stage whose parameters are all frozen gets an empty list, and torch raises there while the other stages
go on into a collective and wait for it until the timeout. Raised on every rank instead, at once, naming where.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def raised_together(what: str, call: Callable[[], T], here: str, hint: str = "") -> T:
    """``call()`` on every rank; if it raised on any, it raises on all: the error itself where every rank
    raised, else a RuntimeError naming ``what``, the ranks that raised (each says ``here``: "rank 1 (pipeline
    stage 0)") and the first one's error, then ``hint``."""
    error: Exception | None = None
    try:
        result = call()
    except Exception as raised:
        error = raised
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result
    said: list[tuple[str, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(said, (here, None if error is None else f"{type(error).__name__}: {error}"))
    failed = [(where, message) for where, message in said if message is not None]  # type: ignore[misc]
    if not failed:
        return result
    if len(failed) == len(said) and error is not None:
        raise error
    where = ", ".join(where for where, _ in failed)
    first = (failed[0][1] or "").strip().splitlines()[0]
    raise RuntimeError(f"MegaScaleStrategy: {what} raised on {where} only: {first}{hint}") from error
