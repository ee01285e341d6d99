"""Tied input/output embeddings under pipeline parallelism, Megatron's way (issue 47), without Lightning: the
first stage holds the embedding, the last a copy under the same name, and a training loop of one's own sums
their gradients once per step (``runtime.sum_tied_gradients()``) after ZeRO's reduction.

Each layout trains a tied megascale GPT and a user's tied model (``pipeline_layers()`` only) for three steps of
SGD with momentum and global-norm clipping (the tied tensor counted once in the norm), against one process on
the union batch; the copies are checked identical afterwards, and the last stage's copy (its checkpoint name,
``head...weight``) equals one process's. Tolerance as in test_compose.py: float32, order of sums only.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan, clip_grad_norm_, materialize, parallelize
from tests._dist import run_distributed
from tests._models import Head, LayeredLM, MLPBlock, full_weights
from tests.core._tiny import TINY_GQA_GPT

WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-6
STEPS = 3
LR = 0.05
MAX_NORM = 0.5  # below the models' gradient norms: every step clips, so a norm counting the copy twice shows
BATCH, SEQ = 8, 8


class TiedLM(LayeredLM):
    """A user's model whose head projection is its embedding."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        super().__init__(vocab, width, [MLPBlock(width) for _ in range(layers)], Head(width, vocab))
        self.head.proj.weight = self.embed.weight


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4, "tie_embeddings": True}))
    return TiedLM()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 60, (BATCH, SEQ), generator=gen), torch.randint(
        0, 60, (BATCH, SEQ), generator=gen
    )


def _train(model: nn.Module, runtime: Any, dp_rank: int, dp: int) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)
    if runtime is not None:
        runtime.zero.attach_optimizers([optimizer])
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = _batch(step)
        share = BATCH // dp
        tokens, targets = (
            tokens[dp_rank * share : (dp_rank + 1) * share],
            targets[dp_rank * share : (dp_rank + 1) * share],
        )
        loss = model(tokens, targets)
        if runtime is None:
            loss.backward()
        else:
            runtime.zero.after_backward()
            runtime.sum_tied_gradients()
        norm = clip_grad_norm_(
            model.parameters(), MAX_NORM, sum_group=runtime.grad_norm_group if runtime else None
        )
        norms.append(float(norm))
        if runtime is not None:
            runtime.zero.before_optimizer_step(optimizer)
        optimizer.step()
        if runtime is not None:
            runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        if dp > 1:
            dist.all_reduce(value, group=runtime.mesh["dp"].get_group())
            value /= dp
        losses.append(float(value))
    if runtime is not None:
        runtime.zero.wait_for_params()
    return losses, norms


def _reference(kind: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = _build(kind)
    materialize(model, "cpu", seed=torch.initial_seed())
    losses, norms = _train(model, None, 0, 1)
    return {"losses": losses, "norms": norms, "weights": full_weights(model, exclude="rope")}


def _layout_worker(rank: int, world: int, kind: str, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runtime = parallelize(model, plan, mesh, device="cpu", sum_tied_gradients=True)
        assert runtime.tied is not None
        losses, norms = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size())
        runtime.tied.check()  # raises on both stages if the copies differ
        out[repr(kw)] = {"losses": losses, "norms": norms, "weights": full_weights(model, exclude="rope")}
        runtime.zero.remove()
    return out


LAYOUTS = {
    "gpt": [
        dict(pp=2, zero_stage=0, num_microbatches=2),
        dict(pp=2, zero_stage=1, zero1_sharding="parameters", num_microbatches=2),
        dict(tp=2, pp=2, zero_stage=0),
        dict(pp=2, zero_stage=0, schedule="interleaved", virtual_stages=2, num_microbatches=2),
    ],
    "own": [
        dict(pp=2, zero_stage=0, num_microbatches=2),
        dict(pp=4, zero_stage=0, num_microbatches=4),
    ],
}


@pytest.mark.parametrize("kind", ["gpt", "own"])
def test_tied_embeddings_under_pp_train_like_one_process(kind: str) -> None:
    want = _reference(kind)
    tied_name = "head.proj.logits.weight" if kind == "gpt" else "head.proj.weight"
    assert torch.equal(want["weights"][tied_name], want["weights"]["embed.weight"])
    for rank, result in enumerate(run_distributed(_layout_worker, 4, kind, LAYOUTS[kind], timeout=300)):
        for name, got in result.items():
            where = f"{kind} {name} rank {rank}"
            assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), where
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), where  # the tied tensor once
            assert got["weights"].keys() == want["weights"].keys(), where
            worst = max((got["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
            assert worst <= WEIGHT_TOL, f"{where}: weights differ by up to {worst:.2e}"


def _refused_worker(rank: int, world: int) -> dict[str, str]:
    out = {}
    for zero in (dict(zero_stage=1), dict(zero_stage=2)):
        plan = ParallelPlan(pp=2, num_microbatches=2, **zero)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build("own")
        try:
            parallelize(model, plan, mesh, device="cpu", sum_tied_gradients=True)
            out[repr(zero)] = "accepted"
        except ValueError as e:
            out[repr(zero)] = str(e)
    return out


def test_a_zero_that_leaves_gradients_in_pieces_is_refused_by_name() -> None:
    for result in run_distributed(_refused_worker, 4, timeout=120):
        assert "zero_stage=1 (zero1_sharding='elements')" in result["{'zero_stage': 1}"]
        assert "zero_stage=2: the two copies' gradients are summed whole" in result["{'zero_stage': 2}"]
