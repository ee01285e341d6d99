"""Benchmark pipeline schedules: measured bubble fraction against theory, step time and throughput.

One run starts P ranks (torch.multiprocessing spawn, or under torchrun if launched by it; gloo and 1 torch
thread per rank on CPU, NCCL with one GPU per rank on CUDA) and, for each microbatch count M, times:
    gpipe        torch's ScheduleGPipe                      (all forwards, then all backwards)
    1f1b         torch's Schedule1F1B                       (fused send+receive batches, blocking)
    decoupled    megascale ScheduleDecoupled1F1B            (same order, decoupled asynchronous P2P)
    interleaved  torch's ScheduleInterleaved1F1B, V=2       (rank r holds stages r and r+P of 2P)
    zb1p         torch's ScheduleInterleavedZeroBubble      (ZB1P: backward split into input gradients, I, and
                                                             weight gradients, W, that fill the bubble)
on the same model: a stack of 2·P·c residual MLP blocks (Linear d→4d, GELU, Linear 4d→d), c per virtual stage;
every non-interleaved stage holds 2c blocks, so each rank computes the same layers in every schedule.

Measured, per (schedule, M), over --steps timed steps after --warmup untimed ones (the first step of a torch
schedule runs its shape inference); at each M the schedules take turns step by step, so that a slow spell of
a shared machine does not fall on one schedule only:
    step time   T = max over ranks of the rank's wall time inside step() (each rank starts after a barrier;
                durations only, so no clock is compared across hosts); the median over steps is reported
    bubble_r    1 − busy_r / T, where busy_r is the time, within [start of step() on rank r, start + T], covered
                by rank r's computations (forward_one_chunk / backward_one_chunk, recorded by ScheduleTimeline);
                everything else (waiting for a neighbour, communication not overlapped, schedule overhead, the
                wait for the slowest rank) counts as bubble. Reported: each rank's median, and their mean
    theory      (P−1)/(M+P−1) for GPipe and 1F1B; (P−1)/(V·M+P−1) for interleaved (Megatron's bubble time
                (P−1)·t/V against M·t of work, t = one microbatch's forward+backward on one rank); for zb1p
                (P−1)(F+B−2W) against M·(F+B), B = I+W the whole backward (arXiv 2401.10241, ZB-1P; the
                DualPipe README's table), with F, I and W the mean durations the timeline recorded on ranks
                1..P−1 (rank 0 has no input gradient: torch runs its whole backward as W). Sleep mode:
                F = I = W by construction, a third of 1F1B's idle time
    throughput  samples/s = M · microbatch rows / T; ratios: interleaved, zb1p and decoupled vs torch 1F1B
                (> 1: faster)
    send wait   decoupled only (torch's schedules do not expose their waits): the largest, over ranks, share
                of T a rank spent waiting on its own sends

Theory assumes every computation takes the same time wherever and whenever it runs. With more ranks than
cores (4 ranks on this repository's 2-core CI machine) that fails: ranks share cores, so a computation runs
slower while more ranks compute at once, and the measured bubble mixes in that contention. `--compute sleep`
replaces the work of each block with a sleep of fixed length (--fwd-ms per stage forward, twice that for the
backward; a per-feature scale keeps real gradients and messages of the configured size flowing), which needs
no core: it measures the schedule and its communication alone (raise --seq / --d-model to make messages
large enough for their transfer time to matter). Use `--compute matmul` (the default) where every rank has
its own core or GPU. On CUDA the timeline synchronises the device around each computation so that intervals
cover kernel execution, not just launches; that costs the timed steps a little overlap.

    python benchmarks/pipeline.py                              # CPU: 4 ranks, M in 4 8 16, < 2 minutes
    python benchmarks/pipeline.py --compute sleep              # schedule only, any core count, ~40 s
    torchrun --nproc-per-node 4 benchmarks/pipeline.py --d-model 2048 --seq 1024 --blocks-per-chunk 4   # GPUs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "decoupled", "interleaved", "zb1p")
V = 2  # virtual stages per rank for the interleaved schedule


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed wall time without using a core."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _WeightSleep(torch.autograd.Function):
    """Identity on a weight whose backward takes a fixed wall time: the weight-gradient part of a backward,
    which a split backward (zb1p) runs apart from the input-gradient part."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.bwd_s)
        return grad, None


class Block(nn.Module):
    """Residual MLP block (matmul mode), or a per-feature scale plus a fixed sleep (sleep mode: next to no
    compute, but real parameters, gradients and activation messages of the configured size)."""

    def __init__(self, d: int, sleep_fwd_s: float | None) -> None:
        super().__init__()
        self.sleep = sleep_fwd_s
        if sleep_fwd_s is None:
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        else:
            self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep is None:
            return x + self.down(nn.functional.gelu(self.up(x)))
        # backward 2x the forward: half on the input's path, half on the weight's (run apart by zb1p)
        return _Sleep.apply(x * _WeightSleep.apply(self.scale, self.sleep), self.sleep, self.sleep)


def _chunk(args: argparse.Namespace, first_block: int, n_blocks: int, device: torch.device) -> nn.Sequential:
    sleep = None if args.compute == "matmul" else args.fwd_ms / 1000 / (V * args.blocks_per_chunk)
    blocks = []
    for i in range(first_block, first_block + n_blocks):
        torch.manual_seed(i)  # the same block has the same weights whichever rank and schedule hold it
        blocks.append(Block(args.d_model, sleep))
    return nn.Sequential(*blocks).to(device)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _build(name: str, args: argparse.Namespace, rank: int, P: int, m: int, device: torch.device) -> Any:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from megascale.core.parallel import ScheduleDecoupled1F1B

    c = args.blocks_per_chunk
    if name == "interleaved":
        stages: list[Any] = [
            PipelineStage(_chunk(args, s * c, c, device), s, V * P, device) for s in (rank, rank + P)
        ]
        return ScheduleInterleaved1F1B(stages, m, _mse)
    stage = PipelineStage(_chunk(args, rank * V * c, V * c, device), rank, P, device)
    if name == "zb1p":
        return ScheduleInterleavedZeroBubble([stage], m, _mse)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "decoupled": ScheduleDecoupled1F1B}[name]
    return cls(stage, m, _mse)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(schedule: Any, inputs: tuple, target: Any, timeline: Any, device: torch.device) -> tuple:
    """One step() with the timeline attached: (T, bubble, receive-wait share, send-wait share) on this rank."""
    timeline.attach(schedule)
    _sync(device)
    dist.barrier()
    t0 = timeline.clock()
    schedule.step(*inputs, target=target)
    _sync(device)
    own = timeline.clock() - t0
    timeline.detach()
    # T: the slowest rank's time inside step(); every rank measures its own bubble over [t0, t0 + T].
    slowest = torch.tensor([own], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    T = slowest.item()
    # Only ScheduleDecoupled1F1B records its waits (receive, send): 0 for torch's schedules.
    mean = {
        k: statistics.fmean([e.end - e.start for e in timeline.events if e.kind == k] or [0.0]) for k in "FIW"
    }
    out = (
        T,
        timeline.bubble_fraction(t0, t0 + T),
        timeline.total("wait_recv") / T,
        timeline.total("wait_send") / T,
        mean["F"],
        mean["I"],
        mean["W"],
    )
    timeline.clear()
    return out


def _measure(args: argparse.Namespace, rank: int, P: int, m: int, device: torch.device) -> dict[str, dict]:
    """Time every schedule at M = m on this rank: {schedule: medians of T, bubble, waits}.

    The schedules take turns step by step (round robin), so a slow spell of the machine hits them alike.
    """
    from megascale.core.parallel import ScheduleTimeline

    schedules = {name: _build(name, args, rank, P, m, device) for name in args.schedules}
    gen = torch.Generator().manual_seed(m)
    shape = (m * args.mb_rows, args.seq, args.d_model)
    x = torch.randn(shape, generator=gen).to(device)
    y = torch.randn(shape, generator=gen).to(device)
    inputs = (x,) if rank == 0 else ()
    target = y if rank == P - 1 else None
    for _ in range(args.warmup):
        for schedule in schedules.values():
            schedule.step(*inputs, target=target)
    timeline = ScheduleTimeline(synchronize=torch.cuda.synchronize if device.type == "cuda" else None)
    samples: dict[str, list[tuple]] = {name: [] for name in schedules}
    for _ in range(args.steps):
        for name, schedule in schedules.items():
            samples[name].append(_timed_step(schedule, inputs, target, timeline, device))
    return {
        name: {
            key: statistics.median(v[i] for v in got)
            for i, key in enumerate(("T", "bubble", "recv_wait", "send_wait", "F", "I", "W"))
        }
        for name, got in samples.items()
    }


def _theory(name: str, P: int, m: int, per_rank: list[dict]) -> float:
    if name == "zb1p":  # from the durations measured: F, I (input gradients), W (weight gradients)
        # rank 0 has no input gradient to compute: torch runs its whole backward as its W, so its F, I, W
        # do not describe the split; the other ranks' do
        f, i, w = (statistics.fmean(r[k] for r in per_rank[1:] or per_rank) for k in "FIW")
        idle = (P - 1) * max(0.0, f + (i + w) - 2 * w)  # (P-1)(F+B-2W), B the whole backward I + W
        return idle / (m * (f + i + w) + idle)
    return (P - 1) / (V * m + P - 1) if name == "interleaved" else (P - 1) / (m + P - 1)


def _table(args: argparse.Namespace, P: int, rows: dict[tuple[str, int], list[dict]]) -> str:
    lines = [
        f"P={P} ranks, compute={args.compute}, d_model={args.d_model}, seq={args.seq}, "
        f"microbatch={args.mb_rows} rows, {V * args.blocks_per_chunk} blocks per rank, "
        f"median of {args.steps} steps after {args.warmup} warm-up",
        "",
        f"| schedule | M | step ms | samples/s | bubble per rank (r0 .. r{P - 1}) | bubble mean | theory | ratio "
        "| own-send wait |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for m in args.microbatches:
        base = {n: rows[(n, m)][0]["T"] for n in args.schedules if (n, m) in rows}
        for name in args.schedules:
            if (name, m) not in rows:
                continue
            per_rank = rows[(name, m)]
            T = per_rank[0]["T"]
            bubbles = [r["bubble"] for r in per_rank]
            ratio = ""
            if name in ("interleaved", "decoupled", "zb1p") and "1f1b" in base:
                ratio = f"{base['1f1b'] / T:.2f}x vs 1f1b"
            lines.append(
                f"| {name} | {m} | {T * 1e3:.0f} | {m * args.mb_rows / T:.1f} | "
                + " ".join(f"{b:.3f}" for b in bubbles)
                + f" | {statistics.mean(bubbles):.3f} | {_theory(name, P, m, per_rank):.3f} | {ratio} | "
                + (f"{max(r['send_wait'] for r in per_rank):.4f} |" if name == "decoupled" else "n/a |")
            )
    return "\n".join(lines)


def _worker(
    rank: int, P: int, args: argparse.Namespace, init_method: str | None, spawned: bool = True
) -> None:
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=P,
        timeout=timedelta(seconds=300),
    )
    rows: dict[tuple[str, int], list[dict]] = {}
    for m in args.microbatches:
        result = _measure(args, rank, P, m, device)
        gathered: list[Any] = [None] * P
        dist.all_gather_object(gathered, result)
        for name in args.schedules:
            rows[(name, m)] = [per_rank[name] for per_rank in gathered]
            if rank == 0 and args.verbose:
                print(f"{name} M={m}: {rows[(name, m)]}", flush=True)
    if rank == 0:
        print(_table(args, P, rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if spawned:  # gloo sometimes aborts at interpreter exit; leave without running its teardown twice
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="pipeline stages P (ignored under torchrun)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--compute", choices=("matmul", "sleep"), default="matmul")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample (activations are rows×seq×d)")
    parser.add_argument("--mb-rows", type=int, default=4, help="samples per microbatch")
    parser.add_argument("--blocks-per-chunk", type=int, default=1, help="blocks per virtual stage (c)")
    parser.add_argument("--fwd-ms", type=float, default=8.0, help="sleep mode: one stage's forward, ms")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA is available")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: env:// rendezvous
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, False)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before the children import torch
    with tempfile.TemporaryDirectory(prefix="megascale-pipeline-bench-") as tmp:
        mp.spawn(_worker, args=(args.ranks, args, f"file://{tmp}/store"), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
