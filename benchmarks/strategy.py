"""Benchmark MegaScaleStrategy at dp=2 against the strategies a Lightning user would otherwise pick.

One run launches (torchrun, 2 ranks; gloo on CPU, NCCL on GPUs) the same GPTModule and data under:
    DDPStrategy                    Lightning's data parallel (the baseline: ratios are vs this)
    ModelParallelStrategy          Lightning's FSDP2 path (fully_shard per block in configure_model)
    MegaScale zero 1 / 2 / 3       each with overlap on (comm overlapped with compute) and off
and, separately, one process running a rank's share of the batch with no communication at all, so that
communication time can be estimated: comm(layout) = step(layout, overlap off) - step(no communication), and
overlap hides (step(off) - step(on)) / comm of it.

Reported per layout: median step time, tokens/s and the ratio to DDP, and the training state each rank holds
(parameters + gradients + optimizer state, local shards counted; on CUDA also peak allocated memory), and the
bytes a rank sends per step ("sent MB": every collective the step issues, counted by
``megascale.core.comm_meter.CollectiveMeter``, as ring algorithms move them: an all-reduce 2(n-1)/n of its
size, a reduce-scatter, all-gather or broadcast (n-1)/n). ZeRO-1 should hold ~1/dp of DDP's optimizer state.

With ``--model own`` the same layouts train a model of the user's own instead of megascale's GPT: the
Llama-style transformer of examples/own_model.py (plain torch layers; it declares its blocks, so ZeRO-2/3 shard
it per block). The "units" column counts the FSDP units a rank holds.

    python benchmarks/strategy.py                     # CPU-sized GPT, ~2 minutes
    python benchmarks/strategy.py --model own         # the user's own transformer
    python benchmarks/strategy.py --d-model 1024 --layers 12 --seq-len 1024 --batch 8   # on GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpt_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                max_seq_len=args.seq_len, parallel_block=True)  # fmt: skip


def _own_model_example() -> Any:
    """examples/own_model.py as a module (examples/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_model", ROOT / "examples" / "own_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    from megascale.core._dtensor import local

    params = {id(p): p for p in module.parameters()}
    out = {"params": sum(local(p).numel() * local(p).element_size() for p in params.values())}
    out["grads"] = sum(
        local(p.grad).numel() * local(p.grad).element_size() for p in params.values() if p.grad is not None
    )
    out["optimizer"] = sum(
        local(v).numel() * local(v).element_size()
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return out


def _worker(args: argparse.Namespace) -> None:
    """One rank: every layout in sequence; rank 0 writes the measurements."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from megascale.core import GPTConfig
    from megascale.core.comm_meter import CollectiveMeter, wire_bytes
    from megascale.lightning import GPTModule, MegaScaleStrategy, TokenDataModule

    class FSDPGPTModule(GPTModule):
        """GPTModule for ModelParallelStrategy: fully_shard each block, then the root (Lightning's recipe)."""

        def configure_model(self) -> None:
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for block in self.gpt.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(self.gpt, mesh=mesh)

    own_model = _own_model_example()

    class FSDPOwnModule(own_model.OwnModelModule):  # type: ignore[name-defined,misc]
        """The user's own model for ModelParallelStrategy, by the same recipe."""

        def configure_model(self) -> None:
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def make_module(fsdp: bool) -> Any:
        if args.model == "own":
            sizes = dict(
                vocab=8192, dim=args.d_model, layers=args.layers, heads=args.heads, kv_heads=args.heads
            )
            return (FSDPOwnModule if fsdp else own_model.OwnModelModule)(lr=1e-4, **sizes)
        return (FSDPGPTModule if fsdp else GPTModule)(
            GPTConfig(**_gpt_kwargs(args)), optimizer="adamw", lr=1e-4, warmup_steps=1
        )

    class Measure(Callback):
        reads_weights_between_steps = False  # times and sizes only: ZeRO-1 keeps gathering during the forward

        def __init__(self) -> None:
            self.times: list[float] = []
            self.state: dict[str, int] = {}
            self.meter = CollectiveMeter()  # every collective a step issues, on this rank's thread
            self.wire: list[float] = []
            self.kinds: dict[str, int] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.meter.clear()
            self.meter.__enter__()
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.state = _state_bytes(pl_module, trainer.optimizers)  # grads present, state of last step
            self.state["units"] = sum(isinstance(m, FSDPModule) for m in pl_module.modules())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)
            self.meter.__exit__(None, None, None)
            # bytes a rank sends per step under ring algorithms (every collective here spans the dp=2 ranks)
            self.wire.append(sum(wire_bytes(c.kind, c.payload, 2) for c in self.meter.collectives()))
            self.kinds = dict(self.meter.kinds())

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = args.batch // 2  # a rank's share of the global batch at dp=2
    layouts: dict[str, Any] = {}
    if args.single:
        layouts["no communication (1 process, a rank's batch)"] = "auto"
    else:
        layouts["DDPStrategy"] = DDPStrategy()
        layouts["ModelParallelStrategy (FSDP2)"] = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1
        )
        for stage in (1, 2, 3):
            for on in (True, False):
                layouts[f"MegaScale zero{stage} overlap {'on' if on else 'off'}"] = MegaScaleStrategy(
                    zero_stage=stage, overlap_grad_reduce=on, overlap_param_gather=on, meta_init=False
                )
    results = {}
    for name, strategy in layouts.items():
        seed_everything(0)
        module = make_module(fsdp=name.startswith("ModelParallel"))
        data = TokenDataModule(source="random:8192", seq_len=args.seq_len, batch_size=micro,
                               max_bytes=args.seq_len * args.batch * (args.steps + 2) * 2)  # fmt: skip
        measure = Measure()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        Trainer(accelerator="gpu" if cuda else "cpu", devices=world, strategy=strategy, max_steps=args.steps,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0, num_sanity_val_steps=0, callbacks=[measure],
                precision="bf16-mixed" if cuda else "32-true").fit(module, datamodule=data)  # fmt: skip
        step = statistics.median(measure.times[args.warmup :])
        results[name] = dict(step_s=step, tokens_per_s=micro * world * args.seq_len / step, state=measure.state,
                             peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
                             wire_bytes=statistics.median(measure.wire[args.warmup :]),
                             collectives=measure.kinds)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _run(args: argparse.Namespace, out: Path, ranks: int, single: bool) -> dict[str, Any]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    worker = [__file__, "--worker", "--out", str(out), *(["--single"] if single else []), *sys.argv[1:]]
    if ranks == 1:
        cmd = [sys.executable, *worker]
    else:
        with socket.socket() as sock:  # a free port: torchrun would hand port 0 on to the workers as is
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={port}", *worker]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL if not args.verbose else None)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=("gpt", "own"),
        default="gpt",
        help="megascale's GPT, or the user's own transformer of examples/own_model.py",
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over dp=2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(args.threads)
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = _run(args, Path(tmp) / "dp2.json", 2, single=False)
        alone = _run(args, Path(tmp) / "one.json", 1, single=True)
    base = results["DDPStrategy"]
    compute = next(iter(alone.values()))["step_s"]
    device = "CUDA, bf16-mixed" if torch.cuda.is_available() else "CPU (gloo), fp32"
    model = (
        f"GPT {_gpt_kwargs(args)}"
        if args.model == "gpt"
        else f"own transformer (examples/own_model.py) d={args.d_model}, {args.layers} layers, vocab 8192"
    )
    print(f"\n{model}; global batch {args.batch} × {args.seq_len} tokens at dp=2; {device}; "
          f"median of {args.steps - args.warmup} steps\n")  # fmt: skip
    print(
        f"{'layout':<34}{'ms/step':>9}{'tokens/s':>10}{'vs DDP':>8}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}"
        f"{'units':>7}{'sent MB':>9}{'vs DDP':>8}"
    )
    for name, r in results.items():
        s = r["state"]
        print(f"{name:<34}{r['step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base['tokens_per_s']:>7.2f}x"
              f"{s['params'] / 2**20:>11.2f}{s['grads'] / 2**20:>10.2f}{s['optimizer'] / 2**20:>10.2f}{s['units']:>7}"
              f"{r['wire_bytes'] / 2**20:>9.2f}{r['wire_bytes'] / base['wire_bytes']:>7.2f}x")  # fmt: skip
    print(f"{'no communication (a rank alone)':<34}{compute * 1e3:>9.1f}")
    print()
    for stage in (1, 2, 3):
        on, off = (results[f"MegaScale zero{stage} overlap {x}"]["step_s"] for x in ("on", "off"))
        comm = off - compute
        hidden = (off - on) / comm if comm > 0 else float("nan")
        print(f"zero{stage}: communication ≈ {comm * 1e3:.1f} ms/step (step with overlap off − no communication); "
              f"overlap hides {hidden:.0%} of it")  # fmt: skip
    z1, ddp = results["MegaScale zero1 overlap on"]["state"]["optimizer"], base["state"]["optimizer"]
    print(f"ZeRO-1 optimizer state per rank: {z1 / ddp:.2f} of DDP's (ideal 1/dp = 0.50)")


if __name__ == "__main__":
    main()
