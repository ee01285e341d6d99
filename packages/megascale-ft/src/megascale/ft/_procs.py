"""Stopping a job's process tree at once, including stopped (SIGSTOP) and detached processes.

torchrun starts every worker in a session of its own, so signalling torchrun's process group misses them;
and a stopped process does not act on SIGTERM until continued. After a fault nothing of the attempt is
worth a graceful shutdown (the checkpoints are on storage; an unfinished one is skipped as partial), so
the whole tree gets SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["descendants", "kill_tree", "pid_alive"]


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


def kill_tree(root: int, extra: Iterable[int] = (), wait: float = 10.0) -> None:
    """SIGKILL ``root``, everything below it and ``extra`` pids (ranks that reported theirs); wait until
    ``root`` is reaped by its parent (the caller) or ``wait`` seconds pass."""
    pids = [*descendants(root), *extra]
    for pid in [root, *pids]:
        _signal(pid, signal.SIGKILL)
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
