"""Expert parallelism: a mixture-of-experts GPT whose experts are split over "ep" trains like one process.

The reference is one process on the union batch; each layout's data-parallel ranks take their rows of it.
Compared: the loss of every step, the clipped gradient norm, the router statistics (tokens per expert, summed
over the data-parallel ranks) and every weight and router bias after three steps. Balancing is on: the
sequence-wise auxiliary loss, the z-loss and the loss-free bias update.

Tolerances: the experts' grouped GEMMs see other rows beside them (other ranks' tokens, in another order),
which reorders fp32 sums in the 1e-7 range; 1e-6 on weights and 1e-5 on losses leave room for that and for
nothing else: a routing decision flipped by a wrong exchange moves them by 1e-3 or more, and with the experts'
1/ep left out (tried by hand) the third step's loss of ep=2 already differs beyond 1e-5.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megascale.core import GPT, GPTConfig
from megascale.core.config import MoEConfig
from megascale.core.model.moe import MoE, take_balancing_losses, update_expert_biases
from megascale.core.parallel import ParallelPlan, clip_grad_norm_, materialize, parallelize
from megascale.core.parallel.ep.dispatch import regroup_by_expert, split_by_expert
from tests._dist import run_distributed
from tests._models import full_weights
from tests.core._tiny import TINY_GQA_GPT

WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-5
STEPS = 3
LR = 0.05
MAX_NORM = 0.5
BATCH = 4
SEQ = 16


def test_rows_arriving_by_source_are_regrouped_by_expert() -> None:
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # from rank 0: 2 rows for expert 0, 1 for expert 2; ...
    arrived = ["s0e0a", "s0e0b", "s0e2", "s1e0", "s1e1a", "s1e1b", "s1e1c"]
    order = regroup_by_expert(counts).tolist()
    assert [arrived[i] for i in order] == ["s0e0a", "s0e0b", "s1e0", "s1e1a", "s1e1b", "s1e1c", "s0e2"]
    assert regroup_by_expert(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_rows_sorted_by_expert_are_cut_into_parts_still_sorted_by_expert(chunks: int) -> None:
    counts = torch.tensor([5, 0, 2, 7])
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    parts, indices = split_by_expert(counts, chunks)
    assert parts.sum(0).tolist() == counts.tolist() and parts.shape == (chunks, 4)
    assert (parts.max(0).values - parts.min(0).values).max() <= 1  # even parts of every expert
    assert sorted(torch.cat(indices).tolist()) == list(range(14))  # every row in exactly one part
    for c, idx in enumerate(indices):
        assert torch.bincount(expert_of_row[idx], minlength=4).tolist() == parts[c].tolist()
        assert torch.equal(expert_of_row[idx], expert_of_row[idx].sort().values)


def _overlap_worker(rank: int, world: int) -> list[str]:
    """One MoE layer's forward at ep=2 with 2 parts, recording when each all-to-all is issued and waited."""
    import megascale.core.parallel.ep.dispatch as dispatch

    events: list[str] = []
    issue = dispatch.all_to_all_single_autograd

    def recorded(*args: Any, **kwargs: Any) -> Any:
        events.append("send")
        return issue(*args, **kwargs)

    dispatch.all_to_all_single_autograd = recorded
    plan = ParallelPlan(ep=2, zero_stage=0)
    mesh = plan.dims(world).build_mesh("cpu")
    with torch.device("meta"):
        model = _build(True)
    runtime = parallelize(model, plan, mesh, device="cpu")

    @contextlib.contextmanager
    def timer(kind: str) -> Iterator[None]:
        events.append(f"wait {kind}")
        yield

    runtime.set_wait_timer(timer)
    layer = model.blocks["0"].moe
    layer(torch.randn(2, SEQ, model.config.d_model))
    return events


def test_the_parts_travel_while_the_experts_compute_the_ones_that_arrived() -> None:
    """MegaScale-MoE's overlap: both parts' rows are sent before the first is waited for; part 0's outputs
    are sent back before part 1 is waited for; the waits are timed (megascale-ft's timelines show them)."""
    for events in run_distributed(_overlap_worker, 2, timeout=120):
        assert events == [
            "wait ep-all-to-all",  # the parts' row counts (blocking: where a slower peer is waited for)
            "send",
            "send",  # both parts on their way
            "wait ep-all-to-all",
            "send",  # part 0 arrived, computed, its outputs sent back
            "wait ep-all-to-all",
            "send",  # part 1 likewise
            "wait ep-all-to-all",  # the outputs back
        ], events


def _config(aux: bool = True) -> GPTConfig:
    moe = MoEConfig(
        num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.05 if aux else 0.0,
        z_loss_coef=1e-3 if aux else 0.0, bias_update_rate=1e-3, shared_experts=1,
    )  # fmt: skip
    return GPTConfig(**{**TINY_GQA_GPT, "n_layers": 2, "max_seq_len": SEQ, "moe": moe})


def _build(aux: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(_config(aux))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 60, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: GPT, runtime: Any, dp_rank: int, dp: int) -> dict[str, Any]:
    # SGD: Adam divides by sqrt(v), which turns the reordering noise of near-zero gradients into whole steps
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)
    group = runtime.mesh["dp"].get_group() if runtime is not None and dp > 1 else None
    if runtime is not None:
        runtime.zero.attach_optimizers([optimizer])
    losses, norms, loads = [], [], []
    for step in range(STEPS):
        tokens, targets = _batch(step)
        share = BATCH // dp
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        value = model(tokens[rows], targets[rows])  # under pp: the schedule, backward included
        if runtime is None or runtime.pipeline is None:
            value.backward()
        if runtime is not None:
            runtime.zero.after_backward()
        norm = clip_grad_norm_(
            model.parameters(), MAX_NORM, sum_group=runtime.grad_norm_group if runtime else None
        )
        if runtime is not None:
            runtime.zero.before_optimizer_step(optimizer)
        optimizer.step()
        if runtime is not None:
            runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        counts = update_expert_biases(model, group)  # the step's tokens per expert over every dp rank
        value = value.detach().float()
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= dp
        losses.append(float(value))
        norms.append(float(norm))
        loads.append(counts)
    if runtime is not None:
        runtime.zero.wait_for_params()  # ZeRO-1: the last step's new values, broadcast by their owners
    return {"losses": losses, "norms": norms, "loads": loads}


def _reference(aux: bool) -> dict[str, Any]:
    with torch.device("meta"):
        model = _build(aux)
    materialize(model, "cpu", seed=torch.initial_seed())
    out = _train(model, None, 0, 1)
    return {**out, "weights": full_weights(model, exclude="rope")}


def _layout_worker(rank: int, world: int, layouts: list[tuple[dict[str, Any], bool]]) -> dict[str, Any]:
    out = {}
    for kw, aux in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(aux)
        runtime = parallelize(model, plan, mesh, device="cpu")
        got = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size())
        if plan.pp > 1:  # each stage counted its own layers' experts: the whole model's, on every rank
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, got["loads"])
            stages = parts[: plan.pp]  # ranks 0..pp-1: the stages of the first replica (counts are summed)
            got["loads"] = [torch.cat([p[s] for p in stages]) for s in range(STEPS)]
        out[repr((kw, aux))] = {**got, "weights": full_weights(model, exclude="rope")}
        runtime.zero.remove()
    return out


def _compare(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), name
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), name
    assert all(n > MAX_NORM for n in want["norms"]), "every step must clip"
    for step, (g, w) in enumerate(zip(got["loads"], want["loads"], strict=True)):
        assert torch.equal(g, w), f"{name}: tokens per expert at step {step}: {g.tolist()} != {w.tolist()}"
    assert got["weights"].keys() == want["weights"].keys(), name
    worst, where = max(
        ((got["weights"][k] - want["weights"][k]).abs().max().item(), k) for k in want["weights"]
    )
    assert worst <= WEIGHT_TOL, f"{name}: weights differ by up to {worst:.2e} ({where})"
    assert all(math.isfinite(v) for v in got["losses"])


TWO_RANKS = [
    (dict(ep=2, zero_stage=0), True),  # every expert on one of the two ranks, no expert replicas
    (dict(ep=2, zero_stage=0, ep_comm_chunks=1), True),  # no overlap: one all-to-all each way
    (dict(ep=2, zero_stage=0, ep_comm_chunks=3), True),
    (dict(zero_stage=1), True),  # ep=1: experts are dense parameters, ZeRO-1 shards them like the rest
    (dict(ep=2, zero_stage=1, zero1_sharding="parameters"), True),  # dense states by owner over dp
    (dict(pp=2, zero_stage=0, num_microbatches=2), True),  # each stage's balancing losses into backward
    (dict(tp=2, sequence_parallel=False, zero_stage=0), True),  # shared experts split like an MLP
    (dict(tp=2, zero_stage=1), True),  # sequence parallelism: the MoE gathers whole sequences
    (dict(cp=2, zero_stage=1), True),  # context parallelism: likewise over cp
    (dict(ep=2, zero_stage=3), True),  # edp = 1: FSDP2 over one rank, the experts' gradients / dp
]
FOUR_RANKS = [
    (dict(ep=4, zero_stage=0), True),  # one expert per rank
    (dict(ep=2, zero_stage=0), True),  # ep2 x edp2: experts averaged over their two replicas
    (dict(ep=2, zero_stage=1, zero1_sharding="parameters"), True),  # experts' states by owner over edp
    # the balancing losses ride on each stage's output
    (dict(ep=2, pp=2, zero_stage=0, num_microbatches=2), True),
    (dict(ep=2, tp=2, sequence_parallel=False, zero_stage=0), True),  # whole experts on each tp rank
    (dict(ep=2, tp=2, zero_stage=1, zero1_sharding="parameters"), True),  # SP: whole sequences gathered
    (dict(ep=2, cp=2, zero_stage=0), True),  # cp chunks gathered, experts split over the dp ranks
    (dict(ep=2, zero_stage=2), True),  # FSDP2: experts sharded over edp beside the dense units over dp
    (dict(ep=2, zero_stage=3), True),
    (dict(cp=2, tp=2, zero_stage=1), True),  # gathered over tp, then over cp
]


@pytest.mark.parametrize(("world", "layouts"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2 ranks", "4 ranks"])
def test_every_expert_parallel_layout_trains_like_one_process(world: int, layouts: list) -> None:
    results = run_distributed(_layout_worker, world, layouts, timeout=300)
    for aux in {a for _, a in layouts}:
        want = _reference(aux)
        assert want["loads"][0].sum() == 2 * BATCH * SEQ * 2  # layers x tokens x top_k
        for kw, a in layouts:
            if a != aux:
                continue
            for rank, result in enumerate(results):
                _compare(result[repr((kw, a))], want, f"{kw}, rank {rank}")


def test_zero1_sharding_left_out_is_the_layouts_choice() -> None:
    assert ParallelPlan(ep=2, zero_stage=1).zero1_sharding == "parameters"  # what ep needs
    assert ParallelPlan(zero_stage=1).zero1_sharding == "elements"
    given = ParallelPlan(
        ep=2, zero1_sharding="elements"
    )  # kept as given (and refused by check_expert_parallel)
    assert given.zero1_sharding == "elements"


@pytest.mark.parametrize(
    ("kw", "config", "message"),
    [
        (dict(ep=3), {}, r"num_experts=4 cannot be split over ep=3 ranks.*choose ep among \[1, 2, 4\]"),
        (
            dict(ep=2),
            {"moe": None},
            "ep=2: expert parallelism splits a mixture of experts, and this GPT has none",
        ),
        (
            dict(ep=2, zero_stage=1, zero1_sharding="elements"),
            {},
            "ep=2 with zero_stage=1 needs zero1_sharding='parameters'",
        ),
    ],
)
def test_what_a_mixture_of_experts_layout_cannot_do_is_refused_by_name(
    kw: dict, config: dict, message: str
) -> None:
    plan = ParallelPlan(**kw)
    with pytest.raises(ValueError, match=message):
        plan.check_gpt_config(GPTConfig(**{**_config().to_dict(), **config}))


def test_ep_must_divide_the_data_parallel_ranks() -> None:
    with pytest.raises(
        ValueError, match=r"ep=4 must divide the data-parallel size dp=2.*choose ep among \[1, 2\]"
    ):
        ParallelPlan(ep=4, tp=2).dims(4)


# ---- a model of one's own using megascale's MoE layer ---------------------------------------------------


class _OwnBlock(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(config.d_model)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class OwnMoELM(torch.nn.Module):
    """A user's own language model (torch.nn layers) whose feed-forwards are megascale's MoE layers."""

    def __init__(self) -> None:
        super().__init__()
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.05, bias_update_rate=1e-3)
        config = GPTConfig(vocab_size=60, d_model=32, n_heads=4, moe=moe)
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([_OwnBlock(config) for _ in range(2)])
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        balancing = take_balancing_losses(self)
        return loss if balancing is None else loss + balancing


def _own_reference() -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = OwnMoELM()
    materialize(model, "cpu", seed=torch.initial_seed())
    return {**_train(model, None, 0, 1), "weights": full_weights(model)}  # type: ignore[arg-type]


def _own_worker(rank: int, world: int, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = OwnMoELM()
        runtime = parallelize(model, plan, mesh, device="cpu")
        got = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size())  # type: ignore[arg-type]
        out[repr(kw)] = {**got, "weights": full_weights(model)}
        runtime.zero.remove()
    return out


def test_a_model_of_ones_own_with_megascales_moe_layers_trains_like_one_process_under_ep() -> None:
    layouts = [
        dict(ep=2, zero_stage=0),
        dict(ep=2, zero_stage=1, zero1_sharding="parameters"),
        dict(ep=2, zero_stage=3),
    ]
    want = _own_reference()
    for rank, result in enumerate(run_distributed(_own_worker, 2, layouts, timeout=180)):
        for kw in layouts:
            _compare(result[repr(kw)], want, f"own model {kw}, rank {rank}")


def test_a_balancing_loss_left_out_of_the_loss_is_an_error_at_the_next_step() -> None:
    torch.manual_seed(0)
    model = OwnMoELM()
    tokens = torch.randint(0, 60, (2, 8))
    x = model.embed(tokens)
    model.blocks[0](x).sum().backward()  # a loss of one's own, without take_balancing_losses
    with pytest.raises(RuntimeError, match="balancing loss of the previous training forward was never added"):
        model.blocks[0](x)


def _own_tp_worker(rank: int, world: int) -> str:
    plan = ParallelPlan(tp=2)
    with torch.device("meta"):
        model = OwnMoELM()
    try:
        parallelize(model, plan, plan.dims(world).build_mesh("cpu"), device="cpu")
    except ValueError as error:
        return str(error)
    return "no error"


def test_what_a_model_of_ones_own_with_moe_layers_cannot_do_is_refused_by_name() -> None:
    for message in run_distributed(_own_tp_worker, 2, timeout=120):
        assert "MoE layers ['blocks.0.moe', 'blocks.1.moe'] of a model of your own with tp=2" in message, (
            message
        )
