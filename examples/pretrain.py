"""Pretrain a small GPT with megascale-core alone: one process, plain PyTorch, no Lightning.

The main job (README, `nox -s demo`) runs this model through LightningCLI with tensor and pipeline parallelism,
megascale-data's loader and megascale-ft's checkpoints; this script shows what megascale-core gives on its own,
for users with their own training loop. The text is the Python standard library's .py files, read in sorted
order, byte-level tokens (vocabulary 256); the last 5% is held out. It trains with LAMB under warmup + cosine
decay, shows a progress bar, reports loss, tokens/s and validation loss, and ends with a sample from the
trained model. tests/core/test_examples.py runs it for a few steps.

    python examples/pretrain.py                # ~2 minutes on 2 CPU cores
    python examples/pretrain.py --steps 30     # a quick look
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from megascale.core import GPT, GPTConfig, flops_per_token, generate
from megascale.core.optim import LAMB

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety, not a requirement
    tqdm = None


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's Python source, sorted by path, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root}")
    return b"".join(chunks)[:max_bytes]


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless random windows of seq_len + 1 tokens: inputs and next-token targets."""
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, seq_len: int, batches_: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same held-out windows every time
    it = batches(tokens, 16, seq_len, gen)
    loss = sum(model(*next(it)).item() for _ in range(batches_)) / batches_
    model.train()
    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2, help="peak LAMB learning rate")
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(stdlib_corpus(int(args.corpus_mb * 2**20))), dtype=torch.uint8).long()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    config = GPTConfig(
        vocab_size=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=args.seq_len,
        parallel_block=True,
        sliding_window=args.seq_len // 2,
        full_attention_every=2,
    )
    model = GPT(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = LAMB([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    tokens_per_step = args.batch_size * args.seq_len
    print(
        f"corpus: {len(data) / 2**20:.1f} MB of Python standard library source "
        f"({len(train):,} training / {len(val):,} held-out tokens)\n"
        f"model: {model.num_parameters():,} parameters, parallel blocks, GQA 4q/2kv, sliding window "
        f"{config.sliding_window} on alternate layers; {flops_per_token(config, args.seq_len) / 1e6:.1f} "
        f"MFLOP/token"
    )
    first_val = evaluate(model, val, args.seq_len)
    stream = batches(train, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    bar = (
        tqdm(range(args.steps), desc="pretraining", unit="step", mininterval=1.0)
        if tqdm
        else range(args.steps)
    )
    start, ema = time.perf_counter(), None
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.lr, warmup=max(1, args.steps // 15), total=args.steps)
        inputs, targets = next(stream)
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        tok_s = (step + 1) * tokens_per_step / (time.perf_counter() - start)
        if tqdm:
            bar.set_postfix(loss=f"{ema:.3f}", grad_norm=f"{grad_norm:.2f}", tok_s=f"{tok_s:,.0f}")
        elif step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {ema:.3f}  grad-norm {grad_norm:.2f}  {tok_s:,.0f} tokens/s")
    final_val = evaluate(model, val, args.seq_len)
    print(
        f"held-out loss: {first_val:.3f} → {final_val:.3f} nats/byte ({final_val / math.log(2):.2f} bits/byte)"
    )
    prompt = torch.tensor([list(b"def ")])
    sample = generate(
        model, prompt, 160, temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(0)
    )
    print("sample:\n" + bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    if not final_val < first_val:
        print("the held-out loss did not improve", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
