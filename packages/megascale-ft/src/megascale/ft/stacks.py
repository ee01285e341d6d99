"""Hang localisation: every rank's Python stacks, collected before a hung job is killed, and the ranks whose
stack differs from the rest named with the frame they are in (MegaScale §4.3's approach).

Rank side (``arm_stack_dump``, called by ``Executor.from_env`` under the launcher): ``faulthandler`` dumps
all threads' stacks to ``<dir>/rank-<r>.txt`` on SIGUSR1. It is a C-level handler, so it answers while the
main thread is blocked inside a collective (gloo/NCCL wait without the GIL).

Driver side (``collect_stacks``): SIGUSR1 then SIGCONT to every rank's process (a SIGSTOPped rank acts on the
pending SIGUSR1 once continued, and dumps the frame it was stopped in), then up to ``timeout`` seconds for the
files. ``localise`` compares the main threads' stacks: with a strict majority, the ranks off the majority
are the suspects; without one (two ranks, one stuck and one waiting for it), the ranks that are not waiting in
a collective or in autograd's engine (which waits for DDP's reductions) are. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "STACKS_ENV",
    "HangReport",
    "arm_stack_dump",
    "collect_stacks",
    "localise",
    "main_stack",
    "prune_empty",
]

STACKS_ENV = "MEGASCALE_FT_STACKS"
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
# frames of a rank that waits for others (a peer is the cause, not this rank)
_WAITING = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py", "threading.py")
_armed: TextIO | None = None


def arm_stack_dump(rank: int, directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Dump all threads' stacks to ``<directory>/rank-<rank>.txt`` on SIGUSR1 (``directory`` defaults to
    ``$MEGASCALE_FT_STACKS``, which the launcher sets; nothing happens without one). Returns the file."""
    global _armed
    directory = directory or os.environ.get(STACKS_ENV)
    if not directory or not hasattr(signal, "SIGUSR1"):
        return None
    path = Path(directory) / f"rank-{rank:05d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if _armed is not None:
        _armed.close()
    _armed = open(path, "w")  # noqa: SIM115 - kept open for the signal handler for the process's life
    faulthandler.register(signal.SIGUSR1, file=_armed, all_threads=True, chain=False)
    return path


def collect_stacks(
    pids: Mapping[int, int], directory: str | os.PathLike[str], timeout: float = 3.0
) -> dict[int, str]:
    """Ask every rank (``rank -> pid``) for its stacks and return what each wrote within ``timeout`` s
    (ranks that wrote nothing are left out)."""
    root = Path(directory)
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + timeout
    got: dict[int, str] = {}
    while True:
        for rank in pids:
            path = root / f"rank-{rank:05d}.txt"
            text = path.read_text(errors="replace") if rank not in got and path.exists() else ""
            if text and (_has_main(text) or time.monotonic() >= deadline):
                got[rank] = text  # complete (the main thread written), or all there is at the deadline
        if len(got) == len(pids) or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


def prune_empty(directory: str | os.PathLike[str]) -> None:
    """Remove the stack files no rank wrote into (every rank opens its file when armed, in case it hangs),
    then ``directory`` and its parent if nothing is left: an attempt without a hang leaves no stacks."""
    root = Path(directory)
    for path in root.glob("rank-*.txt"):
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                path.unlink()
    for folder in (root, root.parent):
        with contextlib.suppress(OSError):  # not empty, or gone
            folder.rmdir()


def _is_main(frames: list[str]) -> bool:
    # the main thread runs a module's top level (a script's, or under `python -m` below runpy's frames)
    return any(frame.endswith("in <module>") for frame in frames)


def _has_main(text: str) -> bool:
    return any(_is_main(frames) for frames in _threads(text).values())


def _threads(text: str) -> dict[str, list[str]]:
    threads: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if _THREAD.match(line):
            current = threads.setdefault(line.split(" (")[0], [])
            continue
        match = _FRAME.match(line)
        if match and current is not None:
            current.append(f"{match['file']}:{match['line']} in {match['func']}")
    return threads


def main_stack(text: str) -> list[str]:
    """The main thread's frames in a faulthandler dump, innermost first (the thread whose outermost frame is
    a module's top level; else the thread that handled the signal)."""
    threads = _threads(text)
    for frames in threads.values():
        if _is_main(frames):
            return frames
    current = [frames for name, frames in threads.items() if name.startswith("Current thread")]
    return current[0] if current else []


def _waiting(frames: list[str]) -> bool:
    return any(marker in frame for frame in frames[:6] for marker in _WAITING)


@dataclass
class HangReport:
    """Who is stuck where: ``suspects`` (rank -> its innermost frame), every rank's innermost frame, the ranks
    that sent no stack, those waiting in a collective (or autograd waiting for one), and the files."""

    suspects: dict[int, str] = field(default_factory=dict)
    frames: dict[int, str] = field(default_factory=dict)
    silent: list[int] = field(default_factory=list)
    files: dict[int, str] = field(default_factory=dict)
    waiting: list[int] = field(default_factory=list)
    map: str | None = None  # the hang map's picture (`megascale.ft.hang_map`)

    def summary(self) -> str:
        if not self.suspects and not self.silent:
            return "every rank's stack is alike: no rank stands out"
        parts = [f"rank {r} differs, in {frame}" for r, frame in sorted(self.suspects.items())]
        parts += [f"rank {r} sent no stack" for r in self.silent]
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"suspects": {str(k): v for k, v in self.suspects.items()}, "summary": self.summary(),
                "frames": {str(k): v for k, v in self.frames.items()}, "silent": self.silent,
                "files": {str(k): v for k, v in self.files.items()}, "waiting": self.waiting,
                "map": self.map}  # fmt: skip


def localise(
    stacks: Mapping[int, str], ranks: list[int] | None = None, directory: str | None = None
) -> HangReport:
    """Compare the ranks' main-thread stacks (see the module docstring) and name the ranks that stand out."""
    ranks = sorted(ranks if ranks is not None else stacks)
    mains = {r: main_stack(stacks[r]) for r in ranks if r in stacks}
    report = HangReport(silent=[r for r in ranks if r not in stacks or not mains.get(r)])
    report.frames = {r: frames[0] for r, frames in mains.items() if frames}
    report.waiting = [r for r, frames in mains.items() if frames and _waiting(frames)]
    if directory is not None:
        report.files = {r: str(Path(directory) / f"rank-{r:05d}.txt") for r in mains}
    signatures = Counter(tuple(frames) for frames in mains.values() if frames)
    if not signatures:
        return report
    (common, count), *rest = signatures.most_common()
    if count * 2 > len(mains) and not (rest and rest[0][1] == count):
        report.suspects = {r: f[0] for r, f in mains.items() if f and tuple(f) != common}
    else:
        report.suspects = {r: f[0] for r, f in mains.items() if f and not _waiting(f)}
    return report
