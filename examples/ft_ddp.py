"""megascale-ft with plain torch: a short deterministic DDP run (gloo) with heartbeats, two-stage
checkpoints and restarts, and faults to inject (for drills, tests/ft/test_faults.py and benchmarks).

    megascale-ft launch --nproc-per-node 2 -- examples/ft_ddp.py CKPT_DIR OUT.pt [--fault KIND@STEP:RANK]

Every step's data comes from a generator seeded by (step, rank), dropout draws from the global RNG, and
SGD carries momentum: a resumed run matches an uninterrupted one bit for bit only if the model, the
optimizer and every rank's RNG state come back exactly. A fault fires only in the first attempt
(``MEGASCALE_FT_ATTEMPT=0``; every attempt with ``--always``), at step STEP on rank RANK. Kinds: sigkill,
sigstop, exception, nan, kill-persist (SIGKILL while a checkpoint persists: its data file exists, its
manifest does not), corrupt-latest (rank 0 damages the checkpoint just committed, then dies: the restart
must skip it), kill-node (RANK is a node name under a multi-node ``megascale-ft launch``: that node's torchrun
and all its ranks are SIGKILLed, as when a machine's job processes die), kill-agent (the same, and the node's
``megascale-ft`` agent above them: the whole node is gone).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from megascale.ft import Executor, TwoStageCheckpointer

EVERY = 2  # checkpoint every 2 steps


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _ddp(module: nn.Module) -> DistributedDataParallel:
    """DDP with its gradient buckets already in their final layout. DDP rebuilds the buckets after the first
    backward of a process (in the order gradients became ready), so a restarted attempt's first step would
    reduce in the old layout, and at 3+ ranks the sums associate differently (float rounding). One backward
    on a dummy input, without dropout and without a step, at the start of every attempt avoids that."""
    model = DistributedDataParallel(module)
    module.eval()
    model(torch.zeros(1, 16)).sum().backward()
    model.zero_grad(set_to_none=True)
    module.train()
    return model


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s ``size`` samples, the same whatever the number of ranks that share them."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _damage_latest(root: str, step: int) -> None:
    files = sorted((Path(root) / f"step-{step:09d}").glob("*.distcp"))
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fault", default="", help="KIND@STEP:RANK, first attempt only")
    parser.add_argument("--always", action="store_true", help="inject the fault in every attempt")
    parser.add_argument("--global-batch", type=int, default=0,
                        help="share one batch of this size per step among the ranks, without dropout: the "
                        "same training on any number of ranks (elastic runs)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    with Executor.from_env() as executor:
        dist.init_process_group("gloo", timeout=executor.collective_timeout)
        rank = dist.get_rank()
        kind, at, who = "", -1, -1
        if args.fault and (executor.attempt == 0 or args.always):
            kind, where = args.fault.split("@")
            at, who = (int(v) for v in where.split(":"))
        model = _ddp(_model())
        world = dist.get_world_size()
        if args.global_batch:
            if args.global_batch % world:
                raise ValueError(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
            model.eval()  # no dropout: its masks would depend on how many ranks share the batch
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        checkpointer = TwoStageCheckpointer(args.ckpt, keep_last=3)
        torch.manual_seed(1 + rank)
        start = 0
        if checkpointer.latest() is not None:
            # model and optimizer are the same on every rank: rank 0 reads them, the others get a copy
            start = checkpointer.load(
                {"model": model.module, "optimizer": optimizer}, replicas=dist.group.WORLD
            )
            rng = {f"rng{rank}": torch.get_rng_state()}
            checkpointer.load(rng, step=start)  # each rank its own generator
            torch.set_rng_state(rng[f"rng{rank}"])
        for step in range(start, args.steps):
            with executor.timer.step(step):
                if args.global_batch:
                    share = args.global_batch // world
                    x, y = (
                        t[rank * share : (rank + 1) * share] for t in global_batch(step, args.global_batch)
                    )
                else:
                    x, y = _batch(step, rank)
                with executor.timer.section("forward"):
                    loss = nn.functional.mse_loss(model(x), y)
                with executor.timer.section("backward"):
                    loss.backward()
                with executor.timer.section("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad()
            value = loss.item()
            node = os.environ.get("MEGASCALE_FT_NODE")
            on_node = step == at and node == str(who) and os.environ.get("LOCAL_RANK") == "0"
            if kind in ("kill-node", "kill-agent") and on_node:
                from megascale.ft._procs import kill_tree

                root = os.getppid()  # torchrun; its parent is the node's agent
                if kind == "kill-agent":
                    root = int(Path(f"/proc/{root}/stat").read_text().rsplit(")", 1)[1].split()[1])
                kill_tree(root)  # then everything below it, this rank included
            if rank == who and step == at:
                if kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "sigstop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                    # a frozen rank stays frozen: continued (to dump its stack), it stays right here
                    while True:
                        time.sleep(1)
                if kind == "exception":
                    raise RuntimeError(f"injected failure at step {step}")
                if kind == "nan":
                    value = float("nan")
            executor.step_done(step, value)
            if (step + 1) % EVERY == 0:
                state = {"model": model.module, "optimizer": optimizer, f"rng{rank}": torch.get_rng_state()}
                checkpointer.save(step + 1, state)
                if kind == "kill-persist" and rank == who and step == at:
                    # die in the middle of stage 2: once this rank's data file is being written
                    mine = Path(args.ckpt) / f"step-{step + 1:09d}" / f"__{rank}_0.distcp"
                    deadline = time.monotonic() + 10
                    while not mine.exists() and time.monotonic() < deadline:
                        time.sleep(0.001)
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "corrupt-latest" and step == at:
                    checkpointer.wait()
                    if rank == who:
                        _damage_latest(args.ckpt, step + 1)
                        os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.close()
        if rank == 0:
            torch.save(model.module.state_dict(), args.out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
