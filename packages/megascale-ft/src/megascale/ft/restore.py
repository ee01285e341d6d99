"""Fast restore: one rank per group of replicas reads a checkpoint, the others receive it by broadcast.

Scope: the broadcast half of ``TwoStageCheckpointer.load(state, replicas=group)``, and `LoadStats`, what
one load cost a rank. Choosing the step, checksums, ``extra.json`` and the DCP read itself stay in
`megascale.ft.checkpoint`.

Design choices:

- ``replicas`` is the group of ranks whose tensor state is identical: the whole world for plain DDP, this
  rank's DP group for dp × tp layouts (the ranks with the same tp/pp coordinate). Its first rank (group
  rank 0, *the reader*) reads its own tensors with DCP on its own (``no_dist``: the local shard of a
  DTensor, the whole of a plain tensor); the others read no tensor data. Storage reads drop from one copy
  per rank to one per group, i.e. ÷ the group's size.
- What travels: the state's tensors (DTensors: their local shards) flattened and sorted by key path, as
  raw bytes, so any dtype goes (bool, bf16, complex: gloo cannot reduce all of them, but bytes are
  bytes). Small tensors share flat buffers of at most `BUCKET_BYTES` per device (few collectives, bounded
  extra memory); a larger contiguous tensor is broadcast in place.
- Before any read, every rank of the checkpointer's group shares its reader, a digest of its group's
  members and a digest of its tensors' names, dtypes, shapes and DTensor shard offsets, in one small gather
  on the checkpointer's side group. A wrong ``replicas`` (e.g. the world group in a tp layout, where the
  ranks hold different shards) then fails on every rank, instead of copying one shard over another.
- A reader's failure is shared the same way before any broadcast, so every rank raises `CheckpointError`
  and none is left waiting in a broadcast that will not come.
- Checksums are not this module's: the checkpointer picks the step (skipping a partial or corrupt latest)
  and verifies it on rank 0 of its group before any of this, reading every file once whatever
  ``replicas`` is; `LoadStats.checksum_bytes` counts that apart from the tensor reads the broadcast saves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megascale.ft.manifest import CheckpointError

__all__ = ["BUCKET_BYTES", "LoadStats", "load_from_replicas"]

BUCKET_BYTES = 64 << 20
_ALIGN = 16  # the largest element size (complex128): every tensor's bytes start aligned for `.view`


@dataclass
class LoadStats:
    """What the last `TwoStageCheckpointer.load` cost this rank (``checkpointer.last_load``).

    Attributes:
        step: the step loaded.
        reader: whether this rank read tensor data from storage (every rank does without ``replicas``).
        tensor_bytes: stored tensor data this rank read from storage (DCP items, as stored).
        metadata_bytes: DCP ``.metadata`` and ``extra.json`` this rank read.
        checksum_bytes: files this rank read to verify checksums (only rank 0 of the checkpointer's
            group verifies; every file of each checkpoint it checked).
        broadcast_bytes: tensor bytes this rank sent (reader) or received (replica) by broadcast.
        seconds: wall time of the load on this rank.
    """

    step: int
    reader: bool = True
    tensor_bytes: int = 0
    metadata_bytes: int = 0
    checksum_bytes: int = 0
    broadcast_bytes: int = 0
    seconds: float = 0.0

    @property
    def storage_bytes(self) -> int:
        """Everything this rank read from storage during the load."""
        return self.tensor_bytes + self.metadata_bytes + self.checksum_bytes


def load_from_replicas(
    tensors: Any,
    read: Callable[[], None],
    *,
    replicas: dist.ProcessGroup,
    group: dist.ProcessGroup,
    where: str,
) -> int:
    """Fill ``tensors`` in place: ``read()`` on the reader of ``replicas``, broadcast to the others.

    Collective over ``group`` (the checkpointer's side group, which must contain every member of
    ``replicas``); every rank of ``group`` calls it, each with its own ``replicas``.

    Args:
        tensors: the tensor tree to load into (nested dicts keyed by str/int, as `_state.tensors_of`).
        read: reads ``tensors`` in place from storage on this rank alone; raises on failure.
        replicas: the ranks holding the same tensors as this one (their reader is group rank 0).
        group: the checkpointer's gloo side group, used for the agreements.
        where: names the checkpoint in errors.

    Returns:
        Tensor bytes this rank sent or received by broadcast.

    Raises:
        CheckpointError: on every rank, when any rank's ``replicas`` does not match its tensors or any
            reader failed.
    """
    flat = _flatten(tensors)
    _check_groups(flat, replicas, group, where)
    error = None
    if dist.get_rank(replicas) == 0:
        try:
            read()
        except Exception as e:  # told to every rank below, so none waits in the broadcast
            error = f"rank {dist.get_rank()} (reader): {e}"
    errors = [e for e in _gather(error, group) if e is not None]
    if errors:
        raise CheckpointError("; ".join(errors))
    try:
        return _broadcast([_local(t) for _, t in flat], replicas)
    except RuntimeError as e:  # a peer died mid-broadcast
        raise CheckpointError(f"broadcasting {where} to the replicas failed: {e}") from e


def _flatten(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """The tensors of ``tree`` with their key paths, in sorted path order (the same on every replica)."""
    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    if not isinstance(tree, dict):
        return []
    out = [pair for k, v in tree.items() for pair in _flatten(v, (*path, str(k)))]
    return sorted(out, key=lambda pair: pair[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local() is a view of the local shard: writing into it writes the DTensor.
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _layout(flat: list[tuple[tuple[str, ...], torch.Tensor]]) -> list[Any]:
    """What replicas must share: names, dtypes, local shapes, and which part of a DTensor each holds."""
    out: list[Any] = []
    for path, t in flat:
        entry: list[Any] = [path, str(t.dtype), tuple(_local(t).shape)]
        if isinstance(t, DTensor):
            entry.append([(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()])
        out.append(entry)
    return out


def _gather(value: Any, group: dist.ProcessGroup) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _check_groups(
    flat: list[tuple[tuple[str, ...], torch.Tensor]],
    replicas: dist.ProcessGroup,
    group: dist.ProcessGroup,
    where: str,
) -> None:
    """Raise on every rank unless each rank's replicas are a consistent group holding its tensors."""
    me = dist.get_rank()
    if dist.get_rank(replicas) < 0:  # still joins the gather, so the others learn it and raise too
        views = _gather((me, None, None, None), group)
    else:
        members = sorted(dist.get_process_group_ranks(replicas))
        reader = dist.get_global_rank(replicas, 0)
        views = _gather((me, reader, _digest(members), _digest(_layout(flat))), group)
    # Every rank computes the same verdict from the same gathered views.
    by_rank = {rank: (reader, layout) for rank, reader, _, layout in views}
    named: dict[int, list[int]] = {}
    for rank, reader, _, _ in views:
        named.setdefault(reader, []).append(rank)
    problems = []
    for rank, reader, group_digest, layout in views:
        if reader is None:
            problems.append(f"rank {rank} passed a replicas group it does not belong to")
        elif (
            reader not in by_rank
            or by_rank[reader][0] != reader
            or group_digest != _digest(sorted(named[reader]))
        ):
            problems.append(
                f"rank {rank}'s replicas group (first rank: {reader}) differs from what its members pass: "
                "give each rank the group of its replicas (e.g. its DP group), the same on all its members"
            )
        elif layout != by_rank[reader][1]:
            problems.append(
                f"rank {rank} holds other tensors than its reader, rank {reader} (names, dtypes, shapes or "
                "DTensor shards differ): replicas must hold identical state, e.g. the DP group in a tp layout"
            )
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(f"cannot restore {where} by broadcast: {'; '.join(problems[:3])}{more}")


def _comm_device(device: torch.device, replicas: dist.ProcessGroup) -> torch.device:
    """``device`` when the group's backend handles it, else the backend's device (CPU tensors, NCCL)."""
    types = [torch.device(d).type for d in replicas._device_types]
    if device.type in types or not types:
        return device
    if types[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def _broadcast(tensors: list[torch.Tensor], replicas: dist.ProcessGroup) -> int:
    """Broadcast ``tensors`` (local, in a fixed order) from group rank 0 of ``replicas``; bytes moved."""
    pending: dict[torch.device, list[torch.Tensor]] = {}  # small tensors waiting, per device
    pending_bytes: dict[torch.device, int] = {}
    moved = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        moved += _nbytes(t)
        if _padded(t) >= BUCKET_BYTES:
            _send_bucket([t], replicas)
            continue
        if pending_bytes.get(t.device, 0) + _padded(t) > BUCKET_BYTES:
            _send_bucket(pending.pop(t.device), replicas)
            pending_bytes[t.device] = 0
        pending.setdefault(t.device, []).append(t)
        pending_bytes[t.device] = pending_bytes.get(t.device, 0) + _padded(t)
    for bucket in pending.values():
        _send_bucket(bucket, replicas)
    return moved


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _padded(t: torch.Tensor) -> int:
    return -(-_nbytes(t) // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _send_bucket(bucket: list[torch.Tensor], replicas: dist.ProcessGroup) -> None:
    device = _comm_device(bucket[0].device, replicas)
    reader = dist.get_rank(replicas) == 0
    with torch.no_grad():
        if len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].device == device:
            dist.broadcast(_as_bytes(bucket[0]), group=replicas, group_src=0)  # in place, no copy
            return
        offsets = [0]
        for t in bucket[:-1]:
            offsets.append(offsets[-1] + _padded(t))
        # The last tensor unpadded: one tensor is then the same bytes whether sent in place or copied.
        flat = torch.empty(offsets[-1] + _nbytes(bucket[-1]), dtype=torch.uint8, device=device)
        if reader:
            for t, start in zip(bucket, offsets):
                flat[start : start + _nbytes(t)].copy_(_as_bytes(t.contiguous()))
        dist.broadcast(flat, group=replicas, group_src=0)
        if not reader:
            for t, start in zip(bucket, offsets):
                part = flat[start : start + _nbytes(t)]
                t.copy_(part.view(t.dtype).view(t.shape))
