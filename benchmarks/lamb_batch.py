"""LAMB's large-batch claim at CPU scale: the same model and token budget, AdamW at batch B vs LAMB at 4B and 8B.

MegaScale (Jiang et al. 2024, §3.1) trains with LAMB (You et al. 2019, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes") to grow the batch 4x at equal loss, which divides the number of
optimizer steps — and with them the pipeline bubbles per token — by 4. The claim has two halves: LAMB at 4B
reaches AdamW-at-B's loss, and AdamW at 4B (the baseline a user would otherwise scale) does not. So this runs,
on one process, a megascale GPT on the embedded stdlib corpus (byte tokens, the main job's data; the last 5%
held out), each with the same token budget and the same tokens in the same order (a step at k·B is the
concatenation of k consecutive B-batches):

    AdamW  at B, 4B, 8B     (β = (0.9, 0.95), weight decay 0.1)
    LAMB   at 4B, 8B        (megascale.core.optim.LAMB, β = (0.9, 0.999), weight decay 0.01)

Every configuration gets its own small learning-rate sweep (3 values, scaled by √k from the B grid, as You et
al. scale LAMB's rate with the square root of the batch), linear warmup over 5% of its steps, cosine decay to
10%; the best final validation loss of each sweep is reported, and with ``--seeds N`` the best rate is re-run
with other seeds to show the spread. Reported: validation loss (fixed held-out windows), steps, wall time, and
the ratios LAMB@kB / AdamW@B and AdamW@kB / AdamW@B.

    python benchmarks/lamb_batch.py                     # ~10 minutes on 2 CPU cores
    python benchmarks/lamb_batch.py --quick --json out.json   # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _pretrain_example() -> Any:
    """examples/pretrain.py as a module (examples/ is not a package): its corpus and learning-rate schedule."""
    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def _run(args: argparse.Namespace, data: dict[str, torch.Tensor], optimizer: str, k: int, lr: float,
         seed: int) -> dict[str, Any]:  # fmt: skip
    from megascale.core import GPT, GPTConfig
    from megascale.core.optim import LAMB

    example = data["example"]
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq_len, pad_vocab_to_multiple_of=64)  # fmt: skip
    model = GPT(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    if optimizer == "adamw":
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    else:
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        opt = LAMB(groups, lr=lr)
    batch = args.batch * k
    steps = args.steps // k
    warmup = max(1, steps // 20)
    order = data["starts"][seed]  # every run of a seed sees the same windows in the same order
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = example.lr_at(step, lr, warmup, steps)
        x, y = _windows(data["train"], order[step * batch : (step + 1) * batch], args.seq_len)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            break
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val = statistics.fmean(
            model(*_windows(data["val"], s, args.seq_len)).item() for s in data["val_starts"]
        )
    return dict(optimizer=optimizer, batch=batch, k=k, lr=lr, seed=seed, steps=steps,
                tokens=steps * batch * args.seq_len, val_loss=val, seconds=seconds)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="B: AdamW's batch (sequences)")
    parser.add_argument("--steps", type=int, default=480, help="AdamW's steps at B (the token budget)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3], help="grid at B")
    parser.add_argument("--lamb-lrs", type=float, nargs="+", default=[2.5e-3, 5e-3, 1e-2], help="grid at B")
    parser.add_argument("--multiples", type=int, nargs="+", default=[4, 8], help="the k of the k·B batches")
    parser.add_argument("--seeds", type=int, default=1, help="seeds for the best rate of each configuration")
    parser.add_argument("--corpus-mb", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", help="write every run and the summary here")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seq_len, args.d_model, args.layers, args.heads = 16, 32, 32, 1, 2
        args.adamw_lrs, args.lamb_lrs, args.multiples, args.corpus_mb = [2e-3], [5e-3], [4], 0.25
    torch.set_num_threads(max(1, torch.get_num_threads()))
    example = _pretrain_example()
    tokens = torch.frombuffer(
        bytearray(example.stdlib_corpus(int(args.corpus_mb * 2**20))), dtype=torch.uint8
    )
    tokens = tokens.long()
    split = int(0.95 * len(tokens))
    train, val = tokens[:split], tokens[split:]
    total = args.steps * args.batch
    starts = {
        seed: torch.randint(
            0, len(train) - args.seq_len - 1, (total,), generator=torch.Generator().manual_seed(seed)
        )
        for seed in range(args.seeds)
    }
    gen = torch.Generator().manual_seed(1234)
    val_starts = [torch.randint(0, len(val) - args.seq_len - 1, (16,), generator=gen) for _ in range(8)]
    data = {"example": example, "train": train, "val": val, "starts": starts, "val_starts": val_starts}

    configs = [("adamw", 1), *[(opt, k) for k in args.multiples for opt in ("adamw", "lamb")]]
    runs: list[dict[str, Any]] = []
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for optimizer, k in configs:
        grid = args.adamw_lrs if optimizer == "adamw" else args.lamb_lrs
        for lr in (x * math.sqrt(k) for x in grid):
            run = _run(args, data, optimizer, k, lr, seed=0)
            runs.append(run)
            print(f"{optimizer:>5} batch {run['batch']:>3} lr {lr:.2e}: {run['steps']:>4} steps, "
                  f"val loss {run['val_loss']:.4f} ({run['seconds']:.0f} s)", flush=True)  # fmt: skip
            if (optimizer, k) not in best or run["val_loss"] < best[(optimizer, k)]["val_loss"]:
                best[(optimizer, k)] = run
    spread: dict[tuple[str, int], list[float]] = {key: [r["val_loss"]] for key, r in best.items()}
    for seed in range(1, args.seeds):
        for (optimizer, k), run in best.items():
            again = _run(args, data, optimizer, k, run["lr"], seed=seed)
            runs.append(again)
            spread[(optimizer, k)].append(again["val_loss"])

    base = statistics.fmean(spread[("adamw", 1)])
    print(f"\nGPT d={args.d_model}, {args.layers} layers, seq {args.seq_len}, byte tokens of the stdlib corpus; "
          f"{total * args.seq_len:,} training tokens per run; best learning rate of each sweep"
          + (f", mean over {args.seeds} seeds" if args.seeds > 1 else "") + "\n")  # fmt: skip
    print("| optimizer | batch | lr | steps | val loss | seeds (min–max) | vs AdamW@B |")
    print("|---|---:|---:|---:|---:|---|---:|")
    summary = []
    for (optimizer, k), run in best.items():
        losses = spread[(optimizer, k)]
        mean = statistics.fmean(losses)
        summary.append(dict(optimizer=optimizer, batch=run["batch"], lr=run["lr"], steps=run["steps"],
                            val_loss=mean, seeds=losses, ratio=mean / base))  # fmt: skip
        print(f"| {'AdamW' if optimizer == 'adamw' else 'LAMB'} | {run['batch']} | {run['lr']:.2e} | {run['steps']} "
              f"| {mean:.4f} | {min(losses):.4f}–{max(losses):.4f} | {mean / base:.3f}x |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "args": {
            k: v for k, v in vars(args).items() if k != "json"}}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
