"""Stopping a job's process tree at once, including stopped (SIGSTOP) and detached processes.

torchrun starts every worker in a session of its own, so signalling torchrun's process group misses them;
and a stopped process does not act on SIGTERM until continued. After a fault nothing of the attempt is
worth a graceful shutdown (the checkpoints are on storage; an unfinished one is skipped as partial), so
the whole tree gets SIGKILL.

A pid recorded earlier (a rank that reported its own, a process seen under torchrun a while ago) may since
have ended and been reused by an unrelated process of the machine. So such pids are recorded with their
start time (``/proc/<pid>/stat`` field 22, in clock ticks since boot), and signalled only through a pidfd
opened while that start time still matches: a reused pid is left alone, and said so in the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "children",
    "descendants",
    "kill_tree",
    "pid_alive",
    "same_process",
    "signal_recorded",
    "start_time",
]

log = logging.getLogger("megascale.ft")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (``/proc/<pid>/stat`` field 22: clock ticks after boot), None when it is gone.
    With the pid, it names one process for the machine's uptime: a reused pid starts later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # fields after the command name (which may hold spaces and parentheses) start at field 3
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int, started: int) -> bool:
    """``pid`` still names the process that started at ``started`` (not ended, not reused)."""
    return start_time(pid) == started


def signal_recorded(pid: int, started: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process recorded as started at ``started``; False
    (and a log line when the pid was reused) otherwise. Through a pidfd where the kernel has them, so the
    pid cannot be reused between the check and the signal."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds (old kernel): check, then signal; a tiny window remains
        fd = None
    try:
        now = start_time(pid)
        if now != started:
            if now is not None:
                log.warning("not signalling pid %d: it was reused by another process (started at tick %d, "
                            "recorded %d)", pid, now, started)  # fmt: skip
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if fd is None:
                os.kill(pid, sig)
            else:
                signal.pidfd_send_signal(fd, sig)
            return True
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    return _children_map().get(pid, [])


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (Linux /proc), children first."""
    children, found, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(root: int, extra: Mapping[int, int] | None = None, wait: float = 10.0) -> None:
    """SIGKILL ``root`` (the caller's child, not yet reaped: its pid cannot be reused), everything below it
    now, and the ``extra`` processes (pid -> start time, recorded earlier: ranks that reported theirs,
    processes seen under ``root`` before) that are still the processes recorded; wait until they are gone
    or ``wait`` seconds pass."""
    below = descendants(root)
    for pid in [root, *below]:
        _signal(pid, signal.SIGKILL)
    recorded = {p: t for p, t in (extra or {}).items() if p != root and p not in below}
    for pid, started in recorded.items():
        signal_recorded(pid, started, signal.SIGKILL)
    # a recorded pid now gone may still name its session (its children); a reused one names a stranger's
    pids = below + [p for p, t in recorded.items() if start_time(p) in (None, t)]
    # processes re-parented meanwhile (a worker's own children) are found by their session id
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped: gone for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
