"""Launch ``tests.lightning._fit_worker`` on fresh rank processes, clean of the test process's environment.

Multi-process ``Trainer.fit`` inside pytest would re-launch pytest itself and leak the process group
(shared notes), so every fit runs in processes of its own. They are forked from the test session's forkserver
(tests/_forkserver.py: torch and Lightning imported once, not ~11 s of CPU per rank) with the environment
torchrun gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID: Lightning
takes the ranks as launched and launches nothing), and ended as torchrun ends them: when one rank fails the
others are killed. Each rank's output goes to a log file, whose tail a failure reports.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import torch

from tests import _forkserver

ROOT = Path(__file__).resolve().parents[2]
_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("TORCHELASTIC")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def free_port() -> int:
    """A port free now on loopback for rank 0's store, below Linux's ephemeral ports (32768+): ranks bind it
    seconds later, and a port of that range may meanwhile become the local end of any outgoing connection
    (CI saw torchrun fail with EADDRINUSE so; megascale-ft's launcher binds its store's socket first)."""
    for port in random.SystemRandom().sample(range(12768, 32768), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 12768-32767 on 127.0.0.1")


def _rank(env: dict[str, str], log: str, main: str, args: tuple[str, ...]) -> None:
    """A forked rank: torchrun's environment, output to its log, then ``main`` ("module:function")."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(ROOT)
    torch.set_num_threads(1)
    module, function = main.split(":")
    getattr(importlib.import_module(module), function)(*args)


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = clean_env()
    if world_size > 1:
        ranks = dict(RANK=rank, LOCAL_RANK=rank, GROUP_RANK=0, ROLE_RANK=rank, WORLD_SIZE=world_size,
                     LOCAL_WORLD_SIZE=world_size, ROLE_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, TORCHELASTIC_RUN_ID="megascale-tests")  # fmt: skip
        env.update({k: str(v) for k, v in ranks.items()})
    return env


def run_ranks(
    main: str, args: list[str], world_size: int, logs: list[Path], timeout: float
) -> list[int | None]:
    """Run ``main`` ("module:function", called with ``args``) on ``world_size`` forked ranks, rank r's output
    to ``logs[r]``; return the exit codes (None: killed at the timeout).

    The master port is free when chosen, but another test's process may take it before rank 0 listens on it
    (EADDRINUSE, seen once in a CI run of two lanes): then the ranks are run again on a new port, twice at most.
    """
    for _ in range(2):
        codes = _run_ranks_once(main, args, world_size, logs, timeout)
        if codes == [0] * world_size or not _port_taken(logs[0]):
            return codes
    return _run_ranks_once(main, args, world_size, logs, timeout)


def _port_taken(log: Path) -> bool:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "EADDRINUSE" in text and "failed to listen" in text


def _run_ranks_once(
    main: str, args: list[str], world_size: int, logs: list[Path], timeout: float
) -> list[int | None]:
    ctx, port = _forkserver.context(), free_port()
    procs = [
        ctx.Process(
            target=_rank, args=(_rank_env(rank, world_size, port), str(logs[rank]), main, tuple(args))
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break  # as torchrun: one rank failed, the others are ended
        time.sleep(0.05)
    timed_out = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return [None if late else p.exitcode for p, late in zip(procs, timed_out)]


def fit(jobs: list[dict[str, Any]], world_size: int, tmp_path: Path, timeout: float = 300) -> dict[str, Any]:
    """Run ``jobs`` on ``world_size`` CPU ranks; return rank 0's results (see _fit_worker)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec, out = tmp_path / f"spec-{world_size}.json", tmp_path / f"out-{world_size}.pt"
    spec.write_text(json.dumps({"jobs": jobs}))
    logs = [tmp_path / f"rank{rank}-{world_size}.log" for rank in range(world_size)]
    codes = run_ranks("tests.lightning._fit_worker:main", [str(spec), str(out)], world_size, logs, timeout)
    if any(code != 0 for code in codes) or not out.exists():
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{_tail(logs[r])}" for r, c in enumerate(codes))
        raise RuntimeError(f"fit failed (exit codes {codes}):\n{tails}")
    return torch.load(out, weights_only=True)


def _tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"
