"""Pictures of all ranks' timings: a Chrome-trace/Perfetto timeline, a PNG timeline and a step heatmap.

Scope: driver side, pure functions of each rank's timing events (``{"name", "step", "start", "dur"}``,
see `megascale.ft.timing`). No torch; matplotlib is imported only by the plotting functions (the ``plots``
extra).

Reading the pictures: in synchronous training every rank's step lasts as long as the slowest rank's, so
"who waited for whom" is in the split of each step. Wait sections (`megascale.ft.stragglers.is_wait`) are
drawn light and hatched: the ranks that waited show long wait bars, the slow rank a long compute bar. The
heatmap colours each step by its compute time (step minus waits), the quantity stragglers are judged by.

Pipeline stages: the sections of each microbatch's forward and backward (``"pipeline/F3@s1"``, see
`megascale.ft.timing.microbatch_section`) are drawn as bars of their own inside the step, labelled ``F3`` /
``B3`` (with the stage where a rank holds several), one colour per pass: the 1F1B pattern of every stage,
its bubbles and the waits between microbatches show on each rank's row. They are computations, never
counted as waits.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import IO, Any

from megascale.ft.stragglers import Event, Straggler, WaitPredicate, is_wait, step_timings
from megascale.ft.timing import parse_microbatch_section

__all__ = ["coordinate_order", "plot_step_heatmap", "plot_timeline", "write_chrome_trace"]

_PLOTS_HINT = "pip install 'megascale-ft[plots]'"
_PASSES = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward"}


def write_chrome_trace(
    events: Mapping[int, Sequence[Event]],
    path: str | os.PathLike[str],
    *,
    hosts: Mapping[int, str] | None = None,
    stragglers: Sequence[Straggler] = (),
    waits: WaitPredicate | None = None,
    order: Sequence[int] | None = None,
) -> None:
    """Write all ranks' events as one Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

    One process per rank (pid = rank, named "rank N (host)"); steps and their sections are complete events
    nested on one thread, ``ts``/``dur`` in microseconds since the earliest event; a pipeline microbatch's
    section is a slice named ``F3`` / ``B3`` (``F3 s1`` on a rank holding several stages), category
    "microbatch", with ``microbatch``, ``stage`` and ``pass`` in its args; each straggler gets an instant
    event at the end of its last step. The file is replaced atomically. Empty ``events`` give a valid trace
    with no events.
    """
    waits = waits or is_wait
    starts = [float(e["start"]) for evs in events.values() for e in evs]
    t0 = min(starts, default=0.0)
    trace: list[dict[str, Any]] = []
    ends: dict[int, float] = {}
    for index, rank in enumerate(_ordered(events, order)):
        trace.append(_meta("process_name", rank, name=_label(rank, hosts)))
        trace.append(_meta("process_sort_index", rank, sort_index=index))
        trace.append(_meta("thread_name", rank, name="steps"))
        several = _holds_several_stages(events[rank])
        for event, ts, dur in _nested(events[rank], t0):
            name = str(event["name"])
            cat = "step" if name == "step" else "wait" if waits(name) else "section"
            args: dict[str, Any] = {"step": int(event["step"])}
            shown = name
            mb = parse_microbatch_section(name)
            if mb is not None:
                cat, shown = "microbatch", _microbatch_label(mb.kind, mb.microbatch, mb.stage, several)
                args.update(
                    microbatch=mb.microbatch, stage=mb.stage, **{"pass": _PASSES.get(mb.kind, mb.kind)}
                )
            trace.append(
                {
                    "name": shown,
                    "cat": cat,
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": ts,
                    "dur": dur,
                    "args": args,
                }
            )
            if name == "step":
                ends[rank] = max(ends.get(rank, 0.0), ts + dur)
    last = max(ends.values(), default=0.0)
    for s in stragglers:
        info: dict[str, Any] = {"message": str(s), **asdict(s)}
        name = f"straggler {s.ratio:.2f}x"
        ts = ends.get(s.rank, last)
        trace.append(
            {
                "name": name,
                "cat": "straggler",
                "ph": "i",
                "s": "p",
                "pid": s.rank,
                "tid": 0,
                "ts": ts,
                "args": info,
            }
        )
    doc = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"t0_unix_s": t0}}
    _write_atomically(path, lambda f: f.write(json.dumps(doc).encode()))


def plot_timeline(
    events: Mapping[int, Sequence[Event]],
    path: str | os.PathLike[str],
    *,
    hosts: Mapping[int, str] | None = None,
    last_steps: int | None = 10,
    title: str | None = None,
    waits: WaitPredicate | None = None,
    order: Sequence[int] | None = None,
) -> None:
    """Draw a PNG timeline: x = time (s), y = rank, one bar per section coloured by name.

    Steps are grey background bars; nested sections are drawn thinner; wait sections light and hatched;
    pipeline microbatches one colour per pass (forward, backward), outlined, labelled ``F3`` / ``B3`` where
    wide enough. ``last_steps`` limits the picture to the last N step numbers seen on any rank (None:
    everything).

    Raises:
        ValueError: no rank has any event.
        ImportError: matplotlib is missing.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    waits = waits or is_wait
    if not any(events.values()):
        raise ValueError("plot_timeline: no timing events to draw (no rank has any event)")
    ranks = _ordered(events, order)
    steps = _step_numbers(events)
    shown = {rank: _last_steps(events[rank], steps, last_steps) for rank in ranks}
    t0 = min((float(e["start"]) for evs in shown.values() for e in evs), default=0.0)
    # a colour per section name, one per pass for all the pipeline's microbatch sections
    names = sorted({_colour_key(str(e["name"])) for evs in shown.values() for e in evs} - {"step"})
    palette = colormaps["tab10" if len(names) <= 10 else "tab20"]
    colour = {name: palette(i % palette.N) for i, name in enumerate(names)}

    # One barh call per (colour key, depth): (rows, lefts, widths); microbatch labels drawn on top.
    bars: dict[tuple[str, int], tuple[list[int], list[float], list[float]]] = {}
    labels: list[tuple[int, float, float, str]] = []  # row, left, width, text
    for row, rank in enumerate(ranks):
        several = _holds_several_stages(shown[rank])
        for event, depth in _depths(shown[rank]):
            name = str(event["name"])
            rows, lefts, widths = bars.setdefault((_colour_key(name), depth), ([], [], []))
            rows.append(row)
            lefts.append(float(event["start"]) - t0)
            widths.append(float(event["dur"]))
            mb = parse_microbatch_section(name)
            if mb is not None:
                labels.append((row, lefts[-1], widths[-1], _microbatch_label(*mb, several)))

    fig = Figure(figsize=(12, min(40.0, 1.5 + 0.4 * len(ranks))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (name, depth), (rows, lefts, widths) in sorted(bars.items(), key=lambda kv: kv[0][1]):
        if name == "step":
            ax.barh(rows, widths, left=lefts, height=0.9, color="0.9", edgecolor="0.45", linewidth=0.6)
        elif name.startswith(_MICROBATCH_KEY):  # outlined: consecutive microbatches stay apart
            ax.barh(rows, widths, left=lefts, height=_height(depth), color=colour[name], edgecolor="white",
                    linewidth=0.4)  # fmt: skip
        elif waits(name):
            light = (*colour[name][:3], 0.25)
            ax.barh(
                rows,
                widths,
                left=lefts,
                height=_height(depth),
                color=light,
                hatch="///",
                edgecolor=colour[name],
                linewidth=0.5,
            )
        else:
            ax.barh(rows, widths, left=lefts, height=_height(depth), color=colour[name], linewidth=0)
    span = max((left + width for _, lefts, widths in bars.values() for left, width in zip(lefts, widths)),
               default=0.0)  # fmt: skip
    for row, left, width, text in labels:
        if width >= 0.006 * span * len(text):  # only where the text fits
            ax.text(left + width / 2, row, text, ha="center", va="center", fontsize=5, color="white")
    handles = [Patch(facecolor="0.9", edgecolor="0.45", label="step (not in a section)")]
    for name in names:
        wait = waits(name)
        label = f"{name} (waiting)" if wait else name
        if name.startswith(_MICROBATCH_KEY):
            kind = name.removeprefix(_MICROBATCH_KEY)
            label = f"{_PASSES.get(kind, kind)} of a microbatch ({kind}0, {kind}1, ...)"
        handles.append(
            Patch(
                facecolor=(*colour[name][:3], 0.25) if wait else colour[name],
                edgecolor=colour[name],
                hatch="///" if wait else None,
                label=label,
            )
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _rank_axis(ax, ranks, hosts)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("time since the first event shown (s)")
    limit = f"last {last_steps} steps" if last_steps else "all steps"
    ax.set_title(title or f"Timeline per rank ({limit}); hatched = waiting for other ranks")
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


def plot_step_heatmap(
    events: Mapping[int, Sequence[Event]],
    path: str | os.PathLike[str],
    *,
    hosts: Mapping[int, str] | None = None,
    title: str | None = None,
    waits: WaitPredicate | None = None,
    order: Sequence[int] | None = None,
) -> None:
    """Draw a PNG heatmap: rows = ranks, columns = steps, colour = step compute time (s).

    Compute time is step time minus wait sections, as in `megascale.ft.stragglers.find_stragglers`.
    Steps a rank has not reported are left grey.

    Raises:
        ValueError: no rank has a finished step.
        ImportError: matplotlib is missing.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    import numpy as np  # a matplotlib dependency
    from matplotlib import colormaps
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ranks = _ordered(events, order)
    compute = {rank: {t.step: t.compute for t in step_timings(events[rank], waits=waits)} for rank in ranks}
    steps = sorted({step for per_step in compute.values() for step in per_step})
    if not steps:
        raise ValueError("plot_step_heatmap: no 'step' events to draw (no rank has finished a step)")
    column = {step: i for i, step in enumerate(steps)}
    grid = np.full((len(ranks), len(steps)), np.nan)
    for row, rank in enumerate(ranks):
        for step, value in compute[rank].items():  # a repeated step number keeps the later value
            grid[row, column[step]] = value

    fig = Figure(figsize=(min(24.0, 4 + 0.12 * len(steps)), min(40.0, 2 + 0.3 * len(ranks))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax).set_label("step compute time (s)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _index_label(steps, x)))
    _rank_axis(ax, ranks, hosts)
    ax.set_xlabel("step")
    ax.set_title(title or "Step compute time per rank (step minus waits)")
    _save(fig, path)


# --- helpers ----------------------------------------------------------------------------------------------
def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plotting needs matplotlib: {_PLOTS_HINT}") from err
    return Figure, FigureCanvasAgg


def _ordered(events: Mapping[int, Any], order: Sequence[int] | None) -> list[int]:
    """The ranks with events, in ``order`` (rows grouped by parallel coordinates) and then by number."""
    first = [r for r in (order or ()) if r in events]
    return first + sorted(set(events) - set(first))


def coordinate_order(coords: Mapping[int, Mapping[str, int]]) -> list[int]:
    """Ranks grouped as a 3D-parallel job reads best: by pipeline stage, then context- and tensor-parallel
    rank, then data-parallel replica (ranks without coordinates last)."""
    key = ("pp", "cp", "tp", "dp")
    return sorted(coords, key=lambda r: (*(coords[r].get(k, 0) for k in key), r))


_MICROBATCH_KEY = "pipeline microbatch "  # colour key prefix of the microbatch sections, by pass


def _colour_key(name: str) -> str:
    """What a section is coloured by: its name, or for a pipeline microbatch its pass ("F", "B")."""
    mb = parse_microbatch_section(name)
    return name if mb is None else _MICROBATCH_KEY + mb.kind


def _holds_several_stages(events: Sequence[Event]) -> bool:
    """Whether a rank's microbatch sections come from more than one pipeline stage (interleaved)."""
    stages = {mb.stage for e in events if (mb := parse_microbatch_section(str(e["name"]))) is not None}
    return len(stages) > 1


def _microbatch_label(kind: str, microbatch: int, stage: int, several: bool) -> str:
    return f"{kind}{microbatch} s{stage}" if several else f"{kind}{microbatch}"


def _label(rank: int, hosts: Mapping[int, str] | None) -> str:
    host = (hosts or {}).get(rank)
    return f"rank {rank} ({host})" if host else f"rank {rank}"


def _meta(kind: str, rank: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": rank, "tid": 0, "args": args}


def _nested(events: Sequence[Event], t0: float) -> list[tuple[Event, float, float]]:
    """Events as (event, ts µs, dur µs), parents before children, each child clipped to its parent.

    Start (wall clock) and duration (perf counter or GPU clock) come from different clocks, so a child may
    overshoot its parent by a few µs; Perfetto would then report mis-nested slices.
    """
    out: list[tuple[Event, float, float]] = []
    open_ends: list[float] = []  # end times (µs) of the enclosing events
    for event in _by_start(events):
        ts = (float(event["start"]) - t0) * 1e6
        end = ts + float(event["dur"]) * 1e6
        _close(open_ends, ts, event["name"] == "step", slack=1.0)
        if open_ends:
            end = min(end, open_ends[-1])
        open_ends.append(end)
        out.append((event, round(ts, 3), round(max(end - ts, 0.0), 3)))
    return out


def _depths(events: Sequence[Event]) -> list[tuple[Event, int]]:
    """Each event with its nesting depth (a step is 0, a section directly in it 1, ...)."""
    out: list[tuple[Event, int]] = []
    open_ends: list[float] = []  # end times of the enclosing events
    in_step = False  # whether the outermost enclosing event is a step
    for event in _by_start(events):
        start, is_step = float(event["start"]), event["name"] == "step"
        _close(open_ends, start, is_step, slack=1e-6)
        in_step = is_step or (in_step and bool(open_ends))
        out.append((event, len(open_ends) + (0 if in_step else 1)))  # sections outside a step: as if in one
        open_ends.append(start + float(event["dur"]))
    return out


def _by_start(events: Sequence[Event]) -> list[Event]:
    """Start order, a parent before the children that start with it."""
    return sorted(events, key=lambda e: (float(e["start"]), -float(e["dur"]), e["name"] != "step"))


def _close(open_ends: list[float], start: float, is_step: bool, slack: float) -> None:
    """Pop the enclosing events that end by ``start``. Steps never nest, and ``slack`` (1 µs) absorbs
    float rounding: unix seconds near 1.7e9 only resolve about 0.24 µs."""
    if is_step:
        open_ends.clear()
    while open_ends and start >= open_ends[-1] - slack:
        open_ends.pop()


def _height(depth: int) -> float:
    return 0.7 * 0.7 ** max(depth - 1, 0)


def _step_numbers(events: Mapping[int, Sequence[Event]]) -> list[int]:
    return sorted({int(e["step"]) for evs in events.values() for e in evs if e["name"] == "step"})


def _last_steps(events: Sequence[Event], steps: list[int], last: int | None) -> Sequence[Event]:
    if last is None or not steps:
        return events
    keep = set(steps[-last:])
    return [e for e in events if int(e["step"]) in keep]


def _index_label(labels: Sequence[Any], x: float) -> str:
    i = round(x)
    return str(labels[i]) if abs(x - i) < 1e-6 and 0 <= i < len(labels) else ""


def _rank_axis(ax: Any, ranks: list[int], hosts: Mapping[int, str] | None) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if len(ranks) <= 64:  # every rank labelled; beyond that matplotlib picks the ticks
        ax.set_yticks(range(len(ranks)))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    labels = [_label(rank, hosts) for rank in ranks]
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _index_label(labels, y)))
    ax.set_ylabel("rank")


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    _write_atomically(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))


def _write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Write to a temporary file next to ``path``, then rename it over ``path``: readers (a dashboard
    polling the file) never see a half-written file."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
