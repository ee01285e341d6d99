# The loss curve of a run that may have been restarted: each attempt (a fault-tolerant launcher's restart, or
# a resume by hand) is a new CSVLogger version, so the run's curve is pieced together from several
# `version_*/metrics.csv` files. Which versions belong to this run is recorded as the run goes: every
# attempt appends {"version", "start_step"} to `attempts.jsonl` next to the versions when training starts
# (start_step = the step it resumed from, 0 for a fresh start). The run is the last entries back to (and
# including) the latest fresh start, so older runs logged in the same folder are left out.
#
# The picture draws each attempt in its own colour, marks where each restart resumed, and greys out what an
# attempt trained past the checkpoint the next one resumed from (work lost to the fault, done again).

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ATTEMPTS_FILE", "Attempt", "logged_names", "plot_loss_curve", "read_attempts", "record_attempt"]

ATTEMPTS_FILE = "attempts.jsonl"


@dataclass
class Attempt:
    """One attempt's logged metrics: ``series[name]`` = [(step, value), ...] in logged order."""

    version: str
    start_step: int
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def record_attempt(root: str | Path, version: str, start_step: int) -> None:
    """Append this attempt to ``root/attempts.jsonl`` (call once per attempt, from one process)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps({"version": version, "start_step": int(start_step)}) + "\n")


def _run_entries(root: Path) -> list[tuple[str, int]]:
    """(version, start step) of this run's attempts, oldest first."""
    path = root / ATTEMPTS_FILE
    if not path.exists():
        return []
    entries: list[tuple[str, int]] = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            entries.append((str(entry["version"]), int(entry["start_step"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a line cut short by a kill: that attempt logged nothing worth drawing
    # the run: back to (and including) its latest fresh start
    for i in range(len(entries) - 1, -1, -1):
        if entries[i][1] == 0:
            return entries[i:]
    return entries


def _read_metrics(path: Path, names: list[str]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    if not path.exists():
        return series
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for name in names:
                value = row.get(name)
                if value:
                    number = float(value)
                    if math.isfinite(number):
                        series[name].append((int(float(step)), number))
    return series


def logged_names(root: str | Path, prefix: str) -> list[str]:
    """The metrics whose names start with ``prefix`` that this run's attempts under ``root`` logged, sorted."""
    root = Path(root)
    names: set[str] = set()
    for version, _ in _run_entries(root):
        path = root / version / "metrics.csv"
        if path.exists():
            with open(path, newline="") as f:
                names.update(n for n in next(csv.reader(f), []) if n.startswith(prefix))
    return sorted(names)


def read_attempts(root: str | Path, names: list[str]) -> list[Attempt]:
    """This run's attempts under ``root`` (a CSVLogger's ``save_dir/name``), oldest first, with ``names``."""
    root = Path(root)
    return [
        Attempt(version, start, _read_metrics(root / version / "metrics.csv", names))
        for version, start in _run_entries(root)
    ]


def plot_loss_curve(
    attempts: list[Attempt], output: str | Path, title: str = "loss", ylabel: str = "loss"
) -> Path:
    """Draw ``attempts`` (see the module header) into the PNG ``output``; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = Path(output)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = [".-", "o--", "s:", "^-."]  # markers: an attempt may log a single point
    for i, attempt in enumerate(attempts):
        color = colors[i % len(colors)]
        # what this attempt trained past the step the next attempt resumed from was redone there
        until = attempts[i + 1].start_step if i + 1 < len(attempts) else None
        for j, (name, points) in enumerate(attempt.series.items()):
            if not points:
                continue
            kept = [(s, v) for s, v in points if until is None or s <= until]
            lost = [(s, v) for s, v in points if until is not None and s >= until]
            style = styles[j % len(styles)]
            label = f"{name} (attempt {i}, {attempt.version})" if len(attempts) > 1 else name
            if kept:
                ax.plot(*zip(*kept), style, color=color, label=label, markersize=3, linewidth=1.2)
            if lost:
                ax.plot(*zip(*lost), style, color="0.75", markersize=3, linewidth=1.0)
        if i > 0:
            ax.axvline(attempt.start_step, color=color, linestyle=":", linewidth=1)
            ax.annotate(
                f"restart {i}: resumed at step {attempt.start_step}", (attempt.start_step, 1.0),
                xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7, color=color,
            )  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    restarts = len(attempts) - 1
    ax.set_title(f"{title}: {restarts} restart{'s' if restarts != 1 else ''}" if restarts else title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output
