"""Benchmark megascale-ft: checkpoint stall, restore reads, fault detection latency.

Part 1, stall (MegaScale §4.2, two-stage checkpointing): --ranks DDP ranks (default 2) hold a model of
--params parameters (default ~100M, fp32) and SGD momentum state. Each method saves model + optimizer state
--repeats times; measured is how long the training thread is blocked ("stall"), per rank, worst rank:
    torch.save   rank 0 writes ``{"model": ..., "optimizer": ...}`` with torch.save, the others wait at a
                 barrier (what Lightning's DDP checkpointing does)
    dcp.save     torch.distributed.checkpoint.save, synchronous, every rank writes its part
    two-stage    megascale.ft.TwoStageCheckpointer.save: returns after the host snapshot; the persist runs
                 in the background ("persist" = until committed, shown for information)
Part 2, restore: bytes each rank reads from storage to load the checkpoint, every rank reading vs one reader
per data-parallel group broadcasting (``load(..., replicas=group)``), and the load time.
Part 3, detection: examples/ft_ddp.py under ``megascale-ft launch`` with a SIGKILL and a SIGSTOP injected;
the driver's detection latency (fault to verdict) from its report, against the configured hang timeout.

    python benchmarks/checkpoint.py                      # ~3 minutes on 2 cores (RESULTS.md)
    python benchmarks/checkpoint.py --params 20e6 --skip-detection
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

from megascale.ft import TwoStageCheckpointer

ROOT = Path(__file__).resolve().parents[1]


def _model(params: float) -> nn.Module:
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    model = _model(args.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the momentum buffers: the optimizer state to save
    results: dict[str, list[float]] = {"torch.save": [], "dcp.save": [], "two-stage": [], "persist": []}
    root = Path(args.dir)

    def torch_save(i: int) -> None:
        if rank == 0:
            torch.save(_state(model, optimizer), root / f"torch-{i}.pt")
        dist.barrier()

    def clean(i: int) -> None:  # keep the disk use at about two checkpoints of each kind
        dist.barrier()
        if rank == 0 and i > 0:
            (root / f"torch-{i - 1}.pt").unlink()
            shutil.rmtree(root / f"dcp-{i - 1}")

    checkpointer = TwoStageCheckpointer(str(root / "two-stage"), keep_last=2)
    for i in range(args.repeats):
        results["torch.save"].append(_timed(lambda i=i: torch_save(i)))
        results["dcp.save"].append(
            _timed(lambda i=i: dcp.save(_state(model, optimizer), checkpoint_id=root / f"dcp-{i}"))
        )
        results["two-stage"].append(
            _timed(lambda i=i: checkpointer.save(i, {"model": model, "optimizer": optimizer}))
        )
        start = time.perf_counter()
        checkpointer.wait()
        results["persist"].append(results["two-stage"][-1] + time.perf_counter() - start)
        clean(i)

    # restore: every rank reads, then one reader per replica group (here: the world) broadcasts
    restore: dict[str, dict[str, float]] = {}
    for name, replicas in (("every rank reads", None), ("one reads, broadcast", dist.group.WORLD)):
        kwargs = {} if replicas is None else {"replicas": replicas}
        start = time.perf_counter()
        checkpointer.load({"model": model, "optimizer": optimizer}, **kwargs)
        stats = checkpointer.last_load
        restore[name] = {"seconds": time.perf_counter() - start, "tensor": stats.tensor_bytes,
                         "checksum": stats.checksum_bytes, "metadata": stats.metadata_bytes}  # fmt: skip
    checkpointer.close()
    Path(f"{out}.{rank}").write_text(json.dumps({"stall": results, "restore": restore}))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def stall_and_restore(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.tmp) as work:
        args.dir = work
        out = os.path.join(work, "result")
        mp.start_processes(_rank, args=(args.ranks, args, os.path.join(work, "store"), out), nprocs=args.ranks,
                           start_method="spawn", join=True)  # fmt: skip
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.ranks)]
    n = sum(p.numel() for p in _model(args.params).parameters())
    print(f"\n# stall: {n / 1e6:.0f}M parameters + SGD momentum ({2 * n * 4 / 1e9:.2f} GB fp32), dp={args.ranks}, "
          f"{args.repeats} saves each, worst rank, median over saves")  # fmt: skip
    base = None
    for method in ("torch.save", "dcp.save", "two-stage", "persist"):
        worst = [max(r["stall"][method][i] for r in ranks) for i in range(args.repeats)]
        median = statistics.median(worst)
        base = median if method == "torch.save" else base
        label = "persist (background, not a stall)" if method == "persist" else method
        print(f"{label:36s} {median:8.3f} s   {median / base:6.3f}x torch.save")
    print(
        "\n# restore of that checkpoint: tensor bytes read from storage per rank (+ checksum verification,"
        " which rank 0 reads once whatever the layout), slowest rank's seconds"
    )
    every = None
    for name in ranks[0]["restore"]:
        reads = [r["restore"][name]["tensor"] for r in ranks]
        every = sum(reads) if every is None else every
        check = ranks[0]["restore"][name]["checksum"]
        secs = max(r["restore"][name]["seconds"] for r in ranks)
        print(f"{name:22s} {' + '.join(f'{b / 1e6:.0f}' for b in reads)} MB = {sum(reads) / 1e6:.0f} MB "
              f"({sum(reads) / every:.2f}x)  + checksums {check / 1e6:.0f} MB   {secs:.2f} s")  # fmt: skip


def detection(args: argparse.Namespace) -> None:
    hang = args.hang_timeout
    print(f"\n# detection: examples/ft_ddp.py, 2 ranks, heartbeat {args.heartbeat} s, hang timeout {hang} s")
    for fault in ("sigkill@4:1", "sigstop@4:1"):
        with tempfile.TemporaryDirectory(dir=args.tmp) as work:
            command = [
                sys.executable, "-m", "megascale.ft.cli", "launch", "--nproc-per-node=2", "--max-restarts=1",
                f"--heartbeat-interval={args.heartbeat}", f"--hang-timeout={hang}",
                f"--collective-timeout={hang * 3}", f"--run-dir={work}/run", "--no-self-check", "--",
                str(ROOT / "examples" / "ft_ddp.py"), f"{work}/ckpt", f"{work}/out.pt", "--fault", fault,
            ]  # fmt: skip
            subprocess.run(command, capture_output=True, timeout=600, check=True)
            report = json.loads(Path(f"{work}/run/report.json").read_text())
        f = report["attempts"][0]["fault"]
        print(f"{fault:14s} → {f['kind']} of rank {f['rank']}, detected after {f['latency']:.2f} s; "
              f"run {'recovered' if report['ok'] else 'FAILED'} in {len(report['attempts'])} attempts")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="where checkpoints are written (default: $TMPDIR)")
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--hang-timeout", type=float, default=5.0)
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument("--skip-detection", action="store_true")
    args = parser.parse_args()
    print(f"megascale-ft checkpoint benchmark — torch {torch.__version__}, {os.cpu_count()} CPUs")
    if not args.skip_stall:
        stall_and_restore(args)
    if not args.skip_detection:
        detection(args)


if __name__ == "__main__":
    main()
