"""Benchmark tensor parallelism: step time with communication overlapped vs not, against one process.

One run spawns ``--tp`` ranks (gloo on CPU, NCCL on CUDA when there are enough GPUs) and times a training
step (forward + backward) of the same GPT under each layout:

    tp=1                 the unsharded model on one rank (the baseline a user would otherwise run)
    tp, no SP            Megatron TP: all-reduce after row-parallel GEMMs
    tp, SP               sequence parallel: all-gather / reduce-scatter around the GEMMs
    tp, SP + overlap     the same collectives split into chunks that overlap the GEMMs (MegaScale §3.2)

It prints the median step time of each, the overlap speed-up (SP / SP+overlap) and the communication time
hidden: comm is estimated as step(SP) - step(tp=1)/tp (what the step costs beyond ideal compute scaling),
and hidden = (step(SP) - step(SP+overlap)) / comm.

    python benchmarks/tensor_parallel.py                 # tp=2, CPU-sized model
    python benchmarks/tensor_parallel.py --tp 4 --d-model 1024 --seq-len 1024
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from megascale.core import GPT, GPTConfig, apply_tensor_parallel


def _time_steps(
    model: GPT, tokens: torch.Tensor, steps: int, warmup: int, device: torch.device, together: bool
) -> float:
    """Median forward+backward time; ``together``: all ranks start each step at a barrier."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if together:
            dist.barrier()
        start = time.perf_counter()
        model(tokens, tokens).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.tp
    backend = "nccl" if cuda else "gloo"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=args.tp, timeout=timedelta(seconds=300)
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    config = GPTConfig(
        vocab_size=32000,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
        parallel_block=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        base = GPT(config).to(dtype)
    tokens = torch.randint(
        0,
        config.vocab_size,
        (args.batch, args.seq_len),
        device=device,
        generator=torch.Generator(device=device).manual_seed(1),
    )
    mesh = init_device_mesh(device.type, (args.tp,))
    results = {}
    if rank == 0:
        results["tp=1"] = _time_steps(base, tokens, args.steps, args.warmup, device, together=False)
    dist.barrier()
    layouts = {
        f"tp={args.tp}, no SP": dict(sequence_parallel=False, overlap=False),
        f"tp={args.tp}, SP": dict(sequence_parallel=True, overlap=False),
        f"tp={args.tp}, SP + overlap": dict(sequence_parallel=True, overlap=True, overlap_chunks=args.chunks),
    }
    for name, kwargs in layouts.items():
        model = apply_tensor_parallel(copy.deepcopy(base), mesh, **kwargs)
        results[name] = _time_steps(model, tokens, args.steps, args.warmup, device, together=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4, help="overlap chunks per collective")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.start_processes(
            _worker, args=(args, os.path.join(tmp, "store"), out), nprocs=args.tp, start_method="spawn"
        )
        results = torch.load(out, weights_only=True)
    device = "CUDA" if torch.cuda.is_available() and torch.cuda.device_count() >= args.tp else "CPU (gloo)"
    print(
        f"\nGPT d_model={args.d_model} layers={args.layers} heads={args.heads}, batch {args.batch} x "
        f"{args.seq_len} tokens, forward+backward, {device}, median of {args.steps} steps\n"
    )
    base = results["tp=1"]
    for name, t in results.items():
        print(f"  {name:<22} {t * 1e3:9.1f} ms/step   {base / t:5.2f}x vs tp=1")
    sp, ov = results[f"tp={args.tp}, SP"], results[f"tp={args.tp}, SP + overlap"]
    comm = sp - base / args.tp
    print(f"\n  overlap speed-up (SP / SP+overlap): {sp / ov:.2f}x")
    if comm > 0:
        print(f"  communication hidden: {(sp - ov) / comm:.0%} of an estimated {comm * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
