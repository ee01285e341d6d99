"""LAMB's large-batch claim at CPU scale: one model and token budget, AdamW at batch B vs LAMB at 4B and 8B.

MegaScale (Jiang et al. 2024, §3.1 and the §6 ablation) trains with LAMB (You et al. 2019, "Large Batch
Optimization for Deep Learning: Training BERT in 76 minutes") to grow the batch 4x at equal loss: 4x fewer
optimizer steps, and with them 4x fewer pipeline bubbles per token. The claim has two halves, and this
benchmark measures both on one process:

    LAMB at 4B (and 8B) reaches the validation loss of AdamW at B, with the same tokens, and
    AdamW at 4B (and 8B), the baseline a user would otherwise scale up, does not.

Every run trains the same GPT from the same initial weights on the same tokens in the same order: the
training windows are drawn once per seed, and a step at batch k·B takes k consecutive B-batches. The data is
the main job's embedded corpus (megascale-data's stdlib files, byte tokens and an end-of-document id, the
same hash-of-path file split: validation files are never trained on). The validation loss is the mean over
a fixed set of non-overlapping held-out windows, the same for every run.

Recipe (the same for both optimizers, so that the only difference is LAMB's per-tensor trust ratio):
    betas (0.9, 0.95), eps 1e-8, decoupled weight decay 0.1 on matrices (not on norms), global gradient
    clipping at 1.0, linear warmup then cosine decay to 10% of the peak rate. Warmup lasts the same number of
    STEPS at every batch size (You et al.'s "linear-epoch warmup": the warmup's share of training grows with
    the batch, here 5% at B, 20% at 4B, 40% at 8B). LAMB is megascale.core.optim.LAMB with its defaults
    otherwise (bias correction, trust ratio clamped at 10, also on norm weights).
    Learning rates: AdamW at B sweeps --adamw-lrs. At k·B both optimizers centre their sweep on the
    square-root rule (You et al. for LAMB; Malladi et al. 2022 for Adam): AdamW sweeps best(B)·√k·{¼, ½, 1, 2}
    (at k=4 that spans half of B's rate, B's own rate, the √ rule and the linear rule); LAMB sweeps --lamb-lrs
    at the smallest k and best(previous k)·√(k/k_prev)·{¼, ½, 1, 2} above. The best rate of each
    configuration (seed 0) is re-run with seeds 1.. (--seeds; another initialisation and another draw of
    training windows) for the spread.

Size. Every configuration needs its own sweep, so the default is small enough for ~30 runs in ~10 minutes on
two shared CPU cores: a GPT of d=64, 4 layers, 4 heads (0.30 M parameters), sequences of 64 bytes, B = 8
sequences (512 tokens), 640 steps at B = 328 k tokens per run (160 steps at 4B, 80 at 8B). One torch thread:
on a machine shared with other work, two threads on two cores stalled on every small matmul (measured
14-250x slower); the comparison is of losses, and wall times are only indicative.

Reported per configuration: optimizer, batch, rate, warmup, steps, tokens, validation loss (seed 0 and over
seeds), wall time; and the ratios to AdamW at B (validation loss and steps), and how much of AdamW's large-
batch gap LAMB closes. A best rate on the edge of its sweep is marked: the true optimum may lie outside.

    python benchmarks/lamb_batch.py                             # ~10 minutes on 2 CPU cores
    python benchmarks/lamb_batch.py --quick --json out.json     # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from megascale.core import GPT, GPTConfig
from megascale.core.optim import LAMB
from megascale.data.stdlib import _held_out, stdlib_files
from megascale.data.tokenize import ByteTokenizer

VAL_PERCENT = 5.0  # the main job's default split (build_stdlib_shards)


# ---- data -----------------------------------------------------------------------------------------------


def load_corpus(train_bytes: int, val_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of the stdlib files, split by file as the main job splits them, each document ended by eos.

    Files are read in sorted order until the training split has ``train_bytes`` and the held-out split at
    least ``val_tokens`` tokens.
    """
    tok = ByteTokenizer()
    root = Path(sysconfig.get_paths()["stdlib"])  # the root stdlib_files() lists from
    parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    for path in stdlib_files():
        if sizes[False] >= train_bytes and sizes[True] >= val_tokens:
            break
        held = _held_out(path.relative_to(root).as_posix(), VAL_PERCENT)
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
        doc = torch.cat([torch.from_numpy(ids).long(), torch.tensor([tok.eos_id])])
        parts[held].append(doc)
        sizes[held] += len(doc)
    train, val = torch.cat(parts[False])[:train_bytes], torch.cat(parts[True])
    return train, val


def training_order(n_train: int, windows: int, seq_len: int, seed: int) -> torch.Tensor:
    """Start offsets of ``windows`` distinct, non-overlapping training windows, in a seeded random order."""
    available = (n_train - 1) // seq_len
    if available < windows:
        raise SystemExit(
            f"the budget needs {windows} windows of {seq_len} tokens but the training split holds {available}: "
            "raise --corpus-mb"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(available, generator=gen)[:windows] * seq_len


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts[:, None] + torch.arange(seq_len + 1)
    window = tokens[index]
    return window[:, :-1], window[:, 1:]


# ---- one training run ------------------------------------------------------------------------------------


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to 10% of it (examples/pretrain.py's schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    return LAMB(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)  # max_trust_ratio: the default 10


@torch.no_grad()
def validation_loss(model: GPT, data: dict[str, Any], seq_len: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for starts in data["val_starts"].split(64):
        total += model(*windows(data["val"], starts, seq_len)).item() * len(starts)
        count += len(starts)
    model.train()
    return total / count


def train(
    args: argparse.Namespace,
    data: dict[str, Any],
    optimizer: str,
    k: int,
    lr: float,
    seed: int,
    steps: int | None = None,
) -> dict:
    torch.manual_seed(seed)  # the same initial weights for every run of a seed
    config = GPTConfig(
        vocab_size=257,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
        pad_vocab_to_multiple_of=64,
    )
    model = GPT(config)
    opt = make_optimizer(optimizer, model, lr)
    batch = k * args.batch
    steps = args.steps // k if steps is None else steps
    warmup = min(args.warmup, max(1, steps // 2))
    order = data["order"][seed]
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup, steps)
        loss = model(*windows(data["train"], order[step * batch : (step + 1) * batch], args.seq_len))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - start
    val = validation_loss(model, data, args.seq_len) if math.isfinite(losses[-1]) else math.nan
    tail = losses[-max(1, steps // 10) :]
    return {
        "optimizer": optimizer,
        "parameters": model.num_parameters(),
        "k": k,
        "batch": batch,
        "tokens_per_step": batch * args.seq_len,
        "lr": lr,
        "warmup": warmup,
        "steps": steps,
        "tokens": steps * batch * args.seq_len,
        "seed": seed,
        "train_loss_last10pct": statistics.fmean(tail),
        "val_loss": val,
        "seconds": seconds,
    }


# ---- the sweep -------------------------------------------------------------------------------------------


def _label(optimizer: str, k: int) -> str:
    return f"{'AdamW' if optimizer == 'adamw' else 'LAMB'}@{'' if k == 1 else k}B"


def _best(runs: list[dict]) -> dict:
    finite = [r for r in runs if math.isfinite(r["val_loss"])]
    return min(finite, key=lambda r: r["val_loss"]) if finite else runs[0]


def _finite_or_none(value: Any) -> Any:
    """NaN (a diverged run) as null, so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="B: AdamW's baseline batch, in sequences")
    parser.add_argument("--steps", type=int, default=640, help="steps at B; the budget is steps·B·seq tokens")
    parser.add_argument("--warmup", type=int, default=32, help="warmup steps, the same at every batch size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--multiples", type=int, nargs="+", default=[4, 8], help="the k of the k·B batches")
    parser.add_argument(
        "--adamw-lrs", type=float, nargs="+", default=[2.5e-3, 5e-3, 1e-2, 2e-2], help="sweep at B"
    )
    parser.add_argument(
        "--lamb-lrs",
        type=float,
        nargs="+",
        default=[1e-2, 2e-2, 4e-2, 8e-2],
        help="sweep at the smallest k·B",
    )
    parser.add_argument(
        "--around",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1.0, 2.0],
        help="factors around a √k-scaled best rate",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds for the best rate of each configuration")
    parser.add_argument("--corpus-mb", type=float, default=2.0, help="training text read (MiB)")
    parser.add_argument("--val-windows", type=int, default=512, help="held-out windows in the validation set")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine more can stall, see below)",
    )
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", help="write every run, the summary and the settings here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.warmup, args.seq_len = 2, 16, 2, 32
        args.d_model, args.layers, args.heads = 32, 1, 2
        args.adamw_lrs, args.lamb_lrs, args.around = [4e-3], [2e-2], [1.0]
        args.seeds, args.corpus_mb, args.val_windows = 1, 0.05, 16
    torch.set_num_threads(args.threads)
    multiples = sorted(set(args.multiples))
    if any(k < 2 or args.steps % k for k in multiples):
        raise SystemExit(f"--multiples must be >= 2 and divide --steps={args.steps}")

    train_tokens, val_tokens = load_corpus(int(args.corpus_mb * 2**20), args.val_windows * args.seq_len + 1)
    n_val = min(args.val_windows, (len(val_tokens) - 1) // args.seq_len)
    data = {
        "train": train_tokens,
        "val": val_tokens,
        "val_starts": torch.arange(n_val) * args.seq_len,  # fixed, non-overlapping held-out windows
        "order": {
            s: training_order(len(train_tokens), args.steps * args.batch, args.seq_len, s)
            for s in range(args.seeds)
        },
    }
    budget = args.steps * args.batch * args.seq_len
    warm = train(args, data, "adamw", 1, 0.0, seed=0, steps=1)  # untimed: one-off costs (kernel checks, ...)
    print(
        f"GPT d={args.d_model}, {args.layers} layers, {args.heads} heads ({warm['parameters']:,} parameters), "
        f"seq {args.seq_len}, byte tokens of the stdlib corpus ({len(train_tokens):,} training / "
        f"{n_val * args.seq_len:,} validation tokens); {budget:,} training tokens per run, B = {args.batch} "
        f"sequences; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    runs: list[dict] = []

    def sweep(optimizer: str, k: int, rates: list[float]) -> dict:
        mine = []
        for lr in rates:
            run = train(args, data, optimizer, k, lr, seed=0)
            mine.append(run)
            runs.append(run)
            print(
                f"  {_label(optimizer, k):>9} lr {lr:.2e}: {run['steps']:4d} steps, val loss {run['val_loss']:.4f} "
                f"({run['seconds']:.0f} s)",
                flush=True,
            )
        best = _best(mine)
        best["edge"] = len(rates) > 1 and best["lr"] in (min(rates), max(rates))
        return best

    best: dict[tuple[str, int], dict] = {("adamw", 1): sweep("adamw", 1, args.adamw_lrs)}
    previous = 1
    for k in multiples:
        centre = best[("adamw", 1)]["lr"] * math.sqrt(k)
        best[("adamw", k)] = sweep("adamw", k, [centre * f for f in args.around])
        if k == multiples[0]:
            rates = args.lamb_lrs
        else:
            rates = [best[("lamb", previous)]["lr"] * math.sqrt(k / previous) * f for f in args.around]
        best[("lamb", k)] = sweep("lamb", k, rates)
        previous = k
    losses = {key: [run["val_loss"]] for key, run in best.items()}
    for seed in range(1, args.seeds):
        for key, run in best.items():
            again = train(args, data, key[0], key[1], run["lr"], seed=seed)
            runs.append(again)
            losses[key].append(again["val_loss"])
            print(
                f"  {_label(*key):>9} lr {run['lr']:.2e}, seed {seed}: val loss {again['val_loss']:.4f}",
                flush=True,
            )

    base = best[("adamw", 1)]
    base_mean = statistics.fmean(losses[("adamw", 1)])
    summary = []
    for key in sorted(best, key=lambda key: (key[1], key[0])):
        run = best[key]
        mean = statistics.fmean(losses[key])
        summary.append(
            {
                "config": _label(*key),
                "optimizer": key[0],
                "k": key[1],
                "batch": run["batch"],
                "lr": run["lr"],
                "lr_on_sweep_edge": run["edge"],
                "warmup": run["warmup"],
                "steps": run["steps"],
                "tokens": run["tokens"],
                "val_loss_seed0": run["val_loss"],
                "val_loss_seeds": losses[key],
                "val_loss": mean,
                "val_loss_vs_adamw_b": mean / base_mean,
                "steps_vs_adamw_b": run["steps"] / base["steps"],
                "seconds": run["seconds"],
            }
        )
    gaps = {}
    for k in multiples:
        adamw, lamb = statistics.fmean(losses[("adamw", k)]), statistics.fmean(losses[("lamb", k)])
        gaps[f"{k}B"] = {
            "adamw_gap": adamw - base_mean,
            "lamb_gap": lamb - base_mean,
            "lamb_over_adamw_b": lamb / base_mean,
            "adamw_over_adamw_b": adamw / base_mean,
            "steps_ratio": 1 / k,
            "share_of_gap_closed": (adamw - lamb) / (adamw - base_mean) if adamw != base_mean else math.nan,
        }

    seeds = f"mean of {args.seeds} seeds (min–max)" if args.seeds > 1 else "seed 0"
    print(
        f"\nbest learning rate of each sweep (* = on the sweep's edge); validation loss in nats/token, {seeds}\n"
    )
    print(
        "| config | batch | lr | warmup | steps | tokens | val loss | vs AdamW@B | steps vs AdamW@B | wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in summary:
        spread = (
            f" ({min(row['val_loss_seeds']):.4f}–{max(row['val_loss_seeds']):.4f})" if args.seeds > 1 else ""
        )
        print(
            f"| {row['config']} | {row['batch']} | {row['lr']:.2e}{'*' if row['lr_on_sweep_edge'] else ''} "
            f"| {row['warmup']} | {row['steps']} | {row['tokens']:,} | {row['val_loss']:.4f}{spread} "
            f"| {row['val_loss_vs_adamw_b']:.3f}x | {row['steps_vs_adamw_b']:.3f}x | {row['seconds']:.0f} |"
        )
    print()
    for name, gap in gaps.items():
        print(
            f"at {name}: AdamW {gap['adamw_gap']:+.4f} nats vs AdamW@B, LAMB {gap['lamb_gap']:+.4f} "
            f"(LAMB/AdamW@B {gap['lamb_over_adamw_b']:.3f}x, {gap['steps_ratio']:.3f}x the steps); "
            f"LAMB closes {gap['share_of_gap_closed']:.0%} of AdamW's gap"
        )
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "json"}
        settings.update(
            parameters=warm["parameters"],
            machine=platform.machine(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        )
        out = {"settings": settings, "summary": summary, "gaps": gaps, "runs": runs}
        Path(args.json).write_text(json.dumps(_finite_or_none(out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
