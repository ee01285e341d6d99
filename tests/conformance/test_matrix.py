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
        params = [pytest.param(c, marks=() if matrix.in_ci_tier(c) else pytest.mark.slow) for c in cells]
        metafunc.parametrize("cell", params, ids=[c.id for c in cells])


@pytest.mark.timeout(3600)  # the first cell's setup runs the whole matrix (the session fixture)
def test_cell(cell: matrix.Cell, matrix_out: Path) -> None:
    OUTCOMES[cell.id] = judge(cell, matrix_out)


def test_guarantees_page_is_generated_from_the_matrix(request: pytest.FixtureRequest) -> None:
    """docs/guides/guarantees.md is exactly what the outcomes of every cell (seed 0) make; when only part of
    the matrix ran (CI's tier), each cell that ran is what the page says of it (its mark and its note)."""
    cells = [c for c in matrix.all_cells(1)]
    ran = [c for c in cells if c.id in OUTCOMES]
    if not ran:
        pytest.skip("no cell of seed 0 passed in this session: page not checked")
    if len(ran) < len(cells):
        said = report.marks(report.PAGE.read_text(encoding="utf-8"))
        wrong = {c.id: (said.get(c.id), report.outcome_mark(OUTCOMES[c.id])) for c in ran
                 if said.get(c.id) != report.outcome_mark(OUTCOMES[c.id])}  # fmt: skip
        assert not wrong, (
            f"docs/guides/guarantees.md says otherwise of {len(wrong)} cells (page, run): {wrong}; regenerate "
            "it with MEGASCALE_WRITE_GUARANTEES=1 nox -s conformance"
        )
        return
    page = report.page([OUTCOMES[c.id] for c in cells])
    if os.environ.get("MEGASCALE_WRITE_GUARANTEES"):
        report.PAGE.write_text(page, encoding="utf-8")
    assert report.PAGE.read_text(encoding="utf-8") == page, (
        "docs/guides/guarantees.md is not what the matrix gives: regenerate it with "
        "MEGASCALE_WRITE_GUARANTEES=1 nox -s conformance"
    )
