"""Measure what a layout of a small GPT holds per rank: the worker the memory-model test runs on gloo ranks.

For each layout a rank builds the GPT on the meta device, ``parallelize``s it, and trains two AdamW steps (the
first warms up what a first step allocates once: pipeline shape inference, ZeRO buffers). In the second it
measures, from the tensors themselves:

- parameters: the distinct storages of this rank's parameters (local shards);
- gradients: the distinct storages of their ``.grad`` after backward and the ZeRO reduction;
- optimizer state: the distinct storages of the optimizer's state tensors after the step;
- saved activations: the peak of ``SavedTensorMeter`` over forward and backward (every microbatch of a pipeline
  step), ignoring parameters and buffers, plus what activation checkpointing keeps for recomputation (the
  inputs of each checkpointed module, held from its forward until the gradient of its output is computed), which
  the checkpoint's own saved-tensor hooks hide from the meter;
- pipeline receive buffers: the storages the pipeline's stages hold to receive activations and gradients
  (pooled over the microbatches in flight: as many as were in flight at once).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ClassVar

import torch
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core._dtensor import local
from megascale.core.memory_meter import SavedTensorMeter, storages_of
from megascale.core.parallel import ParallelPlan, parallelize
from megascale.core.parallel.activation_checkpoint import checkpoint_targets
from tests._models import Head, LayeredLM, MLPBlock


def _nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        for st in storages_of(local(t)):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _unsharded_param_storages(model: nn.Module) -> list[torch.Tensor]:
    """The parameters FSDP2 (ZeRO-2/3) gathers: their storages are weights, not activations."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
            out += [p for p in m.parameters()]
    return out


def _receive_buffers(pipeline: Any) -> int:
    """Bytes of the receive buffers the pipeline's stages hold for the training schedule (activations from the
    previous stage, gradients from the next; lent or pooled), distinct storages."""
    seen: dict[int, int] = {}
    for (purpose, _), schedule in pipeline._schedules.items():
        if purpose != "train":
            continue
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            for buffer in stage.receive_buffers():
                for st in storages_of(buffer):
                    seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class _CheckpointInputs:
    """Counts, in ``meter``, the inputs of checkpointed modules from their forward to their output's gradient."""

    def __init__(self, modules: list[nn.Module], meter: SavedTensorMeter) -> None:
        self.meter = meter
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in modules]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        held = [self.meter.hold(t) for t in inputs]
        out = output if isinstance(output, torch.Tensor) else output[0]
        if out.requires_grad:
            out.register_hook(lambda grad, held=held: held.clear())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class PlannedLM(LayeredLM):
    """A model of the user's own (plain torch: embedding, residual MLP blocks, head) declaring how tensor
    parallelism splits it, for ``megascale.core.plan.module``."""

    tensor_parallel_plan: ClassVar[dict[str, str]] = {
        "embed": "rowwise",
        "blocks.*.norm": "sequence_parallel",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "head.norm": "sequence_parallel",
        "head.proj": "colwise_rep",
    }

    def __init__(self, vocab: int = 128, width: int = 64, layers: int = 4) -> None:
        super().__init__(vocab, width, [MLPBlock(width) for _ in range(layers)], Head(width, vocab))


def measure_layouts(rank: int, world: int, cases: list[dict], batch: int, seq: int) -> list[dict]:
    """Per case (``plan``: ParallelPlan kwargs, ``config``: GPTConfig kwargs, or ``own``: ``PlannedLM`` kwargs,
    ``precision``), this rank's bytes and its mesh coordinates; ``batch`` sequences per data-parallel rank."""
    out = []
    for case in cases:
        kw, config = case["plan"], case["config"]
        mixed = case.get("precision") == "bf16-mixed"
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = PlannedLM(**case["own"]) if "own" in case else GPT(GPTConfig(**config))
        vocab = case["own"]["vocab"] if "own" in case else config["vocab_size"]
        runtime = parallelize(model, plan, mesh, device="cpu", param_dtype=torch.bfloat16 if mixed else None)
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runtime.zero.attach_optimizers([optimizer])
        ckpt = (
            checkpoint_targets(model, plan.activation_checkpointing, plan.checkpoint_modules)
            if (plan.activation_checkpointing != "none")
            else []
        )
        result: dict[str, Any] = {}
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, vocab, (batch * dp, seq), generator=gen)
            tokens = tokens[dp_rank * batch : (dp_rank + 1) * batch].clone()  # its own storage, no larger
            targets = tokens.roll(-1, dims=1)
            meter = None
            if step == 1:
                ignore = [*model.parameters(), *model.buffers()]
                if plan.zero_stage >= 2 and dp > 1:
                    ignore += _unsharded_param_storages(model)
                meter = SavedTensorMeter(ignore=ignore)
                holder = _CheckpointInputs(ckpt, meter)
                meter.__enter__()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                loss = model(tokens, targets)
            if plan.pp == 1:
                loss.backward()
            if meter is not None:
                meter.__exit__(None, None, None)
                holder.remove()
                result["activations"] = meter.peak
            runtime.zero.after_backward()
            if step == 1:
                result["gradients"] = _nbytes(p.grad for p in model.parameters())
            runtime.zero.before_optimizer_step(optimizer)
            optimizer.step()
            runtime.zero.after_optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        runtime.zero.wait_for_params()
        result["parameters"] = _nbytes(model.parameters())
        result["optimizer_state"] = _nbytes(_state_tensors(optimizer))
        result["receive_buffers"] = _receive_buffers(runtime.pipeline) if runtime.pipeline is not None else 0
        result["coords"] = {d: mesh[d].get_local_rank() for d in ("dp", "pp", "tp")}
        out.append(result)
        runtime.zero.remove()
    return out


def count_tp_calls(
    rank: int, world: int, cases: list[dict[str, Any]], batch: int, seq: int
) -> list[dict[str, int]]:
    """For each case (a GPT config and a tensor-parallel plan over every rank): the collective calls one
    forward and backward issues on this rank, counted by the profiler's c10d ops after a warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for case in cases:
        plan = ParallelPlan(**case["plan"])
        mesh = plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(GPTConfig(**case["config"]))
        parallelize(model, plan, mesh, device="cpu")
        tokens = torch.randint(
            0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
        )

        for profiled in (False, True):  # a warm-up step, then the counted one
            with (
                profile(activities=[ProfilerActivity.CPU], record_shapes=False)
                if profiled
                else nullcontext() as prof
            ):
                model(tokens, tokens.roll(-1, 1)).backward()
            model.zero_grad(set_to_none=True)
        counts: dict[str, int] = {}
        for event in prof.key_averages():
            if event.key.startswith("c10d::") and "barrier" not in event.key:
                counts[event.key] = event.count
        out.append(counts)
    return out
