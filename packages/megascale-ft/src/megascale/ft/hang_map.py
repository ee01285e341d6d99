"""A hang as a picture: every rank at its place in the 3D-parallel layout, and who waits for whom.

MegaScale (§5, "3D parallel training visualization") draws the ranks of a job by their data-, pipeline- and
tensor-parallel coordinates with the dependencies between them, so a hang is traced to its origin at a
glance. Here, from the coordinates the ranks send with their heartbeats (``Executor.set_coords``; the
FaultTolerance callback sends MegaScaleStrategy's) and the stacks collected at the hang (`megascale.ft.stacks`):

- one row per pipeline stage, one column per data-parallel replica (and context-parallel rank), the
  tensor-parallel ranks side by side in each cell; a job without coordinates is one row of ranks;
- each rank coloured by what its stack says: *stuck* (off the common path: a suspect), *waiting* (in a
  collective, or autograd waiting for one), *running* like the rest, or *silent* (no stack: dead, or not
  answering the signal);
- an arrow from each waiting rank to each suspect in one of its process groups (the tensor- or
  context-parallel group: same stage and replica; the data-parallel group: same stage and shard; the
  pipeline: same replica and shard), labelled with the group. Ranks with no arrow wait on a waiting rank.

Pure functions of coordinates and a `HangReport`; matplotlib is imported only to draw (the ``plots`` extra).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.ft.stacks import HangReport

__all__ = ["Dependency", "dependencies", "describe", "plot_hang_map", "rank_states", "write_hang_map"]

log = logging.getLogger("megascale.ft")

DIMS = ("pp", "dp", "cp", "tp")
COLOURS = {"stuck": "#d62728", "waiting": "#9ecae1", "running": "#a1d99b", "silent": "#7f7f7f"}


@dataclass(frozen=True)
class Dependency:
    """``waiter`` is blocked in a collective of ``group`` ("tp", "cp", "dp", "pp", or "world" without
    coordinates) that ``suspect`` has not joined."""

    waiter: int
    suspect: int
    group: str


def rank_states(report: HangReport, ranks: list[int]) -> dict[int, str]:
    """Each rank's state in the picture: "stuck", "waiting", "running" or "silent"."""
    states = {}
    for rank in ranks:
        if rank in report.suspects:
            states[rank] = "stuck"
        elif rank in report.silent or rank not in report.frames:
            states[rank] = "silent"
        else:
            states[rank] = "waiting" if rank in report.waiting else "running"
    return states


def _group(a: Mapping[str, int], b: Mapping[str, int]) -> str | None:
    """The one mesh dimension on which two ranks' coordinates differ: the group they share (None if several)."""
    differ = [d for d in DIMS if a.get(d, 0) != b.get(d, 0)]
    return differ[0] if len(differ) == 1 else None


def dependencies(coords: Mapping[int, Mapping[str, int]], states: Mapping[int, str]) -> list[Dependency]:
    """Who waits for whom: each waiting rank and each suspect ("stuck" or "silent") sharing a group with it.
    Without coordinates every rank is in one group ("world")."""
    suspects = [r for r, s in sorted(states.items()) if s in ("stuck", "silent")]
    out = []
    for waiter in (r for r, s in sorted(states.items()) if s == "waiting"):
        for suspect in suspects:
            if waiter in coords and suspect in coords:
                group = _group(coords[waiter], coords[suspect])
            else:
                group = None if coords else "world"
            if group is not None:
                out.append(Dependency(waiter, suspect, group))
    return out


def _all_ranks(coords: Mapping[int, Any], report: HangReport, ranks: list[int] | None) -> list[int]:
    """The job's ranks: those given, with coordinates, or in the report (one picture and log line for all)."""
    return sorted(set(ranks or []) | set(coords) | set(report.frames) | set(report.silent))


def _replicas(coords: Mapping[int, Mapping[str, int]], ranks: list[int]) -> list[tuple[int, int]]:
    """The (dp, cp) replicas present, in order: the picture's columns."""
    return sorted({(coords.get(r, {}).get("dp", 0), coords.get(r, {}).get("cp", 0)) for r in ranks})


def _places(coords: Mapping[int, Mapping[str, int]], ranks: list[int]) -> dict[int, tuple[int, int, int]]:
    """(row, cell, slot) of each rank: row = pipeline stage, cell = (dp, cp) replica, slot = tp rank."""
    if not coords:
        return {rank: (0, i, 0) for i, rank in enumerate(ranks)}
    cells = _replicas(coords, ranks)
    return {
        r: (c.get("pp", 0), cells.index((c.get("dp", 0), c.get("cp", 0))), c.get("tp", 0))
        for r in ranks
        for c in [coords.get(r, {})]
    }


def plot_hang_map(
    coords: Mapping[int, Mapping[str, int]],
    report: HangReport,
    path: str | os.PathLike[str],
    *,
    ranks: list[int] | None = None,
    title: str | None = None,
) -> None:
    """Draw the hang map (see the module docstring) to a PNG at ``path``.

    Raises:
        ImportError: matplotlib is missing.
    """
    from megascale.ft.timeline import _matplotlib, _write_atomically

    Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    ranks = _all_ranks(coords, report, ranks)
    states = rank_states(report, ranks)
    places = _places(coords, ranks)
    rows = 1 + max((p[0] for p in places.values()), default=0)
    cells = 1 + max((p[1] for p in places.values()), default=0)
    slots = 1 + max((p[2] for p in places.values()), default=0)
    width = slots + 0.6  # a cell: the tp ranks side by side, a gap after
    centre = {r: (c * width + s + 0.5, rows - 1 - row + 0.5) for r, (row, c, s) in places.items()}

    fig = Figure(figsize=(min(24.0, 2.0 + 0.9 * cells * width), min(24.0, 1.8 + 1.1 * rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, (x, y) in centre.items():
        ax.add_patch(Rectangle((x - 0.42, y - 0.36), 0.84, 0.72, facecolor=COLOURS[states[rank]],
                               edgecolor="black", linewidth=1.5 if states[rank] == "stuck" else 0.6))  # fmt: skip
        if len(ranks) <= 512 or states[rank] != "waiting":  # thousands of labels would be a grey blur
            ax.text(x, y, f"r{rank}", ha="center", va="center", fontsize=9,
                    color="white" if states[rank] in ("stuck", "silent") else "black")  # fmt: skip
    for dep in dependencies(coords, states):
        (x0, y0), (x1, y1) = centre[dep.waiter], centre[dep.suspect]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12, color="0.25",
                                     linewidth=0.8, shrinkA=12, shrinkB=12,
                                     connectionstyle="arc3,rad=0.25"))  # fmt: skip
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.12, dep.group, fontsize=7, color="0.25", ha="center")
    ax.set_xlim(-0.2, cells * width)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    if coords:
        ax.set_yticks([rows - 1 - r + 0.5 for r in range(rows)], [f"pp {r}" for r in range(rows)])
        replicas = _replicas(coords, ranks)
        names = [f"dp {dp}" + (f" cp {cp}" if any(c for _, c in replicas) else "") for dp, cp in replicas]
        ax.set_xticks([i * width + slots / 2 for i in range(cells)], names)
        ax.set_xlabel("data-parallel replica (tensor-parallel ranks side by side)")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("ranks (no parallel coordinates were sent: every rank in one group)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=s) for s, c in COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)  # fmt: skip
    ax.set_title(title or f"Hang: {report.summary()}", fontsize=9, loc="left")
    _write_atomically(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))


def describe(
    coords: Mapping[int, Mapping[str, Any]], report: HangReport, ranks: list[int] | None = None
) -> str:
    """One line per dependency, for the log: "rank 2 waits for rank 5 (tp)"."""
    states = rank_states(report, _all_ranks(coords, report, ranks))
    return "; ".join(
        f"rank {d.waiter} waits for rank {d.suspect} ({d.group})" for d in dependencies(coords, states)
    )


def write_hang_map(
    directory: Path, coords: Mapping[int, Mapping[str, int]], report: HangReport, ranks: list[int]
) -> HangReport:
    """``directory/hang_map.png`` (beside the stacks) and the waits logged; the report, with the picture's
    path in ``map`` (None without matplotlib)."""
    waits = describe(coords, report, ranks)
    if waits:
        log.error("hang: %s", waits)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        plot_hang_map(coords, report, directory / "hang_map.png", ranks=ranks)
        report.map = str(directory / "hang_map.png")
        log.error("hang map: %s", report.map)
    except ImportError as e:
        log.info("no hang map: %s", e)
    return report
