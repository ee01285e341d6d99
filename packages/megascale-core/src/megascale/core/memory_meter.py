"""Count the memory a piece of code keeps for backward, and the memory it allocates, by tensor storage.

Two meters, both context managers with ``current`` and ``peak`` (bytes) and ``reset_peak()``:

``SavedTensorMeter``
    The bytes of the tensors that autograd saves for backward while the meter is entered (through
    ``torch.autograd.graph.saved_tensors_hooks``) and that are still saved: the activation memory of a training
    step. Counted per storage, so several saved tensors that share one storage (views of one tensor, a tensor
    saved by several ops) count once, with the storage's whole size; a storage's bytes leave the count when the
    last saved reference to it is released (by the backward that uses it, or when its graph is dropped), even
    after the meter was left. ``ignore`` names tensors whose storages never count (e.g. the parameters: a linear
    layer saves its weight, but that memory exists whether or not anything is saved); their storages are taken
    when the meter is made.

``LiveTensorMeter``
    The bytes of the storages that operators run while the meter is entered create and that are still alive
    (a ``TorchDispatchMode``): everything the code allocates and still holds — saved activations, outputs,
    gradients in flight, buffers it keeps, communication buffers it allocates. A storage counts from the op
    that creates it until it is freed (a weak reference on the storage's Python object, which torch preserves
    for as long as the storage lives), also after the meter was left.

What they do not see:

- ``SavedTensorMeter``: tensors held for backward other than through saved-tensor slots (attributes a custom
  ``autograd.Function`` stashes on ``ctx``; the inputs activation checkpointing keeps for recomputation — inside
  a checkpointed region its own hooks replace this meter's; ``hold`` counts such tensors by hand); outputs and
  other live tensors that nothing saved; tensors saved under an inner ``saved_tensors_hooks`` (CPU offloading,
  checkpointing).
- ``LiveTensorMeter``: storages allocated before the meter was entered (parameters, gradients that already
  exist and are accumulated into in place, optimizer state, the receive buffers a pipeline stage preallocates
  at its first step) and ops that write into them or resize them; storages created outside the dispatcher (by C++ code that
  does not run an ATen operator, such as a communication library's internal buffers; ``UntypedStorage.resize_``
  called directly); memory that is not a tensor storage (allocator caching and fragmentation, kernel
  workspaces); and ops run by threads that did not enter the meter (a ``TorchDispatchMode`` is thread-local;
  the autograd engine carries it into backward, which on CPU runs on the calling thread anyway).
- Both count a storage's logical size (``nbytes``), not the allocator's rounding (CUDA rounds to 512 B).

Both are safe across the autograd engine and threads: the counts change under a lock, and the release
callbacks (which run wherever the last reference dies: in backward, in another thread, in the garbage
collector) take the same lock, re-entrantly.

Usage::

    saved, live = SavedTensorMeter(ignore=model.parameters()), LiveTensorMeter()
    with saved, live:
        loss = model(x).sum()
    print(saved.current, live.current)  # what the forward keeps for backward / still holds
    loss.backward()
    print(saved.current, saved.peak)    # 0 after backward; the peak stays
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorMeter", "SavedTensorMeter", "storages_of"]


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or for a wrapper subclass (DTensor) those of its inner tensors.
    Meta and storage-less tensors have none."""
    out: list[torch.UntypedStorage] = []
    todo = [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()  # type: ignore[attr-defined]
            todo.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif x.device.type != "meta" and x.layout == torch.strided:
            out.append(x.untyped_storage())
    return out


class _Meter:
    """A byte count with its peak, changed under a re-entrant lock (release callbacks may fire while the
    lock is held, when a reference dropped inside a locked region was the last one)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.current = 0
        self.peak = 0

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current

    def _sub(self, nbytes: int) -> None:
        self._add(-nbytes)

    def reset_peak(self) -> None:
        """Start a new peak from the current count."""
        with self._lock:
            self.peak = self.current


class _Saved:
    """What a saved-tensor slot holds while the meter packs it: the tensor, and a release on deletion."""

    __slots__ = ("keys", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, keys: list[int]) -> None:
        self.tensor, self.meter, self.keys = tensor, meter, keys

    def __del__(self) -> None:
        self.meter._release(self.keys)


class SavedTensorMeter(_Meter):
    """Bytes of the storages of tensors saved for backward (while entered) that are still saved; see the module
    docstring. ``ignore``: tensors whose storages never count (typically ``model.parameters()``).

    Re-entrant use is not supported (one ``with`` at a time); a new meter per measurement is cheap.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._ignored = {st._cdata for t in ignore for st in storages_of(t)}
        # storage id -> [saved references alive, bytes]. A key stays valid while counted: the saved
        # tensors themselves keep the storage alive, so its id cannot be reused by another storage meanwhile.
        self._refs: dict[int, list[int]] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        keys = []
        with self._lock:
            for st in storages_of(tensor):
                key = st._cdata
                if key in self._ignored:
                    continue
                keys.append(key)
                entry = self._refs.get(key)
                if entry is None:
                    self._refs[key] = [1, st.nbytes()]
                    self._add(st.nbytes())
                else:
                    entry[0] += 1
        # detached: the slot must not hold the tensor itself, whose grad_fn may own this very slot (a saved
        # output): that cycle runs through C++ autograd nodes, which Python's garbage collector cannot see
        return _Saved(tensor.detach(), self, keys)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor

    def _release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                entry = self._refs[key]
                entry[0] -= 1
                if entry[0] == 0:
                    del self._refs[key]
                    self._sub(entry[1])

    def hold(self, tensor: torch.Tensor) -> object:
        """Count ``tensor`` as kept for backward by other means than a saved-tensor slot (what activation
        checkpointing keeps to recompute from) until the returned handle is dropped; shares the per-storage
        count with the saved tensors."""
        return self._pack(tensor)

    @property
    def storages(self) -> int:
        """How many distinct storages are counted now."""
        return len(self._refs)

    def __enter__(self) -> SavedTensorMeter:
        if self._hooks is not None:
            raise RuntimeError("SavedTensorMeter is already entered")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


class LiveTensorMeter(_Meter):
    """Bytes of the storages created by operators run while entered that are still alive; see the module
    docstring. A ``TorchDispatchMode`` underneath (``mode``): other dispatch modes may be stacked with it."""

    def __init__(self) -> None:
        super().__init__()
        # storage id -> bytes, for the storages counted and alive; the weak references' callbacks remove them
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self.mode = _CreatedStorages(self)

    def _track(self, st: torch.UntypedStorage) -> None:
        key, nbytes = st._cdata, st.nbytes()
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                self._sizes[key] = nbytes
                self._refs[key] = weakref.ref(st, functools.partial(self._forget, key))
                self._add(nbytes)
            elif old != nbytes:  # resized by an op (tensor.resize_)
                self._sizes[key] = nbytes
                self._add(nbytes - old)

    def _forget(self, key: int, _ref: object = None) -> None:
        with self._lock:
            nbytes = self._sizes.pop(key, None)
            self._refs.pop(key, None)
            if nbytes is not None:
                self._sub(nbytes)

    def tracks(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is counted (created by an op under this meter and still alive)."""
        with self._lock:
            return any(st._cdata in self._sizes for st in storages_of(t))

    @property
    def storages(self) -> int:
        """How many distinct storages are counted now."""
        return len(self._sizes)

    def __enter__(self) -> LiveTensorMeter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


class _CreatedStorages(TorchDispatchMode):
    """Hands each storage an operator creates (one that none of its inputs had) to the meter."""

    def __init__(self, meter: LiveTensorMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor & co. run their local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] = set()
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                inputs.update(st._cdata for st in storages_of(a))
            elif isinstance(a, torch.UntypedStorage):
                inputs.add(a._cdata)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    if st._cdata not in inputs or st._cdata in self.meter._sizes:
                        self.meter._track(st)
        return out
