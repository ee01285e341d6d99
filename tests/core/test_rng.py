"""The model-parallel random streams (``megascale.core.parallel.rng``): dropout independent across
tensor-parallel ranks where activations are split, identical where they are replicated, offset per pipeline
stage, replayed exactly by activation checkpointing, and resumable from a checkpoint.

One process: the stream mechanics. Real tp2 / pp2 ranks: a GPT with dropout 0.1 trained through
``parallelize`` — its replicated parameters stay bitwise equal across tp ranks (they diverge if a replicated
region's mask differs between ranks), split regions draw different masks on the two ranks, and gradients with
full activation checkpointing equal those without (a recomputation drawing a fresh tensor-parallel mask would
change them by ~1e-2; equal here bitwise up to the recomputation's float order: bound 1e-6).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core._dtensor import is_dtensor, local
from megascale.core.parallel import ParallelPlan, parallelize
from megascale.core.parallel.rng import ModelParallelRNG
from tests._dist import run_distributed
from tests.core._tiny import TINY_GQA_GPT

# ---- one process ---------------------------------------------------------------------------------------


def test_a_fork_draws_its_own_stream_and_leaves_the_default_one_where_it_was() -> None:
    torch.manual_seed(7)
    plain = [torch.rand(3) for _ in range(3)]
    torch.manual_seed(7)
    rng = ModelParallelRNG(7, tp_rank=0, pp_rank=0, pp=1, device="cpu")
    first = torch.rand(3)
    with rng.fork():
        split_a = torch.rand(3)
    second = torch.rand(3)
    with rng.fork():
        split_b = torch.rand(3)
    third = torch.rand(3)
    for got, want in zip((first, second, third), plain):
        assert torch.equal(got, want), "drawing in a fork moved the default stream"
    assert not torch.equal(split_a, split_b), "the tensor-parallel stream did not advance"
    assert not torch.equal(split_a, plain[1])

    other = ModelParallelRNG(7, tp_rank=1, pp_rank=0, pp=1, device="cpu")
    with other.fork():
        split_other = torch.rand(3)
    assert not torch.equal(split_a, split_other), "tp ranks 0 and 1 drew the same split-region stream"


def test_pipeline_stages_start_from_different_default_streams_and_pp1_leaves_it_alone() -> None:
    draws = []
    for pp_rank in (0, 1):
        torch.manual_seed(3)
        ModelParallelRNG(3, tp_rank=0, pp_rank=pp_rank, pp=2, device="cpu")
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])
    torch.manual_seed(3)
    torch.rand(2)  # the run drew something before: pp = 1 must not re-seed
    expected = torch.rand(4)
    torch.manual_seed(3)
    torch.rand(2)
    ModelParallelRNG(3, tp_rank=1, pp_rank=0, pp=1, device="cpu")
    assert torch.equal(torch.rand(4), expected)


def test_state_dict_resumes_both_streams() -> None:
    torch.manual_seed(5)
    rng = ModelParallelRNG(5, tp_rank=1, pp_rank=0, pp=1, device="cpu")
    torch.rand(2)
    with rng.fork():
        torch.rand(2)
    saved = rng.state_dict()
    with rng.fork():
        want_split = torch.rand(4)
    want_default = torch.rand(4)

    torch.manual_seed(99)  # another process, fresh
    resumed = ModelParallelRNG(99, tp_rank=1, pp_rank=0, pp=1, device="cpu")
    resumed.load_state_dict(saved)
    with resumed.fork():
        assert torch.equal(torch.rand(4), want_split)
    assert torch.equal(torch.rand(4), want_default)
    with pytest.raises(KeyError, match="tensor_parallel"):
        resumed.load_state_dict({"default": saved["default"]})


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8), nn.Dropout(0.5))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_activation_checkpointing_replays_the_forked_masks(checkpointed: bool) -> None:
    from megascale.core.parallel.activation_checkpoint import apply_activation_checkpointing

    def grads(ac: bool) -> list[torch.Tensor]:
        net = _dropout_net()
        torch.manual_seed(11)
        rng = ModelParallelRNG(11, tp_rank=1, pp_rank=0, pp=1, device="cpu")
        rng.fork_around(net[1])  # one split-region dropout, one on the default stream
        if ac:
            apply_activation_checkpointing(net, "full", ["0", "1"] if checkpointed else ["0"], rng=rng)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # the stream advances between steps: the replay must use the step's own state
            net(x).square().sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)


# ---- real ranks ----------------------------------------------------------------------------------------

STEPS = 3


def _probe(rng_draws: list[torch.Tensor]) -> Any:
    def hook(_module: nn.Module, _args: Any) -> None:
        rng_draws.append(torch.rand(8))  # what this region's stream would draw now

    return hook


def _gpt_worker(rank: int, world: int, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in layouts:
        ac = layout.pop("ac", False)
        plan = ParallelPlan(**layout, activation_checkpointing="full" if ac else "none")
        mesh = plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(GPTConfig(**{**TINY_GQA_GPT, "n_layers": 2, "dropout": 0.1}))
        torch.manual_seed(1234)
        runtime = parallelize(model, plan, mesh, device="cpu")
        default_after_setup = torch.rand(4)  # pp > 1: each stage's own stream; tp ranks: the same
        split_draws: list[torch.Tensor] = []
        replicated_draws: list[torch.Tensor] = []
        from megascale.core.model.attention import SelfAttention

        attn = next(m for m in model.modules() if isinstance(m, SelfAttention))
        attn.register_forward_pre_hook(_probe(split_draws))  # after the fork hook: inside the split region
        if plan.pp == 1:
            model.head.register_forward_pre_hook(_probe(replicated_draws))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(5)
        grads: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            tokens = torch.randint(0, 60, (4, 8), generator=gen)
            targets = torch.randint(0, 60, (4, 8), generator=gen)
            loss = model(tokens, targets)
            if plan.pp == 1:
                loss.backward()
            if step == 0:
                grads = {n: local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        replicated = {n: local(p).detach().clone() for n, p in model.named_parameters()
                      if not is_dtensor(p) or all(pl.is_replicate() for pl in p.placements)}  # fmt: skip
        out[repr(layout) + (" ac" if ac else "")] = {
            "split": torch.stack(split_draws),
            "replicated": torch.stack(replicated_draws) if replicated_draws else None,
            "replicated_params": replicated,
            "grads": grads,
            "default_after_setup": default_after_setup,
        }
        del runtime
    return out


def test_tensor_parallel_dropout_splits_streams_where_activations_are_split() -> None:
    layouts = [
        dict(tp=2, sequence_parallel=False),
        dict(tp=2, sequence_parallel=True),
        dict(tp=2, sequence_parallel=False, ac=True),
        dict(tp=2, sequence_parallel=True, ac=True),
    ]
    results = run_distributed(_gpt_worker, 2, layouts, timeout=240)
    for name in results[0]:
        r0, r1 = results[0][name], results[1][name]
        assert not torch.equal(r0["split"], r1["split"]), f"{name}: tp ranks drew the same attention masks"
        assert torch.equal(r0["replicated"], r1["replicated"]), f"{name}: replicated draws differ across tp"
        assert torch.equal(r0["default_after_setup"], r1["default_after_setup"]), name
        for k, v in r0["replicated_params"].items():
            assert torch.equal(v, r1["replicated_params"][k]), (
                f"{name}: replicated {k} diverged across tp ranks"
            )
    # full activation checkpointing replays every mask: the same gradients as without it
    for rank in (0, 1):
        for sp in (False, True):
            name = repr(dict(tp=2, sequence_parallel=sp))
            plain, ac = results[rank][name]["grads"], results[rank][name + " ac"]["grads"]
            assert plain.keys() == ac.keys()
            worst = max((plain[k] - ac[k]).abs().max().item() for k in plain)
            assert worst <= 1e-6, (
                f"rank {rank}, SP {sp}: activation checkpointing changed gradients by {worst:.2e}"
            )


def test_pipeline_stages_draw_different_streams() -> None:
    results = run_distributed(_gpt_worker, 2, [dict(pp=2, num_microbatches=2)], timeout=240)
    name = next(iter(results[0]))
    # both ranks were seeded alike just before parallelize: only the per-stage offset tells them apart
    assert not torch.equal(results[0][name]["default_after_setup"], results[1][name]["default_after_setup"])


class _PlannedMLP(nn.Module):
    """A user's MLP: column-parallel up, a dropout on the split features, row-parallel down, a dropout after."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor_parallel_plan = {"up": "colwise", "split_drop": "split_region", "down": "rowwise"}
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.split_drop, self.drop = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(self.split_drop(self.up(x))))


def _plan_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    plan = ParallelPlan(tp=2, sequence_parallel=False)
    mesh = plan.dims(world).build_mesh("cpu")
    torch.manual_seed(0)
    model = _PlannedMLP()
    parallelize(model, plan, mesh, device="cpu")
    split: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    model.split_drop.register_forward_pre_hook(_probe(split))
    model.drop.register_forward_pre_hook(_probe(replicated))
    model(torch.ones(2, 8))
    return {"split": split[0], "replicated": replicated[0]}


def test_a_plans_split_region_draws_its_own_stream() -> None:
    r0, r1 = run_distributed(_plan_worker, 2, timeout=120)
    assert not torch.equal(r0["split"], r1["split"]), "the split region drew the same stream on both tp ranks"
    assert torch.equal(r0["replicated"], r1["replicated"]), "the replicated dropout drew different streams"
