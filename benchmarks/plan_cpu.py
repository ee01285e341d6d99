"""Benchmark the planner's step time on this machine: predicted (from ``--calibrate``'s figures) vs measured.

``megascale.core.plan.calibrate.measure`` times this machine's matmul rate, memory copy, gloo all-reduce
bandwidth and the latency of one small collective call and of one send/receive, with one thread per rank;
``cpu_cluster`` makes those a cluster of CPU ranks (every collective call pays the measured latency, nothing
overlaps compute: gloo runs on the ranks' own cores). Then, for three
layouts of a small GPT on 2 ranks (dp2 ZeRO-1, tp2 with sequence parallelism, pp2 1F1B with 4 microbatches),
one run per layout spawns the ranks (gloo, one torch thread each), trains AdamW steps through megascale's
``parallelize`` (forward, backward, the ZeRO hooks, the optimizer) and takes the median step time after
warm-up; the planner predicts the same layout. The ratio measured / predicted is reported, not gated: on two
cores the ranks share the machine with gloo's threads (and with whatever else runs), and the model leaves out
Python and kernel-launch overheads, the copies that regroup tensor-parallel chunks, and ranks waiting for each
other, which weigh at these sizes. The calibration and the runs are minutes apart: on a busy machine their
ratio moves with the load.

    python benchmarks/plan_cpu.py
    python benchmarks/plan_cpu.py --d-model 512 --seq-len 512 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan, parallelize
from megascale.core.plan import Kernels, Layout, Workload, predict_step
from megascale.core.plan.calibrate import cpu_cluster, measure

LAYOUTS = {
    "dp2 zero1": dict(zero_stage=1),
    "tp2 sp": dict(tp=2),
    "pp2 1f1b m4": dict(pp=2, num_microbatches=4),
}


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                     max_seq_len=args.seq_len)  # fmt: skip


def _worker(rank: int, world: int, args: argparse.Namespace, plan_kw: dict, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    plan = ParallelPlan(**plan_kw)
    mesh = plan.dims(world).build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_config(args))
    runtime = parallelize(model, plan, mesh, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runtime.zero.attach_optimizers([optimizer])
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    share = args.batch // dp
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(
            0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(step)
        )
        tokens = tokens[dp_rank * share : (dp_rank + 1) * share].clone()
        dist.barrier()
        start = time.perf_counter()
        loss = model(tokens, tokens.roll(-1, 1))
        if plan.pp == 1:
            loss.backward()
        runtime.zero.after_backward()
        runtime.zero.before_optimizer_step(optimizer)
        optimizer.step()
        runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        runtime.zero.wait_for_params()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        if step >= args.warmup:
            times.append(float(elapsed))
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo sometimes aborts at interpreter exit (docs: CPU distributed notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    world = 2
    calibration = measure(threads=1, ranks=world)
    print(f"calibration (1 thread per rank): matmul {calibration.matmul_flops / 1e9:.1f} GFLOP/s, memory copy "
          f"{calibration.memory_bandwidth / 1e9:.2f} GB/s, gloo all-reduce bus bandwidth "
          f"{calibration.allreduce_bandwidth / 1e9:.2f} GB/s ({world} ranks), {calibration.call_latency * 1e6:.0f} µs "
          f"per collective call, {calibration.p2p_latency * 1e6:.0f} µs per send/receive")  # fmt: skip
    cluster = cpu_cluster(calibration, world)
    # the model before per-call latency: bytes only, and overlap hiding communication as on a GPU
    bytes_only = cpu_cluster(replace(calibration, call_latency=0.0, p2p_latency=0.0), world)
    bytes_only = replace(bytes_only, gpu=replace(bytes_only.gpu, overlap=True))
    workload = Workload(_config(args), seq_len=args.seq_len, global_batch=args.batch, precision="32-true",
                        kernels=Kernels.cpu())  # fmt: skip
    print(f"GPT d_model={args.d_model}, {args.layers} blocks, vocab {args.vocab}, global batch {args.batch} × "
          f"{args.seq_len} tokens, AdamW fp32; median of {args.steps} steps after {args.warmup}")  # fmt: skip
    print(f"{'layout':<14} {'measured ms':>11} {'predicted ms':>12} {'measured/predicted':>18} {'(bytes only)':>12}  "
          "predicted: compute / TP / PP+bubble / DP / optimizer ms")  # fmt: skip
    for name, kw in LAYOUTS.items():
        plan = ParallelPlan(**kw)
        dp = world // (plan.tp * plan.pp)
        micro = args.batch // dp // (plan.microbatches if plan.pp > 1 else 1)
        layout = Layout(plan, dp=dp, micro_batch_size=micro)
        step = predict_step(workload, layout, cluster)
        old = predict_step(workload, layout, bytes_only).step_time
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "median")
            os.environ["OMP_NUM_THREADS"] = "1"
            mp.spawn(_worker, args=(world, args, kw, f"file://{tmp}/store", out), nprocs=world, join=True)
            measured = float(Path(out).read_text())
        parts = " / ".join(f"{1e3 * v:.0f}" for v in (step.compute, step.tp_comm, step.pp_comm + step.bubble,
                                                       step.dp_comm, step.optimizer))  # fmt: skip
        print(f"{name:<14} {1e3 * measured:>11.0f} {1e3 * step.step_time:>12.0f} "
              f"{measured / step.step_time:>18.2f} {measured / old:>12.2f}  {parts}")  # fmt: skip


if __name__ == "__main__":
    main()
