"""The verdict on one cell: exact, refused by name, or warned about, or an AssertionError saying why not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.conformance import matrix
from tests.conformance.compare import BF16, BF16_EXPERTS, FLOAT32, compare
from tests.conformance.scenarios import LAYOUT, expected_refusals, expected_warnings, scenario


@dataclass(frozen=True)
class Outcome:
    cell: matrix.Cell
    kind: str  # "exact" | "refused" | "warned" (not exact, and the strategy says so)
    message: str  # the refusal's or the warning's first line, or the strategy's warnings in an exact cell


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def judge(cell: matrix.Cell, out: Path) -> Outcome:
    """The cell's outcome from the results in ``out``; AssertionError when it is none of the three."""
    assert cell.layout is not None
    layout, bf16 = LAYOUT[cell.layout], scenario(cell.scenario).bf16
    got = matrix.result(cell, out)
    want = matrix.result(cell.reference, out)
    assert want["status"] == "ok", (
        f"the one-process reference failed: {want.get('error')}\n{want.get('rank_errors', {})}"
    )
    # "not run" (its launch broke before it), "killed its launch", "missing": it neither ran nor was refused
    assert got["status"] in ("ok", "error"), f"{got['status']}: {got.get('error')}"
    refusals = [] if cell.saved_under else expected_refusals(cell.scenario, layout)
    if refusals:
        assert got["status"] == "error", f"expected a refusal naming {refusals[0]!r}; the cell ran"
        assert any(w in got["error"] for w in refusals), (
            f"refused with {got['error']!r}, expected words {' or '.join(map(repr, refusals))}"
        )
        ranks = got["rank_errors"]
        assert len(ranks) == layout.world, f"only ranks {sorted(ranks)} refused: the others went on"
        return Outcome(cell, "refused", _first_line(got["error"]))
    detail = "\n".join(got.get("rank_errors", {}).values())  # none where the launch died ("missing")
    assert got["status"] == "ok", f"{got.get('error_type', '')}: {got.get('error')}\n{detail}"
    assert not got["rank_errors"], detail
    warnings = [] if cell.saved_under else expected_warnings(cell.scenario, layout)
    if warnings:  # cannot be exact: the strategy must say so
        said = [w for w in got["warnings"] if any(words in w for words in warnings)]
        assert said, f"expected a warning with {warnings[0]!r}; the strategy warned {got['warnings']}"
        return Outcome(cell, "warned", _first_line(said[0]))
    tol = (BF16_EXPERTS if cell.moe else BF16) if bf16 else FLOAT32
    problems = compare(got, want, tol, skip_steps=2 if cell.saved_under else 0)
    assert not problems, f"{cell.id} differs from one process:\n" + "\n".join(problems[:40])
    return Outcome(cell, "exact", "; ".join(got.get("warnings", [])))
