"""ZeRO-0/1 gradient buckets are released as they are reduced (issue 24, item 4): during backward at most
IN_FLIGHT + 1 flat buffers are alive, whatever the number of buckets, and the averages are unchanged.

Measured with ``LiveTensorMeter`` around the second step's backward and ``finish()`` (the gradients exist from
the first step, so what it sees is the reduction's buffers and backward's transients). A chain of 12 linear
layers, each weight (64 x 64, 16 KiB) a bucket of its own: keeping every buffer to the end of backward, as
before, holds ~12 buckets (ZeRO-1 at dp2: ~18); released, about IN_FLIGHT + 1 at any time.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megascale.core.memory_meter import LiveTensorMeter
from megascale.core.parallel.zero.grad_reduce import IN_FLIGHT, BucketedGradReduce
from tests._dist import run_distributed

LAYERS, WIDTH = 12, 64
BUCKET_BYTES = WIDTH * WIDTH * 4  # one weight per bucket (the biases: buckets of their own, 256 B)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _worker(rank: int, world: int, scatter: bool) -> dict:
    model = _model()
    reducer = BucketedGradReduce(list(model.parameters()), dist.group.WORLD, bucket_size_mb=BUCKET_BYTES / 2**20,
                                 scatter=scatter)  # fmt: skip
    stepper = object()  # stands for a ZeRO-1 sharded step that steps every parameter in pieces
    if (
        scatter
    ):  # (a parameter no sharded step steps is an orphan, its bucket all-reduced: see grad_reduce.py)
        reducer.set_stepped(stepper, list(model.parameters()))
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(rank))  # one row: tiny activations
    model(x).sum().backward()
    reducer.finish()
    for p in model.parameters():
        p.grad.zero_()  # kept: the next backward accumulates into them, allocating nothing
    with LiveTensorMeter() as meter:
        model(x).sum().backward()
        reducer.finish()
    return {"peak": meter.peak, "grads": [p.grad.clone() for p in model.parameters()],
            "shards": [reducer.shard_range(p) for p in model.parameters()] if scatter else None}  # fmt: skip


@pytest.mark.parametrize("scatter", [False, True], ids=["ZeRO-0 all-reduce", "ZeRO-1 reduce-scatter"])
def test_buffers_are_released_as_buckets_are_reduced_and_the_averages_are_unchanged(scatter: bool) -> None:
    results = run_distributed(_worker, 2, scatter, timeout=120)
    # the reference: each rank's gradient averaged, on one process
    model = _model()
    grads = []
    for rank in range(2):
        model.zero_grad()
        model(torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(rank))).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for rank, result in enumerate(results):
        for i, got in enumerate(result["grads"]):
            want = (grads[0][i] + grads[1][i]) / 2
            if scatter:  # this rank's piece of the average, zeros elsewhere
                start, stop = result["shards"][i]
                mask = torch.zeros(want.numel(), dtype=torch.bool)
                mask[start:stop] = True
                want = torch.where(mask, want.view(-1), 0.0).view_as(want)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # buffers: flat (a bucket) + ZeRO-1's chunk (half of one) for each bucket alive at once; backward's own
        # transients (activation gradients of one row, a weight gradient before it is accumulated) add ~1.
        per_bucket = BUCKET_BYTES * (1.5 if scatter else 1.0)
        assert result["peak"] <= (IN_FLIGHT + 1) * per_bucket + 2 * BUCKET_BYTES, (
            f"rank {rank}: {result['peak'] / BUCKET_BYTES:.1f} buckets' bytes alive at the peak; "
            f"{LAYERS} buckets were launched"
        )
