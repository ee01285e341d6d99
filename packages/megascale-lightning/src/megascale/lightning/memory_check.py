"""Before the first step: is the user's layout predicted to fit the device? (``megascale plan``'s memory model.)

An out-of-memory error at step 1 of a large job costs a queue slot and says little; the planner's memory
model (``megascale.core.plan.memory_warning``, validated within 1% on CPU layouts) can say beforehand that a
layout will not fit, which parts are largest, and what would shrink them. The strategy asks once, at the
first training batch — the first moment the micro-batch size and sequence length are known — for modules
that hold a megascale ``GPTConfig`` as ``config``, on devices that report their memory (CUDA). It warns; it
does not stop the run (the model is an estimate).
"""

from __future__ import annotations

from typing import Any

import torch

from megascale.core import GPTConfig
from megascale.core.parallel.plan import ParallelPlan

__all__ = ["device_memory", "layout_memory_warning"]


def device_memory(device: torch.device) -> float | None:
    """Bytes of memory of ``device``, or None where it cannot be told (a CPU shares the host's memory)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


def layout_memory_warning(
    module: Any, plan: ParallelPlan, world_size: int, batch: Any, device: torch.device, precision: str
) -> str | None:
    """The planner's warning for ``module`` trained at ``plan`` on batches like ``batch`` (this rank's),
    or None: it fits, the module is not a megascale GPT, or the device's memory is unknown."""
    config = getattr(module, "config", None)
    memory = device_memory(device)
    if not isinstance(config, GPTConfig) or memory is None:
        return None
    from megascale.core.plan.check import memory_warning
    from megascale.lightning.module import split_batch

    try:
        inputs, _ = split_batch(batch)
    except TypeError:
        return None
    rows, seq_len = int(inputs.shape[0]), int(inputs.shape[-1])
    micro = max(rows // plan.microbatches, 1) if plan.pp > 1 else rows
    optimizer = "lamb" if getattr(module, "optimizer_name", "adamw") == "lamb" else "adamw"
    return memory_warning(
        config, plan, world_size, micro_batch_size=micro, seq_len=seq_len, device_memory=memory,
        precision="bf16-mixed" if precision == "bf16-mixed" else "32-true", optimizer=optimizer,
        cuda=device.type == "cuda",
    )  # fmt: skip
