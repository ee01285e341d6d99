"""Run a function on several real processes over gloo, the way every distributed test here does.

Why not ``torch.multiprocessing.spawn`` as is: it neither bounds the run with a timeout nor avoids the
interpreter-exit aborts gloo sometimes causes (see shared notes). Each worker here initialises a process
group on a file store (no port races under xdist), runs with one thread (ranks oversubscribe 2 cores
badly otherwise), sends its result back through a file, and leaves with ``os._exit`` after tearing the
group down. A worker that fails writes its traceback, and the parent raises with all of them.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from tests import _forkserver

COLLECTIVE_TIMEOUT_S = 60


def _worker(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(workdir) / f"rank{rank}"
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        # every rank past its connections before any may leave: a rank whose fn ends at once (a refusal) closed
        # its sockets while a slower peer was still connecting ("Gloo connectFullMesh failed", CI 2026-12-06)
        dist.barrier()
        result = fn(rank, world_size, *args)
        out.with_suffix(".result").write_bytes(pickle.dumps(result))
    except BaseException:
        out.with_suffix(".error").write_text(traceback.format_exc())
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def finish_and_exit() -> NoReturn:
    """End a rank of a script launched under torchrun: wait for the others, tear the group down, flush, and
    leave with ``os._exit(0)``, which avoids gloo's occasional abort at interpreter exit (shared notes)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function of an importable module (children import it by name). Ranks are
    forked from a server that imported torch once (tests/_forkserver.py), not spawned: starting them was
    most of what distributed tests cost.
    """
    ctx = _forkserver.context()
    with tempfile.TemporaryDirectory(prefix="megascale-dist-") as workdir:
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch is imported there
        try:
            procs = [
                ctx.Process(target=_worker, args=(fn, rank, world_size, workdir, args), daemon=False)
                for rank in range(world_size)
            ]
            for p in procs:
                p.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for rank in range(world_size):
            err = Path(workdir) / f"rank{rank}.error"
            if err.exists():
                errors.append(f"--- rank {rank} ---\n{err.read_text()}")
        if errors:
            raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout:.0f} s")
        bad = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited abnormally without a traceback: {bad}")
        return [
            pickle.loads((Path(workdir) / f"rank{rank}.result").read_bytes()) for rank in range(world_size)
        ]
