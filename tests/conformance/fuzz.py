"""Run any number of generated conformance cases; shrink each failure to the fewest features that still fail.

    python -m tests.conformance.fuzz --cases 200 --seed 1000          # 200 cases from seed 1000
    python -m tests.conformance.fuzz --cases 1 --seed 17 --layouts all  # one case under every layout

(``nox -s conformance_fuzz -- ...`` runs it.) Prints one line per failing cell with the case's features, the
shrunk case (its name runs it again: ``generate.case(name)``), and counts of cells, failures by layout and
by feature. Exit status 1 when any cell failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

from tests.conformance import generate, matrix
from tests.conformance.judge import judge


def _failures(cells: list[matrix.Cell], out: Path) -> dict[matrix.Cell, str]:
    out.mkdir(parents=True, exist_ok=True)
    matrix.run(cells, out)
    failed = {}
    for cell in cells:
        try:
            judge(cell, out)
        except AssertionError as failure:
            lines = str(failure).strip().splitlines()
            failed[cell] = " / ".join(lines[:2])[:400]
    return failed


def shrink(case: generate.Case, layout: str, workdir: Path) -> generate.Case:
    """The smallest case (by features dropped one at a time) that still fails under ``layout``."""
    current = case
    while True:
        for smaller in generate.smaller(current):
            cell = matrix.Cell(smaller.name, 0, layout)
            if _failures([cell], Path(tempfile.mkdtemp(dir=workdir))):
                current = smaller
                break
        else:
            return current


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed")
    parser.add_argument("--layouts", default="2", help="layouts per case (world-2 ones), or 'all'")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument(
        "--out", type=Path, help="keep the launches' results and logs here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    per_case = None if args.layouts == "all" else int(args.layouts)
    cases = [generate.draw(seed) for seed in range(args.seed, args.seed + args.cases)]
    cells = [
        matrix.Cell(c.name, 0, layout.name) for c in cases for layout in generate.layouts_for(c, per_case)
    ]
    with tempfile.TemporaryDirectory(prefix="conformance-fuzz-") as tmp:
        failed = _failures(cells, args.out or Path(tmp) / "run")
        by_layout: collections.Counter[str] = collections.Counter()
        by_feature: collections.Counter[str] = collections.Counter()
        for cell, why in failed.items():
            case = generate.case(cell.scenario)
            assert cell.layout is not None
            print(f"FAILED {case.describe()} under {cell.layout}: {why}")
            if not args.no_shrink:
                small = shrink(case, cell.layout, Path(tmp))
                print(f"  shrunk: {small.describe()}")
                case = small
            by_layout[cell.layout] += 1
            for name in [case.way.name, *(f.name for f in case.features)]:
                by_feature[name] += 1
    print(f"{len(cases)} cases (seeds {args.seed}-{args.seed + args.cases - 1}), {len(cells)} cells, "
          f"{len(failed)} failed")  # fmt: skip
    if failed:
        print("failures by layout:", dict(by_layout.most_common()))
        print("features of the (shrunk) failures:", dict(by_feature.most_common()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
