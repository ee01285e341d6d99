"""Hang localisation: stacks dumped by real processes on SIGUSR1 (one of them SIGSTOPped), and which ranks a
comparison of the stacks names."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megascale.ft.stacks import HangReport, collect_stacks, localise, main_stack

_RANK = textwrap.dedent(
    """
    import sys, threading, time
    from megascale.ft.stacks import arm_stack_dump

    def wait_for_peers():  # what a healthy rank does in a hang: block in a collective
        time.sleep(600)

    def stuck_in_user_code():
        time.sleep(600)

    arm_stack_dump(int(sys.argv[1]), sys.argv[2])
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # another thread, not the main
    print("ready", flush=True)
    (stuck_in_user_code if sys.argv[3] == "stuck" else wait_for_peers)()
    """
)


def _start(tmp_path: Path, rank: int, role: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    proc = subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "stacks"), role],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_every_rank_answers_even_a_stopped_one_and_the_odd_one_is_named(tmp_path: Path) -> None:
    procs = {0: _start(tmp_path, 0, "wait"), 1: _start(tmp_path, 1, "stuck"), 2: _start(tmp_path, 2, "wait")}
    try:
        procs[1].send_signal(signal.SIGSTOP)  # frozen: only acts on signals once continued
        time.sleep(0.2)
        stacks = collect_stacks({r: p.pid for r, p in procs.items()}, tmp_path / "stacks", timeout=10)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert sorted(stacks) == [0, 1, 2]
    assert main_stack(stacks[1])[0].endswith("in stuck_in_user_code")  # the main thread, not the sleeper
    report = localise(stacks, [0, 1, 2], str(tmp_path / "stacks"))
    assert list(report.suspects) == [1] and report.suspects[1].endswith("in stuck_in_user_code")
    assert report.frames[0].endswith("in wait_for_peers") and not report.silent
    assert "rank 1 differs, in" in report.summary()


def _dump(*frames: str) -> str:
    lines = ["Thread 0x00007f0000000001 (most recent call first):", '  File "threading.py", line 1 in wait']
    lines += ["", "Current thread 0x00007f0000000002 (most recent call first):"]
    lines += [f'  File "{f.split(":")[0]}", line {f.split(":")[1]} in {f.split(":")[2]}' for f in frames]
    lines.append('  File "train.py", line 99 in <module>')
    return "\n".join(lines) + "\n"


def test_without_a_majority_the_ranks_not_waiting_on_a_collective_are_named() -> None:
    waiting = _dump("/x/torch/distributed/distributed_c10d.py:10:all_reduce", "train.py:50:step")
    stuck = _dump("train.py:70:load_batch", "train.py:51:step")
    report = localise({0: waiting, 1: stuck})  # 1 against 1: no majority
    assert report.suspects == {1: "train.py:70 in load_batch"}
    report = localise({0: waiting, 1: waiting, 2: waiting}, [0, 1, 2, 3])
    assert report.suspects == {} and report.silent == [3]
    assert report.summary() == "rank 3 sent no stack"


def _hang_2x2x2() -> tuple[dict[int, dict[str, int]], HangReport]:
    """pp2 × dp2 × tp2, rank = pp*4 + dp*2 + tp; rank 5 (pp1 dp0 tp1) stuck in user code, the rest waiting."""
    coords = {r: {"pp": r // 4, "dp": r // 2 % 2, "tp": r % 2} for r in range(8)}
    waiting = _dump("/x/torch/distributed/distributed_c10d.py:10:all_reduce", "train.py:50:step")
    stacks = {r: waiting for r in range(8)}
    stacks[5] = _dump("train.py:70:load_batch", "train.py:51:step")
    return coords, localise(stacks)


def test_the_hang_map_traces_waiting_ranks_to_the_stuck_one_along_their_groups() -> None:
    from megascale.ft.hang_map import Dependency, dependencies, describe, rank_states

    coords, report = _hang_2x2x2()
    assert report.suspects == {5: "train.py:70 in load_batch"} and report.waiting == [0, 1, 2, 3, 4, 6, 7]
    states = rank_states(report, list(range(8)))
    assert states[5] == "stuck" and {states[r] for r in range(8) if r != 5} == {"waiting"}
    # only ranks in a group with rank 5: its tp peer 4, its dp peer 7, its pipeline peer 1
    assert dependencies(coords, states) == [
        Dependency(1, 5, "pp"),
        Dependency(4, 5, "tp"),
        Dependency(7, 5, "dp"),
    ]
    assert describe(coords, report) == (
        "rank 1 waits for rank 5 (pp); rank 4 waits for rank 5 (tp); rank 7 waits for rank 5 (dp)"
    )
    # a rank that sent no stack is a suspect too; without coordinates every rank is in one group
    report = localise({0: _dump("/x/torch/distributed/distributed_c10d.py:10:all_reduce")}, [0, 1])
    assert dependencies({}, rank_states(report, [0, 1])) == [Dependency(0, 1, "world")]


def test_the_hang_map_is_drawn_beside_the_stacks(tmp_path: Path) -> None:
    from megascale.ft.hang_map import write_hang_map

    coords, report = _hang_2x2x2()
    write_hang_map(tmp_path, coords, report, list(range(8)))
    assert report.map == str(tmp_path / "hang_map.png") and report.to_json()["map"] == report.map
    assert (tmp_path / "hang_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_hang_map(tmp_path / "none", {}, localise({0: _dump("train.py:1:f")}, [0, 1]), [0, 1])
    assert (tmp_path / "none" / "hang_map.png").is_file()  # no coordinates: one row of ranks
