"""ZeRO-0/1 gradient reduction: buffers released as buckets are reduced vs kept to the end of backward.

``BucketedGradReduce`` completes every launched bucket but the last ``IN_FLIGHT`` before it launches the next
(issue 24, item 4), so at most ``IN_FLIGHT + 1`` flat buffers live during backward. Before, every bucket's buffer
(and at ZeRO-1 its reduce-scatter output) stayed alive until ``finish()``. This script runs both on the same
model, in alternating rounds on two spawned gloo ranks (1 thread each), by setting the module's ``IN_FLIGHT``
(the old behaviour is ``IN_FLIGHT`` = every bucket), and prints per mode and per ZeRO stage:

- the peak bytes of the reduction's own buffers alive at once (flat buckets and ZeRO-1's chunks, summed at
  each launch), in MiB and as a multiple of the gradients' bytes: what the change is about;
- the peak bytes that backward + ``finish()`` allocate and hold (``LiveTensorMeter``; gradients exist from the
  step before, so this is those buffers plus backward's own transients — at this shape the logits' gradient,
  which sets the step's peak whatever the buffers do);
- the median wall time of forward + backward + ``finish()`` (the release waits for a bucket two launches back,
  whose collective overlap has usually finished by then), and the ratio released / kept.

    python benchmarks/grad_buckets.py                 # CPU-sized GPT, 1 MiB buckets, ~1 minute
    python benchmarks/grad_buckets.py --bucket-mb 4   # fewer, larger buckets
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
MODES = ("kept", "released")
_buffer_peak: dict[str, int] = {}  # stage -> the most bytes of flat buffers + chunks alive after a launch


def _track_buffers(stage: str, reducer) -> None:
    launch = reducer._launch

    def counted(bucket) -> None:
        launch(bucket)
        alive = sum(b.flat.nbytes + (b.chunk.nbytes if b.chunk is not None else 0)
                    for b in reducer.buckets if b.flat is not None)  # fmt: skip
        _buffer_peak[stage] = max(_buffer_peak.get(stage, 0), alive)

    reducer._launch = counted


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from megascale.core import GPT, GPTConfig
    from megascale.core.memory_meter import LiveTensorMeter
    from megascale.core.parallel.zero import grad_reduce

    config = GPTConfig(vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq_len, parallel_block=True)  # fmt: skip
    stages = {}
    for stage, scatter in (("ZeRO-0", False), ("ZeRO-1", True)):
        torch.manual_seed(0)
        model = GPT(config)
        params = list(model.parameters())
        reducer = grad_reduce.BucketedGradReduce(params, dist.group.WORLD, bucket_size_mb=args.bucket_mb,
                                                 scatter=scatter)  # fmt: skip
        if scatter:  # a stand-in for ShardedOptimizerStep: every parameter stepped in pieces (no orphans)
            reducer.set_stepped(object(), params)
        stages[stage] = (model, reducer)
        _track_buffers(stage, reducer)
    released = grad_reduce.IN_FLIGHT
    gen = torch.Generator().manual_seed(rank)
    batch = args.batch // 2

    def step(stage: str, meter: LiveTensorMeter | None) -> float:
        model, reducer = stages[stage]
        x = torch.randint(0, config.vocab_size, (batch, args.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        if meter is None:
            loss.backward()
            reducer.finish()
        else:
            with meter:
                loss.backward()
                reducer.finish()
        elapsed = time.perf_counter() - t0
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()  # kept: the next backward accumulates into them, allocating nothing
        return elapsed

    times = {(stage, mode): [] for stage in stages for mode in MODES}
    peaks, buffers = {}, {}
    for stage in stages:
        step(stage, None)  # the gradients exist from here on
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            grad_reduce.IN_FLIGHT = released if mode == "released" else 1 << 30
            for stage in stages:
                if r == 0:
                    meter = LiveTensorMeter()
                    _buffer_peak[stage] = 0
                    step(stage, meter)
                    peaks[stage, mode] = meter.peak
                    buffers[stage, mode] = _buffer_peak[stage]
                for i in range(args.steps):
                    elapsed = step(stage, None)
                    if i >= args.warmup:
                        times[stage, mode].append(elapsed)
    grad_reduce.IN_FLIGHT = released
    if rank == 0:
        mib = 2**20
        print(f"GPT {config.d_model=} {config.n_layers=}; {args.batch} x {args.seq_len} tokens at dp=2, gloo, "
              f"1 thread/rank; buckets of {args.bucket_mb} MiB; {args.rounds} rounds x "
              f"{args.steps - args.warmup} timed steps per mode")  # fmt: skip
        for stage, (model, reducer) in stages.items():
            grads = sum(p.numel() * p.element_size() for p in model.parameters())
            print(f"{stage}: {len(reducer.buckets)} buckets, gradients {grads / mib:.1f} MiB")
            ms = {mode: 1e3 * statistics.median(times[stage, mode]) for mode in MODES}
            for mode in MODES:
                buf, peak = buffers[stage, mode], peaks[stage, mode]
                print(f"  {mode:8s} buffers {buf / mib:6.1f} MiB ({buf / grads:4.2f}x the gradients)"
                      f"  backward's peak {peak / mib:6.1f} MiB  {ms[mode]:7.1f} ms/step")  # fmt: skip
            print(f"  released / kept: buffers {buffers[stage, 'released'] / buffers[stage, 'kept']:.3f}x, "
                  f"backward's peak {peaks[stage, 'released'] / peaks[stage, 'kept']:.3f}x, "
                  f"throughput {ms['kept'] / ms['released']:.3f}x")  # fmt: skip
        sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can abort at exit (shared/notes/cpu-distributed.md)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over dp=2")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket capacity (MiB)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of kept and released")
    parser.add_argument("--steps", type=int, default=6, help="steps per mode and stage per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each round")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sys.path.insert(0, str(ROOT))
    mp.spawn(_worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
