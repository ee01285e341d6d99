"""ZeRO stage 1: each data-parallel rank keeps the optimizer state of the parameters it owns.

The stages together are described in ``megascale.core.parallel.zero``; this file is stage 1's mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from megascale.core._dtensor import local
from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["OptimizerStateSharding", "init_optimizer_state", "optimizer_params", "register_unit_waits"]

_MIB = 1024 * 1024


def optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in group order, each once."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@torch.no_grad()
def init_optimizer_state(optimizer: Optimizer, params: Iterable[Tensor]) -> None:
    """Create optimizer state for each of ``params`` that has none yet, and for no other parameter: one step
    with zero gradients at learning rate 0 over them alone, which changes no parameter (nor, for torch's
    optimizers and LAMB, any state but the step count of a fresh state, which a following load overwrites).
    Gradients and learning rates are restored after."""
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return
    everything = optimizer_params(optimizer)
    grads = {id(p): p.grad for p in everything}
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in everything:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in everything:
            p.grad = grads[id(p)]


def _local_nbytes(t: Tensor) -> int:
    shard = local(t)
    return shard.numel() * shard.element_size()


# Why this shape. ZeroRedundancyOptimizer (torch's ZeRO-1) builds a second optimizer over each rank's share,
# which hides the user's optimizer from LR schedulers and Lightning, and it broadcasts whole parameters, which
# breaks on DTensors. Here the user's optimizer stays as it is. Every parameter has one owner in the dp
# group; before optimizer.step(), the other ranks drop its gradient (p.grad = None). torch optimizers skip
# parameters without a gradient and create state only for those they step (AdamW: _init_group skips
# p.grad None, in the for-loop, foreach and fused paths alike; megascale LAMB: _collect skips them), so each
# rank holds the state of its own parameters only: ~1/dp of the whole. After the step, owners broadcast
# their updated parameters, bucketed.
#
# Ownership is a function of the ordered parameter list, each parameter's global size and dtype, and the dp
# size only: greedy, largest first (ties by order), to the least-loaded rank (ties to the lowest). It is not
# the local size: for a DTensor p.numel() is the global size, equal on every rank even where shards are
# uneven. Therefore the ranks of one tensor-parallel group, which share their dp rank, own exactly the same
# parameters. That is what LAMB needs: it all-reduces the trust-ratio norms of the DTensors it steps over
# their TP mesh, so every rank of that mesh must step the same parameters, in the same order.
#
# Parameters joining the optimizer later (add_param_group, compared per group before each step) are given
# owners the same way, after those already owned, which keep theirs and so their states. Buckets none of whose
# parameters has a gradient (none on any rank: the reducer left them None) are stepped nowhere and not sent.
#
# Communication: the gradients are all-reduced beforehand (stage 0: every rank needs the whole gradient for
# the global-norm clip anyway), then owners broadcast parameters: 1.5x the traffic of plain data
# parallelism, the price of keeping the user's optimizer and gradients unchanged. Stage 2 (reduce-scatter,
# FSDP2) is the way to cut it.
#
# Overlap (Megatron's overlap_param_gather): the broadcasts are launched asynchronously, in the order of the
# parameters (≈ forward order), and the next forward waits for them piecewise: a forward pre-hook on each
# "unit" module waits for the buckets holding the parameters of its subtree (minus those of nested units) and
# copies the received values in. Units are modules whose forward reads only parameters of their own
# subtree. Not every module qualifies: the grouped linears of our GPT (FanOutLinear, ColumnParallelLinear)
# read their child Projection modules' weights without calling them, so hooks that waited for each module's
# direct parameters would never wait for those. The default units of a megascale GPT are therefore
# GPT.layers() (embedding, each block, head), the root model covering everything else.


@dataclass
class _ParamBucket:
    """Parameters of one owner broadcast together as one flat buffer."""

    owner: int  # rank in the dp group
    params: list[Tensor]
    dtype: torch.dtype
    device: torch.device
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    first: int = 0  # index of its first parameter in the optimizer's order


class OptimizerStateSharding:
    """ZeRO stage 1 around an existing optimizer: each dp rank keeps the optimizer state of its own share.

    The optimizer is not replaced (LR schedulers, Lightning and checkpoint code keep using it); this object
    decides who owns which parameter and moves the updated values. A training step::

        loss.backward(); reducer.finish()           # gradients averaged over dp (BucketedGradReduce)
        clip_grad_norm_(model.parameters(), 1.0)    # needs every gradient: before dropping any
        zero1.drop_unowned_grads()                  # p.grad = None where another rank owns p
        optimizer.step()                            # steps (and keeps state for) owned parameters only
        zero1.broadcast_updated()                   # owners send the new values; the next forward waits
        optimizer.zero_grad()

    Call ``wait()`` before reading parameters outside a forward of ``module`` (checkpointing, validation
    that bypasses the model's forward, comparing weights). The optimizer's state dict on each rank holds its
    own share only.

    Every rank of ``group`` must pass the same optimizer parameters in the same order; tensor-parallel
    ranks of one dp rank then own the same parameters (see the comment above the class).

    Args:
        optimizer: any torch optimizer that skips parameters whose ``grad`` is None (all of torch's, LAMB).
        module: the model; forward pre-hooks on it (and ``units``) wait for the broadcasts.
        group: the data-parallel process group.
        overlap_param_gather: launch the broadcasts asynchronously and wait for each unit's parameters just
            before its forward (True), or wait in ``broadcast_updated()`` (False).
        bucket_size_mb: most MiB per broadcast bucket (a larger parameter gets one alone).
        units: modules whose forward pre-hooks wait for their subtree's parameters (minus nested units');
            each must read only parameters of its own subtree. None: ``module.layers()`` if the module has
            such a method (a megascale GPT), else ``module`` alone. ``module`` is always a unit.
        covers: which of the optimizer's parameters this sharding takes (None: all); the others are left to
            another one over another group (a mixture of experts' experts, replicated over fewer ranks).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        module: nn.Module,
        group: dist.ProcessGroup,
        *,
        overlap_param_gather: bool = True,
        bucket_size_mb: float = 25.0,
        units: Iterable[nn.Module] | None = None,
        covers: Callable[[Tensor], bool] | None = None,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.optimizer = optimizer
        self.module = module
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.overlap_param_gather = overlap_param_gather
        self._covers = covers
        self._capacity = int(bucket_size_mb * _MIB)
        self.params: list[Tensor] = []
        self._owner: dict[int, int] = {}
        self._pending: dict[int, tuple[Tensor, Any]] = {}  # bucket index -> (flat buffer, work)
        self._live: list[bool] | None = None  # per bucket: stepped this step (None: all)
        self._dropped: list[tuple[Tensor, Tensor]] = []  # other owners' gradients, set aside for the step
        self.wait_timer: WaitTimer = untimed  # around the next forward's waits for the broadcasts
        if units is None:
            layers = getattr(module, "layers", None)
            units = layers() if callable(layers) else []
        self._units = [module, *units]
        self._handles: list[Any] = []
        self._signature: tuple[tuple[int, int], ...] | None = None
        self.refresh()
        # Unowned parameters' state (an optimizer stepped before wrapping, a full checkpoint loaded) is freed.
        for p in self.params:
            if self._owner[id(p)] != self.rank:
                optimizer.state.pop(p, None)

    # ---- ownership and buckets --------------------------------------------------------------------------

    def refresh(self) -> None:
        """(Re)build ownership and buckets when the optimizer's parameters changed (``add_param_group``, as
        Lightning's BaseFinetuning does; compared per group before each step). Parameters already owned keep
        their owner, and with it their state; new ones go to the least-loaded ranks."""
        signature = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        if signature == self._signature:
            return
        self.wait()
        self.params = [p for p in optimizer_params(self.optimizer) if self._covers is None or self._covers(p)]
        self._owner = self._assign_owners()
        self.buckets = self._make_buckets(self._capacity)
        for handle in self._handles:
            handle.remove()
        self._handles = self._register_units(self._units)
        self._signature = signature

    def _assign_owners(self) -> dict[int, int]:
        """Kept owners (of parameters still there), then greedy for the new ones: largest first (ties by
        order), to the least-loaded rank (ties to the lowest). A function of what every rank holds alike."""
        sizes = [p.numel() * p.element_size() for p in self.params]  # global sizes (see the comment above)
        loads = [0] * self.world_size
        owner: dict[int, int] = {}
        for i, p in enumerate(self.params):
            if id(p) in self._owner:
                owner[id(p)] = self._owner[id(p)]
                loads[owner[id(p)]] += sizes[i]
        new = [i for i, p in enumerate(self.params) if id(p) not in owner]
        for i in sorted(new, key=lambda i: (-sizes[i], i)):
            r = min(range(self.world_size), key=lambda r: (loads[r], r))
            owner[id(self.params[i])] = r
            loads[r] += sizes[i]
        return owner

    def _make_buckets(self, capacity: int) -> list[_ParamBucket]:
        buckets: list[_ParamBucket] = []
        for r in range(self.world_size):
            current: _ParamBucket | None = None
            for i, p in enumerate(self.params):
                if self._owner[id(p)] != r:
                    continue
                shard = local(p.detach())
                fits = (
                    current is not None
                    and current.dtype == shard.dtype
                    and current.device == shard.device
                    and (current.numel + shard.numel()) * shard.element_size() <= capacity
                )
                if not fits:
                    current = _ParamBucket(r, [], shard.dtype, shard.device, first=i)
                    buckets.append(current)
                assert current is not None
                current.offsets.append(current.numel)
                current.params.append(p)
                current.numel += shard.numel()
        # Launch order = order of the first parameter (≈ forward order), identical on every rank.
        buckets.sort(key=lambda b: b.first)
        return buckets

    def owner_of(self, p: Tensor) -> int:
        """The rank (in ``group``) that steps ``p`` and broadcasts its new values."""
        return self._owner[id(p)]

    def owned_params(self) -> list[Tensor]:
        """This rank's parameters, in the optimizer's order."""
        return [p for p in self.params if self._owner[id(p)] == self.rank]

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank (local shards of DTensor state)."""
        return sum(
            _local_nbytes(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor)
        )

    def init_owned_state(self) -> None:
        """Create optimizer state for every owned parameter that has none yet, and for no other.

        Checkpointing needs it: ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` creates
        state for all parameters when the optimizer has none, and a template for loading must hold exactly
        the states this rank owns (``init_optimizer_state``).
        """
        self.refresh()
        init_optimizer_state(self.optimizer, self.owned_params())

    # ---- the step ---------------------------------------------------------------------------------------

    def drop_unowned_grads(self) -> None:
        """``p.grad = None`` for every parameter another rank owns, so ``optimizer.step()`` neither steps
        them nor creates state for them (``broadcast_updated`` gives them back). Call after the gradients were
        averaged and clipped."""
        self.refresh()
        # A bucket none of whose parameters has a gradient (none on any rank: the reducer left them None) is
        # stepped nowhere: nothing to broadcast.
        self._live = []
        for bucket in self.buckets:
            self._live.append(any(p.grad is not None for p in bucket.params))
            if bucket.owner != self.rank:
                for p in bucket.params:
                    if p.grad is not None:
                        self._dropped.append((p, p.grad))
                    p.grad = None

    @torch.no_grad()
    def broadcast_updated(self) -> None:
        """After ``optimizer.step()``: owners broadcast their updated parameters to the rest of ``group``.

        With ``overlap_param_gather`` the broadcasts run in the background and the next forward waits for
        each unit's buckets; otherwise this waits for all of them.
        """
        self.wait()  # a previous gather that no forward consumed: finish it before sending new values
        # the whole averages again, as on one process until the next zero_grad (code reading them after the step)
        for p, grad in self._dropped:
            if p.grad is None:
                p.grad = grad
        self._dropped = []
        live, self._live = self._live, None
        for b, bucket in enumerate(self.buckets):
            if live is not None and not live[b]:
                continue
            if bucket.owner == self.rank:
                flat = torch.cat([local(p).reshape(-1) for p in bucket.params])
            else:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            work = dist.broadcast(flat, group=self.group, group_src=bucket.owner, async_op=True)
            self._pending[b] = (flat, work)
        if not self.overlap_param_gather:
            self.wait()

    @torch.no_grad()
    def _complete(self, b: int) -> None:
        flat, work = self._pending.pop(b)
        work.wait()
        bucket = self.buckets[b]
        if bucket.owner == self.rank:
            return  # the owner's parameters hold the new values already
        for p, offset in zip(bucket.params, bucket.offsets):
            target = local(p)
            target.copy_(flat[offset : offset + target.numel()].view_as(target))

    def wait(self) -> None:
        """Finish every pending broadcast, so that all parameters hold their updated values."""
        for b in sorted(self._pending):
            self._complete(b)

    # ---- units: forward pre-hooks ------------------------------------------------------------------------

    def _register_units(self, units: list[nn.Module]) -> list[Any]:
        bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        return register_unit_waits(units, bucket_of, self._wait_buckets)

    def _wait_buckets(self, buckets: Iterable[int]) -> None:
        waiting = [b for b in buckets if b in self._pending]
        if waiting:
            with self.wait_timer("param-gather"):
                for b in waiting:
                    self._complete(b)

    def remove(self) -> None:
        """Remove the forward pre-hooks (call ``wait()`` first if a gather may be pending)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def register_unit_waits(
    units: list[nn.Module], bucket_of: dict[int, int], wait_for: Callable[[list[int]], None]
) -> list[Any]:
    """Forward pre-hooks that call ``wait_for(buckets)`` with the buckets (``bucket_of``: id(parameter) ->
    bucket) holding the parameters of each unit's subtree, minus those of units nested in it."""
    unique: list[nn.Module] = []
    for u in units:
        if all(u is not v for v in unique):
            unique.append(u)
    handles = []
    for u in unique:
        inside = {id(m) for m in u.modules()}
        nested = [v for v in unique if v is not u and id(v) in inside]
        others = {id(p) for v in nested for p in v.parameters()}
        buckets = sorted(
            {bucket_of[id(p)] for p in u.parameters() if id(p) in bucket_of and id(p) not in others}
        )
        if buckets:

            def pre_hook(module: nn.Module, args: Any, buckets: list[int] = buckets) -> None:
                wait_for(buckets)

            handles.append(u.register_forward_pre_hook(pre_hook, prepend=True))
    return handles
