"""The chaos soak's short version (benchmarks/chaos.py; `nox -s chaos` runs it for 30 minutes with every
kind of fault): the main job's model on 2 loopback nodes × 2 ranks under `megascale-ft launch`, hit once by
each of a killed rank, a corrupted checkpoint followed by a killed rank, a killed data reader
and an idle connection to the driver, in a random order at random moments. Every fault is named as what it
was in report.json, no resume loses or loads a bad checkpoint, and the final checkpoint (weights, LAMB's
moments) equals an uninterrupted run's bit for bit. The kinds left to the soak are proven in CI by their own
tests: a node's processes or its agent killed (tests/ft/test_multinode.py, test_warm_restart.py), a frozen rank
(tests/ft/test_faults.py), a slowed rank (test_ft_megascale_strategy.py); a checkpoint write killed midway is
in test_faults.py's slow tier and the soak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.lightning._launch import ROOT, clean_env

FAULTS = ("kill-rank", "corrupt-checkpoint", "kill-reader", "idle-connection")


def _soak(tmp_path: Path, faults: tuple[str, ...], *extra: str) -> tuple[dict, str]:
    out = tmp_path / "soak.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--minutes=5", "--steps=50", "--seed=1",
        f"--faults={','.join(faults)}", "--pause=1,2", "--rounds=1", f"--dir={tmp_path}", f"--json={out}", *extra,
    ]  # fmt: skip
    done = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    summary = json.dumps({k: v for k, v in result.items() if k != "injected"}, indent=1)
    assert done.returncode == 0 and not result["problems"], summary
    return result, summary


def test_a_short_chaos_soak_names_every_fault_loses_nothing_and_ends_bitwise_equal(tmp_path: Path) -> None:
    result, summary = _soak(tmp_path, FAULTS)
    assert sorted(result["faults"]) == sorted(FAULTS), summary  # each kind hit once
    assert result["bitwise_equal"], summary
    stops = sum(result["faults"][k] for k in FAULTS if k != "idle-connection")
    assert result["attempts"] == stops + 1, summary
    assert 0 < result["effective_training_time"] < 1, summary


def test_restarts_in_place_under_lightning_resume_bitwise_in_the_surviving_processes(tmp_path: Path) -> None:
    """The same job under --restart-in-place: a killed data reader makes its rank raise, so every rank of
    both nodes outlives the fault and the restart runs in the same processes (`megascale fit` run again as
    __main__: Lightning, the strategy, the data module and megascale-ft's callback built anew in a process
    that already fitted); a killed rank leaves the other node's ranks alive, which restart in place while
    that node's spare takes over. Named, nothing lost, bitwise equal to the uninterrupted run."""
    # 80 steps: room for both faults before the last checkpoints (the monkey spares the job's end)
    result, summary = _soak(tmp_path, ("kill-reader", "kill-rank"), "--in-place", "--steps=80")
    assert result["bitwise_equal"] and result["attempts"] == 3, summary
    by_kind = {i["kind"]: n for n, i in enumerate(result["injected"])}  # restart n follows fault n
    assert result["in_place"][by_kind["kill-reader"]] == ["0", "1"], summary
    killed_node = result["injected"][by_kind["kill-rank"]]["node"]
    assert result["in_place"][by_kind["kill-rank"]] == sorted({"0", "1"} - {killed_node}), summary
