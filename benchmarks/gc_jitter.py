"""Step-time jitter from Python's garbage collector, automatic vs synchronised (megascale.ft.GCSchedule).

Ranks (gloo, 1 thread each) run a synchronous loop: build a Python-heavy structure with reference cycles
(standing in for what a training step allocates: autograd graphs, hooks, dataclass records, logging), a small
matmul, then an all-reduce, so every step waits for the slowest rank. With automatic GC each rank collects
whenever its own allocation counters say so, at different steps; with the schedule every rank collects at the
same step every --every steps. Reported per mode, rank 0's step times: median, p99, max, standard deviation,
and the total time; the ratio of the tails is the figure (MegaScale §4 reports the MFU decay this fixes).

    python benchmarks/gc_jitter.py                 # ~1 minute on 2 cores
    python benchmarks/gc_jitter.py --ranks 4 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _Node:
    __slots__ = ("children", "parent", "payload")

    def __init__(self, parent: Any, payload: int) -> None:
        self.parent, self.payload, self.children = parent, payload, []


def _garbage(n: int) -> None:
    """``n`` objects in parent <-> child cycles, dropped at once: only the cyclic collector frees them."""
    root = _Node(None, 0)
    for i in range(n):
        node = _Node(root, i)
        root.children.append(node)
    # a long-lived survivor list makes older generations grow, as a real process's heap does
    _SURVIVORS.append(root if len(_SURVIVORS) < 200 else _Node(None, -1))


_SURVIVORS: list[Any] = []


def _worker(rank: int, ranks: int, store: str, mode: str, args: argparse.Namespace, out: str) -> None:
    from megascale.ft import GCSchedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=120))  # fmt: skip
    a = torch.randn(args.dim, args.dim)
    schedule = GCSchedule(every_n_steps=args.every) if mode == "synchronized" else None
    if schedule is not None:
        schedule.start()
    times = []
    flag = torch.zeros(1)
    for step in range(1, args.warmup + args.steps + 1):
        started = time.perf_counter()
        _garbage(args.objects)
        (a @ a).sum()
        dist.all_reduce(flag)
        if schedule is not None:
            schedule.step(step)
        if step > args.warmup:
            times.append(time.perf_counter() - started)
    if schedule is not None:
        schedule.stop()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _run(mode: str, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, (args.ranks, os.path.join(tmp, "store"), mode, args, out), nprocs=args.ranks)
        with open(out) as f:
            return json.load(f)


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "max_ms": 1e3 * ordered[-1],
        "std_ms": 1e3 * statistics.pstdev(ordered),
        "total_s": sum(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--objects", type=int, default=20000, help="cyclic objects made per step")
    parser.add_argument("--dim", type=int, default=256, help="matmul size per step")
    parser.add_argument("--every", type=int, default=50, help="steps between synchronised collections")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    results = {mode: _summary(_run(mode, args)) for mode in ("automatic", "synchronized")}
    print(
        f"{args.ranks} ranks, {args.steps} steps, {args.objects} cyclic objects per step, collect every {args.every}"
    )
    print(f"{'GC':<14}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}{'std ms':>9}{'total s':>9}")
    for mode, r in results.items():
        print(f"{mode:<14}{r['median_ms']:>11.2f}{r['p99_ms']:>9.2f}{r['max_ms']:>9.2f}{r['std_ms']:>9.2f}"
              f"{r['total_s']:>9.2f}")  # fmt: skip
    auto, sync = results["automatic"], results["synchronized"]
    print(f"synchronized vs automatic: std {sync['std_ms'] / auto['std_ms']:.2f}x, "
          f"p99 {sync['p99_ms'] / auto['p99_ms']:.2f}x, total {sync['total_s'] / auto['total_s']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
