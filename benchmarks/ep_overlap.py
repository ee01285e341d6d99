"""Expert parallelism: the all-to-all sent in parts overlapped with the experts' GEMMs vs in one piece.

``AllToAllDispatcher`` (``parallel/ep/dispatch.py``) sends each MoE layer's routed rows in ``ep_comm_chunks``
parts, all issued at once, and computes part c while part c+1 still travels (MegaScale-MoE's overlap). This
script trains the same MoE GPT at ep=2 on two spawned gloo ranks (1 thread each) with ``ep_comm_chunks`` 1 and
2, in alternating rounds, and prints per setting: the median step time (forward + backward + AdamW, the slower
rank's), the forward's time waited on the all-to-alls (``wait/ep-all-to-all``, the sections megascale-ft's
timelines draw), and the ratios parts / one piece. The losses of both settings are compared too: they agree to
rounding (each row is computed alone; only how rows are grouped into GEMMs, and so their blocking, changes).

    python benchmarks/ep_overlap.py              # d_model 256, 8 experts of 512, 8 x 512 tokens, ~1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = (1, 2)  # ep_comm_chunks


def _worker(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from megascale.core import GPT, GPTConfig, MoEConfig
    from megascale.core.parallel import ParallelPlan, parallelize

    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=args.expert_hidden, aux_loss_coef=0.01)
    config = GPTConfig(vocab_size=4096, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                       max_seq_len=args.seq, parallel_block=False, moe=moe)  # fmt: skip
    waited = {c: 0.0 for c in SETTINGS}
    current = [SETTINGS[0]]

    @contextlib.contextmanager
    def timer(kind: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if kind == "ep-all-to-all":
            waited[current[0]] += time.perf_counter() - start

    models = {}
    for chunks in SETTINGS:
        plan = ParallelPlan(ep=2, zero_stage=0, ep_comm_chunks=chunks)
        mesh = plan.dims(2).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(config)
        runtime = parallelize(model, plan, mesh, device="cpu")
        runtime.set_wait_timer(timer)
        models[chunks] = (model, runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(100 + rank)
    times: dict[int, list[float]] = {c: [] for c in SETTINGS}
    losses: dict[int, list[float]] = {c: [] for c in SETTINGS}
    for round_ in range(args.rounds):
        tokens = torch.randint(0, 4096, (args.batch // 2, args.seq + 1), generator=gen)
        order = SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]
        for chunks in order:
            model, runtime, optimizer = models[chunks]
            current[0] = chunks
            dist.barrier()
            start = time.perf_counter()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            runtime.zero.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slower rank
            if round_ > 0:  # the first round warms up
                times[chunks].append(float(elapsed))
            losses[chunks].append(float(loss.detach()))
    if rank == 0:
        out.update(times=times, losses=losses, waited=dict(waited))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--expert-hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, both ranks together")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(args, _free_port(), out), nprocs=2, join=True)
    times, losses, waited = out["times"], out["losses"], out["waited"]
    steps = args.rounds - 1
    print(f"MoE GPT d_model {args.d_model}, {args.layers} layers of 8 experts of {args.expert_hidden} (top 2), "
          f"{args.batch} x {args.seq} tokens per step, ep=2 on 2 gloo ranks, {steps} timed rounds, alternating")  # fmt: skip
    print(
        "| ep_comm_chunks | step (median s) | forward's wait on all-to-alls per step (s, rank 0) | vs one piece |"
    )
    print("|---:|---:|---:|---:|")
    base = statistics.median(times[1])
    for chunks in SETTINGS:
        median = statistics.median(times[chunks])
        wait = waited[chunks] / args.rounds
        print(f"| {chunks} | {median:.3f} | {wait:.3f} | {median / base:.2f}x |")
    worst = max(abs(a - b) for a, b in zip(losses[1], losses[2], strict=True))
    print(f"losses of the two settings differ by at most {worst:.1e} (the same steps)")


if __name__ == "__main__":
    main()
