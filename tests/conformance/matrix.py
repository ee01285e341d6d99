"""The cells of the matrix and the launches that run them.

A cell is (scenario, seed, layout) — or a resume cell: the "plain" scenario (or "tied-resumed", for
``TIED_RESHARDS``) saved at its first epoch's end under one layout and resumed under another. Launches, in order (a resume needs its checkpoint saved first):

1. the reference: one process, every (scenario, seed) needed;
2. every world-2 layout's cells in one torchrun launch of 2 ranks, then its resumes of world-2 checkpoints;
3. the same for world 4, resuming world-2 and world-4 checkpoints;
4. world-2 layouts resuming world-4 checkpoints (a run shrunk after losing ranks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conformance.scenarios import LAYOUT, LAYOUTS, SCENARIOS, TIED_RESHARDS, Layout, resume_pairs
from tests.lightning._launch import run_ranks

LAUNCH_TIMEOUT_S = 1800


def slug(name: str) -> str:
    return name.replace("/", "_").replace("×", "x")


@dataclass(frozen=True)
class Cell:
    scenario: str
    seed: int
    layout: str | None  # None: the one-process reference
    saved_under: str | None = None  # resume cells: the layout whose checkpoint is resumed
    reference_moe: bool = False  # a reference: of the mixture-of-experts model (what ep layouts train)

    @property
    def moe(self) -> bool:
        """Whether the cell trains the model with mixture-of-experts feed-forwards."""
        return LAYOUT[self.layout].moe if self.layout is not None else self.reference_moe

    @property
    def id(self) -> str:
        where = "reference" if self.layout is None else slug(self.layout)
        if self.layout is None and self.moe:
            where = "reference-moe"
        if self.saved_under is not None:
            what = "" if self.scenario == "plain" else f"{self.scenario}-"
            return f"resume-{what}s{self.seed}-{slug(self.saved_under)}-to-{where}"
        return f"{self.scenario}-s{self.seed}-{where}"

    @property
    def reference(self) -> Cell:
        return Cell(self.scenario, self.seed, None, reference_moe=self.moe)

    @property
    def saver(self) -> Cell:
        assert self.saved_under is not None
        return Cell(self.scenario, self.seed, self.saved_under)


def all_cells(seeds: int) -> list[Cell]:
    cells = [Cell(s.name, seed, layout.name) for seed in range(seeds) for s in SCENARIOS for layout in LAYOUTS
             if s.runs_under(layout)]  # fmt: skip
    pairs = resume_pairs()
    shrink = [(b, a) for a, b in pairs if a.world == 2 and b.world == 4]
    shrink = [pair for i, pair in enumerate(shrink) if i % 3 == 0]  # each world-4 layout → some world-2 ones
    cells += [Cell("plain", seed, b.name, a.name) for seed in range(seeds) for a, b in [*pairs, *shrink]]
    cells += [Cell("tied-resumed", seed, b, a) for seed in range(seeds) for a, b in TIED_RESHARDS]
    return cells


# variants of a layout CI also runs in its main form (ZeRO-1 sharded by elements, tp2 with sequence parallelism,
# ep2 with ZeRO-0, pp2 with 1F1B)
VARIANTS = ("dp2/zero1-params", "tp2/no-sp", "ep2/zero1-params", "pp2/zb1p")


def in_ci_tier(cell: Cell) -> bool:
    """CI runs every cell on 2 ranks but half of the variant layouts' (``VARIANTS``: every other scenario,
    alternating, and the plain one), and a third of the 4-rank ones (4 ranks on CI's 2 cores cost 2.5x a
    2-rank cell): each scenario under one 4-rank layout (turn by turn), each 4-rank layout resuming from two
    2-rank checkpoints and from each other, and every 4-rank checkpoint shrunk onto 2 ranks. The rest is the
    slow tier (``nox -s conformance`` runs all)."""
    assert cell.layout is not None
    if cell.saved_under is not None and cell.scenario != "plain":
        return True  # the few resharded scenarios of their own (TIED_RESHARDS)
    # the turns below are taken among the layouts training the same model (dense, or with experts: ep)
    same_model = [layout for layout in LAYOUTS if layout.moe == cell.moe]
    world4 = [layout.name for layout in same_model if layout.world == 4]
    if cell.layout in VARIANTS and cell.saved_under is None:  # every other scenario (and the plain one)
        index = [s.name for s in SCENARIOS].index(cell.scenario)
        return index == 0 or index % 2 == VARIANTS.index(cell.layout) % 2
    if LAYOUT[cell.layout].world == 2:
        return True  # the other 2-rank layouts: every scenario, every resume (from 2 or 4 ranks)
    if cell.saved_under is None:  # the scenario's turn among the 4-rank layouts it runs under
        scenario = next(s for s in SCENARIOS if s.name == cell.scenario)
        runs_under = [name for name in world4 if scenario.runs_under(LAYOUT[name])]
        return runs_under[SCENARIOS.index(scenario) % len(runs_under)] == cell.layout
    if LAYOUT[cell.saved_under].world == 4:
        return True
    world2 = [layout.name for layout in same_model if layout.world == 2]
    turn = world4.index(cell.layout)
    return world2.index(cell.saved_under) in (turn, turn + len(world4))


def _launch_of(cell: Cell) -> int:
    assert cell.layout is not None
    layout = LAYOUT[cell.layout]
    if cell.saved_under is not None and LAYOUT[cell.saved_under].world > layout.world:
        return 4  # after the world-4 launch saved its checkpoints
    return 2 if layout.world == 2 else 3


def run(cells: list[Cell], out: Path) -> None:
    """Run ``cells`` (and the references and saved checkpoints they need); results land in ``out``."""
    needed = set(cells)
    needed |= {c.saver for c in cells if c.saved_under is not None}
    needed |= {c.reference for c in list(needed)}
    launches: dict[int, list[Cell]] = {1: [], 2: [], 3: [], 4: []}
    for cell in sorted(needed, key=_order):
        launches[1 if cell.layout is None else _launch_of(cell)].append(cell)
    for number, group in launches.items():
        if group:
            _launch(group, 1 if number == 1 else LAYOUT[group[0].layout].world, out, f"launch{number}")  # type: ignore[index]


def _order(cell: Cell) -> tuple[int, int, int, int, str]:
    """Within a launch: plain cells before resumes, layouts in LAYOUTS order, then scenarios."""
    layouts = [layout.name for layout in LAYOUTS]
    position = layouts.index(cell.layout) if cell.layout else -1
    names = [s.name for s in SCENARIOS]
    scenario = names.index(cell.scenario) if cell.scenario in names else len(names)  # generated cases last
    return (cell.saved_under is not None, position, scenario, cell.seed, cell.scenario)


def _launch(cells: list[Cell], world: int, out: Path, name: str) -> None:
    """One torchrun launch for ``cells``; a cell that leaves the ranks out of step (one raised while the others
    wait in a collective) ends it, and the cells after it run in a fresh launch. A launch that dies in its first
    cell (no result: it would again) has that cell recorded as having killed it, and the rest go on without it;
    three such launches in a row mean the launch itself is broken, and what is left is recorded so."""
    attempt, deaths = 0, 0
    while cells:
        _launch_once(cells, world, out, name if attempt == 0 else f"{name}.{attempt}")
        left = [c for c in cells if result(c, out)["status"] in ("not run", "missing")]
        if left and left[0] == cells[0]:
            deaths += 1
            dead = left if deaths == 3 else left[:1]
            why = result(left[0], out)["error"]
            for cell in dead:
                torch.save({"status": "killed its launch", "error": why}, out / f"{cell.id}.pt")
            left = left[len(dead) :]
        else:
            deaths = 0
        cells, attempt = left, attempt + 1


def _launch_once(cells: list[Cell], world: int, out: Path, name: str) -> None:
    jobs = []
    for cell in cells:
        resume = None
        if cell.saved_under is not None:
            resume = str(out / "work" / cell.saver.id / "epochs" / "epoch=0.ckpt")
        jobs.append(dict(cell=cell.id, scenario=cell.scenario, seed=cell.seed, layout=cell.layout, moe=cell.moe,
                         resume_from=resume, work=str(out / "work" / cell.id)))  # fmt: skip
    spec = out / f"{name}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    logs = [out / f"{name}.rank{rank}.log" for rank in range(world)]
    codes = run_ranks("tests.conformance.runner:main", [str(spec), str(out)], world, logs, LAUNCH_TIMEOUT_S)
    log = out / f"{name}.log"
    log.write_text("".join(f"--- rank {r} ---\n{p.read_text(errors='replace')}" for r, p in enumerate(logs)))
    if any(code != 0 for code in codes):
        (out / f"{name}.failed").write_text(f"exit codes {codes}; see {log}")


def result(cell: Cell, out: Path) -> dict[str, Any]:
    """The cell's result, with every rank's error (a fit that raised on some ranks only is out of step)."""
    path = out / f"{cell.id}.pt"
    if not path.exists():
        logs = sorted(out.glob("launch*.log"))
        tail = "\n".join(p.read_text()[-3000:] for p in logs)
        return {"status": "missing", "error": f"no result for {cell.id}; launch logs:\n{tail}"}
    found = torch.load(path, weights_only=True)
    found["rank_errors"] = {p.name: p.read_text() for p in sorted(out.glob(f"{cell.id}.rank*.error"))}
    return found


def layouts_of(world: int) -> list[Layout]:
    return [layout for layout in LAYOUTS if layout.world == world]
