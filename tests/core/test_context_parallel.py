"""Context parallelism (``parallel/cp``): each rank holds two chunks of every sequence, against one process.

Every layout trains a megascale GPT (grouped-query heads, RoPE; full attention, or sliding windows on every
other layer) for three steps of SGD with momentum and weight decay, clipped by the global norm, every cp rank
of a dp replica given that replica's whole sequences (the model keeps its chunks), against one process stepping the whole model on the union batch. Checked: the loss every
rank returns (the whole batch's mean, also on cp ranks that hold different tokens), the updated weights,
and what user code sees of the gradients (the clipped global norm, which every step reaches).

Tolerance: float32; a layout differs from one process only in the order of sums (attention over keys in
another order, gradients averaged over dp·cp, the loss summed over cp): ~1e-6 relative on gradients (the
norms agree to 2e-6). SGD is linear in the gradients, so weights differ by lr × that (observed ~1e-8, bound
1e-6; an optimizer that normalises per element, like AdamW, would turn the noise of near-zero gradients into
differences of up to lr, which says nothing about the layout). What a bug does: a missed key, a wrong
position or a dropped cp average changes the loss by ~1e-2 and the weights by ~lr × |grad| ≈ 1e-3.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan, clip_grad_norm_, materialize, parallelize
from megascale.core.parallel.cp import halo_plan, positions, shard_sequence, unshard_sequence
from megascale.core.parallel.cp.attention import attention_mask
from megascale.core.parallel.cp.balance import SequenceLayout, balanced_layout, head_tail
from megascale.core.parallel.cp.block_attention import block_attention, block_plan
from megascale.core.parallel.cp.kv_exchange import choose
from megascale.core.parallel.cp.sharding import chunk_owner
from megascale.core.parallel.cp.user_model import check_context_parallel_plan
from tests._dist import run_distributed
from tests._models import AttentionLM, Head, LayeredLM, MLPBlock, full_weights
from tests.core._tiny import TINY_GQA_GPT

WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-5
STEPS = 3
LR = 0.05
MAX_NORM = 0.5
BATCH = 4
SEQ = 16


# ---- the sharding and the halo, without processes -------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunks_are_balanced_and_unshard_inverts_shard(cp: int) -> None:
    T = 4 * cp
    x = torch.arange(T).unsqueeze(0)
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards), x)
    for r, shard in enumerate(shards):
        assert torch.equal(positions(T // cp, r, cp), shard[0])
    # causal work: (query, key) pairs each rank's queries see are equal
    work = [int((positions(T // cp, r, cp) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_sequence(torch.zeros(1, 6), 0, 2)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 8, 13])
def test_the_halo_brings_exactly_the_keys_each_window_needs(cp: int, window: int) -> None:
    local = 8  # chunks of 4
    plan = halo_plan(local, cp, window)
    for rank in range(cp):
        q_pos = positions(local, rank, cp).tolist()
        have = set(q_pos)
        received = plan.positions(rank).tolist()
        assert len(received) == len(set(received)) and not have & set(received), "a key held twice"
        needed = {k for t in q_pos for k in range(max(0, t - window + 1), t + 1)}
        assert needed <= have | set(received), f"rank {rank} lacks {sorted(needed - have - set(received))}"
        assert set(received) <= needed, f"rank {rank} receives keys it never uses"
        for i, q, _ in plan.transfers:
            assert chunk_owner(i, cp) != q
    # the halo is chosen while it moves less than the all-gather: a short window always
    if window - 1 <= local // 2:
        assert choose(local, cp, window) is plan
        assert max(plan.received(r) for r in range(cp)) <= 2 * (window - 1)


KERNELS = {"fused CPU kernel": dict(flex=False), "fp32 reference": dict(fused=False), "flex": dict(flex=True)}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
def test_block_attention_is_sdpa_with_the_positions_mask_forward_and_backward(
    cp: int, window: int | None, kernel: str
) -> None:
    """Every rank's layout of keys (all gathered, or the halo and its own), grouped-query heads: the blocks'
    online softmax and recomputing backward against SDPA over the dense mask built from the positions, through
    torch's fused CPU kernel per block, the plain fp32 reference, and FlexAttention's mask over the positions
    (the GPU's path; eager here)."""
    local = 12  # chunks of 6
    gen = torch.Generator().manual_seed(cp * 100 + (window or 0))
    for rank in range(cp):
        q_pos = positions(local, rank, cp)
        halo = choose(local, cp, window) if cp > 1 else None
        if halo is None:
            k_pos = torch.cat([positions(local, r, cp) for r in range(cp)])
        else:
            k_pos = torch.cat((halo.positions(rank), q_pos))
        q = torch.randn(2, local, 4, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, len(k_pos), 2, 8, generator=gen, requires_grad=True) for _ in range(2))
        plan = block_plan(tuple(q_pos.tolist()), tuple(k_pos.tolist()), window)
        got = block_attention(q, k, v, plan, **KERNELS[kernel])
        mask = attention_mask(q_pos, k_pos, window)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        dout = torch.randn(got.shape, generator=gen)
        grads = torch.autograd.grad(got, (q, k, v), dout)
        wants = torch.autograd.grad(want, (q, k, v), dout)
        for name, g, w in zip("qkv", grads, wants):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"d{name}, rank {rank}")
        masked = sum(kind == "masked" for pairs in plan.pairs for _, kind in pairs)
        assert masked <= 2 * len(plan.q_runs) + (2 if window else 0)  # only the diagonal and window edges


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_block_attention_keeps_each_query_inside_its_document(
    cp: int, window: int | None, kernel: str
) -> None:
    """Packed documents whose boundaries fall inside chunks, on chunk edges and (row 1) a row of one document:
    the blocks against SDPA over the dense mask (positions ∧ same document), forward and backward; blocks no
    query's document reaches are skipped."""
    local = 12
    whole = local * cp
    starts = [{0, 5, 6, 13, whole - 1}, {0}]  # row 0: documents of 5, 1, 7, ... tokens; row 1: one document
    position_ids = torch.stack(
        [torch.tensor([t - max(s for s in row if s <= t) for t in range(whole)]) for row in starts]
    )
    ids = (position_ids == 0).cumsum(-1)
    gen = torch.Generator().manual_seed(cp * 10 + (window or 0))
    for rank in range(cp):
        q_pos = positions(local, rank, cp)
        halo = choose(local, cp, window) if cp > 1 else None
        k_pos = (
            torch.cat([positions(local, r, cp) for r in range(cp)])
            if halo is None
            else (torch.cat((halo.positions(rank), q_pos)))
        )
        q = torch.randn(2, local, 4, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, len(k_pos), 2, 8, generator=gen, requires_grad=True) for _ in range(2))
        plan = block_plan(tuple(q_pos.tolist()), tuple(k_pos.tolist()), window)
        documents = (ids[:, q_pos], ids[:, k_pos])
        got = block_attention(q, k, v, plan, documents=documents, **KERNELS[kernel])
        mask = attention_mask(q_pos, k_pos, window) & (
            documents[0].unsqueeze(-1) == documents[1].unsqueeze(-2)
        )
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
            enable_gqa=True,
        ).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        plain = block_attention(q, k, v, plan, **KERNELS[kernel])
        assert not torch.allclose(got[0], plain[0], atol=1e-3), "the documents must change row 0"
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-6)  # one document: no change
        dout = torch.randn(got.shape, generator=gen)
        grads = torch.autograd.grad(got, (q, k, v), dout)
        wants = torch.autograd.grad(want, (q, k, v), dout)
        for name, g, w in zip("qkv", grads, wants):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"d{name}, rank {rank}")


def _work(layout: SequenceLayout, position_ids: torch.Tensor) -> list[float]:
    """Per rank, the (query, key) pairs its queries see in their documents."""
    pairs = (position_ids + 1).sum(0).double()
    return [float(pairs[layout.indices(r)].sum()) for r in range(layout.cp)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_packed_documents_are_dealt_to_the_ranks_by_their_work(cp: int) -> None:
    """Documents of 256 to 2048 tokens in rows of 8192: head and tail leaves a rank with far more than the mean
    work; the dealt layout holds every block once, T/cp tokens per rank, its heaviest rank at most 2% over the
    mean here. Without documents (one per row) head and tail is kept: it balances causal work exactly."""
    gen = torch.Generator().manual_seed(cp)
    rows = []
    for _ in range(2):
        lengths: list[int] = []
        while sum(lengths) < 8192:
            lengths.append(min(int(torch.randint(256, 2049, (), generator=gen)), 8192 - sum(lengths)))
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    position_ids = torch.stack(rows)
    layout = balanced_layout(position_ids, cp)
    held = sorted(b for blocks in layout.blocks for b in blocks)
    assert held == list(range(len(held))) and len({len(b) for b in layout.blocks}) == 1
    assert sorted(torch.cat([layout.indices(r) for r in range(cp)]).tolist()) == list(range(8192))
    dealt, before = _work(layout, position_ids), _work(head_tail(8192, cp), position_ids)
    mean = sum(dealt) / cp
    assert max(before) > 1.05 * mean and max(dealt) < 1.02 * mean, (max(before) / mean, max(dealt) / mean)
    whole = torch.arange(8192).expand(2, -1)
    assert balanced_layout(whole, cp) == head_tail(8192, cp)
    x = torch.arange(8192).view(1, -1)
    assert torch.equal(layout.shard(x, 1)[0], layout.indices(1))


# ---- layouts against one process ------------------------------------------------------------------------


def _config(windowed: bool) -> GPTConfig:
    extra = dict(sliding_window=3, full_attention_every=2) if windowed else {}
    return GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4, "max_seq_len": SEQ, **extra})


def _build(windowed: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(_config(windowed))


# Packed documents: each row's document starts (position 0), crossing the chunk edges of cp2 and cp4 (chunks of
# 4 and 2 tokens), a document of one token; different at each step. Long documents late in the rows: the
# head-and-tail chunks are unbalanced at every step, so cp2 and cp4 run dealt layouts (checked below).
DOCUMENT_STARTS = ({0, 3, 9}, {0, 10}, {0, 12}, {0, 1, 2, 15})


def _position_ids(step: int) -> torch.Tensor:
    rows = [{(s + step) % SEQ for s in row} | {0} for row in DOCUMENT_STARTS]
    return torch.tensor([[t - max(s for s in row if s <= t) for t in range(SEQ)] for row in rows])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 60, (BATCH, SEQ + 1), generator=gen)
    targets = tokens[:, 1:].clone()
    # Ignored targets: at cp4 rank 1 holds positions 2-3 and 12-13, all of them ignored (it adds nothing, and
    # no NaN). The same in every row: dp replicas average their own means, as DDP does, which is the union
    # batch's mean only when they count the same targets.
    targets[:, :5] = -100
    targets[:, 12:14] = -100
    return tokens[:, :-1], targets


def _train(
    model: GPT, runtime: Any, dp_rank: int, dp: int, documents: bool = False
) -> dict[str, list[float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)
    if runtime is not None:
        runtime.zero.attach_optimizers([optimizer])
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = _batch(step)
        share = BATCH // dp
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        tokens, targets = tokens[rows], targets[rows]  # whole sequences: the model keeps its chunks
        position_ids = _position_ids(step)[rows] if documents else None
        loss = model(tokens, targets) if position_ids is None else model(tokens, targets, position_ids)
        if runtime is None or runtime.pipeline is None:
            loss.backward()
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
        value = loss.detach().float()
        if dp > 1:  # the global batch's loss: the mean over the dp replicas
            dist.all_reduce(value, group=runtime.mesh["dp"].get_group())
            value /= dp
        losses.append(float(value))
        norms.append(float(norm))
    if runtime is not None:
        runtime.zero.wait_for_params()
    return {"losses": losses, "norms": norms}


def _reference(windowed: bool, documents: bool = False) -> dict[str, Any]:
    with torch.device("meta"):
        model = _build(windowed)
    materialize(model, "cpu", seed=torch.initial_seed())
    out = _train(model, None, 0, 1, documents)
    return {**out, "weights": full_weights(model, exclude="rope")}


def _layout_worker(
    rank: int, world: int, layouts: list[tuple[dict[str, Any], bool]], documents: bool = False
) -> dict[str, Any]:
    out = {}
    for kw, windowed in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(windowed)
        runtime = parallelize(model, plan, mesh, device="cpu")
        got = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size(), documents)
        out[repr((kw, windowed))] = {**got, "weights": full_weights(model, exclude="rope")}
        runtime.zero.remove()
    return out


def _compare(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), name
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), name
    assert all(n > MAX_NORM for n in want["norms"]), "every step must clip"
    assert got["weights"].keys() == want["weights"].keys(), name
    worst, where = max(
        ((got["weights"][k] - want["weights"][k]).abs().max().item(), k) for k in want["weights"]
    )
    assert worst <= WEIGHT_TOL, f"{name}: weights differ by up to {worst:.2e} ({where})"
    assert all(math.isfinite(v) for v in got["losses"])


TWO_RANKS = [
    (dict(cp=2, zero_stage=1), False),
    (dict(cp=2, zero_stage=0), True),
]
FOUR_RANKS = [
    (dict(cp=4, zero_stage=1), True),
    (dict(cp=2, zero_stage=1), False),  # dp2 × cp2
    (dict(cp=2, zero_stage=2), False),  # dp2 × cp2, gradients sharded over all four
    (dict(cp=2, zero_stage=3), True),  # dp2 × cp2, parameters sharded over all four
    (dict(cp=2, tp=2, zero_stage=1), True),  # with sequence parallelism
    (dict(cp=2, pp=2, zero_stage=1, num_microbatches=2), False),
]


@pytest.mark.parametrize(("world", "layouts"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2 ranks", "4 ranks"])
def test_every_context_parallel_layout_trains_like_one_process(world: int, layouts: list) -> None:
    results = run_distributed(_layout_worker, world, layouts, timeout=300)
    for windowed in {w for _, w in layouts}:
        want = _reference(windowed)
        for kw, w in layouts:
            if w != windowed:
                continue
            name = f"{kw}, windows={windowed}"
            for rank, result in enumerate(results):
                _compare(result[repr((kw, w))], want, f"{name}, rank {rank}")


DOCUMENT_LAYOUTS = [
    (dict(cp=4, zero_stage=1), False),  # all-gather: chunks of 2 tokens, documents across them
    (dict(cp=4, zero_stage=1), True),  # the halo
    (dict(cp=2, tp=2, zero_stage=3), True),  # sequence parallelism, parameters sharded
    (dict(cp=2, pp=2, zero_stage=1, num_microbatches=2), False),  # each microbatch's documents
]


def test_packed_documents_under_context_parallelism_train_like_one_process() -> None:
    """Every cp rank is given the whole sequences' position_ids and keeps its blocks' rotary angles (blocks
    dealt by the documents' work); its queries see only their document's keys, gathered or brought by the
    halo."""
    for step in range(STEPS):
        for cp in (2, 4):
            assert not balanced_layout(_position_ids(step), cp).is_head_tail, (step, cp)
    results = run_distributed(_layout_worker, 4, DOCUMENT_LAYOUTS, True, timeout=300)
    for windowed in (False, True):
        want = _reference(windowed, documents=True)
        causal = _reference(windowed)
        assert abs(want["losses"][0] - causal["losses"][0]) > 1e-3, "the documents must change the loss"
        for kw, w in DOCUMENT_LAYOUTS:
            if w == windowed:
                for rank, result in enumerate(results):
                    _compare(result[repr((kw, w))], want, f"{kw}, windows={w}, documents, rank {rank}")


LONG = 64


def _exchange_worker(rank: int, world: int) -> dict[str, Any]:
    """What the forward of one full and one windowed attention layer moves, at cp = world."""
    from megascale.core.comm_meter import CollectiveMeter

    plan = ParallelPlan(cp=world, zero_stage=0)
    mesh = plan.dims(world).build_mesh("cpu")
    out = {}
    for window in (None, 3):
        torch.manual_seed(0)
        config = GPTConfig(**{**TINY_GQA_GPT, "n_layers": 1, "max_seq_len": LONG, "sliding_window": window})
        model = GPT(config)
        parallelize(model, plan, mesh, device="cpu").zero.remove()
        tokens = torch.randint(0, 60, (1, LONG))
        with CollectiveMeter() as meter:
            model(tokens)
        out[str(window)] = dict(meter.kinds()), {k: meter.payload_bytes(k) for k in meter.kinds()}
    return out


def test_a_sliding_window_moves_only_its_halo_and_full_attention_gathers_every_key() -> None:
    token_bytes = 2 * TINY_GQA_GPT["n_kv_heads"] * (TINY_GQA_GPT["d_model"] // TINY_GQA_GPT["n_heads"]) * 4
    for rank, result in enumerate(run_distributed(_exchange_worker, 2, timeout=120)):
        kinds, payload = result["None"]
        assert kinds == {"all_gather": 1}, kinds  # keys and values in one collective
        assert payload["all_gather"] == LONG * token_bytes
        kinds, payload = result["3"]
        assert "all_gather" not in kinds, kinds
        # one tail of window − 1 = 2 tokens each way: 1/32 of the all-gather at 64 tokens
        assert payload["send"] == 2 * token_bytes, (rank, payload)


# ---- a model of a user's own -------------------------------------------------------------------------------


def _build_own() -> torch.nn.Module:
    torch.manual_seed(0)
    return AttentionLM(vocab=64, width=32, layers=2)


def _own_worker(rank: int, world: int, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build_own()
        runtime = parallelize(model, plan, mesh, device="cpu")
        got = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size())
        out[repr(kw)] = {**got, "weights": full_weights(model)}
        runtime.zero.remove()
    # a model with neither a megascale GPT nor a context_parallel_plan: refused before any collective
    plain = LayeredLM(64, 32, [MLPBlock(32)], Head(32, 64))
    try:
        parallelize(plain, ParallelPlan(cp=2), ParallelPlan(cp=2).dims(world).build_mesh("cpu"), device="cpu")
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    # a model that applied fully_shard itself on the dp mesh: it would not average over the cp ranks
    from torch.distributed.fsdp import fully_shard

    mesh = ParallelPlan(cp=2).dims(world).build_mesh("cpu")
    sharded = AttentionLM()
    fully_shard(sharded, mesh=mesh["dp"])
    try:
        parallelize(sharded, ParallelPlan(cp=2), mesh, device="cpu")
        out["fsdp"] = None
    except ValueError as error:
        out["fsdp"] = str(error)
    return out


def test_a_model_of_ones_own_declaring_its_plan_trains_like_one_process() -> None:
    """tests/_models.py's AttentionLM (rotary, grouped-query heads, its own loss module) under cp2 with ZeRO-1
    and ZeRO-3, against one process: the same tolerances as the GPT's."""
    layouts = [dict(cp=2, zero_stage=1), dict(cp=2, zero_stage=3)]
    results = run_distributed(_own_worker, 2, layouts, timeout=300)
    with torch.device("meta"):
        model = _build_own()
    materialize(model, "cpu", seed=torch.initial_seed())
    want = {**_train(model, None, 0, 1), "weights": full_weights(model)}
    for kw in layouts:
        for rank, result in enumerate(results):
            _compare(result[repr(kw)], want, f"own model {kw}, rank {rank}")
    for result in results:
        assert "holds no megascale GPT and declares no context_parallel_plan" in (result["refused"] or "")
        assert "applied fully_shard itself on the data-parallel mesh, and cp=2" in (result["fsdp"] or "")


class _Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Conv1d(4, 4, 3, padding=1)


def test_what_a_context_parallel_plan_cannot_do_is_refused_by_name() -> None:
    model = AttentionLM()
    plan = dict(model.context_parallel_plan)
    check_context_parallel_plan(model, plan, 2)  # the plan as declared is fine
    with pytest.raises(ValueError, match=r"\['attention'\] = 'layers\.\*\.attn' matches no module"):
        check_context_parallel_plan(model, {**plan, "attention": "layers.*.attn"}, 2)
    with pytest.raises(ValueError, match=r"needs exactly the roles .* missing \['loss'\]"):
        check_context_parallel_plan(model, {"tokens": "embed", "attention": "blocks.*.attn"}, 2)
    with pytest.raises(
        ValueError, match=r"blocks\.0\.mlp \(MLPBlock\) .* does not declare `context_parallel"
    ):
        check_context_parallel_plan(model, {**plan, "attention": "blocks.0.mlp"}, 2)
    model.blocks[0].conv = _Conv()
    with pytest.raises(ValueError, match=r"blocks\.0\.conv\.mix \(Conv1d\) mixes tokens along the sequence"):
        check_context_parallel_plan(model, plan, 2)
