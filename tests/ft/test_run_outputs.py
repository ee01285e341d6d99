"""What a run leaves in its run directory: no empty stack files of attempts that did not hang, and a
timeline.png of the last attempt (a restart's gap would squeeze every step of a merged picture into a sliver)
while timeline.json keeps every attempt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megascale.ft import launcher, timeline
from megascale.ft.stacks import prune_empty


class _Monitor:
    """The part of a JobMonitor the report writer reads: per-rank step events."""

    def __init__(self, start: float, steps: range) -> None:
        self.hosts: dict[int, str] = {0: "h", 1: "h"}
        self.coords: dict[int, dict[str, int]] = {}
        self._events = {
            r: [{"name": "step", "step": s, "start": start + s, "dur": 0.9} for s in steps] for r in (0, 1)
        }

    def timings(self) -> dict[int, list[dict[str, Any]]]:
        return self._events


def test_the_picture_shows_the_last_attempt_and_the_trace_every_attempt(tmp_path, monkeypatch):
    drawn: dict[str, Any] = {}
    monkeypatch.setattr(
        timeline, "plot_timeline", lambda events, path, **kw: drawn.update(events=events, **kw)
    )
    monkeypatch.setattr(timeline, "plot_step_heatmap", lambda *a, **kw: None)
    first, second = _Monitor(0.0, range(0, 5)), _Monitor(60.0, range(4, 10))  # killed at step 4, resumed
    launcher._write_timeline(tmp_path, [first, second], threshold=1.2)  # type: ignore[list-item]
    steps = sorted({e["step"] for evs in drawn["events"].values() for e in evs})
    assert steps == list(range(4, 10)) and "Attempt 1 of 2" in drawn["title"]
    trace = json.loads((tmp_path / "timeline.json").read_text())
    traced = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    assert len(traced) == 2 * (5 + 6)  # every attempt's steps


def test_empty_stack_files_are_pruned_and_written_ones_kept(tmp_path: Path) -> None:
    quiet = tmp_path / "stacks" / "attempt-0"
    quiet.mkdir(parents=True)
    (quiet / "rank-00000.txt").write_text("")
    (quiet / "rank-00001.txt").write_text("")
    prune_empty(quiet)
    assert not (tmp_path / "stacks").exists()
    hung = tmp_path / "stacks" / "attempt-1"
    hung.mkdir(parents=True)
    (hung / "rank-00000.txt").write_text("Current thread 0x1 (most recent call first):\n")
    (hung / "rank-00001.txt").write_text("")
    prune_empty(hung)
    assert sorted(p.name for p in hung.iterdir()) == ["rank-00000.txt"]


@pytest.mark.parametrize("option", ["--run-dir"])
def test_the_default_run_directory_is_stated(option: str, capsys) -> None:
    from megascale.ft.cli import main

    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    assert "(default: ./megascale-ft-run)" in " ".join(capsys.readouterr().out.split())
