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
from tests.conformance.judge import Outcome, judge

OUTCOMES: dict[str, Outcome] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        cells = matrix.all_cells(metafunc.config.getoption("seeds"))
        metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


@pytest.mark.timeout(3600)  # the first cell's setup runs the whole matrix (the session fixture)
def test_cell(cell: matrix.Cell, matrix_out: Path) -> None:
    OUTCOMES[cell.id] = judge(cell, matrix_out)


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
