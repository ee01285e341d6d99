"""``whole_gradients``: inside, a sharded DTensor gradient reads whole on every rank (``float(p.grad.norm())``
is the whole norm, not this rank's share); outside, it is split as before, keeping what the reader wrote (its
own clipping). The conformance matrix's "read-grads" cells prove it inside a fit."""

from __future__ import annotations

from tests._dist import run_distributed


def _read_and_scale(rank: int, world_size: int) -> tuple[float, float, float, str, list[float]]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megascale.lightning.whole_gradients import whole_gradients

    mesh = init_device_mesh("cpu", (world_size,))
    whole = torch.arange(8.0).reshape(4, 2)
    p = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    p.grad = distribute_tensor(whole, mesh, [Shard(0)])
    plain = nn.Parameter(torch.zeros(3))
    plain.grad = torch.ones(3)
    shard_norm = float(p.grad.norm())  # what a reader gets without it: this rank's share
    with whole_gradients([p, plain]):
        read = float(p.grad.norm())
        p.grad.mul_(0.5)  # a reader's own clipping
    after = p.grad
    return (
        shard_norm,
        read,
        float(plain.grad.sum()),
        str(after.placements),
        after.to_local().flatten().tolist(),
    )


def test_a_sharded_gradient_reads_whole_inside_and_keeps_what_was_written() -> None:
    import math

    results = run_distributed(_read_and_scale, 2)
    want = math.sqrt(sum(v * v for v in range(8)))
    for rank, (shard_norm, read, plain, placements, local) in enumerate(results):
        assert shard_norm != want  # the trap: without it a rank reads its share
        assert abs(read - want) < 1e-5
        assert plain == 3.0
        assert placements == "(Shard(dim=0),)"
        assert local == [0.5 * v for v in range(4 * rank, 4 * rank + 4)]
