"""Gradients are reduced once per step, during the last micro-batch's backward, under every ZeRO stage with
gradient accumulation and with pipeline micro-batches — counted, and with results unchanged.

Counted with ``CollectiveMeter`` (every c10d op on the rank's thread). The model is a small LayeredLM written
here (FSDP units: the embedding, each block, the head). Per optimizer step, a ZeRO-2/3 rank must issue one
reduce-scatter per FSDP unit holding parameters — not one per micro-batch (what FSDP2 does inside an
accumulation unless told not to sync) — and under pp they must all be issued before the stage's
``perform_reduce_grad`` (torch's PipelineStage otherwise reduces every unit there, after the last backward,
overlapping nothing). ZeRO-2 keeps parameters gathered across the micro-batches: one all-gather per unit per
step (+1: the next step's first unit, prefetched after the optimizer step).

Results: weights after the steps equal one process stepping the union batch (SGD with momentum; float32; the
layouts differ only in summation order: observed ≤ 1e-7, bound 1e-6, as in test_compose).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from megascale.core.comm_meter import CollectiveMeter
from megascale.core.parallel import ParallelPlan, materialize, parallelize
from tests._dist import run_distributed
from tests._models import Head, LayeredLM, MLPBlock, full_weights

STEPS = 2
ACCUMULATION = 4
BATCH = 16  # sequences per optimizer step, over every rank and micro-batch
SEQ = 8
LR = 0.05
WEIGHT_TOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return LayeredLM(64, 32, [MLPBlock(32) for _ in range(4)], Head(32, 64))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (BATCH, SEQ), generator=gen), torch.randint(
        0, 64, (BATCH, SEQ), generator=gen
    )


def _reference() -> dict[str, torch.Tensor]:
    with torch.device("meta"):  # initialised as parallelize does (each layer from the seed and its name)
        model = _model()
    materialize(model, "cpu", seed=torch.initial_seed())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        model(*_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return full_weights(model)


def _fsdp_units(model: nn.Module) -> int:
    """FSDP units holding parameters on this rank (each reduce-scatters once per synchronised backward)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {
        id(m._get_fsdp_state()._fsdp_param_group)
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    }
    return len(groups)


def _worker(rank: int, world: int, layout: dict[str, Any], accumulation: int) -> dict[str, Any]:
    from megascale.core.parallel.pp import apply as pipeline_module

    meter = CollectiveMeter()
    original = pipeline_module._LeanStage.perform_reduce_grad

    # where torch's PipelineStage would reduce every unit: after the last backward
    def marked(stage: Any, factor: int) -> None:
        meter.mark("perform_reduce_grad")
        original(stage, factor)

    pipeline_module._LeanStage.perform_reduce_grad = marked  # type: ignore[method-assign]
    plan = ParallelPlan(**layout, bucket_size_mb=0)  # a unit per layer: several reduce-scatters to count
    mesh = plan.dims(world).build_mesh("cpu")
    with torch.device("meta"):
        model = _model()
    runtime = parallelize(model, plan, mesh, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    runtime.zero.attach_optimizers([optimizer])
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    if runtime.pipeline is not None:
        runtime.pipeline.loss_scale = 1.0 / accumulation
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        tokens, targets = _batch(step)
        per_rank = BATCH // dp
        tokens = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].chunk(accumulation)
        targets = targets[dp_rank * per_rank : (dp_rank + 1) * per_rank].chunk(accumulation)
        meter.clear()
        with meter:
            for k in range(accumulation):
                last = k == accumulation - 1
                with runtime.no_sync() if not last else nullcontext():
                    if runtime.pipeline is not None:
                        model(tokens[k], targets[k])  # the schedule runs backward
                    else:
                        (model(tokens[k], targets[k]) / accumulation).backward()
                if last:
                    meter.mark("backward done")
            runtime.zero.after_backward()
            optimizer.step()
            runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        # reduce-scatters issued before the synchronised step's (the last) perform_reduce_grad
        last_mark = max(
            (i for i, r in enumerate(meter.records) if r.label == "perform_reduce_grad"), default=None
        )
        early = (
            None if last_mark is None else sum(r.kind == "reduce_scatter" for r in meter.records[:last_mark])
        )
        steps.append(
            {
                "reduce_scatter": meter.count("reduce_scatter"),
                "all_gather": meter.count("all_gather"),
                "reduce_scatter_before_reduce_grad": early,
            }
        )
    runtime.zero.wait_for_params()
    return {"steps": steps, "units": _fsdp_units(model), "weights": full_weights(model)}


CASES = {
    "dp2 ZeRO-2, 4 accumulated micro-batches": (dict(zero_stage=2), ACCUMULATION, 2),
    "dp2 ZeRO-3, 4 accumulated micro-batches": (dict(zero_stage=3), ACCUMULATION, 2),
    "pp2 x dp2 ZeRO-2, 4 pipeline micro-batches": (dict(pp=2, zero_stage=2, num_microbatches=4), 1, 4),
    "pp2 x dp2 ZeRO-2, 2 steps accumulated": (dict(pp=2, zero_stage=2, num_microbatches=2), 2, 4),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _reference()


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_reduce_scattered_once_per_step_during_the_last_backward(
    case: str, reference: dict[str, torch.Tensor]
) -> None:
    layout, accumulation, world = CASES[case]
    results = run_distributed(_worker, world, layout, accumulation, timeout=180)
    for rank, result in enumerate(results):
        units = result["units"]
        assert units >= 2, f"{case}: rank {rank} has {units} FSDP units; the test needs several"
        for step, counts in enumerate(result["steps"]):
            where = f"{case}, rank {rank}, step {step}"
            assert counts["reduce_scatter"] == units, (
                f"{where}: {counts['reduce_scatter']} reduce-scatters, want {units}"
            )
            if layout.get("pp", 1) > 1:
                # all launched by the last micro-batch's backward, none left for perform_reduce_grad
                assert counts["reduce_scatter_before_reduce_grad"] == units, f"{where}: {counts}"
            if layout["zero_stage"] == 2 and layout.get("pp", 1) == 1:
                # gathered once per step (+1: the next step's first unit, prefetched after the optimizer step);
                # before the first forward every unit is also gathered once (FSDPUnits.gather_units_once)
                once = units if step == 0 else 0
                assert counts["all_gather"] <= units + 1 + once, (
                    f"{where}: {counts['all_gather']} all-gathers"
                )
        worst = max((result["weights"][k] - reference[k]).abs().max().item() for k in reference)
        assert worst <= WEIGHT_TOL, f"{case}, rank {rank}: weights differ from one process by {worst:.2e}"
