"""The zero-bubble schedule (issue 35), without Lightning: ``ParallelPlan(schedule="zb1p")`` splits every
backward into its input-gradient half (B), sent on at once, and its weight-gradient half (W), run where 1F1B
would idle (torch's ``ScheduleInterleavedZeroBubble``, arXiv 2401.10241).

A megascale GPT and a user's model (``pipeline_layers()`` only) train three steps of SGD with momentum, weight
decay and global-norm clipping under zb1p layouts, against one process on the union batch: losses, the
clipped norms and the updated weights. W is where the gradients land, so ZeRO-0/1's buckets must be reduced
after it (``_LeanStage.backward_weight_one_chunk`` runs their hooks) and ZeRO-2 (FSDP) after the last W
(torch's end of backward, not FSDP's own hooks, which fire in B): ZeRO over dp2 shows a reduction before W. Tolerance as in test_compose.py: float32, order of sums only. Layouts the split does not carry
yet are refused by name when the plan meets the model.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan, materialize, parallelize
from tests._dist import run_distributed
from tests._models import Head, LayeredLM, MLPBlock, full_weights
from tests.core._tiny import TINY_GQA_GPT
from tests.core._train_loop import train

WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-6
STEPS = 3
BATCH, SEQ = 8, 8


class _DetachedHead(Head):
    """Reads its input detached: the loss reaches the head's weights but no stage's input (torch's split
    alone would give the head no gradient: its weights lie on no path from the stage's inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.detach())


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4}))
    head = _DetachedHead(32, 64) if kind == "detached" else Head(32, 64)
    return LayeredLM(64, 32, [MLPBlock(32) for _ in range(4)], head)


def _train(model: nn.Module, runtime: Any, dp_rank: int, dp: int) -> tuple[list[float], list[float]]:
    return train(model, runtime, dp_rank, dp, pipelined=runtime is not None, steps=STEPS, lr=0.05,
                 max_norm=0.5, size=BATCH, seq=SEQ, weight_decay=0.1)  # fmt: skip


def _reference(kind: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = _build(kind)
    materialize(model, "cpu", seed=torch.initial_seed())
    losses, norms = _train(model, None, 0, 1)
    return {"losses": losses, "norms": norms, "weights": full_weights(model, exclude="rope")}


def _layout_worker(rank: int, world: int, kind: str, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**{"schedule": "zb1p", **kw})
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runtime = parallelize(model, plan, mesh, device="cpu")
        schedule = runtime.pipeline._schedule("train", (BATCH // mesh["dp"].size(), SEQ))
        stages = getattr(schedule, "_stages", [getattr(schedule, "_stage", None)])
        split = [0]
        for stage in stages:  # count the weight halves run apart
            run_w = stage.backward_weight_one_chunk

            def counted(*args: Any, run_w: Any = run_w, split: list[int] = split, **kwargs: Any) -> None:
                split[0] += 1
                run_w(*args, **kwargs)

            stage.backward_weight_one_chunk = counted
        losses, norms = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size())
        out[repr(kw)] = {"losses": losses, "norms": norms, "weights": full_weights(model, exclude="rope"),
                         "w_halves": split[0], "chunks": STEPS * plan.microbatches * len(stages) * (plan.schedule == "zb1p")}  # fmt: skip
        runtime.zero.remove()
    return out


LAYOUTS = {
    "gpt": [
        dict(pp=2, num_microbatches=4, zero_stage=0),
        dict(pp=2, virtual_stages=2, num_microbatches=4, zero_stage=0),
        dict(pp=2, num_microbatches=2, zero_stage=1),  # dp2: ZeRO-1 by elements, buckets after W
        dict(pp=2, num_microbatches=4, zero_stage=1, zero1_sharding="parameters"),
        dict(tp=2, pp=2, num_microbatches=2, zero_stage=0),
        dict(
            pp=2, num_microbatches=2, zero_stage=2
        ),  # FSDP reduces after the last W (torch's end of backward)
    ],
    "own": [
        dict(pp=4, num_microbatches=4, zero_stage=0),
        dict(pp=2, num_microbatches=2, zero_stage=1, overlap_grad_reduce=False),
        dict(pp=2, num_microbatches=4, zero_stage=2),
    ],
    # dp2: the blocks' zero gradients, dropped after the step as unreached (pp/unreached.py), had their buckets
    # launched already (1F1B too: ZeRO-0/1 crashed writing the averages into them)
    "detached": [
        dict(pp=2, num_microbatches=2, zero_stage=0),
        dict(pp=2, num_microbatches=2, zero_stage=1),
        dict(pp=2, num_microbatches=2, zero_stage=0, schedule="1f1b"),
    ],
}


@pytest.mark.parametrize("kind", ["gpt", "own", "detached"])
def test_zb1p_trains_like_one_process(kind: str) -> None:
    want = _reference(kind)
    for rank, result in enumerate(run_distributed(_layout_worker, 4, kind, LAYOUTS[kind], timeout=300)):
        for name, got in result.items():
            where = f"{kind} {name} rank {rank}"
            assert got["w_halves"] == got["chunks"], where  # every backward split in two
            assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), where
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), where
            worst = max((got["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
            assert worst <= WEIGHT_TOL, f"{where}: weights differ by up to {worst:.2e}"


@pytest.mark.parametrize(
    ("plan", "config", "message"),
    [
        (dict(cp=2), {}, "schedule='zb1p' with cp=2"),
        (dict(activation_checkpointing="full"), {}, "schedule='zb1p' with activation_checkpointing='full'"),
        (dict(num_microbatches=5), {}, "num_microbatches=5 is not a multiple of 2"),
        (dict(num_microbatches=1), {}, "at least as many microbatches as pipeline ranks"),
        ({}, dict(moe=dict(num_experts=4, top_k=2)), "schedule='zb1p' with a mixture of experts"),
    ],
)  # fmt: skip
def test_what_the_split_does_not_carry_yet_is_refused_by_name(plan: dict, config: dict, message: str) -> None:
    from megascale.core import MoEConfig

    if "moe" in config:
        config = {**config, "moe": MoEConfig(**config["moe"])}
    with pytest.raises(ValueError, match=r"zb1p|microbatches") as info:
        ParallelPlan(pp=2, schedule="zb1p", **{"num_microbatches": 2, **plan}).check_gpt_config(
            GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4, **config})
        )
    assert message in str(info.value)
