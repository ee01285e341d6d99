# Data-parallel gradient averaging (ZeRO stage 0) for plain and DTensor parameters, overlapped with backward.
#
# Why this exists: torch's DistributedDataParallel cannot take DTensor parameters (our tensor-parallel GPT
# has nothing else: Shard for split weights, Replicate for norms), and FSDP2 is ZeRO-3, not plain data
# parallelism. What DDP does for plain tensors is what Megatron-LM calls overlap_grad_reduce: gradients are
# grouped into buckets, and each bucket is all-reduced over the data-parallel group as soon as backward has
# produced all of its gradients, while backward goes on computing the earlier layers' gradients.
#
# Mechanism. Parameters are bucketed in reverse order of the sequence given (model.parameters() runs from
# the embedding to the head; backward produces gradients roughly from the head back), up to bucket_size_mb
# of reduce_dtype per bucket; a larger parameter gets a bucket of its own. A post-accumulate-grad hook on each
# parameter marks it ready; when a bucket is complete its gradients are copied into one flat buffer (the
# LOCAL tensor of a DTensor gradient: across the data-parallel group every rank holds the same slice, since
# data-parallel ranks share their tensor-parallel coordinate) and an asynchronous all-reduce (SUM) starts.
# finish(), after backward, launches what is left, waits, divides by the group size and copies the averages
# back into the gradients, in the gradients' dtype (so bf16 gradients summed in fp32 are rounded once).
#
# Same collectives, same order, on every rank: gloo and NCCL match collectives by issue order, so every
# rank must issue the same all-reduces in the same order. Buckets are therefore launched strictly in bucket
# order: a complete bucket waits until all earlier buckets have been launched (as DDP does). For one graph
# the autograd engine fires the hooks in the same order on every rank, so in practice bucket i completes
# before bucket i+1 everywhere, but the launch order does not depend on that; only the timing does. A
# parameter that got no gradient this step (unused in this forward, on some or all ranks) blocks its bucket
# until finish(), which launches every remaining bucket in order (zeros standing in for the missing
# gradients, so the average is the other ranks' sum / size), so no rank skips a collective the others issue
# and nothing hangs.
#
# Every parameter is covered, whatever its requires_grad when the reducer is built: Lightning's
# BaseFinetuning freezes a backbone before training and unfreezes it later, and a frozen parameter left out
# would never be averaged again (DDP's reducer has exactly that defect). Parameters frozen at construction
# get buckets of their own, and a bucket none of whose parameters requires grad or holds one is skipped
# (no collective): a frozen backbone costs nothing. requires_grad must therefore be the same on every rank,
# as it is for code that freezes by name, by epoch or by step (and for Lightning's toggle_optimizer).
#
# Parameters that got no gradient on ANY rank keep p.grad None, as on one process and as DDP's locally-used
# map does: the optimizer then skips them (no momentum, no weight decay for a frozen, skipped or unused
# parameter). Which ones those are takes one small all-reduce (MAX) per step of a flag per parameter,
# issued after the last bucket; a rank that had every gradient itself needs no answer and does not wait.
#
# Scattered (scatter=True, ZeRO-1 at DDP's bytes, as Megatron's distributed optimizer): each bucket's buffer
# is padded to a multiple of the group size and reduce-scattered instead of all-reduced, so rank r receives
# the average of elements [r*c, (r+1)*c) of the bucket (c = padded size / group size), whatever parameters
# they belong to: balanced to the element, a parameter may be cut between ranks. finish() writes those
# averages into the gradients and zeros everywhere else, so every p.grad is this rank's share of the whole:
# a global norm is the sum of every rank's local squares (clip with sum_group = the dp group), and
# `shard_range(p)` says which flat elements of p this rank holds. Buckets then also group parameters of
# one dtype only, so the updated values can travel back in their own dtype (all-gather, `sharded_step.py`).
#
# A bucket is all-reduced instead (same layout, every rank the whole average; the pieces are still what is
# stepped) where a piece would be wrong: with `whole = True`, when user code reads gradients (a logged
# grad norm, its own clip_grad_norm_, manual optimization: ZeRO-1 then costs 1.5x DDP's bytes), and for a
# bucket holding a parameter that requires grad but that no sharded step steps (`set_stepped`): its gradient
# is not zeroed by any optimizer, so the next backward accumulates into it, and only a whole average
# accumulates right (a piece plus the next local gradient would be reduced to the piece / size).
#
# Buffers are released as buckets are reduced: launching a bucket first completes every launched bucket but
# the last IN_FLIGHT (waiting for its collective, which overlap has usually finished by then, and writing its
# averages into the gradients), so at most IN_FLIGHT + 1 flat buffers live during backward, whatever the
# model's size — what the planner counts (plan/memory.py imports IN_FLIGHT). Before, every bucket's
# buffer stayed alive to the end of backward: one more copy of the gradients in reduce_dtype (ZeRO-0), and
# the reduce-scatter's outputs as well (ZeRO-1: 1.5x at dp2). A bucket with a parameter that had no gradient
# here waits for finish() (it needs the other ranks' flags); only finish() launches such buckets anyway.
#
# Not done (DDP's gradient_as_bucket_view): gradients are copied into the flat buffer and back rather than
# living in it, which costs one bucket-sized buffer per in-flight bucket and two copies (scattered: only each
# rank's piece is copied back, the rest of a gradient zeroed), and leaves the gradients ordinary tensors that
# optimizers, clipping and FSDP-style code can hold as they like.

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.core._dtensor import local
from megascale.core.parallel.tp.comm import reduce_scatter_flat
from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["BucketedGradReduce"]

_MIB = 1024 * 1024
IN_FLIGHT = 2  # launched buckets whose reduction may still be outstanding while backward goes on (header)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    dtype: torch.dtype  # of the flat buffer
    device: torch.device
    numel: int
    param_dtype: torch.dtype | None = None
    first: int = 0  # index of its first parameter in the flag vector (all buckets' parameters in order)
    ready: int = 0
    done: bool = False  # reduced and written into the gradients, buffers released
    flat: Tensor | None = None
    work: Any = None  # the async all-reduce's handle once launched
    chunk: Tensor | None = None  # scatter: this rank's part of the reduce-scatter
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # local numel of each parameter
    # this step: no collective (no parameter requires grad or holds one), and the positions (in params) of
    # the parameters that had no gradient on this rank when the bucket was launched
    skipped: bool = False
    missing: list[int] = field(default_factory=list)
    # scatter: parameters no sharded step steps (their gradients must stay whole: see the header)
    orphans: list[nn.Parameter] = field(default_factory=list)

    def padded(self, world_size: int) -> int:
        """Elements of the buffer reduce-scattered: ``numel`` rounded up to a multiple of ``world_size``."""
        return -(-self.numel // world_size) * world_size

    def idle(self) -> bool:
        """No parameter requires grad or holds a gradient (the same on every rank): nothing to reduce."""
        return not any(p.requires_grad or p.grad is not None for p in self.params)


class BucketedGradReduce:
    """Average gradients over a data-parallel group in buckets, overlapping the all-reduces with backward.

    The ZeRO stage 0 of this project (DDP's job) for models whose parameters are DTensors (tensor parallel)
    and/or plain tensors. Use::

        reducer = BucketedGradReduce(list(model.parameters()), dp_group)
        for micro_batch in accumulation[:-1]:
            with reducer.no_sync():
                model(micro_batch).backward()
        model(accumulation[-1]).backward()  # buckets are all-reduced as their gradients appear
        reducer.finish()                    # every p.grad is now the average over the group
        optimizer.step()

    Every rank of ``group`` must construct it with the same parameters in the same order (shapes of the
    local tensors equal across the group), and keep ``requires_grad`` of each the same on every rank.

    Args:
        params: the parameters whose gradients to average, whatever their ``requires_grad`` now (frozen ones
            are covered once they train); one listed twice (tied weights) counts once.
        group: the data-parallel process group.
        bucket_size_mb: most MiB (of ``reduce_dtype``) per bucket; a larger parameter gets a bucket alone.
        overlap: launch each bucket's all-reduce from backward as soon as it is complete (True), or
            reduce every bucket in ``finish()`` (False).
        reduce_dtype: dtype of the sum; None for the gradients' own dtype. The fp32 default keeps bf16
            gradients from losing precision in the sum.
        accumulations: how many times each gradient is accumulated in one synchronised backward — one per
            microbatch when a pipeline schedule runs several backward passes per step; a bucket is launched
            after the last of them.
        scatter: reduce-scatter each bucket instead of all-reducing it: afterwards each rank's gradients
            hold the averages of its ``shard_range`` only, zeros elsewhere (ZeRO-1; see the file header).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
        reduce_dtype: torch.dtype | None = torch.float32,
        accumulations: int = 1,
        scatter: bool = False,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        if accumulations < 1:
            raise ValueError(f"accumulations must be >= 1, got {accumulations}")
        self.accumulations = accumulations
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.overlap = overlap
        self.reduce_dtype = reduce_dtype
        self.scatter = scatter
        #: scatter: all-reduce every bucket, so that every p.grad user code reads is the whole average (the
        #: pieces are still what the sharded steps step); set where user code reads gradients
        self.whole = False
        self.wait_timer: WaitTimer = untimed  # around the wait for what backward left outstanding
        self.rank = dist.get_rank(group) if scatter else 0
        self._sync = True
        self._next_launch = 0
        self._next_release = 0  # the first launched bucket whose averages are not yet in the gradients
        seen: set[int] = set()
        unique = []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.buckets = self._make_buckets(unique[::-1], int(bucket_size_mb * _MIB))
        self._bucket_of: dict[int, int] = {
            id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params
        }
        self._num_params = len(unique)
        self._stepped: dict[int, set[int]] = {}  # scatter: id(sharded step) -> ids of the parameters it steps
        self._refreshers: dict[int, Callable[[], None]] = {}
        self._update_orphans()
        self._flags_pending: tuple[Tensor, Any] | None = None  # the last step's flags, when nobody read them
        self._arrived: dict[int, int] = {}  # id(param) -> gradient accumulations seen in this backward
        self._handles: list[Any] = []
        # hooks cannot be registered on a tensor without requires_grad: frozen ones get theirs once they train
        self._unhooked: list[nn.Parameter] = []
        if overlap:
            self._unhooked = [p for p in unique if not p.requires_grad]
            self._handles = [
                p.register_post_accumulate_grad_hook(self._on_grad) for p in unique if p.requires_grad
            ]

    def _make_buckets(self, params: list[nn.Parameter], capacity: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        for first, p in enumerate(params):
            # Sizes of the local tensor (a DTensor's shard): what is actually reduced.
            shard = local(p.detach())
            dtype = self.reduce_dtype or p.dtype
            last = buckets[-1] if buckets else None
            fits = (
                last is not None
                and last.dtype == dtype
                and (not self.scatter or last.param_dtype == shard.dtype)
                and last.device == shard.device
                # frozen parameters apart: a bucket of them is skipped while they stay frozen
                and last.params[-1].requires_grad == p.requires_grad
                and (last.numel + shard.numel()) * dtype.itemsize <= capacity
            )
            if not fits:  # a parameter larger than capacity gets a bucket of its own
                last = _Bucket([], dtype, shard.device, 0, param_dtype=shard.dtype, first=first)
                buckets.append(last)
            assert last is not None
            last.offsets.append(last.numel)
            last.sizes.append(shard.numel())
            last.params.append(p)
            last.numel += shard.numel()
        return buckets

    def shard_range(self, p: Tensor) -> tuple[int, int]:
        """scatter=True: the elements ``[start, stop)`` of ``local(p).view(-1)`` whose averages this rank
        receives (possibly empty); a parameter this reducer does not cover raises KeyError."""
        bucket = self.buckets[self._bucket_of[id(p)]]
        offset = next(o for q, o in zip(bucket.params, bucket.offsets) if q is p)
        chunk = bucket.padded(self.world_size) // self.world_size
        lo, hi = self.rank * chunk, (self.rank + 1) * chunk
        numel = local(p).numel()
        start, stop = min(max(lo - offset, 0), numel), min(max(hi - offset, 0), numel)
        return start, max(start, stop)

    def gradient_piece(self, p: Tensor) -> tuple[int, int] | None:
        """``shard_range(p)`` where ``p.grad`` holds this rank's piece only after ``finish()``; None where it
        is whole (not scattered, ``whole``, or no sharded step steps it) or not reduced here."""
        if not self.scatter or self.whole or not self.covers(p):
            return None
        bucket = self.buckets[self._bucket_of[id(p)]]
        if any(q is p for q in bucket.orphans):
            return None
        return self.shard_range(p)

    def covers(self, p: Tensor) -> bool:
        """Whether ``p``'s gradient is reduced here."""
        return id(p) in self._bucket_of

    def set_stepped(
        self, key: object, params: Sequence[Tensor], refresh: Callable[[], None] | None = None
    ) -> None:
        """scatter: ``params`` are stepped in pieces by ``key`` (a ``ShardedOptimizerStep``; an empty list when
        it is removed). A bucket holding a trainable parameter that no key steps is all-reduced (header).
        ``refresh`` is called at the start of every ``finish()``: ``key`` calls ``set_stepped`` again there if
        its optimizer's parameters changed since (a param group added before this step's backward)."""
        if params:
            self._stepped[id(key)] = {id(p) for p in params}
        else:
            self._stepped.pop(id(key), None)
        if refresh is not None:
            self._refreshers[id(key)] = refresh
        elif not params:
            self._refreshers.pop(id(key), None)
        self._update_orphans()

    def _update_orphans(self) -> None:
        if not self.scatter:
            return
        stepped = set().union(*self._stepped.values())
        for bucket in self.buckets:
            bucket.orphans = [p for p in bucket.params if id(p) not in stepped]

    # ---- backward side ----------------------------------------------------------------------------------

    def _on_grad(self, p: Tensor) -> None:
        if not self._sync:
            return  # accumulating locally (no_sync): the last backward reduces the sums
        b = self._bucket_of[id(p)]
        bucket = self.buckets[b]
        arrived = self._arrived.get(id(p), 0) + 1
        if bucket.work is not None or arrived > self.accumulations:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket was already reduced or marked ready: call "
                "finish() after each synchronised backward, and run all but the last backward of an "
                "accumulation inside no_sync()"
            )
        self._arrived[id(p)] = arrived
        if arrived < self.accumulations:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Strictly in bucket order: every rank issues the same all-reduces in the same order (header). A bucket
        # of frozen parameters never completes; being idle on every rank alike, it is skipped, not waited for.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                if not bucket.idle():
                    return
                bucket.skipped = True
            else:
                if self._next_launch == 0:
                    self._refresh()  # the optimizers' parameters as of this backward, before any launch
                self._release_reduced(keep=IN_FLIGHT)
                self._launch(bucket)
            self._next_launch += 1

    def _refresh(self) -> None:
        for refresh in list(self._refreshers.values()):
            refresh()  # orphans as of now: an all-reduced bucket still gives pieces to what is stepped now

    def _release_reduced(self, keep: int) -> None:
        """Complete the launched buckets, in order, but the last ``keep`` (see the header); stops at a bucket
        that lacks a gradient here (finish() completes it, with the other ranks' flags)."""
        while self._next_release < self._next_launch - keep:
            bucket = self.buckets[self._next_release]
            if not bucket.skipped:
                if bucket.missing:
                    return
                with self.wait_timer("grad-reduce"):
                    self._complete(bucket, set())
            self._next_release += 1

    def _whole(self, bucket: _Bucket) -> bool:
        """scatter: whether ``bucket`` is all-reduced this step (its gradients left whole: see the header)."""
        return self.whole or any(p.requires_grad or p.grad is not None for p in bucket.orphans)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        size = bucket.padded(self.world_size) if self.scatter else bucket.numel
        flat = torch.empty(size, dtype=bucket.dtype, device=bucket.device)
        flat[bucket.numel :].zero_()
        for i, p in enumerate(bucket.params):
            offset, numel = bucket.offsets[i], bucket.sizes[i]
            if p.grad is None:
                # No gradient here: zeros stand in, so the average is the other ranks' sum / size.
                flat[offset : offset + numel].zero_()
                bucket.missing.append(i)
                continue
            flat[offset : offset + numel].copy_(local(p.grad).reshape(-1))
        bucket.flat = flat
        if self.scatter and not self._whole(bucket):
            bucket.chunk = flat.new_empty(size // self.world_size)
            bucket.work = reduce_scatter_flat(
                bucket.chunk, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        else:
            bucket.work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce whatever backward has not, wait, and write the group averages into every ``p.grad``.

        Call after the (last) backward of a step. A parameter that got a gradient on no rank keeps
        ``p.grad`` None (the optimizer skips it, as on one process); one that got it on some ranks only gets
        their sum / size. Inside ``no_sync()`` this does nothing: the gradients stay the local sums.
        """
        if not self._sync or not self.buckets:
            return
        self._wait_flags()
        self._refresh()
        for bucket in self.buckets[self._next_launch :]:
            if bucket.idle():
                bucket.skipped = True
            else:
                self._launch(bucket)
        self._next_launch = len(self.buckets)
        if self._unhooked:
            self._hook_unfrozen()
        flags = self._launch_flags()
        with self.wait_timer("grad-reduce"):
            self._complete_all(self._received_flags(flags))

    def _launch_flags(self) -> tuple[Tensor, Any, bool]:
        """All-reduce (MAX) a flag per parameter, 1 where this rank holds a gradient: afterwards 1 where any
        rank does. Returns (flags, work, whether this rank needs the answer)."""
        device = self.buckets[0].device
        flags = torch.ones(self._num_params, dtype=torch.uint8, device=device)
        missing: list[int] = []
        for bucket in self.buckets:
            if bucket.skipped:
                flags[bucket.first : bucket.first + len(bucket.params)] = 0
            else:
                missing.extend(bucket.first + i for i in bucket.missing)
        if missing:
            flags[torch.tensor(missing, device=device)] = 0
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return flags, work, bool(missing)

    def _received_flags(self, launched: tuple[Tensor, Any, bool]) -> list[int] | None:
        """The flags of every parameter where this rank lacks some gradient (None where it lacks none: every
        parameter of a reduced bucket then has a gradient here, so none is None anywhere)."""
        flags, work, needed = launched
        if not needed:
            self._flags_pending = (flags, work)  # waited for at the next finish(): nobody reads it
            return None
        work.wait()
        return flags.tolist()

    def _wait_flags(self) -> None:
        if self._flags_pending is not None:
            self._flags_pending[1].wait()
            self._flags_pending = None

    def _hook_unfrozen(self) -> None:
        """Parameters frozen when the reducer was built that now train get their hooks (overlap from the
        next backward on; until then their buckets are launched by finish())."""
        frozen = []
        for p in self._unhooked:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            else:
                frozen.append(p)
        self._unhooked = frozen

    def _complete_all(self, flags: list[int] | None) -> None:
        try:
            for bucket in self.buckets:
                if not bucket.skipped and not bucket.done:
                    self._complete(bucket, self._absent(bucket, flags))
        finally:
            self._reset()

    def _complete(self, bucket: _Bucket, absent: set[int]) -> None:
        """Wait for ``bucket``'s collective, write the averages into its gradients (not those ``absent``: no
        rank had them; nor those dropped since the launch, on every replica alike: the zeros a pipeline stage
        got from a later stage the loss did not reach, ``pp/unreached.py``) and release its buffers."""
        assert bucket.work is not None and bucket.flat is not None
        bucket.work.wait()
        if bucket.chunk is not None:
            self._write_pieces(bucket, bucket.chunk.div_(self.world_size), absent)
        else:
            bucket.flat.div_(self.world_size)
            if self.scatter and not self.whole:  # all-reduced for an orphan: the others still get pieces
                self._write_pieces(bucket, self._my_chunk(bucket), absent, whole=bucket.orphans)
            else:
                for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                    if i not in absent and p.grad is not None:  # None: dropped since its launch (below)
                        g = local(p.grad)
                        g.copy_(bucket.flat[offset : offset + g.numel()].view_as(g))
        bucket.done, bucket.flat, bucket.work, bucket.chunk = True, None, None, None

    def _absent(self, bucket: _Bucket, flags: list[int] | None) -> set[int]:
        """Positions of ``bucket``'s parameters that got a gradient on no rank (they keep p.grad None); those
        that got one on other ranks only are given a zero gradient to receive the average into."""
        absent = set()
        for i in bucket.missing:
            assert flags is not None  # this rank lacked a gradient, so it waited for the flags
            p = bucket.params[i]
            if flags[bucket.first + i]:
                p.grad = torch.zeros_like(p)
            else:
                absent.add(i)
        return absent

    def _my_chunk(self, bucket: _Bucket) -> Tensor:
        assert bucket.flat is not None
        size = bucket.flat.numel() // self.world_size
        return bucket.flat[self.rank * size : (self.rank + 1) * size]

    def _write_pieces(
        self, bucket: _Bucket, chunk: Tensor, absent: set[int], whole: Sequence[Tensor] = ()
    ) -> None:
        """Scattered: each gradient gets this rank's averages in its piece and zeros around it, written
        directly (only the piece is copied, only the rest zeroed); those in ``whole`` get the whole average
        (``bucket.flat``, all-reduced)."""
        first = self.rank * chunk.numel()
        whole_ids = {id(q) for q in whole}
        for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            if i in absent or p.grad is None:  # None: dropped since its launch (below)
                continue
            g = local(p.grad)
            numel = g.numel()
            if id(p) in whole_ids:
                assert bucket.flat is not None
                g.copy_(bucket.flat[offset : offset + numel].view_as(g))
                continue
            start = min(max(first - offset, 0), numel)
            stop = max(start, min(first + chunk.numel() - offset, numel))
            contiguous = g.is_contiguous()
            flat = g.view(-1) if contiguous else torch.empty(numel, dtype=g.dtype, device=g.device)
            if start > 0:
                flat[:start].zero_()
            if stop < numel:
                flat[stop:].zero_()
            if stop > start:
                flat[start:stop].copy_(chunk[offset + start - first : offset + stop - first])
            if not contiguous:
                g.copy_(flat.view_as(g))

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready, bucket.flat, bucket.work, bucket.chunk = 0, None, None, None
            bucket.skipped = bucket.done = False
            if bucket.missing:
                bucket.missing = []
        self._arrived.clear()
        self._next_launch = self._next_release = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this context accumulates gradients locally; the next backward outside it (and
        its ``finish()``) reduces the accumulated sums, as ``DistributedDataParallel.no_sync`` does."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def remove(self) -> None:
        """Unregister the gradient hooks (``finish()`` still reduces every bucket if called)."""
        self._wait_flags()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unhooked = []
