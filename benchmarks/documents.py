"""Packed documents: attention masked to each document vs plain causal attention, forward + backward.

What ``GPT.forward(..., position_ids=...)`` costs in its attention (issue 34): ``kernels.attention`` with
``documents`` (the automatic choice: SDPA with a (B, 1, T, T) boolean mask on the CPU) against the causal call
(SDPA's fused causal kernel), on the same q, k, v, at T 4096 and 8192 with documents of 256 to 2048 tokens
drawn from a seed. Prints the median time of each over a few repetitions and the ratio documents / causal,
and the share of the causal score matrix the document mask keeps (the work a block-sparse kernel such as
FlexAttention's does instead). The GPU rows are in ``gpu.py`` (FlexAttention document mask vs SDPA causal).

    python benchmarks/documents.py            # 8 heads of 64 (GQA 2 kv heads), T 4096 and 8192, ~1 minute
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megascale.core import kernels


def _documents(T: int, gen: torch.Generator) -> torch.Tensor:
    """(1, T) positions restarting at documents of 256 to 2048 tokens."""
    lengths, total = [], 0
    while total < T:
        n = int(torch.randint(256, 2049, (), generator=gen))
        lengths.append(min(n, T - total))
        total += lengths[-1]
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def _timed(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads}/{args.kv_heads} "
          f"of {args.head_dim}, forward + backward")  # fmt: skip
    print("| T | documents | causal s | documents s | documents / causal | scores kept vs causal |")
    print("|---|---|---|---|---|---|")
    for T in args.seq_lens:
        q = torch.randn(1, T, args.heads, args.head_dim, generator=gen, requires_grad=True)
        k = torch.randn(1, T, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
        v = torch.randn(1, T, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
        positions = _documents(T, gen)
        documents = kernels.document_ids(positions)

        def step(documents: torch.Tensor | None, q=q, k=k, v=v) -> None:
            kernels.attention(q, k, v, documents=documents).sum().backward()

        t_causal = _timed(lambda: step(None), args.repeats)
        t_masked = _timed(lambda: step(documents), args.repeats)  # noqa: B023 (timed inside this iteration)
        lengths = torch.bincount(documents[0]).float()
        kept = float((lengths * (lengths + 1) / 2).sum() / (T * (T + 1) / 2))
        print(f"| {T} | {int((positions == 0).sum())} | {t_causal:.3f} | {t_masked:.3f} | "
              f"{t_masked / t_causal:.2f}x | {kept:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
