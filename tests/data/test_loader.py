"""WebLoader end to end: tree loading over simulated nodes, coverage, exact and elastic resume — for every
format (tar shards, Parquet row groups, JSONL.zst files) through the same tests.

Ranks are real processes (tests/_dist.py); "nodes" are simulated by giving each process its node rank and
local rank, so two nodes' readers and rings run side by side on this machine as they would on two.
The reference for every position of the canonical order is an inline loader with one rank reading the whole
global batch: the tree must hand out exactly those sequences, wherever it runs.
"""

from __future__ import annotations

import collections
import uuid

import numpy as np
import pytest

from megascale.data import Source, WebDataConfig, WebLoader
from megascale.data.loader import merge_states
from megascale.data.packing import pack
from megascale.data.tokenize import ByteTokenizer
from tests._dist import run_distributed
from tests.data._shards import write_corpus, write_text_shards

SEQ_LEN, BATCH = 16, 2
N_SHARDS, DOCS = 8, 12


def _config(url: str, **overrides) -> WebDataConfig:
    base = dict(
        sources=[Source(url)], seq_len=SEQ_LEN, batch_size=BATCH, num_workers=1, prefetch=2, timeout=60
    )
    return WebDataConfig(**{**base, **overrides})


@pytest.fixture(scope="module", params=["tar", "parquet", "jsonl.zst"])
def shards(request, tmp_path_factory):
    """N_SHARDS units of DOCS documents: tar shards, Parquet files of two row groups, or JSONL.zst files."""
    if request.param != "tar":
        pytest.importorskip("pyarrow" if request.param == "parquet" else "zstandard")
    return write_corpus(
        request.param, str(tmp_path_factory.mktemp("shards")), N_SHARDS, DOCS, doc_chars=60, seed=1
    )


def _reference(url: str, positions: int, lanes: int) -> list[list[int]]:
    """The sequences at global positions 0..positions-1, read by one inline rank."""
    loader = WebLoader(_config(url, batch_size=1, lanes=lanes), tree=False, max_steps=positions)
    return [[*x[0].tolist(), int(y[0, -1])] for x, y in loader]


def _rank_reads(rank, world, url, tp, nodes, steps, lanes, state, run_id, num_workers):
    local_world = world // nodes
    loader = WebLoader(
        _config(url, lanes=lanes, num_workers=num_workers),
        dp_rank=rank // tp, dp_size=world // tp, local_rank=rank % local_world, local_world_size=local_world,
        node_rank=rank // local_world, run_id=run_id,
    )  # fmt: skip
    if state is not None:
        loader.load_state_dict(state)
    batches = []
    for _, (x, y) in zip(range(steps), loader, strict=False):
        assert x.dtype.is_signed and x.shape == (BATCH, SEQ_LEN) and (x[:, 1:] == y[:, :-1]).all()
        batches.append([[*row, last] for row, last in zip(x.tolist(), y[:, -1].tolist(), strict=True)])
    state = loader.state_dict()
    loader.close()
    return {"batches": batches, "state": state}


def _run(url, *, world, tp, nodes, steps, lanes, state=None, num_workers=1):
    run_id = uuid.uuid4().hex[:8]
    return run_distributed(_rank_reads, world, url, tp, nodes, steps, lanes, state, run_id, num_workers)


def _check_against_reference(results, ref, *, tp, start):
    dp = len(results) // tp
    for rank, result in enumerate(results):
        dp_rank = rank // tp
        for k, batch in enumerate(result["batches"]):
            for row, seq in enumerate(batch):
                g = start + k * dp * BATCH + dp_rank * BATCH + row
                assert seq == ref[g], (
                    f"rank {rank} step {k} row {row}: not position {g} of the canonical order"
                )


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2-dp2", "dp4"])
def test_tree_loading_over_two_nodes_covers_an_epoch_exactly(shards, tp):
    url, docs = shards
    per_shard = [
        list(pack((ByteTokenizer().encode(d) for d in shard_docs), SEQ_LEN, 256)) for shard_docs in docs
    ]
    epoch = sum(len(s) for s in per_shard)
    global_batch = 4 // tp * BATCH
    assert (
        epoch % global_batch == 0 and len({len(s) for s in per_shard}) == 1
    )  # the layout below relies on it
    steps = epoch // global_batch
    results = _run(url, world=4, tp=tp, nodes=2, steps=steps, lanes=global_batch)
    # ranks of one TP group: identical batches
    for rank in range(0, 4, tp):
        for peer in range(rank, rank + tp):
            assert results[peer]["batches"] == results[rank]["batches"]
    # DP ranks together: every sequence of the epoch exactly once (independent packing of each shard)
    delivered = collections.Counter(
        tuple(seq) for r in range(0, 4, tp) for batch in results[r]["batches"] for seq in batch
    )
    expected = collections.Counter(tuple(int(t) for t in seq) for s in per_shard for seq in s)
    assert delivered == expected
    # and in the canonical order's positions
    _check_against_reference(results, _reference(url, epoch, global_batch), tp=tp, start=0)


def test_exact_resume_mid_epoch(shards):
    url, _ = shards
    first = _run(url, world=2, tp=1, nodes=1, steps=5, lanes=4)
    state = merge_states([r["state"] for r in first])
    assert state["consumed"] == 5 * 2 * BATCH
    second = _run(url, world=2, tp=1, nodes=1, steps=6, lanes=4, state=state)
    uninterrupted = _run(url, world=2, tp=1, nodes=1, steps=11, lanes=4)
    for rank in range(2):
        assert first[rank]["batches"] + second[rank]["batches"] == uninterrupted[rank]["batches"]


def test_elastic_resume_dp4_to_dp2_and_back_neither_repeats_nor_skips(shards):
    url, _ = shards
    lanes = 8
    ref = _reference(url, 3 * 8 + 5 * 4 + 3 * 8, lanes)
    a = _run(url, world=4, tp=1, nodes=2, steps=3, lanes=lanes)  # dp4: 8 positions per step
    _check_against_reference(a, ref, tp=1, start=0)
    state = merge_states([r["state"] for r in a])
    b = _run(url, world=4, tp=2, nodes=2, steps=5, lanes=None, state=state)  # dp2 (tp2): 4 per step
    _check_against_reference(b, ref, tp=2, start=24)
    state = merge_states([r["state"] for r in b])
    assert state["consumed"] == 24 + 20 and state["lanes"] == lanes
    c = _run(url, world=4, tp=1, nodes=2, steps=3, lanes=None, state=state)
    _check_against_reference(c, ref, tp=1, start=44)


def test_inline_and_tree_agree_and_workers_do_not_change_the_data(shards):
    url, _ = shards
    ref = _reference(url, 40, 4)
    for workers in (0, 2):
        results = _run(url, world=2, tp=1, nodes=1, steps=10, lanes=4, num_workers=workers)
        _check_against_reference(results, ref, tp=1, start=0)


def test_weighted_mixing_follows_the_weights(tmp_path):
    a, docs_a = write_text_shards(str(tmp_path / "a"), 4, 40, doc_chars=40, seed=2, prefix="a")
    b, docs_b = write_text_shards(str(tmp_path / "b"), 4, 40, doc_chars=40, seed=3, prefix="b")
    text = {0: "\n".join(d for s in docs_a for d in s), 1: "\n".join(d for s in docs_b for d in s)}
    cfg = WebDataConfig(
        sources=[Source(a, weight=3.0), Source(b, weight=1.0)], seq_len=16, batch_size=8, lanes=4,
        num_workers=0, timeout=60,
    )  # fmt: skip
    loader = WebLoader(cfg, tree=False, max_steps=100)
    counts = collections.Counter()
    for x, y in loader:
        for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1):
            piece = max(_pieces(row), key=len)
            sources = [s for s in (0, 1) if piece in text[s]]
            assert sources, f"window {piece!r} is in neither source"
            counts[sources[0] if len(sources) == 1 else "either"] += 1  # e.g. a bare "shard 0 doc 1"
    n = counts[0] + counts[1]
    assert n > 600, counts
    # source b is drawn with p = 1/4: over n ≈ 800 windows the share's std is ≈ 0.015; 4 std of slack
    assert abs(counts[1] / n - 0.25) < 0.06, counts


def _pieces(row: np.ndarray) -> list[str]:
    """The runs of a window between end-of-document tokens (256), as text."""
    pieces, current = [], []
    for t in row.tolist():
        if t == 256:
            pieces.append(bytes(current).decode())
            current = []
        else:
            current.append(t)
    return [*pieces, bytes(current).decode()]
