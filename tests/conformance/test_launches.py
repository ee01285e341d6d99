"""The matrix's launches: a cell that breaks or kills its launch costs only itself, never the cells after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conformance import matrix
from tests.conformance.judge import judge


def _fake_launches(monkeypatch: pytest.MonkeyPatch, kills: set[str], breaks: set[str]) -> list[list[str]]:
    """Launches that run their cells in order: a cell in ``kills`` ends the process before writing anything;
    one in ``breaks`` is written as an error and leaves the ranks out of step (the rest "not run")."""
    launched: list[list[str]] = []

    def launch_once(cells: list[matrix.Cell], world: int, out: Path, name: str) -> None:
        launched.append([c.scenario for c in cells])
        broken = None
        for cell in cells:
            if cell.scenario in kills:
                return
            if broken:
                found = {"status": "not run", "error": f"the ranks fell out of step in {broken}"}
            elif cell.scenario in breaks:
                found, broken = {"status": "error", "error_type": "ValueError", "error": "raised"}, cell.id
            else:
                found = {"status": "ok"}
            torch.save(found, out / f"{cell.id}.pt")

    monkeypatch.setattr(matrix, "_launch_once", launch_once)
    return launched


def test_a_cell_that_kills_its_launch_is_recorded_and_the_cells_after_it_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = [f"gen-{seed}" for seed in range(8)]
    launched = _fake_launches(monkeypatch, kills={"gen-1", "gen-3", "gen-4"}, breaks={"gen-6"})
    matrix._launch([matrix.Cell(n, 0, "dp2/zero0") for n in names], 2, tmp_path, "launch2")
    status = {n: matrix.result(matrix.Cell(n, 0, "dp2/zero0"), tmp_path)["status"] for n in names}
    assert status == {"gen-0": "ok", "gen-1": "killed its launch", "gen-2": "ok", "gen-3": "killed its launch",
                      "gen-4": "killed its launch", "gen-5": "ok", "gen-6": "error", "gen-7": "ok"}  # fmt: skip
    # each launch starts where the last one stopped: a killing cell is tried twice, then left out
    assert [run[0] for run in launched] == ["gen-0", "gen-1", "gen-2", "gen-3", "gen-4", "gen-5", "gen-7"]


def test_three_launches_in_a_row_killed_at_their_first_cell_end_the_relaunching(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = [f"gen-{seed}" for seed in range(6)]
    launched = _fake_launches(monkeypatch, kills=set(names), breaks=set())
    matrix._launch([matrix.Cell(n, 0, "dp2/zero0") for n in names], 2, tmp_path, "launch2")
    assert len(launched) == 3  # each died at its first cell: the third gives up
    assert {matrix.result(matrix.Cell(n, 0, "dp2/zero0"), tmp_path)["status"] for n in names} == {
        "killed its launch"
    }


def test_a_cell_that_did_not_run_fails_as_such_even_where_a_refusal_is_expected(tmp_path: Path) -> None:
    cell = matrix.Cell("manual", 0, "pp2")  # manual optimization is refused under pp
    torch.save({"status": "ok"}, tmp_path / f"{cell.reference.id}.pt")
    torch.save({"status": "not run", "error": "the ranks fell out of step in x"}, tmp_path / f"{cell.id}.pt")
    with pytest.raises(AssertionError, match="not run: the ranks fell out of step"):
        judge(cell, tmp_path)
