"""Tied input/output embeddings under pipeline parallelism, Megatron's way (issue 47), without Lightning: the
first stage holds the embedding, the last a copy under the same name, and a training loop of one's own sums
their gradients once per step (``runtime.sum_tied_gradients()``) after ZeRO's reduction (whole, in ZeRO-2's
shards, or in ZeRO-1's pieces).

Each layout trains a tied megascale GPT and a user's tied model (``pipeline_layers()`` only) for three steps of
SGD with momentum and global-norm clipping (the tied tensor counted once in the norm), against one process on
the union batch; the copies are checked identical afterwards, and the last stage's copy (its checkpoint name,
``head...weight``) equals one process's. Tolerance as in test_compose.py: float32, order of sums only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
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
LR = 0.05
MAX_NORM = 0.5  # below the models' gradient norms: every step clips, so a norm counting the copy twice shows
BATCH, SEQ = 8, 8


class TiedLM(LayeredLM):
    """A user's model whose head projection is its embedding."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        super().__init__(vocab, width, [MLPBlock(width) for _ in range(layers)], Head(width, vocab))
        self.head.proj.weight = self.embed.weight


def _build(kind: str, hf_dir: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    if kind == "hf":  # a Hugging Face model saved with tie_word_embeddings=True, loaded by each stage
        from megascale.core.hf import HFWeights, gpt_config_from_hf

        model = GPT(gpt_config_from_hf(json.loads((Path(str(hf_dir)) / "config.json").read_text())))
        model.weights_source = HFWeights(hf_dir)
        return model
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4, "tie_embeddings": True}))
    return TiedLM()


def _train(model: nn.Module, runtime: Any, dp_rank: int, dp: int) -> tuple[list[float], list[float]]:
    return train(model, runtime, dp_rank, dp, pipelined=runtime is not None, steps=STEPS, lr=LR,
                 max_norm=MAX_NORM, size=BATCH, seq=SEQ, weight_decay=0.1)  # fmt: skip


def _reference(kind: str, hf_dir: str | None = None) -> dict[str, Any]:
    if kind == "hf":
        from megascale.core.hf import gpt_from_hf

        model: nn.Module = gpt_from_hf(str(hf_dir))
    else:
        with torch.device("meta"):
            model = _build(kind)
        materialize(model, "cpu", seed=torch.initial_seed())
    losses, norms = _train(model, None, 0, 1)
    return {"losses": losses, "norms": norms, "weights": full_weights(model, exclude="rope")}


def _layout_worker(
    rank: int, world: int, kind: str, layouts: list[dict[str, Any]], hf_dir: str | None
) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(kind, hf_dir)
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
        dict(pp=2, zero_stage=1, zero1_sharding="elements", num_microbatches=2),
        dict(pp=2, zero_stage=2, num_microbatches=2),
        dict(tp=2, pp=2, zero_stage=0),
        dict(pp=2, zero_stage=0, schedule="interleaved", virtual_stages=2, num_microbatches=2),
        dict(pp=2, zero_stage=2, schedule="zb1p", num_microbatches=2),
    ],
    "hf": [
        dict(pp=2, zero_stage=0, num_microbatches=2),
        dict(tp=2, pp=2, zero_stage=0),
    ],
    "own": [
        dict(pp=2, zero_stage=0, num_microbatches=2),
        dict(pp=2, zero_stage=2, num_microbatches=2),
        dict(pp=4, zero_stage=0, num_microbatches=4),
    ],
}


@pytest.mark.parametrize("kind", ["gpt", "hf", "own"])
def test_tied_embeddings_under_pp_train_like_one_process(kind: str, tmp_path: Path) -> None:
    hf_dir = None
    if kind == "hf":
        from tests.core.hf._tiny_hf import save_tiny

        save_tiny("llama", True, tmp_path)
        hf_dir = str(tmp_path)
    want = _reference(kind, hf_dir)
    tied_name = "head.proj.weight" if kind == "own" else "head.proj.logits.weight"
    assert torch.equal(want["weights"][tied_name], want["weights"]["embed.weight"])
    for rank, result in enumerate(
        run_distributed(_layout_worker, 4, kind, LAYOUTS[kind], hf_dir, timeout=300)
    ):
        for name, got in result.items():
            where = f"{kind} {name} rank {rank}"
            assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), where
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), where  # the tied tensor once
            assert got["weights"].keys() == want["weights"].keys(), where
            worst = max((got["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
            assert worst <= WEIGHT_TOL, f"{where}: weights differ by up to {worst:.2e}"


def _refused_worker(rank: int, world: int) -> str:
    plan = ParallelPlan(pp=4, num_microbatches=4)
    mesh = plan.dims(world).build_mesh("cpu")
    with torch.device("meta"):
        model = _build("own")
        model.blocks[2].up.weight = model.blocks[1].up.weight  # stages 1 and 2 of 4: neither first nor last
    try:
        parallelize(model, plan, mesh, device="cpu", sum_tied_gradients=True)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_tie_between_other_stages_than_the_first_and_last_is_refused_by_name() -> None:
    for result in run_distributed(_refused_worker, 4, timeout=120):
        assert "'blocks.1.up.weight' of" in result and "layers 'blocks.1' and 'blocks.2'" in result, result
        assert "only a tensor tied between the first and the last stage can be" in result, result


class _HiddenTieHead(nn.Module):
    """Projects with the embedding's weight reached through a list: a tie no module shows."""

    def __init__(self, embed: nn.Embedding, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self._embed = [embed]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self._embed[0].weight)


def _hidden_tie_worker(rank: int, world: int, meta: bool) -> str:
    plan = ParallelPlan(pp=2, num_microbatches=2)
    mesh = plan.dims(world).build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = LayeredLM(64, 32, [MLPBlock(32) for _ in range(2)], nn.Identity())
        model.head = _HiddenTieHead(model.embed, 32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime = parallelize(model, plan, mesh, device="cpu", sum_tied_gradients=True)
    tokens = torch.randint(0, 60, (4, 8))
    model(tokens, tokens)  # the first step completes on every stage (meta: zeros stand in)
    try:
        runtime.check_first_step()
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("meta", [False, True])
def test_a_tie_no_module_shows_is_refused_by_name_after_the_first_step(meta: bool) -> None:
    """Built whole, the last stage would project with a stale copy nobody trains (silently wrong); built on
    the meta device, with a tensor of no values."""
    for result in run_distributed(_hidden_tie_worker, 2, meta, timeout=120):
        assert "pipeline stage 1 used parameter 'embed.weight', which stage 0 holds" in result, result
