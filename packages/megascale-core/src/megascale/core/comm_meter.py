"""Count the collectives a piece of code issues, and their bytes: how ZeRO stages and overlaps are compared.

    with CollectiveMeter() as meter:
        train_one_step()
    meter.count("reduce_scatter"), meter.payload_bytes("all_reduce")

Every ``torch.distributed`` collective runs through a ``c10d`` dispatcher op (``c10d.allreduce_``,
``c10d._reduce_scatter_base_``, ...), whichever API issued it: ``dist.*`` calls, FSDP2, DDP's reducer, DTensor
redistributions. A ``TorchDispatchMode`` sees each one on the calling thread, so the meter needs no patching
of any library. What it does not see: collectives issued on other threads (an asynchronous checkpoint
writer's), and work a backend does without an op (gloo's own connection setup).

Payload is the size of the full tensor a collective is about (an all-reduce's tensor, a reduce-scatter's
input, an all-gather's output, a broadcast's tensor). ``wire_bytes`` turns it into what one rank sends under
ring algorithms (Patarasuk & Yuan 2009; NCCL's bus bandwidth): all-reduce 2(n−1)/n × payload, reduce-scatter
and all-gather (n−1)/n, broadcast (n−1)/n (pipelined ring) — the usual yardstick for "DDP's bytes".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Collective", "CollectiveMeter", "wire_bytes"]

# c10d op name (without overload) -> kind
_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "broadcast_": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
}

_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}


def wire_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes over ``group_size`` ranks (ring algorithms)."""
    if group_size <= 1:
        return 0.0
    return _RING_FACTOR.get(kind, 1.0) * (group_size - 1) / group_size * payload


@dataclass(frozen=True)
class Collective:
    """One collective seen by the meter (``kind == "mark"`` for a label the caller placed)."""

    kind: str
    payload: int
    dtype: torch.dtype | None = None
    label: str = ""


class CollectiveMeter(TorchDispatchMode):
    """Record every c10d collective issued inside the ``with`` block on this thread (see the module docstring).

    ``mark(label)`` puts a label in the record, so a test can tell which collectives ran before a point (e.g.
    inside the last microbatch's backward) and which after.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            kind = _KINDS.get(func._opname, func._opname)
            tensors = [a for a in (args[0], args[1] if len(args) > 1 else None) if a is not None]
            sizes = []
            dtype = None
            for arg in tensors:
                leaves = [t for t in tree_flatten(arg)[0] if isinstance(t, torch.Tensor)]
                if leaves:
                    sizes.append(sum(t.numel() * t.element_size() for t in leaves))
                    dtype = dtype or leaves[0].dtype
            self.records.append(Collective(kind, max(sizes, default=0), dtype))
        return func(*args, **kwargs)

    def mark(self, label: str) -> None:
        """Place ``label`` in the record."""
        self.records.append(Collective("mark", 0, None, label))

    def collectives(self, kind: str | None = None) -> list[Collective]:
        """The recorded collectives (of ``kind``), marks left out."""
        return [r for r in self.records if r.kind != "mark" and (kind is None or r.kind == kind)]

    def count(self, kind: str | None = None) -> int:
        """How many collectives (of ``kind``) were issued."""
        return len(self.collectives(kind))

    def payload_bytes(self, kind: str | None = None) -> int:
        """Summed payload of the collectives (of ``kind``)."""
        return sum(r.payload for r in self.collectives(kind))

    def kinds(self) -> Counter[str]:
        """Collectives issued, by kind."""
        return Counter(r.kind for r in self.collectives())

    def before(self, label: str, kind: str | None = None) -> list[Collective]:
        """The collectives (of ``kind``) recorded before the first mark ``label``."""
        out: list[Collective] = []
        for r in self.records:
            if r.kind == "mark" and r.label == label:
                return out
            if r.kind != "mark" and (kind is None or r.kind == kind):
                out.append(r)
        raise KeyError(f"no mark {label!r} was recorded")

    def clear(self) -> None:
        """Forget what was recorded."""
        self.records.clear()
