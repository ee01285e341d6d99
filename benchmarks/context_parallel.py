"""Context parallelism: activation memory per rank at a long sequence, measured vs the planner, and step time.

For cp = 1, 2, 4 (1, 2 and 4 spawned gloo ranks, 1 thread each), a small GPT (4 layers, width 64, grouped-query
heads; ``--window`` puts a sliding window on every other layer) runs forward and backward on one sequence of
``--seq`` tokens. (At cp = 1 on a CPU a windowed layer runs torch's SDPA with a dense mask, which it saves as
an fp32 (s, s) tensor; the cp attention computes block by block and saves nothing quadratic.)
Each rank measures the bytes autograd saves for backward (``SavedTensorMeter``: parameters and buffers
excluded) at the end of forward, which ``megascale plan``'s memory model (``predict_memory``) must give within
10%, and the median wall time of forward + backward. Printed per cp: measured MiB per rank, predicted MiB and
the error, the ratio to cp = 1 (the goal: about 1/cp), seconds per step and tokens/s per rank.

    python benchmarks/context_parallel.py               # 8192 tokens, ~2 minutes
    python benchmarks/context_parallel.py --seq 32768   # the issue's 32k (slow on a CPU: attention is s²)
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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from megascale.core import GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def _config(args: argparse.Namespace) -> GPTConfig:
    from megascale.core import GPTConfig

    return GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_multiple_of=32,
                     max_seq_len=args.seq, pad_vocab_to_multiple_of=64, parallel_block=True,
                     sliding_window=args.window or None, full_attention_every=2 if args.window else None)  # fmt: skip


def _worker(rank: int, cp: int, args: argparse.Namespace, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=timedelta(seconds=600))
    from megascale.core import GPT
    from megascale.core.memory_meter import SavedTensorMeter
    from megascale.core.parallel import ParallelPlan, parallelize

    plan = ParallelPlan(cp=cp, zero_stage=0)
    mesh = plan.dims(cp).build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_config(args))
    runtime = parallelize(model, plan, mesh, device="cpu")
    tokens = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times, saved = [], 0
    for step in range(args.steps):
        meter = SavedTensorMeter(ignore=[*model.parameters(), *model.buffers()]) if step == 0 else None
        t0 = time.perf_counter()
        if meter is not None:
            with meter:
                loss = model(inputs, targets)
            saved = meter.current
        else:
            loss = model(inputs, targets)
        loss.backward()
        runtime.zero.after_backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    result = torch.tensor([float(saved), statistics.median(times[1:] or times)])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)  # the rank with the most (the halo differs by rank)
    if rank == 0:
        out[cp] = result.tolist()
    dist.destroy_process_group()


def _predicted(args: argparse.Namespace, cp: int) -> float:
    from megascale.core.parallel import ParallelPlan
    from megascale.core.plan import Kernels, Layout, Workload, predict_memory

    workload = Workload(
        _config(args), seq_len=args.seq, global_batch=1, kernels=Kernels.cpu(), precision="32-true"
    )
    layout = Layout(ParallelPlan(cp=cp, zero_stage=0), dp=1, micro_batch_size=1)
    return predict_memory(workload, layout).ranks[0].activations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument(
        "--window", type=int, default=0, help="a sliding window on every other layer (0: none)"
    )
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--steps", type=int, default=3, help="forward + backward per layout (the first measured)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    results = mp.Manager().dict()
    for cp in args.cp:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_worker, args=(cp, args, port, results), nprocs=cp, join=True)
    mib = 2**20
    windows = f"window {args.window} on every other" if args.window else "full attention"
    print(f"GPT d_model 64, 4 layers ({windows}), one sequence of {args.seq} tokens; "
          "saved activations per rank (the most of any rank)")  # fmt: skip
    print("| cp | measured MiB/rank | predicted MiB | error | vs cp=1 | s/step | tokens/s per rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = results[args.cp[0]][0]
    for cp in args.cp:
        saved, seconds = results[cp]
        predicted = _predicted(args, cp)
        print(f"| {cp} | {saved / mib:.1f} | {predicted / mib:.1f} | {predicted / saved - 1:+.1%} | "
              f"{saved / base:.3f} | {seconds:.2f} | {args.seq / cp / seconds:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
