"""Start test ranks by forking a server that has imported torch (and Lightning) once.

A rank process spends ~3 s of CPU importing torch and ~8 s more importing Lightning (torch._dynamo and
torchmetrics come with it); a suite that starts hundreds of ranks on 2 cores spent most of its time importing.
multiprocessing's forkserver imports ``PRELOAD`` once, in one server process per test session, and forks each
rank from it: the rank starts in milliseconds with those modules already imported. Nothing else is shared: the
server only imports (no torch computation, no thread pool, no process group), so a forked rank starts as fresh
as a spawned one. Modules a session has not installed are skipped by the server (an ImportError there is
ignored), so one list serves every package's session.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "megascale.core.model",  # the packages' __init__s import lazily: name the modules that carry the weight
    "megascale.core.parallel",
    "lightning.pytorch",
    "megascale.lightning.strategy",
    "megascale.lightning.module",
]


def context() -> ForkServerContext:
    """The forkserver context every test rank starts from; its server is started here (once) with
    ``OMP_NUM_THREADS=1`` in its environment, as torchrun gives its ranks (4 ranks of 2 threads each on 2
    cores ran ~18x slower)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    return ctx
