"""Step timings, straggler detection and the timeline pictures: StepTimer on CPU (and with fake CUDA
events), find_stragglers on synthetic synchronous steps, the Chrome trace, and the PNGs; pipeline
microbatch sections (a bar per forward / backward per stage, never counted as waits)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megascale.ft.stragglers import Straggler, find_stragglers, is_wait, step_timings
from megascale.ft.timeline import plot_step_heatmap, plot_timeline, write_chrome_trace
from megascale.ft.timing import StepTimer, microbatch_section, parse_microbatch_section

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- helpers ----------------------------------------------------------------------------------------------
def _ev(name: str, step: int, start: float, dur: float) -> dict[str, Any]:
    return {"name": name, "step": step, "start": start, "dur": dur}


def _synchronous(
    compute: dict[int, float], steps: int = 10, t0: float = 1_700_000_000.0
) -> dict[int, list[dict[str, Any]]]:
    """Synchronous data-parallel steps: every rank's step lasts as long as the slowest rank's compute
    (+ 10 ms of data loading); faster ranks spend the difference in "wait_allreduce"."""
    slowest = max(compute.values())
    step_len = 0.01 + slowest + 0.002
    events: dict[int, list[dict[str, Any]]] = {}
    for rank, c in compute.items():
        evs = events[rank] = []
        for i in range(steps):
            s = t0 + i * step_len
            evs.append(_ev("step", i, s, step_len))
            evs.append(_ev("data", i, s, 0.01))
            evs.append(_ev("forward", i, s + 0.01, c / 3))
            evs.append(_ev("backward", i, s + 0.01 + c / 3, 2 * c / 3))
            evs.append(_ev("wait_allreduce", i, s + 0.01 + c, step_len - 0.01 - c))
    return events


# --- StepTimer --------------------------------------------------------------------------------------------
def test_step_timer_records_nested_sections_on_cpu() -> None:
    timer = StepTimer(rank=0, use_cuda=False)
    assert not timer.use_cuda and timer.last_step_time is None
    with timer.step(7):
        with timer.section("forward"):
            time.sleep(0.005)
        with timer.section("backward"), timer.section("wait_allreduce"):
            time.sleep(0.005)
    events = timer.drain()
    json.dumps(events)  # JSON-able for the heartbeat
    assert [e["name"] for e in events] == ["step", "forward", "backward", "wait_allreduce"]
    assert all(e["step"] == 7 and set(e) == {"name", "step", "start", "dur"} for e in events[1:])
    step, fwd, bwd, wait = events
    assert step["wait"] == wait["dur"]  # the step carries its waits
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert abs(step["start"] - time.time()) < 5  # unix seconds
    assert fwd["dur"] >= 0.004 and wait["dur"] >= 0.004
    assert fwd["start"] + fwd["dur"] <= bwd["start"] + 1e-3  # forward ends before backward starts
    assert bwd["start"] <= wait["start"] and wait["dur"] <= bwd["dur"]  # wait inside backward
    assert step["dur"] >= fwd["dur"] + bwd["dur"]  # sections inside the step
    assert timer.last_step_time == step["dur"]
    assert timer.drain() == []  # drained events are forgotten


def test_step_timer_sections_outside_steps_and_errors() -> None:
    timer = StepTimer(use_cuda=False)
    with timer.section("checkpoint"):
        pass
    with pytest.raises(ZeroDivisionError), timer.step(3):
        1 / 0  # noqa: B018 - a failing step is still timed
    with timer.section("checkpoint"):
        pass
    with timer.step(4), pytest.raises(RuntimeError, match="do not nest"), timer.step(5):
        pass
    with pytest.raises(ValueError, match="reserved"), timer.section("step"):
        pass
    assert [(e["name"], e["step"]) for e in timer.drain()] == [
        ("checkpoint", -1),
        ("step", 3),
        ("checkpoint", 3),
        ("step", 4),
    ]


def test_step_timer_open_step_stays_until_finished() -> None:
    timer = StepTimer(use_cuda=False)
    with timer.step(0):
        with timer.section("forward"):
            pass
        assert [e["name"] for e in timer.drain()] == ["forward"]
    assert [e["name"] for e in timer.drain()] == ["step"]


def test_step_timer_records_host_intervals_between_steps() -> None:
    """A batch fetched between two steps (FaultTolerance's "data"): an event of the next step that lies
    outside it, drawn but not subtracted from any step's compute; inside a step it is a wait."""
    timer = StepTimer(use_cuda=False)
    with timer.step(0):
        pass
    timer.record("data", 1, time.time() - 0.05, 0.05)  # a fetch that just ended
    with timer.step(1):
        time.sleep(0.01)
    events = timer.drain()
    assert [(e["name"], e["step"]) for e in events] == [("step", 0), ("data", 1), ("step", 1)]
    assert events[1]["dur"] == 0.05
    (timing,) = [t for t in step_timings(events) if t.step == 1]
    assert timing.wait < 0.01  # the fetch before the step is not part of it (clipped to the step)
    with pytest.raises(ValueError, match=r"come from StepTimer\.step"):
        timer.record("step", 2, time.time(), 0.1)


def test_a_step_carries_its_outermost_waits_and_survives_the_driver_s_event_bound(monkeypatch) -> None:
    """Nested waits count once, waits outside a step not at all; the driver keeps step events apart from the
    sections, so straggler detection still sees every step's waits when a big model's thousands of
    tensor-parallel waits per step overflow the sections kept."""
    from megascale.ft import monitor as monitor_module
    from megascale.ft.config import Timeouts
    from megascale.ft.heartbeat import Heartbeat
    from megascale.ft.monitor import JobMonitor

    timer = StepTimer(use_cuda=False)
    with timer.section("wait/data"):  # before any step: not part of one
        time.sleep(0.002)
    with timer.step(0):
        with timer.section("wait/grad-reduce"), timer.section("wait/inner"):
            time.sleep(0.005)
        with timer.section("forward"), timer.section("wait/tp-all-reduce"):
            time.sleep(0.003)
    events = timer.drain()
    (step,) = [e for e in events if e["name"] == "step"]
    outer = [e for e in events if e["name"] in ("wait/grad-reduce", "wait/tp-all-reduce")]
    assert step["wait"] == pytest.approx(sum(e["dur"] for e in outer), abs=1e-9)
    assert step_timings(events)[0].wait == pytest.approx(step["wait"], abs=1e-9)

    monkeypatch.setattr(monitor_module, "MAX_EVENTS_PER_RANK", 50)
    monitor = JobMonitor(2, Timeouts(0.5, 3.0, 8.0, 10.0))
    for rank, events in _synchronous({0: 0.10, 1: 0.20}, steps=12).items():
        steps = [e for e in events if e["name"] == "step"]
        for e in steps:  # what StepTimer now attaches
            e["wait"] = step_timings(events)[steps.index(e)].wait
        flood = [_ev("wait/tp-all-reduce", e["step"], e["start"], 0.0) for e in steps for _ in range(40)]
        monitor.on_heartbeat(Heartbeat(rank=rank, events=[*events, *flood]))
    kept = monitor.timings()
    assert all(sum(e["name"] != "step" for e in evs) == 50 for evs in kept.values())  # sections overflowed
    assert all(sum(e["name"] == "step" for e in evs) == 12 for evs in kept.values())  # steps all kept
    assert [s.rank for s in find_stragglers(kept)] == [1]


def test_step_timer_keeps_at_most_max_events() -> None:
    timer = StepTimer(use_cuda=False, max_events=5)
    for i in range(4):
        with timer.step(i), timer.section("forward"):
            pass
    events = timer.drain()
    assert len(events) == 5 and timer.dropped == 3
    assert [(e["name"], e["step"]) for e in events][-2:] == [("step", 3), ("forward", 3)]  # newest kept
    with pytest.raises(ValueError, match="max_events"):
        StepTimer(use_cuda=False, max_events=0)


class _FakeEvent:
    """Stands in for torch.cuda.Event on one stream: an event's time is only readable once the "GPU" is
    known to have reached it, i.e. after it or a later event was synchronized."""

    syncs = 0
    recorded = 0  # events recorded so far, in stream order
    reached = 0  # the stream is known to have executed the events up to this one

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0
        self.order = 0

    def record(self) -> None:
        _FakeEvent.recorded += 1
        self.t, self.order = time.perf_counter(), _FakeEvent.recorded

    def query(self) -> bool:
        return 0 < self.order <= _FakeEvent.reached

    def synchronize(self) -> None:
        _FakeEvent.syncs += 1
        _FakeEvent.reached = max(_FakeEvent.reached, self.order)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event that has not completed"
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA


class _FakeCuda:
    Event = _FakeEvent

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


def test_step_timer_cuda_path_resolves_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    import megascale.ft.timing as timing

    monkeypatch.setattr(timing, "_cuda_module", lambda required: _FakeCuda)
    timer = StepTimer(use_cuda=True)
    assert timer.use_cuda
    syncs = _FakeEvent.syncs  # the anchor's
    with timer.step(0), timer.section("forward"):
        time.sleep(0.003)
    assert _FakeEvent.syncs == syncs  # nothing waited for the GPU during the step
    assert timer.last_step_time is None  # the step's GPU work is not known to be done, so no value
    events = timer.drain()
    assert _FakeEvent.syncs == syncs + 2  # drain waited for the two end events
    step, fwd = events
    assert fwd["dur"] >= 0.002 and step["dur"] >= fwd["dur"] and step["start"] <= fwd["start"]
    assert abs(step["start"] - time.time()) < 5  # anchored to the wall clock
    assert timer.last_step_time == step["dur"]


# --- stragglers -------------------------------------------------------------------------------------------
def test_find_stragglers_flags_the_rank_that_computes_slowly() -> None:
    events = _synchronous({0: 0.10, 1: 0.10, 2: 0.18, 3: 0.11})
    assert len({e["dur"] for evs in events.values() for e in evs if e["name"] == "step"}) == 1

    found = find_stragglers(events, hosts={2: "h1"})
    assert [s.rank for s in found] == [2]
    s = found[0]
    assert s.host == "h1" and s.steps == 10
    assert s.rank_step == pytest.approx(0.18) and s.median_step == pytest.approx(0.105)
    assert s.ratio == pytest.approx(0.18 / 0.105)
    assert str(s).startswith("rank 2 (host h1) is 1.71x slower than the median step (0.180 s vs 0.105 s")
    assert str(s).endswith("over 10 steps)")
    # Judged by whole step time (no section is a wait), nobody stands out: that is why waits are subtracted.
    assert find_stragglers(events, waits=lambda name: False) == []


def test_find_stragglers_threshold_window_and_min_steps() -> None:
    assert find_stragglers(_synchronous({0: 0.10, 1: 0.10, 2: 0.115})) == []  # 1.13x < 1.2
    assert [s.rank for s in find_stragglers(_synchronous({0: 0.10, 1: 0.10, 2: 0.115}), threshold=1.1)] == [2]

    # Rank 2 was slow in its first 10 steps only; the window looks at the last 5.
    slow_then_fine = _synchronous({0: 0.1, 1: 0.1, 2: 0.2}, steps=10)
    fine = _synchronous({0: 0.1, 1: 0.1, 2: 0.1}, steps=5, t0=1_800_000_000.0)
    for rank in fine:
        slow_then_fine[rank] += [e | {"step": e["step"] + 10} for e in fine[rank]]
    assert [s.rank for s in find_stragglers(slow_then_fine, window=20)] == [2]
    assert find_stragglers(slow_then_fine, window=5) == []

    few = _synchronous({0: 0.1, 1: 0.1, 2: 0.3}, steps=2)
    assert find_stragglers(few) == []  # fewer than min_steps
    assert [s.rank for s in find_stragglers(few, min_steps=2)] == [2]
    assert find_stragglers({}) == []
    with pytest.raises(ValueError, match="threshold"):
        find_stragglers(few, threshold=0)


def test_step_timings_count_nested_waits_once() -> None:
    events = [
        _ev("step", 0, 10.0, 1.0),
        _ev("wait_allreduce", 0, 10.5, 0.4),
        _ev("wait_inner", 0, 10.6, 0.1),  # inside the other wait
        _ev("data", 0, 10.9, 0.5),  # overruns the step: clipped
        _ev("wait", 1, 10.0, 0.3),  # another step's
    ]
    (timing,) = step_timings(events)
    assert timing.wait == pytest.approx(0.5) and timing.compute == pytest.approx(0.5)
    with pytest.raises(ValueError, match="malformed"):
        step_timings([{"name": "step", "step": 0}])


# --- Chrome trace -----------------------------------------------------------------------------------------
def test_chrome_trace_has_one_process_per_rank_in_microseconds(tmp_path: Path) -> None:
    events = _synchronous({0: 0.1, 1: 0.1, 3: 0.2}, steps=3)
    straggler = Straggler(3, "h3", 0.1, 0.2, 2.0, 3)
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path, hosts={3: "h3"}, stragglers=[straggler])
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary file left
    trace = json.loads(path.read_text())["traceEvents"]

    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 3: "rank 3 (h3)"}
    complete = [e for e in trace if e["ph"] == "X"]
    assert len(complete) == sum(len(v) for v in events.values())
    assert min(e["ts"] for e in complete) == 0
    step1 = next(e for e in complete if e["pid"] == 1 and e["name"] == "step" and e["args"]["step"] == 1)
    step_len = events[1][0]["dur"]
    assert step1["ts"] == pytest.approx(step_len * 1e6) and step1["dur"] == pytest.approx(step_len * 1e6)
    assert {e["cat"] for e in complete if e["name"] == "wait_allreduce"} == {"wait"}
    for e in complete:  # sections lie inside their step on the same thread
        step = next(s for s in complete if s["pid"] == e["pid"] and s["name"] == "step")
        assert e["tid"] == step["tid"] == 0
    (instant,) = [e for e in trace if e["ph"] == "i"]
    assert instant["pid"] == 3 and instant["ts"] == pytest.approx(3 * step_len * 1e6)
    assert instant["args"]["ratio"] == 2.0 and "rank 3 (host h3)" in instant["args"]["message"]


def test_chrome_trace_clips_children_to_their_step(tmp_path: Path) -> None:
    events = {0: [_ev("step", 0, 100.0, 1.0), _ev("forward", 0, 100.5, 0.500002)]}  # overshoots by 2 µs
    write_chrome_trace(events, tmp_path / "t.json")
    step, fwd = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert fwd["ts"] + fwd["dur"] <= step["ts"] + step["dur"]
    write_chrome_trace({}, tmp_path / "empty.json")  # an empty run still gives a trace that opens
    assert json.loads((tmp_path / "empty.json").read_text())["traceEvents"] == []


# --- PNGs -------------------------------------------------------------------------------------------------
def _assert_png(path: Path, min_width: int = 300) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)
    assert pixels.shape[1] >= min_width and pixels.shape[0] >= 100
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


def test_plot_timeline_and_heatmap_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    events = _synchronous({0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1}, steps=12)
    events[1] = events[1][: 5 * 7]  # rank 1 reported fewer steps
    events[0].append(_ev("checkpoint", 11, events[0][-1]["start"] + 1, 0.05))  # a section outside a step
    plot_timeline(events, tmp_path / "timeline.png", hosts={2: "h2"}, last_steps=3)
    plot_timeline(events, tmp_path / "all.png", last_steps=None, title="all")
    plot_step_heatmap(events, tmp_path / "heatmap.png", hosts={2: "h2"})
    for name in ("timeline.png", "all.png", "heatmap.png"):
        _assert_png(tmp_path / name)


def test_plots_refuse_empty_input(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no timing events"):
        plot_timeline({}, tmp_path / "t.png")
    with pytest.raises(ValueError, match="no timing events"):
        plot_timeline({0: [], 1: []}, tmp_path / "t.png")
    with pytest.raises(ValueError, match="no 'step' events"):
        plot_step_heatmap({0: [_ev("forward", -1, 1.0, 0.1)]}, tmp_path / "h.png")
    assert list(tmp_path.iterdir()) == []


def test_plots_explain_a_missing_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'megascale-ft\[plots\]'"):
        plot_timeline({0: [_ev("step", 0, 1.0, 0.1)]}, tmp_path / "t.png")


def test_driver_modules_import_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, megascale.ft.timeline, megascale.ft.stragglers, megascale.ft.timing\n"
        "heavy = sorted({'torch', 'matplotlib'} & set(sys.modules))\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rows_are_grouped_by_stage_tensor_rank_and_replica(tmp_path):
    from megascale.ft.timeline import coordinate_order, write_chrome_trace

    # dp2 × pp2 × tp2 in torch's rank order (dp outermost): row order stage by stage, then tp, then dp
    coords = {r: {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2} for r in range(8)}
    order = coordinate_order(coords)
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    events = {r: [{"name": "step", "step": 0, "start": 100.0 + r, "dur": 1.0}] for r in range(8)}
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path, order=order)
    import json

    sort = {e["pid"]: e["args"]["sort_index"] for e in json.loads(path.read_text())["traceEvents"]
            if e.get("name") == "process_sort_index"}  # fmt: skip
    assert sorted(sort, key=sort.get) == order


# --- pipeline microbatches --------------------------------------------------------------------------------
def _pipeline(
    stages: dict[int, tuple[int, ...]], steps: int = 4, m: int = 4
) -> dict[int, list[dict[str, Any]]]:
    """Two pipeline ranks running 1F1B-like steps of ``m`` microbatches per stage they hold: each rank's
    step has a "forward" section holding every microbatch section (F then B, 10 ms each), with a receive
    wait of 5 ms before each forward."""
    events: dict[int, list[dict[str, Any]]] = {}
    t0 = 1_700_000_000.0
    per_stage = m * (0.005 + 0.02)
    for rank, held in stages.items():
        evs = events[rank] = []
        step_len = 0.01 + len(held) * per_stage
        for i in range(steps):
            s = t0 + i * step_len
            evs.append(_ev("step", i, s, step_len))
            evs.append(_ev("forward", i, s + 0.005, len(held) * per_stage))
            t = s + 0.005
            for stage in held:
                for mb in range(m):
                    evs.append(_ev("wait/pipeline-recv-F", i, t, 0.005))
                    evs.append(_ev(microbatch_section("F", mb, stage), i, t + 0.005, 0.01))
                    evs.append(_ev(microbatch_section("B", mb, stage), i, t + 0.015, 0.01))
                    t += 0.025
    return events


def test_microbatch_section_names_round_trip() -> None:
    assert microbatch_section("F", 3, 1) == "pipeline/F3@s1"
    assert parse_microbatch_section("pipeline/B12@s0") == ("B", 12, 0)
    for other in ("forward", "wait/pipeline-recv-F", "pipeline/F3", "pipeline/F3@s1x"):
        assert parse_microbatch_section(other) is None
    assert not is_wait(microbatch_section("F", 0, 0))  # computing, never waiting


def test_microbatch_sections_are_computation_not_waits() -> None:
    events = _pipeline({0: (0,), 1: (1,)})
    for timing in step_timings(events[0]):
        assert timing.wait == pytest.approx(4 * 0.005, abs=1e-5)  # only the receive waits
        assert timing.compute == pytest.approx(timing.dur - 4 * 0.005, abs=1e-5)
    assert find_stragglers(events) == []


def test_chrome_trace_nests_a_bar_per_microbatch_in_each_step(tmp_path: Path) -> None:
    events = _pipeline({0: (0,), 1: (1, 3)})  # rank 1 holds two stages (interleaved)
    write_chrome_trace(events, tmp_path / "t.json")
    complete = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    bars = [e for e in complete if e["cat"] == "microbatch"]
    assert len(bars) == 4 * (4 + 8) * 2  # steps × microbatches on the rank's stages × (F, B)
    rank0 = [e for e in bars if e["pid"] == 0 and e["args"]["step"] == 1]
    assert [e["name"] for e in rank0] == [f"{k}{mb}" for mb in range(4) for k in "FB"]
    first = rank0[0]
    assert first["args"] == {"step": 1, "microbatch": 0, "stage": 0, "pass": "forward"}
    assert {e["name"] for e in bars if e["pid"] == 1} >= {"F0 s1", "B3 s3"}  # several stages: named
    for bar in bars:  # inside its step and its "forward" section, on the rank's one thread
        for parent in ("step", "forward"):
            (p,) = [e for e in complete if e["pid"] == bar["pid"] and e["name"] == parent
                    and e["args"]["step"] == bar["args"]["step"]]  # fmt: skip
            assert p["ts"] <= bar["ts"] and bar["ts"] + bar["dur"] <= p["ts"] + p["dur"] + 1e-3
            assert bar["tid"] == p["tid"] == 0
    assert {e["cat"] for e in complete if e["name"] == "wait/pipeline-recv-F"} == {"wait"}


def test_plot_timeline_draws_microbatches(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot_timeline(_pipeline({0: (0,), 1: (1,)}), tmp_path / "pp.png", last_steps=2)
    _assert_png(tmp_path / "pp.png")
