"""Calibration on this machine: what a CPU (or any torch device) achieves, as a ``ClusterSpec`` to plan with.

``measure()`` times, with ``threads`` torch threads per rank (what each training rank gets):

- the matmul rate: the best of a few (n × n) @ (n × n) products in the compute dtype, 2n³ FLOPs each;
- the memory bandwidth: the best of a few copies of a 128 MiB tensor (read + write);
- the collective bandwidth: a gloo all-reduce of ``allreduce_mib`` among ``ranks`` local processes, as bus
  bandwidth (2(n-1)/n of the buffer per rank over the time: nccl-tests' busbw; megascale-ft's self-check
  reports the same all-reduce as algorithm bandwidth, bytes / time);
- the latency of one collective call, as the runtime issues its tensor-parallel chunks and buckets: a
  one-element all-reduce started asynchronously and waited for (the median: on a shared machine a call
  pays the typical wake-up of gloo's threads, not the best one), and of one point-to-point transfer, a
  one-element send/receive exchange between neighbours (``batch_isend_irecv``, as the pipeline issues them).

``cpu_cluster`` turns that into a ``ClusterSpec`` whose "GPU" is one rank of this machine: its peak is the
measured matmul rate at efficiency 1 (the rate is what GEMMs achieve), its memory bandwidth the measured one,
and every rank sits in one "node" joined by the measured all-reduce bandwidth and latencies (the whole call's
latency, no per-step term: it was measured among the ranks planned for). Its ranks do not overlap
communication with compute: gloo moves the bytes on the cores the ranks compute on. Predictions for CPU layouts
(``megascale plan --calibrate``) then compare with CPU runs (``benchmarks/plan_cpu.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch

from megascale.core.plan.cluster import ClusterSpec, GPUSpec

__all__ = ["Calibration", "cpu_cluster", "measure", "measure_allreduce", "measure_collectives"]


@dataclass(frozen=True)
class Calibration:
    """What ``measure`` found: FLOP/s of a matmul, bytes/s of a copy, all-reduce bus bytes/s (per rank), and
    seconds of one small collective call and of one point-to-point transfer (0: not measured)."""

    matmul_flops: float
    memory_bandwidth: float
    allreduce_bandwidth: float
    threads: int
    ranks: int
    dtype: str
    call_latency: float = 0.0
    p2p_latency: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """FLOP/s of an (n × n) @ (n × n) product on this process's threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats)


def measure_memory_bandwidth(mib: int = 128, repeats: int = 5) -> float:
    """Bytes/s of copying a ``mib`` MiB tensor (counted read + write)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), repeats)


def _collectives_worker(
    rank: int, world: int, store: str, mib: int, repeats: int, threads: int, out: str
) -> None:
    import json
    import statistics

    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip

    def timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
        fn()  # warm-up: connections
        times = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times

    x, one = torch.ones(mib * 2**20 // 4), torch.ones(1)
    peer = rank ^ 1  # neighbours exchange, as pipeline stages do

    def exchange() -> None:
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend, one, peer), dist.P2POp(dist.irecv, torch.empty(1), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    try:
        bulk = min(timed(lambda: dist.all_reduce(x), repeats))
        call = statistics.median(timed(lambda: dist.all_reduce(one, async_op=True).wait(), 10 * repeats))  # type: ignore[union-attr]
        p2p = statistics.median(timed(exchange, 10 * repeats)) if world > 1 else 0.0
        if rank == 0:
            Path(out).write_text(json.dumps({"bulk": bulk, "call": call, "p2p": p2p}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        os._exit(0)  # gloo may abort at interpreter exit otherwise (docs: CPU distributed notes)


def measure_collectives(
    ranks: int = 2, mib: int = 16, repeats: int = 5, threads: int = 1
) -> tuple[float, float, float]:
    """Among ``ranks`` local gloo processes: the all-reduce bus bandwidth (bytes/s per rank) of ``mib`` MiB,
    and the seconds of one small collective call and of one point-to-point transfer (module docstring)."""
    import json

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megascale-calibrate-") as tmp:
        out = os.path.join(tmp, "seconds")
        procs = [
            ctx.Process(
                target=_collectives_worker,
                args=(r, ranks, os.path.join(tmp, "store"), mib, repeats, threads, out),
            )
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        if not os.path.exists(out):
            raise RuntimeError("the collective calibration did not finish (gloo processes failed or hung)")
        found = json.loads(Path(out).read_text())
    return 2 * (ranks - 1) / ranks * mib * 2**20 / found["bulk"], found["call"], found["p2p"]


def measure_allreduce(ranks: int = 2, mib: int = 16, repeats: int = 5, threads: int = 1) -> float:
    """Bus bandwidth (bytes/s per rank) of a gloo all-reduce of ``mib`` MiB among ``ranks`` local processes."""
    return measure_collectives(ranks, mib, repeats, threads)[0]


def measure(threads: int = 1, ranks: int = 2, dtype: torch.dtype = torch.float32) -> Calibration:
    """Matmul rate and memory bandwidth with ``threads`` threads, and the all-reduce among ``ranks``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_matmul(dtype=dtype)
        bandwidth = measure_memory_bandwidth()
    finally:
        torch.set_num_threads(previous)
    allreduce, call, p2p = (
        measure_collectives(ranks=ranks, threads=threads) if ranks > 1 else (float("inf"), 0.0, 0.0)
    )
    return Calibration(
        flops, bandwidth, allreduce, threads, ranks, str(dtype).removeprefix("torch."), call, p2p
    )


def cpu_cluster(calibration: Calibration, ranks: int, memory_bytes: float | None = None) -> ClusterSpec:
    """A cluster of ``ranks`` processes of this machine, as ``calibration`` measured it (module docstring)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks)
    link = calibration.allreduce_bandwidth if calibration.allreduce_bandwidth != float("inf") else 1e12
    rank = GPUSpec(
        "cpu", peak_flops=calibration.matmul_flops, memory_bytes=memory_bytes,
        memory_bandwidth=calibration.memory_bandwidth, nvlink_bandwidth=link, matmul_efficiency=1.0,
        memory_efficiency=1.0, link_efficiency=1.0, call_latency=calibration.call_latency, nvlink_latency=0.0,
        p2p_latency=calibration.p2p_latency, overlap=False,
    )  # fmt: skip
    return ClusterSpec(rank, gpus=ranks, gpus_per_node=ranks, network_bandwidth=link * ranks,
                       usable_memory_fraction=1.0, network_latency=0.0)  # fmt: skip
