"""Calibration on this machine: what a CPU (or any torch device) achieves, as a ``ClusterSpec`` to plan with.

``measure()`` times, with ``threads`` torch threads per rank (what each training rank gets):

- the matmul rate: the best of a few (n × n) @ (n × n) products in the compute dtype, 2n³ FLOPs each;
- the memory bandwidth: the best of a few copies of a 128 MiB tensor (read + write);
- the collective bandwidth: a gloo all-reduce of ``allreduce_mib`` among ``ranks`` local processes, as bus
  bandwidth (2(n-1)/n of the buffer per rank over the time: nccl-tests' busbw; megascale-ft's self-check
  reports the same all-reduce as algorithm bandwidth, bytes / time).

``cpu_cluster`` turns that into a ``ClusterSpec`` whose "GPU" is one rank of this machine: its peak is the
measured matmul rate at efficiency 1 (the rate is what GEMMs achieve), its memory bandwidth the measured one,
and every rank sits in one "node" joined by the measured all-reduce bandwidth. Predictions for CPU layouts
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

__all__ = ["Calibration", "cpu_cluster", "measure"]


@dataclass(frozen=True)
class Calibration:
    """What ``measure`` found: FLOP/s of a matmul, bytes/s of a copy, all-reduce bus bytes/s (per rank)."""

    matmul_flops: float
    memory_bandwidth: float
    allreduce_bandwidth: float
    threads: int
    ranks: int
    dtype: str

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


def _allreduce_worker(
    rank: int, world: int, store: str, mib: int, repeats: int, threads: int, out: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    x = torch.ones(mib * 2**20 // 4)
    try:
        dist.all_reduce(x)  # warm-up: connections
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(str(min(times)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        os._exit(0)  # gloo may abort at interpreter exit otherwise (docs: CPU distributed notes)


def measure_allreduce(ranks: int = 2, mib: int = 16, repeats: int = 5, threads: int = 1) -> float:
    """Bus bandwidth (bytes/s per rank) of a gloo all-reduce of ``mib`` MiB among ``ranks`` local processes."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megascale-calibrate-") as tmp:
        out = os.path.join(tmp, "seconds")
        procs = [
            ctx.Process(
                target=_allreduce_worker,
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
            raise RuntimeError("the all-reduce calibration did not finish (gloo processes failed or hung)")
        seconds = float(Path(out).read_text())
    return 2 * (ranks - 1) / ranks * mib * 2**20 / seconds


def measure(threads: int = 1, ranks: int = 2, dtype: torch.dtype = torch.float32) -> Calibration:
    """Matmul rate and memory bandwidth with ``threads`` threads, and the all-reduce among ``ranks``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_matmul(dtype=dtype)
        bandwidth = measure_memory_bandwidth()
    finally:
        torch.set_num_threads(previous)
    allreduce = measure_allreduce(ranks=ranks, threads=threads) if ranks > 1 else float("inf")
    return Calibration(flops, bandwidth, allreduce, threads, ranks, str(dtype).removeprefix("torch."))


def cpu_cluster(calibration: Calibration, ranks: int, memory_bytes: float | None = None) -> ClusterSpec:
    """A cluster of ``ranks`` processes of this machine, as ``calibration`` measured it (module docstring)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks)
    link = calibration.allreduce_bandwidth if calibration.allreduce_bandwidth != float("inf") else 1e12
    rank = GPUSpec(
        "cpu", peak_flops=calibration.matmul_flops, memory_bytes=memory_bytes,
        memory_bandwidth=calibration.memory_bandwidth, nvlink_bandwidth=link, matmul_efficiency=1.0,
        memory_efficiency=1.0, link_efficiency=1.0,
    )  # fmt: skip
    return ClusterSpec(rank, gpus=ranks, gpus_per_node=ranks, network_bandwidth=link * ranks,
                       usable_memory_fraction=1.0)  # fmt: skip
