"""``ParallelPlan(compile=True)``: every block compiled in place, trained like one eager process.

The layouts train as in tests/core/test_compose.py (three SGD steps with momentum and global-norm clipping on
the union batch, the tiny GPT, no dropout), with the blocks compiled, against one eager process. Tolerance:
test_compose's (weights 1e-6, losses 1e-6): inductor fuses elementwise work and may reorder a reduction, a few
float32 roundings; a wrong update moves weights by ~1e-3. Numbers cannot tell a block left uncompiled, so the
tests also check which modules run compiled code (the blocks, nothing else).
Compiling costs ~30 s per process and graph on CPU: the CI tier runs one process and dp2 × ZeRO-1; the slow
tier tp2, pp2, cp2, ep2 and ZeRO-2 with full activation checkpointing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megascale.core.parallel import ParallelPlan, materialize, parallelize
from tests._dist import run_distributed
from tests.core.test_compose import _build, _compare, _full_weights, _reference, _train


def _compiled(model: nn.Module) -> list[str]:
    """Names of the modules that run compiled (``nn.Module.compile`` sets ``_compiled_call_impl``)."""
    return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def _worker(rank: int, world: int, layout: dict[str, Any]) -> dict[str, Any]:
    torch._dynamo.reset()
    plan = ParallelPlan(**layout, compile=True)
    mesh = plan.dims(world).build_mesh("cpu")
    with torch.device("meta"):
        model = _build("gpt")
    runtime = parallelize(model, plan, mesh, device="cpu")
    compiled = _compiled(model)
    losses = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size(), pipelined=plan.pp > 1)
    runtime.zero.remove()
    return {"losses": losses, "weights": _full_weights(model), "compiled": compiled}


LAYOUTS = [
    pytest.param(dict(zero_stage=1), id="dp2-zero1"),
    pytest.param(dict(tp=2), id="tp2", marks=pytest.mark.slow),
    pytest.param(dict(pp=2, num_microbatches=2), id="pp2", marks=pytest.mark.slow),
    pytest.param(
        dict(zero_stage=2, activation_checkpointing="full"), id="dp2-zero2-ac", marks=pytest.mark.slow
    ),
    pytest.param(dict(cp=2), id="cp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_blocks_train_like_one_eager_process(layout: dict[str, Any]) -> None:
    want = _reference("gpt")
    for rank, got in enumerate(run_distributed(_worker, 2, layout, timeout=600)):
        blocks = {f"blocks.{i}" for i in range(4)} if layout.get("pp", 1) == 1 else None
        assert got["compiled"] and all(n.startswith("blocks.") for n in got["compiled"]), got["compiled"]
        assert blocks is None or set(got["compiled"]) == blocks, got["compiled"]
        _compare(got, want, f"compile {layout} rank {rank}")


@pytest.mark.slow
def test_compiled_moe_blocks_with_experts_over_ep_train_like_one_eager_process() -> None:
    """The mixture-of-experts GPT of test_expert_parallel.py at ep2 (its tolerances: tokens per expert equal,
    weights 1e-6): the router and experts in compiled blocks, the all-to-all dispatch eager between them."""
    from tests.core import test_expert_parallel as moe

    want = moe._reference(True)
    layouts = [(dict(ep=2, zero_stage=0, compile=True), True)]
    for rank, result in enumerate(run_distributed(moe._layout_worker, 2, layouts, timeout=600)):
        for name, got in result.items():
            moe._compare(got, want, f"compiled {name} rank {rank}")


def test_one_process_compiles_each_listed_block_and_a_model_without_blocks_is_refused() -> None:
    from megascale.core.parallel.compile import compile_blocks

    torch._dynamo.reset()
    want = _reference("gpt")
    with torch.device("meta"):
        model = _build("gpt")
    materialize(model, "cpu", seed=torch.initial_seed())
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(b)] for b in compile_blocks(model)] == [f"blocks.{i}" for i in range(4)]
    assert _compiled(model) == [f"blocks.{i}" for i in range(4)]
    got = {"losses": _train(model, None, 0, 1, pipelined=False), "weights": _full_weights(model)}
    _compare(got, want, "one process, compiled")
    with pytest.raises(
        ValueError, match=r"compile=True compiles the blocks a model lists in pipeline_layers\(\)"
    ):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)))
