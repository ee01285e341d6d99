"""Context parallelism and the data modules (issue 26 item 4): under MegaScaleStrategy(cp=2) on 4 ranks
(dp2 × cp2), WebDataModule and TokenDataModule give both cp ranks of a replica the same whole sequences (the
model keeps each rank's chunks of them), the two replicas different ones, and a run resumed from a
mid-run checkpoint sees exactly the batches the uninterrupted run saw after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megascale.data")

from tests.data._shards import write_text_shards
from tests.lightning._launch import run_ranks

STEPS = 6


def test_cp_ranks_read_the_same_sequences_and_resume_exactly(tmp_path: Path) -> None:
    shards, _ = write_text_shards(str(tmp_path / "shards"), 4, 20, doc_chars=60)
    out = tmp_path / "seen"
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    codes = run_ranks(
        "tests.integration._fit_cp_data:main", [shards, str(out), str(STEPS), "2"], 4, logs, 600
    )
    assert codes == [0, 0, 0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(4)]
    for kind in ("web", "token"):
        by_coord = {(r["dp"], r["cp"]): r[kind] for r in ranks}
        for dp in (0, 1):
            first, second = by_coord[(dp, 0)], by_coord[(dp, 1)]
            assert [step for step, _ in first["whole"]] == list(range(STEPS)), kind
            assert all(len(batch) == 2 and len(batch[0]) == 8 for _, batch in first["whole"]), kind
            # the cp ranks of a replica: the same whole sequences at every step, uninterrupted and resumed
            assert first == second, f"{kind}: cp ranks of replica {dp} read different batches"
            # resumed from the checkpoint at STEPS/2: exactly the rest of the uninterrupted run's batches
            assert first["resumed"] == first["whole"][STEPS // 2 :], f"{kind}: replica {dp} resumed elsewhere"
        rows = [{str(row) for _, batch in by_coord[(dp, 0)]["whole"] for row in batch} for dp in (0, 1)]
        assert not rows[0] & rows[1], f"{kind}: the two replicas read the same sequences"
