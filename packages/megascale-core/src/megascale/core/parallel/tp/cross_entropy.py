"""Cross-entropy over vocabulary-sharded logits, without ever gathering the vocabulary on one rank.

Each rank holds logits for columns [vocab_start, vocab_start + V/tp). Per row we need the global max (for a
stable softmax), the global sum of exponentials and the target's logit, which lives on exactly one rank:
one all-reduce MAX and one all-reduce SUM of (target logit, sum of exps) suffice (Megatron's
vocab-parallel cross-entropy, with its two SUMs fused into one). Columns at or past the real vocabulary
size are padding: set to -inf, they add nothing to the softmax and get no gradient.

Both all-reduces wait for every rank of the group: ``timer`` (``wait_timer.py``) spans them as waits of kind
``"tp-all-reduce"`` (straggler detection; the default times nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index, timer):
        # logits (N, V/tp) this rank's columns; targets (N,) global ids
        n_local = logits.shape[-1]
        real = max(0, min(n_local, vocab_size - vocab_start))  # local columns that are real tokens
        z = logits.to(torch.float32, copy=True)
        if real < n_local:
            z[:, real:] = float("-inf")
        row_max = z.max(dim=1).values
        with timer("tp-all-reduce"):
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z -= row_max.unsqueeze(1)
        local_t = targets - vocab_start
        valid = targets != ignore_index
        mine = valid & (local_t >= 0) & (local_t < real)  # this rank holds the target column
        idx = local_t.clamp(0, n_local - 1)
        target_logit = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
        z.exp_()
        stats = torch.stack((target_logit, z.sum(dim=1)))
        with timer("tp-all-reduce"):
            dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        z /= sum_exp.unsqueeze(1)  # softmax of the local columns, kept for backward
        ctx.save_for_backward(z, idx, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax  # reused in place: the graph holds it only for this backward (as Megatron does)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, idx] -= mine.to(grad.dtype)
        grad *= torch.where(valid, grad_loss, 0.0).unsqueeze(1)
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup,
    *,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
    timer: WaitTimer = untimed,
) -> torch.Tensor:
    """Mean cross-entropy over targets != ignore_index; ``logits`` (..., V/tp) are this rank's columns.

    Every rank of ``group`` returns the same loss, and the gradient of its own columns. ``timer`` spans the
    waits on the group's all-reduces.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    per_row = _VocabParallelCrossEntropy.apply(
        flat, targets.reshape(-1), group, vocab_start, vocab_size, ignore_index, timer
    )
    return per_row.sum() / (targets != ignore_index).sum()
