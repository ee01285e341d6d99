"""Mixture of experts vs a dense GPT at equal active parameters: tokens/s and memory per rank, on the CPU.

Two GPTs of the same width, depth, heads and sequence: a dense one whose SwiGLU MLP is ``top_k·expert_hidden``
wide, and an MoE one whose every block has ``--experts`` experts of width ``expert_hidden``, ``--top-k`` of
them per token (router, sequence-wise balancing loss at its default 0.01). Each token then goes through the
same number of feed-forward weights in both (active parameters equal up to the router's ``d_model·experts`` per
layer), while the MoE holds ``experts/top_k`` times the feed-forward weights. Both train (forward, backward,
the data-parallel reduction, AdamW) in two layouts, fp32, 1 torch thread per process:

- one process: the dense GPT vs the MoE at ep = 1 (every expert on the one rank);
- two gloo ranks: the dense GPT data-parallel (dp = 2, ZeRO-0: gradients all-reduced) vs the MoE with its
  experts split over the two ranks (ep = 2, ZeRO-0: tokens moved to their experts' rank by all-to-all, the
  non-expert gradients all-reduced). Each rank takes half of the same global batch.

Within a layout both models live in the same processes; after two untimed steps each (the second measures
memory), they take turns, one step at a time, for ``--rounds`` rounds (dense first in even rounds, the MoE
first in odd ones), so the machine's noise hits both. A step counts as long as its slowest rank's. Printed per
layout and model: total and active parameters; tokens/s (global tokens / the median step); MoE / dense as the
ratio of the medians and, in brackets, the median of the rounds' own ratios (the two steps of a round ran
back to back); and on the fullest rank: the bytes of parameters + gradients + AdamW state (the local tensors'
storages), the activations autograd saves (``SavedTensorMeter``'s peak, parameters excluded), the step's peak
of tensor bytes (parameters and AdamW state, which exist before the step, + the most that ``LiveTensorMeter``
saw allocated and alive at once during forward, backward, the reduction and the optimizer step, gradients
included), each beside ``megascale plan``'s prediction (``predict_memory``; its total adds the communication
buffers and the workspace it reserves on a GPU).

    python benchmarks/moe.py            # d_model 256, 4 layers, 8 experts top-2 of 384, 8 x 256 tokens, ~2 min
    python benchmarks/moe.py --quick    # toy sizes, ~20 s, most of it starting processes (the test's run)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from megascale.core import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("dense", "moe")
MIB = 2**20


def _config(args: argparse.Namespace, model: str) -> GPTConfig:
    from megascale.core import GPTConfig
    from megascale.core.config import MoEConfig

    common = dict(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                  max_seq_len=args.seq, parallel_block=True)  # fmt: skip
    if model == "dense":
        return GPTConfig(**common, ffn_hidden=args.top_k * args.expert_hidden)
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_hidden=args.expert_hidden)
    return GPTConfig(**common, moe=moe)


def _plan_kwargs(model: str, world: int) -> dict[str, int]:
    return {"zero_stage": 0, "ep": world if model == "moe" else 1}


def _nbytes(tensors: Any) -> int:
    from megascale.core._dtensor import local
    from megascale.core.memory_meter import storages_of

    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            for st in storages_of(local(t)):
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    from megascale.core import GPT
    from megascale.core.memory_meter import LiveTensorMeter, SavedTensorMeter
    from megascale.core.parallel import ParallelPlan, parallelize

    per_rank = args.batch // world
    runs = {}
    for name in MODELS:
        plan = ParallelPlan(**_plan_kwargs(name, world))
        mesh = plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(_config(args, name))
        runtime = parallelize(model, plan, mesh, device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runtime.zero.attach_optimizers([optimizer])
        runs[name] = (model, runtime, optimizer)
    gen = torch.Generator().manual_seed(0)  # the same batches on every rank: each takes its rows

    def step(name: str, measure: dict | None = None) -> float:
        model, runtime, optimizer = runs[name]
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        tokens = tokens[rank * per_rank : (rank + 1) * per_rank].clone()
        saved = live = None
        if measure is not None:
            saved = SavedTensorMeter(ignore=[*model.parameters(), *model.buffers()])
            live = LiveTensorMeter()
            live.__enter__()
            saved.__enter__()
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        if saved is not None:
            saved.__exit__(None, None, None)
        loss.backward()
        runtime.zero.after_backward()
        if measure is not None:
            measure["gradients"] = _nbytes(p.grad for p in model.parameters())
        runtime.zero.before_optimizer_step(optimizer)
        optimizer.step()
        runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if measure is not None:
            live.__exit__(None, None, None)
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            measure["parameters"] = _nbytes(model.parameters())
            measure["optimizer_state"] = _nbytes(state)
            measure["activations"] = saved.peak
            # parameters and AdamW state existed before the step (the live meter does not see them)
            measure["step_peak"] = measure["parameters"] + measure["optimizer_state"] + live.peak
        return elapsed

    memory: dict[str, dict] = {name: {} for name in MODELS}
    for name in MODELS:
        step(name)  # AdamW's state and every first-step allocation exist from here on
        step(name, memory[name])
    times: dict[str, list[float]] = {name: [] for name in MODELS}
    for r in range(args.rounds):
        for name in MODELS if r % 2 == 0 else reversed(MODELS):
            times[name].append(step(name))
    # each step as long as its slowest rank's, the fullest rank's bytes
    cats = ("parameters", "gradients", "optimizer_state", "activations", "step_peak")
    steps = torch.tensor([times[n] for n in MODELS], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    bytes_ = torch.tensor([[float(memory[n][c]) for c in cats] for n in MODELS], dtype=torch.float64)
    dist.all_reduce(bytes_, op=dist.ReduceOp.MAX)
    if rank == 0:
        for n, t, b in zip(MODELS, steps.tolist(), bytes_.tolist(), strict=True):
            model = runs[n][0]
            out[(world, n)] = {
                "seconds": statistics.median(t),
                "times": t,
                **dict(zip(cats, b, strict=True)),
                "total_params": model.num_parameters(),
                "active_params": model.num_parameters(active=True),
            }
    for _, runtime, _ in runs.values():
        runtime.zero.remove()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can abort at exit (shared/notes/cpu-distributed.md)


def _predicted(args: argparse.Namespace, name: str, world: int) -> Any:
    from megascale.core.parallel import ParallelPlan
    from megascale.core.plan import Kernels, Layout, Workload, predict_memory

    workload = Workload(_config(args, name), seq_len=args.seq, global_batch=args.batch, kernels=Kernels.cpu(),
                        precision="32-true")  # fmt: skip
    layout = Layout(ParallelPlan(**_plan_kwargs(name, world)), dp=world, micro_batch_size=args.batch // world)
    return predict_memory(workload, layout).peak


def _spawn(world: int, args: argparse.Namespace, out: dict) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, args, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"a rank of the {world}-process run failed (exit codes {failed})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument(
        "--expert-hidden", type=int, default=384, help="one expert's width; dense: top_k x it"
    )
    parser.add_argument(
        "--world", type=int, nargs="+", default=[1, 2], help="layouts: processes (1 and/or 2)"
    )
    parser.add_argument(
        "--rounds", type=int, default=10, help="rounds of one timed step per model, the order alternating"
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes, 2 rounds (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.heads, args.vocab, args.seq = 64, 2, 4, 512, 32
        args.batch, args.experts, args.expert_hidden, args.rounds = 4, 4, 64, 2
    if args.experts % 2 or args.batch % 2:
        parser.error("--experts and --batch must be even (ep = 2 and dp = 2 split them)")
    sys.path.insert(0, str(ROOT))
    results = mp.Manager().dict()
    for world in args.world:
        _spawn(world, args, results)

    tokens = args.batch * args.seq
    print(f"GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; "
          f"{args.batch} x {args.seq} tokens per step (global), fp32, AdamW, 1 thread per process. "
          f"dense: SwiGLU MLP of {args.top_k * args.expert_hidden}; MoE: {args.experts} experts of "
          f"{args.expert_hidden}, top-{args.top_k}. {args.rounds} rounds of one step per model, alternating")  # fmt: skip
    print("| layout | model | params total / active (M) | tokens/s | MoE / dense: medians (paired) | "
          "params + grads + AdamW MiB/rank (planner) | activations MiB/rank (planner) | step peak MiB/rank | "
          "planner total MiB |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for world in args.world:
        dense = results[(world, "dense")]
        for name in MODELS:
            r = results[(world, name)]
            want = _predicted(args, name, world)
            layout = "1 process" if world == 1 else ("dp2" if name == "dense" else "ep2") + " (2 gloo ranks)"
            ratio = dense["seconds"] / r["seconds"]
            paired = statistics.median(d / m for d, m in zip(dense["times"], r["times"], strict=True))
            states = r["parameters"] + r["gradients"] + r["optimizer_state"]
            print(f"| {layout} | {name} | {r['total_params'] / 1e6:.2f} / {r['active_params'] / 1e6:.2f} | "
                  f"{tokens / r['seconds']:,.0f} | {ratio:.2f}x ({paired:.2f}x) | "
                  f"{states / MIB:.1f} ({want.states / MIB:.1f}) | "
                  f"{r['activations'] / MIB:.1f} ({want.activations / MIB:.1f}) | {r['step_peak'] / MIB:.1f} | "
                  f"{want.total / MIB:.1f} |")  # fmt: skip
            rows.append({"world": world, "model": name, "tokens_per_s": tokens / r["seconds"],
                         "moe_over_dense": ratio, "moe_over_dense_paired": paired, "predicted": want.to_dict(),
                         **r})  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}))


if __name__ == "__main__":
    main()
