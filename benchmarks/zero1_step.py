"""ZeRO-1 (``zero1_sharding="elements"``) against torch DDP, one training step at a time, at dp=2.

No Lightning: two spawned gloo ranks (1 thread each) train two copies of the same GPT side by side, a round of
steps under DDP, then a round under ZeRO-1 (BucketedGradReduce(scatter=True) + ShardedOptimizerStep), and so
on, so that a machine whose load drifts disturbs both alike. Each step is what GPTModule does under the
strategies: forward, backward, the gradient reduction, the global gradient norm (ZeRO-1 adds its shares over
dp), AdamW, zero_grad. Reported: median step time per layout and their ratio, the CPU time rank 0's process
spends per step (all its threads, gloo's included: what communication costs on a CPU whose cores compute too),
and each layout's phases (median ms): forward (ZeRO-1: including the wait for the parameters' all-gather),
backward (DDP: including its all-reduce), finish (ZeRO-1: the reduce-scatter's wait, the averages written into
the gradients), norm, step (ZeRO-1: pieces in, AdamW, pieces out, all-gathers issued).

    python benchmarks/zero1_step.py                  # CPU-sized GPT (benchmarks/strategy.py's), ~1 minute
    python benchmarks/zero1_step.py --cpu            # phases in main-thread CPU time: the bookkeeping itself,
                                                     # whatever else a shared machine runs
    python benchmarks/zero1_step.py --profile zero1  # + cProfile of rank 0's ZeRO-1 steps (megascale's parts)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    # --cpu: phases in this thread's CPU time (the bookkeeping itself, whatever else the machine runs)
    _clock = time.thread_time if args.cpu else time.perf_counter
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from torch.nn.parallel import DistributedDataParallel

    from megascale.core import GPT, GPTConfig
    from megascale.core.parallel.grad_clip import grad_norm
    from megascale.core.parallel.zero import BucketedGradReduce, ShardedOptimizerStep

    config = GPTConfig(vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq_len, parallel_block=True)  # fmt: skip
    group = dist.group.WORLD
    layouts = {}
    torch.manual_seed(0)
    model = GPT(config)
    layouts["ddp"] = (DistributedDataParallel(model), model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reducer = BucketedGradReduce(list(model.parameters()), group, scatter=True)
    zero1 = ShardedOptimizerStep(opt, reducer, model)
    layouts["zero1"] = (model, model, opt)

    gen = torch.Generator().manual_seed(rank)
    batch = args.batch // 2
    times: dict[str, list[float]] = {name: [] for name in layouts}
    cpu: dict[str, list[float]] = {name: [] for name in layouts}  # this process's CPU time, all threads
    names = ("forward", "backward", "finish", "norm", "step")
    phases: dict[str, dict[str, list[float]]] = {name: {k: [] for k in names} for name in layouts}
    profiler = cProfile.Profile() if args.profile and rank == 0 else None

    def step(name: str, record: bool) -> None:
        wrapped, model, opt = layouts[name]
        x = torch.randint(0, 8192, (batch, args.seq_len + 1), generator=gen)
        prof = profiler if (record and name == args.profile) else None
        if prof is not None:
            prof.enable()
        c0, w0 = time.process_time(), time.perf_counter()
        t0 = _clock()
        loss = wrapped(x[:, :-1], x[:, 1:])
        t1 = _clock()
        loss.backward()
        t2 = _clock()
        if name == "zero1":
            reducer.finish()
            zero1.arm()
        t3 = _clock()
        grad_norm(model.parameters(), sum_group=group if name == "zero1" else None)
        t4 = _clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t5 = _clock()
        c5, w5 = time.process_time(), time.perf_counter()
        if prof is not None:
            prof.disable()
        if record:
            times[name].append(w5 - w0)
            cpu[name].append(c5 - c0)
            for k, a, b in zip(names, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                phases[name][k].append(b - a)

    for r in range(args.rounds):
        for name in layouts if r % 2 == 0 else reversed(layouts):
            for i in range(args.steps):
                step(name, record=i >= args.warmup)
    zero1.wait()
    if rank == 0:
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        cpu_ms = {name: 1e3 * statistics.median(t) for name, t in cpu.items()}
        print(f"GPT {config.d_model=} {config.n_layers=}; {args.batch} x {args.seq_len} tokens at dp=2, gloo, "
              f"1 thread/rank; {args.rounds} rounds x {args.steps - args.warmup} timed steps per layout")  # fmt: skip
        for name, v in ms.items():
            print(f"{name:6s} {v:8.1f} ms/step  {ms['ddp'] / v:5.3f}x DDP's throughput   "
                  f"CPU {cpu_ms[name]:6.1f} ms/step ({cpu_ms[name] / cpu_ms['ddp']:5.3f}x DDP's)")  # fmt: skip
        for name, by_phase in phases.items():
            print(f"{name} phases (median {'main-thread CPU ' if args.cpu else ''}ms): " + ", ".join(f"{k} {1e3 * statistics.median(v):.1f}"
                                                            for k, v in by_phase.items()))  # fmt: skip
        if profiler is not None:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumtime").print_stats("zero|grad_clip|optim", 40)
            print(out.getvalue())
        sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over dp=2")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of DDP and ZeRO-1 steps")
    parser.add_argument("--steps", type=int, default=8, help="steps per layout per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each round")
    parser.add_argument("--cpu", action="store_true", help="phases in main-thread CPU time, not wall time")
    parser.add_argument("--profile", choices=["ddp", "zero1"], help="cProfile rank 0's steps of this layout")
    args = parser.parse_args()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sys.path.insert(0, str(ROOT))
    mp.spawn(_worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
