"""benchmarks/data.py --quick on Parquet with a BPE it trains itself: the tree loader against Hugging Face
`datasets` streaming per rank, all three parts reported.

An integration test: the benchmark runs megascale-data's reader next to torch DataLoaders, and reads the
main job's config. Two ranks instead of four, and tiny sizes: the ranks' start-up (importing torch and
datasets, once per configuration) is most of its time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="the Parquet baseline is Hugging Face datasets streaming")
pytest.importorskip("tokenizers", reason="the BPE is a Hugging Face tokenizers file")
pytest.importorskip("pyarrow", reason="the corpus is written as Parquet (megascale-data[parquet])")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "data.py"
_DIST = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.slow
def test_quick_run_compares_the_tree_loader_with_datasets_streaming_on_parquet_with_a_bpe(
    tmp_path: Path,
) -> None:
    out = tmp_path / "data.json"
    env = {k: v for k, v in os.environ.items() if k not in _DIST}
    command = [sys.executable, str(SCRIPT), "--quick", "--ranks", "2", "--format", "parquet", "--tokenizer", "bpe",
               "--json", str(out)]  # fmt: skip
    # generous: on a loaded 2-core machine each configuration's start-up takes seconds (~20 s when idle)
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())

    # part 1: both loaders on the same Parquet corpus with the same BPE; every rank got the same batches
    (pair,) = result["part1"]
    assert set(pair) == {"datasets", "tree"}
    for row in pair.values():
        assert row["identical"] and row["seq_per_s"] > 0 and row["rss_all_mb"] > 0
        assert row["tokenizer"] and row["files"][0].endswith(".parquet")
        assert row["throughput"]["tokens_per_s_per_worker"] > 0
    assert "| datasets streaming, 1 worker per rank | BPE |" in done.stdout
    assert "| tree, 1 worker (node) | BPE |" in done.stdout

    # part 2: the data wait of the tree at three settings and of datasets at the short step
    wait = result["part2"]
    assert [(r["loader"], r["workers"]) for r in wait["rows"]] == [("tree", 1), ("tree", 1), ("tree", 2),
                                                                    ("datasets", 1)]  # fmt: skip
    assert wait["prep_ms"] > 0 and all(r["identical"] for r in wait["rows"])
    assert len(wait["keeps_up"]) == 4

    # part 3: one main-job batch (its seq_len and batch size) tokenized with bytes and with the BPE
    main = result["part3"]
    assert (main["seq_len"], main["batch"]) == (128, 16)
    by_name = {r["tokenizer"]: r for r in main["rows"]}
    assert by_name["bytes"]["vocab"] == 257 and by_name["BPE"]["vocab"] == 4096
    assert by_name["bytes"]["bytes_per_token"] == pytest.approx(1.0, abs=0.01)
    assert by_name["BPE"]["bytes_per_token"] > 2  # the BPE merges the stdlib's text it was trained on
    assert all(math.isfinite(r["ms_per_batch"]) and r["ms_per_batch"] > 0 for r in main["rows"])
