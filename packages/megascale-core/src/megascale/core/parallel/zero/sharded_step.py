"""ZeRO stage 1 at DDP's bytes: gradients reduce-scattered, each rank steps its piece, parameters all-gathered.

The stages together are described in ``megascale.core.parallel.zero``; this file is stage 1's default
mechanism (``zero1_sharding="elements"``), Megatron-LM's "distributed optimizer" around the user's own
optimizer. ``optimizer_state.py`` is the other (``"parameters"``): whole parameters by owner, 1.5x the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from megascale.core._dtensor import is_dtensor, local, mark_split, shard_spec
from megascale.core.parallel.tp.comm import all_gather_flat
from megascale.core.parallel.zero.grad_reduce import BucketedGradReduce
from megascale.core.parallel.zero.optimizer_state import optimizer_params, register_unit_waits

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizerStep"]

# Why this shape. The gradient buckets of stage 0 are reduce-scattered instead of all-reduced
# (BucketedGradReduce(scatter=True)): rank r receives the averages of elements [r*c, (r+1)*c) of every
# bucket, cut across parameters wherever the boundary falls, so the optimizer state is balanced to the
# element (no largest-parameter bound). Each rank then steps only those elements: around optimizer.step()
# the optimizer's parameter lists hold 1-D views into the parameters' storage (one per parameter, empty
# where the rank holds none of it), whose .grad are the matching views of the gradients, and the state of
# each parameter is moved onto its view and back. The update lands in the parameters in place; the new
# values of everyone's pieces are then all-gathered per bucket (in the parameters' dtype) and the next
# forward waits per unit, as stage 1 always did. The parameters of a bucket are views of one flat buffer in
# the bucket's layout (made at the first gather, remade if a parameter is given new storage), so the
# all-gather runs in place: this rank's piece is its input, and the other pieces land directly in the
# parameters, with no gather buffer and no copies. Bytes per step: reduce-scatter + all-gather = DDP's
# all-reduce (both are (n-1)/n of the buffer per rank, twice).
#
# What a 1-D piece changes. An elementwise optimizer (SGD, Adam, AdamW, ...) computes on a piece exactly what
# it computes on those elements of the whole. LAMB's trust ratio needs norms of whole tensors: each piece is
# marked (mark_split) as split over the dp group and the parameter's tensor-parallel groups, and LAMB sums its
# norms over them. Anything that looks at a parameter's shape (Adafactor's factored moments, Shampoo, Muon)
# would silently compute something else, so only optimizers known to be elementwise are accepted; others get
# an error that names the alternatives.
#
# What is stepped follows Lightning's contract: a parameter whose gradient is None (no rank got one: the
# reducer leaves it None) gets no piece, so its state and values stay as they are, and buckets with no such
# piece are not gathered. The optimizer's parameters are compared per group at each step (and at the
# reduction): after an add_param_group the ranges, buckets and unit waits are rebuilt. The ranges are cut from
# the reducer's buckets, which cover every parameter from the start and never change, so the states already
# kept in pieces stay valid.
#
# State between steps stays keyed by the parameter, as 1-D pieces (1/dp of the whole on each rank). Whole
# state is what checkpoints hold (DCP reshards it into any layout): `gather_state()` all-gathers the pieces
# into whole tensors (DTensors for DTensor parameters, as stage 0 keeps them) before a state dict is taken,
# and whole state, gathered or loaded, is cut back into pieces at the next step. That costs the whole
# optimizer state in memory while a checkpoint is written; a flat sharded format that avoids it is future work.

ELEMENTWISE_OPTIMIZERS: tuple[str, ...] = (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "LAMB",
)  # fmt: skip
"""Class names of optimizers whose update of an element reads only that element (LAMB's norms aside)."""


def _is_elementwise(optimizer: Optimizer) -> bool:
    kind = type(optimizer)
    if getattr(kind, "megascale_elementwise", False):
        return True
    return kind.__name__ in ELEMENTWISE_OPTIMIZERS and kind.__module__.split(".")[0] in ("torch", "megascale")


class ShardedOptimizerStep:
    """ZeRO-1 over reduce-scattered gradient buckets: each rank steps its 1/dp of every bucket.

    The user's optimizer is kept (LR schedulers, Lightning and checkpoint code see it unchanged). A step::

        loss.backward(); reducer.finish()        # BucketedGradReduce(scatter=True): each rank its averages
        clip_grad_norm_(params, 1.0, sum_group=dp_group)   # zeros outside each piece: shares add up
        zero1.begin_step()                        # the optimizer now holds this rank's pieces
        optimizer.step()                          # steps the pieces (a step post-hook ends it: end_step)
        optimizer.zero_grad()                     # the next forward waits for the all-gathered values

    ``begin_step`` also runs from a step pre-hook when ``arm()`` was called after the reduction and
    ``step()`` is given no closure, so a plain loop may leave it out. Call ``wait()`` before reading parameters outside a forward of ``module`` (the
    gathers write into them in place).

    Args:
        optimizer: an elementwise optimizer (see ``ELEMENTWISE_OPTIMIZERS``; a class of your own may declare
            ``megascale_elementwise = True``) over parameters ``reducer`` covers.
        reducer: the stage-0 gradient buckets, built with ``scatter=True``.
        module: the model; forward pre-hooks on it (and ``units``) wait for the gathers.
        overlap_param_gather: the next forward waits per unit (True) or ``end_step`` waits (False).
        units: as for ``OptimizerStateSharding``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        reducer: BucketedGradReduce,
        module: nn.Module,
        *,
        overlap_param_gather: bool = True,
        units: Iterable[nn.Module] | None = None,
    ) -> None:
        if not reducer.scatter:
            raise ValueError("ShardedOptimizerStep needs a BucketedGradReduce built with scatter=True")
        if not _is_elementwise(optimizer):
            raise ValueError(
                f"ZeRO-1 with zero1_sharding='elements' steps 1-D pieces of parameters, which gives the same "
                f"result only for elementwise optimizers ({', '.join(ELEMENTWISE_OPTIMIZERS)}); "
                f"{type(optimizer).__name__} may look at whole parameters. Use zero1_sharding='parameters' "
                "(each parameter stepped whole by one rank), zero_stage=2, or declare "
                f"{type(optimizer).__name__}.megascale_elementwise = True if it is elementwise"
            )
        self.optimizer, self.reducer, self.module = optimizer, reducer, module
        self.group, self.rank, self.world_size = reducer.group, reducer.rank, reducer.world_size
        self.overlap_param_gather = overlap_param_gather
        self._flat: dict[int, Tensor] = {}
        self._armed = False
        self._swapped: list[tuple[dict[str, Any], list[Tensor], dict[int, Tensor]]] = []
        self._whole = True  # no state yet, or whole (loaded, gathered): cut into pieces at the next step
        self._pending: dict[int, tuple[Tensor | None, Any]] = {}
        self._live: set[int] | None = None  # buckets stepped this step (None: all); the rest: not gathered
        if units is None:
            layers = getattr(module, "layers", None)
            units = layers() if callable(layers) else []
        self._units = [module, *units]
        self._waits: list[Any] = []
        self._signature: tuple[tuple[int, int], ...] | None = None
        self._refresh()
        self._step_hooks = [
            optimizer.register_step_pre_hook(lambda _, args, kwargs: self._begin_if_armed(args, kwargs)),
            optimizer.register_step_post_hook(lambda *_: self.end_step()),
        ]

    @property
    def _handles(self) -> list[Any]:
        """Every hook: the units' waits, then the optimizer's step pre- and post-hook."""
        return [*self._waits, *self._step_hooks]

    def _refresh(self) -> None:
        """(Re)build what depends on the optimizer's parameters: at construction, and whenever they changed
        (``add_param_group``, as Lightning's BaseFinetuning does; compared per group at each step). The
        ranges are cut from the reducer's buckets, which never change, so state kept in pieces stays valid."""
        signature = _param_signature(self.optimizer)
        if signature == self._signature:
            return
        self.wait()
        reducer = self.reducer
        self.params = [p for p in optimizer_params(self.optimizer) if reducer.covers(p)]
        for p in self.params:
            if not local(p).is_contiguous():
                raise ValueError(f"ZeRO-1 steps flat views of parameters; a parameter of shape "
                                 f"{tuple(p.shape)} is not contiguous")  # fmt: skip
        mine = {id(p) for p in self.params}
        self._range = {id(p): reducer.shard_range(p) for p in self.params}
        # LAMB's norms of a piece are summed over the dp group and the parameter's own tp groups.
        self._split = {id(p): (*(shard_spec(p) or ()), self.group) for p in self.params}
        self._buckets = [
            b for b, bucket in enumerate(reducer.buckets) if any(id(p) in mine for p in bucket.params)
        ]
        # Buckets whose parameters this optimizer all steps live in one flat buffer each (the parameters are
        # views of it), so their all-gather writes the new values in place: no gather buffer, no copies.
        self._whole_buckets = {
            b for b in self._buckets if all(id(p) in mine for p in reducer.buckets[b].params)
        }
        self._flat = {b: flat for b, flat in self._flat.items() if b in self._whole_buckets}
        self._bucket_of = {
            id(p): b for b in self._buckets for p in reducer.buckets[b].params if id(p) in mine
        }
        for handle in self._waits:
            handle.remove()
        self._waits = register_unit_waits(self._units, self._bucket_of, self._wait_buckets)
        reducer.set_stepped(self, self.params, refresh=self._refresh)
        self._signature = signature

    # ---- the step ---------------------------------------------------------------------------------------

    def arm(self) -> None:
        """The gradients were just reduce-scattered: the next ``optimizer.step()`` steps pieces."""
        self._armed = True

    def _begin_if_armed(self, args: tuple, kwargs: dict) -> None:
        # Not with a closure: it recomputes the gradients inside step(), after this hook (Lightning's loop,
        # which calls begin_step itself after it); the armed reduction may be of a batch that was not stepped.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer itself
        if closure is not None:
            return
        if self._armed and not self._swapped:
            self.begin_step()

    @torch.no_grad()
    def begin_step(self) -> None:
        """Put this rank's pieces (views of the parameters and their gradients) in the optimizer's place,
        each with its parameter's state (cut from whole state where that is what the optimizer holds)."""
        if self._swapped:
            return
        self.wait()  # the parameters must hold the last step's values before they are stepped again
        self._refresh()
        self._armed = False
        state = self.optimizer.state
        # Only parameters with a gradient are stepped (None: no rank got one, as on one process), and only
        # buckets holding one are gathered after the step (the same on every rank: the reducer decided).
        self._live = set()
        for group in self.optimizer.param_groups:
            originals = group["params"]
            pieces: dict[int, Tensor] = {}
            for p in originals:
                if id(p) not in self._range or p.grad is None:
                    continue
                self._live.add(self._bucket_of[id(p)])
                start, stop = self._range[id(p)]
                piece = mark_split(local(p).detach().view(-1)[start:stop], self._split[id(p)])
                piece.grad = local(p.grad).reshape(-1)[start:stop]
                saved = state.pop(p, None)
                if saved:
                    state[piece] = self._as_pieces(saved, p, start, stop)
                pieces[id(p)] = piece
            group["params"] = [pieces.get(id(p), p) for p in originals]
            self._swapped.append((group, originals, pieces))
        self._whole = False

    def _as_pieces(self, saved: dict[str, Any], p: Tensor, start: int, stop: int) -> dict[str, Any]:
        whole = local(p).shape
        out = {}
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                if is_dtensor(value) or value.shape == whole:
                    value = local(value).reshape(-1)[start:stop].clone()
                elif value.shape != (stop - start,):
                    raise RuntimeError(
                        f"{type(self.optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a "
                        f"parameter of shape {tuple(whole)}: it is not elementwise, which ZeRO-1 with "
                        "zero1_sharding='elements' needs; use zero1_sharding='parameters'"
                    )
            out[key] = value
        return out

    @torch.no_grad()
    def end_step(self) -> None:
        """After ``optimizer.step()`` (a step post-hook calls it): parameters and state back in place, and the
        updated pieces all-gathered (waited for by the next forward, or here without overlap)."""
        if not self._swapped:
            return
        state = self.optimizer.state
        for group, originals, pieces in self._swapped:
            group["params"] = originals
            for p in originals:
                piece = pieces.get(id(p))
                if piece is not None:
                    piece.grad = None
                    moved = state.pop(piece, None)
                    if moved:
                        state[p] = moved
        self._swapped = []
        self._gather_params()
        if not self.overlap_param_gather:
            self.wait()

    # ---- gathers ----------------------------------------------------------------------------------------

    def _chunk(self, b: int, values: dict[int, Tensor], dtype: torch.dtype) -> Tensor:
        """This rank's part of bucket ``b``: its pieces of ``values`` (keyed by parameter), zeros elsewhere."""
        bucket = self.reducer.buckets[b]
        size = bucket.padded(self.world_size) // self.world_size
        chunk = torch.zeros(size, dtype=dtype, device=bucket.device)
        first = self.rank * size
        for p, offset in zip(bucket.params, bucket.offsets):
            start, stop = self._range.get(id(p), (0, 0))
            if stop > start and id(p) in values:
                chunk[offset + start - first : offset + stop - first].copy_(values[id(p)])
        return chunk

    def _all_gather(self, chunk: Tensor) -> tuple[Tensor, Any]:
        full = chunk.new_empty(chunk.numel() * self.world_size)
        return full, all_gather_flat(full, chunk, group=self.group, async_op=True)

    def _flat_params(self, b: int) -> Tensor | None:
        """Bucket ``b``'s flat parameter buffer (made, or remade where a parameter was given new storage,
        e.g. ``p.data = ...``), or None where the bucket holds parameters other optimizers step."""
        if b not in self._whole_buckets:
            return None  # shared with another optimizer's parameters: values copied in and out instead
        bucket = self.reducer.buckets[b]
        flat = self._flat.get(b)
        item = bucket.param_dtype.itemsize if bucket.param_dtype is not None else 0
        if flat is not None and all(
            local(p).data_ptr() == flat.data_ptr() + offset * item
            for p, offset in zip(bucket.params, bucket.offsets)
        ):
            return flat
        flat = torch.zeros(bucket.padded(self.world_size), dtype=bucket.param_dtype, device=bucket.device)
        for p, offset in zip(bucket.params, bucket.offsets):
            values = local(p).detach()
            view = flat[offset : offset + values.numel()].view(values.shape)
            view.copy_(values)
            # A DTensor parameter's to_local() is a fresh view: its own local tensor is what must move.
            (p._local_tensor if is_dtensor(p) else p).data = view  # type: ignore[attr-defined]
        self._flat[b] = flat
        return flat

    def _gather_params(self) -> None:
        self.wait()
        live, self._live = self._live, None
        for b in reversed(self._buckets):  # buckets run from the head back: gather in forward order
            if live is not None and b not in live:
                continue  # no parameter of it was stepped on any rank: every rank holds its values
            bucket = self.reducer.buckets[b]
            flat = self._flat_params(b)
            if flat is not None:  # this rank's part is in place: gathered into the parameters themselves
                size = flat.numel() // self.world_size
                mine = flat[self.rank * size : (self.rank + 1) * size]
                self._pending[b] = (None, all_gather_flat(flat, mine, group=self.group, async_op=True))
                continue
            pieces = {}
            for p in bucket.params:
                start, stop = self._range.get(id(p), (0, 0))
                pieces[id(p)] = local(p).detach().view(-1)[start:stop]
            assert bucket.param_dtype is not None
            self._pending[b] = self._all_gather(self._chunk(b, pieces, bucket.param_dtype))

    @torch.no_grad()
    def _wait_buckets(self, buckets: Iterable[int]) -> None:
        waiting = [b for b in buckets if b in self._pending]
        if not waiting:
            return
        with self.reducer.wait_timer("param-gather"):
            self._receive(waiting)

    def _receive(self, buckets: list[int]) -> None:
        for b in buckets:
            full, work = self._pending.pop(b)
            work.wait()
            if full is None:  # gathered in place
                continue
            bucket = self.reducer.buckets[b]
            for p, offset in zip(bucket.params, bucket.offsets):
                if id(p) in self._range:
                    target = local(p).detach().view(-1)
                    target.copy_(full[offset : offset + target.numel()])

    def wait(self) -> None:
        """Until every parameter holds its updated values (the gathers in flight are finished)."""
        self._wait_buckets(sorted(self._pending))

    # ---- whole state for checkpoints ------------------------------------------------------------------------

    @torch.no_grad()
    def gather_state(self) -> None:
        """Make the optimizer's state whole (every rank the same, DTensors for DTensor parameters), as a
        checkpoint saves and loads it; the next step cuts it into pieces again. Every rank calls it."""
        self.end_step()
        self.wait()
        if self._whole:
            return
        state = self.optimizer.state
        keys = sorted({k for p in self.params for k, v in state.get(p, {}).items() if _is_piece(v)})
        for b in self._buckets:
            # never stepped (frozen, unused so far: on every rank alike): no state, as on one process
            params = [p for p in self.reducer.buckets[b].params if id(p) in self._range and state.get(p)]
            for key in keys if params else ():
                values = {id(p): self._piece_of(p, state[p][key]) for p in params if key in state[p]}
                if len(values) != len(params):
                    raise RuntimeError(f"ZeRO-1: optimizer state {key!r} exists for some parameters only")
                dtype = next(iter(values.values())).dtype
                full, work = self._all_gather(self._chunk(b, values, dtype))
                work.wait()
                offsets = dict(zip(map(id, self.reducer.buckets[b].params), self.reducer.buckets[b].offsets))
                for p in params:
                    shape = local(p).shape
                    whole = full[offsets[id(p)] : offsets[id(p)] + shape.numel()].view(shape).clone()
                    state[p][key] = _like(p, whole)
        self._whole = True

    def _piece_of(self, p: Tensor, value: Tensor) -> Tensor:
        """This rank's piece of ``p``'s state ``value``: kept as a piece since the last step, or whole still
        (gathered or loaded, and ``p`` not stepped since: layer drop, an unused branch)."""
        start, stop = self._range[id(p)]
        if _is_piece(value) and value.numel() == stop - start:
            return value  # (a whole 1-D parameter held entirely by this rank is its own piece)
        return local(value).reshape(-1)[start:stop]

    def remove(self) -> None:
        """Remove the hooks (waits for gathers in flight first)."""
        self.end_step()
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._waits, self._step_hooks = [], []
        self.reducer.set_stepped(self, [])


def _param_signature(optimizer: Optimizer) -> tuple[tuple[int, int], ...]:
    """Changes when a param group is added or a group's list of parameters replaced or grown (per group, not
    per parameter: cheap enough for every step)."""
    return tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)


def _is_piece(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and not is_dtensor(value)


def _like(p: Tensor, whole_local: Tensor) -> Tensor:
    """``whole_local`` as ``p`` is: a DTensor with ``p``'s mesh and placements, or plain."""
    if not is_dtensor(p):
        return whole_local
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)
    return DTensor.from_local(
        whole_local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
