"""A memory check a strategy can run before it builds anything: does the layout fit the device?

``memory_warning`` predicts the layout's memory per rank (``predict_memory``) for the run's micro-batch and
sequence length and returns a sentence when it exceeds what the device offers, naming the largest parts and
what would shrink them, or None when it fits. It takes what a strategy knows at setup: the model's
``GPTConfig``, its ``ParallelPlan``, the world size, the micro-batch size and sequence length, and the device's
memory in bytes.
"""

from __future__ import annotations

from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.plan.layout import Kernels, Layout, Workload
from megascale.core.plan.memory import predict_memory

__all__ = ["memory_warning"]

_GB = 1e9


def memory_warning(
    config: GPTConfig,
    plan: ParallelPlan,
    world_size: int,
    *,
    micro_batch_size: int,
    seq_len: int,
    device_memory: float,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    cuda: bool = True,
    usable_fraction: float = 0.9,
) -> str | None:
    """A warning when ``plan`` is predicted to need more than ``usable_fraction`` of ``device_memory`` bytes
    per rank (see the module docstring); None when it fits."""
    dp = plan.dims(world_size).dp
    micro = micro_batch_size
    workload = Workload(config, seq_len=seq_len, global_batch=dp * micro * (plan.microbatches if plan.pp > 1 else 1),
                        precision=precision, optimizer=optimizer,  # type: ignore[arg-type]
                        kernels=Kernels.gpu() if cuda else Kernels.cpu())  # fmt: skip
    rank = predict_memory(workload, Layout(plan, dp=dp, micro_batch_size=micro)).peak
    budget = device_memory * usable_fraction
    if rank.total <= budget:
        return None
    parts = {
        "parameters, gradients and optimizer state": rank.states,
        "saved activations": rank.activations,
        "pipeline buffers": rank.pipeline_buffers,
        "gathered parameters (ZeRO-2/3)": rank.gathered_parameters,
        "workspace (logits, recomputation)": rank.workspace,
    }
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    hints = []
    if rank.states > budget / 2:
        hints.append("a higher zero_stage or larger tp/pp shards the training state")
    if rank.activations > budget / 4:
        hints.append("activation_checkpointing ('selective', then 'full'), sequence_parallel or a smaller "
                     "micro-batch cut the activations")  # fmt: skip
    if rank.pipeline_buffers > budget / 4:
        hints.append("smaller microbatches (more of them) or fewer pipeline stages cut the pipeline's receive "
                     "buffers, which hold every microbatch in flight")  # fmt: skip
    return (
        f"this layout (tp={plan.tp}, pp={plan.pp}, dp={dp}, zero_stage={plan.zero_stage}, micro-batch {micro} × "
        f"{seq_len} tokens) is predicted to need {rank.total / _GB:.1f} GB on pipeline rank {rank.pp_rank}, more "
        f"than {usable_fraction:.0%} of the device's {device_memory / _GB:.1f} GB; largest: "
        + ", ".join(f"{name} {v / _GB:.1f} GB" for name, v in largest)
        + (". " + "; ".join(hints) if hints else "")
        + ". `megascale plan` ranks layouts that fit."
    )
