"""Lightning's contract under every layout: each cell against one process on the union batch.

Cells: every scenario of ``scenarios.SCENARIOS`` under every layout of ``scenarios.LAYOUTS`` (model shapes
drawn from ``--seeds`` seeds, 1 in CI), plus resume cells: the "plain" scenario's checkpoint from the end of
its first epoch, saved under one layout, resumed under another, for every pair of layouts (and world-4
checkpoints shrunk onto world-2 layouts). A cell passes when it is exact (``compare.compare`` finds nothing
beyond the tolerances given there) or when it is refused as ``scenarios.REFUSED`` declares, on every rank,
with a message containing the declared words. The last test checks that docs/guides/guarantees.md is the
table these outcomes make (regenerate it with ``MEGASCALE_WRITE_GUARANTEES=1``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance import matrix, report
from tests.conformance.compare import BF16, FLOAT32, compare
from tests.conformance.scenarios import LAYOUT, SCENARIO, expected_refusal, expected_warning

OUTCOMES: dict[str, report.Outcome] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        cells = matrix.all_cells(metafunc.config.getoption("seeds"))
        metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


@pytest.mark.timeout(3600)  # the first cell's setup runs the whole matrix (the session fixture)
def test_cell(cell: matrix.Cell, matrix_out: Path) -> None:
    assert cell.layout is not None
    layout, scenario = LAYOUT[cell.layout], SCENARIO[cell.scenario]
    got = matrix.result(cell, matrix_out)
    want = matrix.result(cell.reference, matrix_out)
    assert want["status"] == "ok", (
        f"the one-process reference failed: {want.get('error')}\n{want['rank_errors']}"
    )
    refusal = None if cell.saved_under else expected_refusal(cell.scenario, layout)
    if refusal is not None:
        assert got["status"] == "error", f"expected a refusal naming {refusal!r}; the cell ran"
        assert refusal in got["error"], f"refused with {got['error']!r}, expected words {refusal!r}"
        ranks = got["rank_errors"]
        assert len(ranks) == layout.world, f"only ranks {sorted(ranks)} refused: the others went on"
        OUTCOMES[cell.id] = report.Outcome(cell, "refused", _first_line(got["error"]))
        return
    detail = "\n".join(got["rank_errors"].values())
    assert got["status"] == "ok", f"{got.get('error_type', '')}: {got.get('error')}\n{detail}"
    assert not got["rank_errors"], detail
    warning = None if cell.saved_under else expected_warning(cell.scenario, layout)
    if warning is not None:  # cannot be exact: the strategy must say so
        said = [w for w in got["warnings"] if warning in w]
        assert said, f"expected a warning with {warning!r}; the strategy warned {got['warnings']}"
        OUTCOMES[cell.id] = report.Outcome(cell, "warned", _first_line(said[0]))
        return
    tol = BF16 if scenario.bf16 else FLOAT32
    problems = compare(got, want, tol, skip_steps=2 if cell.saved_under else 0)
    assert not problems, f"{cell.id} differs from one process:\n" + "\n".join(problems[:40])
    OUTCOMES[cell.id] = report.Outcome(cell, "exact", "; ".join(got.get("warnings", [])))


def test_guarantees_page_is_generated_from_the_matrix(request: pytest.FixtureRequest) -> None:
    """docs/guides/guarantees.md is exactly what the outcomes of every cell (seed 0) make."""
    cells = [c for c in matrix.all_cells(1)]
    if any(c.id not in OUTCOMES for c in cells):
        missing = [c.id for c in cells if c.id not in OUTCOMES]
        pytest.skip(
            f"{len(missing)} cells did not pass in this session (e.g. {missing[:3]}): page not checked"
        )
    page = report.page([OUTCOMES[c.id] for c in cells])
    if os.environ.get("MEGASCALE_WRITE_GUARANTEES"):
        report.PAGE.write_text(page, encoding="utf-8")
    assert report.PAGE.read_text(encoding="utf-8") == page, (
        "docs/guides/guarantees.md is not what the matrix gives: regenerate it with "
        "MEGASCALE_WRITE_GUARANTEES=1 nox -s conformance"
    )
