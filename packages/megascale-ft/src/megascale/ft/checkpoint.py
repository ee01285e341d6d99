"""Two-stage fast checkpointing (MegaScale §4): snapshot to host memory, persist in the background.

Scope: `TwoStageCheckpointer` — save, commit, prune, find the latest intact checkpoint, and load it
(resharding through DCP). Plain torch API; the Lightning callback builds on this.

Layout: ``ROOT/step-000000012/`` holds a ``torch.distributed.checkpoint`` (DCP) directory (``.metadata``,
``__R_0.distcp``), ``extra.json`` (every non-tensor value, written by rank 0) and, written last,
``manifest.json`` (see `megascale.ft.manifest`). A directory without a manifest is partial.

Design choices:

- **Stage 1** (`save`, on the training thread) copies the tensors with DCP's own `DefaultStager`
  (pinned host memory when CUDA is available, DTensor shards kept as DTensors) and encodes the non-tensor
  values as JSON, then returns. **Stage 2** runs on one background thread: ``dcp.save`` of the snapshot,
  checksums, manifest, pruning.
- Why ``dcp.save`` on our own thread rather than ``dcp.async_save``: both work on gloo/CPU in torch 2.13,
  but the commit (every rank's checksums gathered, the manifest written last, pruning, one verdict sent to
  all ranks) has to run after DCP's write, on the same background thread and the same side process group;
  with ``async_save`` it would run in a done-callback on DCP's executor thread with less control over
  errors. The snapshot still comes from DCP's stager, as ``async_save`` would make it.
- Collectives: the constructor creates a **side gloo group** over the same ranks. The background thread
  only ever uses that group, never the training group. The training thread uses it too (`latest`,
  `load`), but only after joining the background thread, so the group is never used from two threads.
- One save in flight: `save` first waits for the previous persist (the stager reuses its host buffers,
  so the next snapshot may only be taken once the previous one is on storage), and raises its failure.
- Non-tensor state never goes through DCP (which pickles it); see `megascale.ft._state`. Loading reads
  ``.metadata`` with a restricted unpickler and refuses DCP byte items: see `manifest.SafeFsspecReader`
  and `_TensorOnlyLoadPlanner`. Tensor data is read by DCP with ``torch.load(weights_only=True)``.
- Non-tensor values and replicated (plain, non-DTensor) tensors are taken from one rank, as in DCP: give
  per-rank values (e.g. each rank's RNG state) rank-specific keys.
- Restore by broadcast: ``load(state, replicas=group)`` reads tensor data on one rank per group of
  replicas and broadcasts it to the others (see `megascale.ft.restore`); `last_load` says what a load
  read from storage.
- Partial states: ``load(state, partial=True)`` lets each rank hold only its part (a pipeline stage, a
  ZeRO-1 owner's optimizer states). DCP reads only the entries a state asks for anyway; what ``partial``
  changes is the check of ``extra.json``: checkpoint entries the state lacks are skipped, not refused.
  Entries the state holds and the checkpoint lacks are refused either way, on every rank before any read
  (so DCP's ``allow_partial_load``, which would silently skip those, stays off).
"""

from __future__ import annotations

import json
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import _init_optim_state

from megascale.ft import _state
from megascale.ft.manifest import (
    EXTRA_NAME,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    SafeFsspecReader,
    hash_file,
    list_files,
    read_manifest,
    verify_files,
    write_manifest,
)
from megascale.ft.restore import LoadStats, load_from_replicas

__all__ = ["CheckpointError", "TwoStageCheckpointer", "close_open_checkpointers"]

_STEP_DIR = re.compile(r"^step-(\d{9,})$")


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus ``load_bytes``: DCP 2.13 would ``torch.load(weights_only=False)``
    those bytes, i.e. unpickle arbitrary objects. This checkpointer never writes byte items, so one in a
    checkpoint means it was tampered with."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is a pickled object, which this checkpointer never "
            "writes and refuses to unpickle: the checkpoint was tampered with or written by something else"
        )


def _is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, dict)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


class TwoStageCheckpointer:
    """Save training state in two stages and keep the last few committed checkpoints.

    Args:
        root: directory (local path or fsspec URL such as ``s3://bucket/run1``) holding ``step-*/``.
        keep_last: committed checkpoints to keep; older ones are deleted after each commit.
        storage_options: fsspec options for ``root`` (e.g. ``endpoint_url``, ``key``, ``secret``).
        process_group: the ranks that checkpoint together (default: the whole world when
            ``torch.distributed`` is initialized, else a single process). Only used to create a side gloo
            group; no collective is issued on it.

    The constructor, `save`, `latest` and `load` are collective: every rank of the group calls them, in
    the same order. ``root`` must be storage all ranks see (shared filesystem or object store).

    A top-level value of ``state`` may be a dict/list/tuple tree of tensors and int/float/str/bool/None, or
    an object with ``state_dict()``/``load_state_dict()`` (a module, an optimizer).
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int = 3,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self._options = dict(storage_options or {})
        self._fs, self._base = url_to_fs(self.root, **self._options)
        self._base = self._base.rstrip("/")
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group: dist.ProcessGroup | None = None
        if self._distributed:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # gloo: the snapshot lives in host memory, and DCP's coordination is object collectives.
            self._group = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=process_group is not None
            )
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
        else:
            self.rank, self.world_size = 0, 1
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,  # save() returns once the snapshot exists, not before
                use_non_blocking_copy=cuda,
            )
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megascale-ft-checkpoint")
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._lock = threading.Lock()
        self.last_load: LoadStats | None = None
        """What the last `load` read from storage on this rank, and how long it took."""
        self._checksum_bytes = 0  # read by `_problem` since the current load began
        _OPEN.add(self)

    # --- naming -----------------------------------------------------------------------------------------
    def _name(self, step: int) -> str:
        return f"step-{step:09d}"

    def _dir(self, step: int) -> str:
        return f"{self._base}/{self._name(step)}"

    def _url(self, step: int) -> str:
        return f"{self.root}/{self._name(step)}"

    def _where(self, step: int) -> str:
        return f"checkpoint {self._name(step)} under {self.root}"

    # --- coordination on the side group -----------------------------------------------------------------
    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (side group)."""
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if not self._distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _agree(self, error: str | None) -> None:
        """Raise on every rank when rank 0 reports an error."""
        error = self._from_rank0(error)
        if error is not None:
            raise CheckpointError(error)

    # --- save -------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` to host memory and persist it in the background as step ``step``.

        Returns once the snapshot exists (stage 1); stage 2 writes, checksums and commits it. Waits for the
        previous save first (one in flight).

        Args:
            step: the training step; names the directory ``step-{step:09d}``.
            state: str-keyed dict of tensors (incl. DTensor), JSON-able values, nested dicts/lists/tuples
                of those, and objects with ``state_dict``/``load_state_dict``.

        Raises:
            TypeError: a value cannot be saved safely; the message names its key.
            CheckpointError: the *previous* save failed (this one was not started).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.wait()
        plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
        if not all(isinstance(k, str) for k in plain):
            raise TypeError("checkpoint state must be a dict with str keys at the top level")
        tensors, encoded = _state.split_for_save(plain)
        snapshot = cast(dict[str, Any], self._stager.stage(tensors or {}))  # stage 1: the host copy
        with self._lock:
            self._pending_step = step
            self._pending = self._executor.submit(self._persist, step, snapshot, encoded)

    def _persist(self, step: int, snapshot: dict[str, Any], encoded: Any) -> None:
        """Stage 2, on the background thread: write, checksum, commit, prune."""
        fs, directory = self._fs, self._dir(step)
        error = None
        encodings = self._gather(encoded)  # every rank's non-tensor tree: per-rank keys are kept
        if self.rank == 0:
            try:  # a leftover of an interrupted save of this step must not mix with the new files
                if fs.exists(directory):  # un-commit first, so a crash mid-delete leaves a partial
                    if fs.exists(f"{directory}/{MANIFEST_NAME}"):
                        fs.rm_file(f"{directory}/{MANIFEST_NAME}")
                    fs.rm(directory, recursive=True)
                fs.makedirs(directory, exist_ok=True)
                extra = {"step": step, "state": _state.union(encodings)}
                fs.pipe_file(f"{directory}/{EXTRA_NAME}", json.dumps(extra).encode())
            except Exception as e:
                error = f"{self._where(step)}: could not prepare the directory: {e!r}"
        self._agree(error)

        writer = FsspecWriter(
            self._url(step), sync_files=isinstance(fs, LocalFileSystem), overwrite=True, **self._options
        )
        dcp.save(snapshot, storage_writer=writer, process_group=self._group, no_dist=not self._distributed)
        # dcp.save returns on every rank after the coordinator wrote .metadata, i.e. after all data files.

        names: list[str] | None = None
        if self.rank == 0:
            try:
                names = list_files(fs, directory)
            except Exception as e:
                error = f"{self._where(step)}: could not list the written files: {e!r}"
        self._agree(error)
        names = self._from_rank0(names)
        assert names is not None
        try:  # each rank hashes its share of the files, in parallel
            mine: Any = {n: hash_file(fs, f"{directory}/{n}") for n in names[self.rank :: self.world_size]}
        except Exception as e:
            mine = f"rank {self.rank}: {e!r}"
        shares = self._gather(mine)

        if self.rank == 0:
            failed = [s for s in shares if isinstance(s, str)]
            if failed:
                error = f"{self._where(step)}: could not checksum the written files: {'; '.join(failed)}"
            else:
                files = {n: h for share in shares for n, h in share.items()}
                try:
                    write_manifest(
                        fs, directory, Manifest(step=step, world_size=self.world_size, files=files)
                    )
                except Exception as e:
                    error = f"{self._where(step)}: could not write manifest.json (not committed): {e!r}"
            if error is None:
                try:
                    self._prune()
                except Exception as e:  # housekeeping: the commit stands, and the other ranks wait below
                    warnings.warn(f"could not prune old checkpoints under {self.root}: {e!r}", stacklevel=2)
        self._agree(error)

    def _steps(self) -> list[int]:
        """Steps of every ``step-*`` directory under root, ascending."""
        try:
            self._fs.invalidate_cache(self._base)
            entries = self._fs.ls(self._base, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            m = _STEP_DIR.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _is_committed(self, step: int) -> bool:
        return bool(self._fs.exists(f"{self._dir(step)}/{MANIFEST_NAME}"))

    def _prune(self) -> None:
        """Keep the newest `keep_last` committed checkpoints; drop older ones and older partial ones."""
        steps = self._steps()
        committed = [s for s in steps if self._is_committed(s)]
        if not committed:
            return
        keep = set(committed[-self.keep_last :])
        newest = committed[-1]
        for s in steps:
            if s in keep or s > newest:  # a partial newer than the newest commit is left alone
                continue
            try:
                self._fs.rm(self._dir(s), recursive=True)
            except Exception as e:  # pruning is housekeeping: the commit stands
                warnings.warn(f"could not delete old {self._where(s)}: {e!r}", stacklevel=2)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed.

        Raises:
            CheckpointError: the background save failed; the error is cleared once raised.
        """
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending = self._pending_step = None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"saving {self._where(cast(int, step))} failed: {e}") from e

    def _join(self) -> None:
        """Wait for the background thread without consuming its error (it stays for `wait`/`save`)."""
        pending = self._pending
        if pending is not None:
            wait_futures([pending])

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and the host buffers."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()
            _OPEN.discard(self)

    def __enter__(self) -> TwoStageCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- find and load ----------------------------------------------------------------------------------
    def _problem(self, step: int) -> str | None:
        """Why ``step`` cannot be loaded (partial, corrupt, ...), or None when it is intact; the same answer on
        every rank. Collective: every rank reads the manifest and hashes its share of the files (1/world of
        the checkpoint, several files at once), and the verdicts are gathered."""
        where = self._where(step)
        problem: str | None = None
        try:
            manifest = read_manifest(self._fs, self._dir(step), where)
            if manifest is None:
                problem = "partial (no manifest.json: its save did not finish)"
            elif manifest.step != step:
                problem = f"inconsistent (its manifest says step {manifest.step})"
            else:
                reason = verify_files(
                    self._fs, self._dir(step), manifest, on_read=self._count_checksum_read,
                    share=(self.rank, self.world_size),
                )  # fmt: skip
                problem = None if reason is None else f"corrupt ({reason})"
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # every rank must still answer the others
            problem = f"unreadable ({e!r})"
        # the first problem in rank order: ranks verified different files, any one of them failing is enough
        return next((p for p in self._gather(problem) if p is not None), None)

    def _count_checksum_read(self, size: int) -> None:
        self._checksum_bytes += size

    def latest(self) -> int | None:
        """The newest step whose manifest exists and whose files match their checksums, or None.

        Newer partial or corrupt checkpoints are skipped with a warning saying why. Rank 0 lists the
        checkpoints; every rank verifies its share of each candidate's files (collective). Waits for a save
        in flight to finish first.
        """
        self._join()
        steps, error = [], None
        if self.rank == 0:
            try:
                steps = self._steps()
            except Exception as e:  # rank 0 must still answer the other ranks
                error = f"cannot list checkpoints under {self.root}: {e!r}"
        steps, error = self._from_rank0((steps, error))
        if error is not None:
            raise CheckpointError(f"{error}; check the path and storage_options")
        for step in reversed(steps):
            problem = self._problem(step)
            if problem is None:
                return cast(int, step)
            if self.rank == 0:
                warnings.warn(
                    f"skipping {self._where(step)}: {problem}; falling back to an older checkpoint",
                    stacklevel=2,
                )
        return None

    def manifest(self, step: int) -> Manifest:
        """The manifest of the committed checkpoint of ``step``: its world size, files, torch version.

        Reads ``manifest.json`` on this rank (not collective); does not verify the files (`latest` and
        `load` do).

        Raises:
            CheckpointError: ``step`` has no committed checkpoint (missing or partial), or its manifest is
                unreadable.
        """
        where = self._where(step)
        try:
            manifest = read_manifest(self._fs, self._dir(step), where)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where}: cannot read its {MANIFEST_NAME} ({e!r})") from e
        if manifest is None:
            raise CheckpointError(f"{where} does not exist or is partial (no {MANIFEST_NAME})")
        return manifest

    def load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        replicas: dist.ProcessGroup | None = None,
        partial: bool = False,
        per_rank: Collection[str] = (),
    ) -> int:
        """Load a checkpoint into ``state`` in place (resharding to the current layout) and return its step.

        Args:
            state: the structure to load into, as given to `save` (tensors are overwritten in place,
                modules/optimizers get ``load_state_dict``). Top-level keys it lacks are not loaded; entries
                it holds that the checkpoint lacks are an error.
            step: the step to load; default: `latest`.
            replicas: the ranks whose tensor state is identical to this rank's: for plain DDP the whole
                world, for dp × tp layouts this rank's DP group (``mesh["dp"].get_group()``). Only its
                first rank reads tensor data from storage and broadcasts it to the others, so storage
                reads drop by the group's size. Pass it on every rank or on none; every member must
                load with this checkpointer. Default: every rank reads its own tensors.
            partial: this rank's ``state`` holds only its part of the checkpoint (a pipeline stage's
                layers, the optimizer states a ZeRO-1 rank owns): checkpoint entries it lacks are skipped
                instead of being an error, and only what it holds is read.
            per_rank: top-level keys of ``state`` holding per-rank values under rank-specific keys (RNG
                states): with ``replicas``, every rank reads these itself. Pass the same on every rank.

        Raises:
            CheckpointError: no intact checkpoint, or the requested one is partial, corrupt or unsafe, or
                lacks entries ``state`` holds, or a reader failed (raised on every rank), or ``replicas``
                does not hold identical state.
        """
        if replicas is not None and not self._distributed:
            raise ValueError("replicas needs torch.distributed to be initialized")
        started = time.perf_counter()
        self._join()
        self._checksum_bytes = 0
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(
                    f"no committed, intact checkpoint under {self.root}: check the path and "
                    "storage_options, or start from scratch"
                )
        else:
            problem = self._problem(step)
            if problem is not None:
                raise CheckpointError(f"{self._where(step)} is {problem}: load another step, or delete it")
        where = self._where(step)
        stats = LoadStats(step=step)

        loaders: dict[str, Callable[[Any], Any]] = {}
        plain: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer) and not value.state:
                # a fresh optimizer has no state tensors to load into yet: create them (zeros) as DCP's
                # own set_optimizer_state_dict does
                _init_optim_state(value)
            if _is_stateful(value):
                plain[key] = value.state_dict()
                loaders[key] = value.load_state_dict
            else:
                plain[key] = value

        error = None
        encoded: dict[str, Any] = {}
        try:
            raw = self._fs.cat_file(f"{self._dir(step)}/{EXTRA_NAME}")
            stats.metadata_bytes += len(raw)
            encoded = dict(json.loads(raw)["state"]["dict"])
            lacking = [k for k in plain if k not in encoded]
            lacking += [m for k in plain if k in encoded for m in _state.missing(plain[k], encoded[k], (k,))]
            if lacking:
                more = f" and {len(lacking) - 10} more" if len(lacking) > 10 else ""
                error = (
                    f"has no entries {lacking[:10]}{more}: remove them from the state to load, or load "
                    "another step"
                )
        except Exception as e:
            error = f"has an unreadable {EXTRA_NAME} ({e!r}): load another step"
        errors = [f"rank {r}: {where} {e}" for r, e in enumerate(self._gather(error)) if e is not None]
        if errors:  # raised on every rank, before DCP's collectives, so no rank is left waiting
            raise CheckpointError("; ".join(errors))

        tensors = _state.tensors_of(plain) or {}
        reader = SafeFsspecReader(self._url(step), **self._options)
        if replicas is None:
            self._read_tensors(tensors, reader, where, alone=not self._distributed)
        else:
            own = {k: tensors.pop(k) for k in per_rank if k in tensors}
            stats.reader = dist.get_rank(replicas) == 0
            stats.broadcast_bytes = load_from_replicas(
                tensors,
                lambda: self._read_tensors(tensors, reader, where, alone=True),
                replicas=replicas,
                group=cast(dist.ProcessGroup, self._group),
                where=where,
            )
            if per_rank:
                self._read_own(own, reader, where)
        for key in plain:
            try:
                value = _state.merge(plain[key], encoded[key], (key,), partial=partial)
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from e
            if key in loaders:
                loaders[key](value)
            else:
                state[key] = value
        stats.tensor_bytes = reader.data_bytes_read
        stats.metadata_bytes += reader.metadata_bytes_read
        stats.checksum_bytes = self._checksum_bytes
        stats.seconds = time.perf_counter() - started
        self.last_load = stats
        return step

    def _read_own(self, tensors: dict[str, Any], reader: SafeFsspecReader, where: str) -> None:
        """Every rank reads its per-rank ``tensors`` alone; a failure is raised on every rank."""
        error = None
        try:
            if tensors:
                self._read_tensors(tensors, reader, where, alone=True)
        except CheckpointError as e:
            error = f"rank {self.rank}: {e}"
        errors = [e for e in self._gather(error) if e is not None]
        if errors:
            raise CheckpointError("; ".join(errors))

    def _read_tensors(
        self, tensors: dict[str, Any], reader: SafeFsspecReader, where: str, *, alone: bool
    ) -> None:
        """DCP-load ``tensors`` in place: with the whole group, or on this rank ``alone`` (no collectives)."""
        try:
            with warnings.catch_warnings():
                # DCP warns that a no_dist load assumes a single process: here that is the intent.
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(
                    tensors,
                    storage_reader=reader,
                    planner=_TensorOnlyLoadPlanner(),
                    process_group=None if alone else self._group,
                    no_dist=alone,
                )
        except CheckpointException as e:  # DCP gathers every rank's failure into one BaseException
            raise CheckpointError(f"loading {where} failed: {e}") from e


_OPEN: weakref.WeakSet[TwoStageCheckpointer] = weakref.WeakSet()  # not closed yet, in this process


def close_open_checkpointers() -> list[str]:
    """Close every checkpointer of this process that a failed run left open; the errors of their last saves.

    For a process that runs the training again after a failure (`megascale.ft.warm`, in place): a save in
    flight goes on in the background, in collectives of the side group with the other ranks' background
    saves, which do the same, so it ends (committed, or failed where a peer is gone); only then may the
    process groups be destroyed, which would leave those collectives waiting forever."""
    errors = []
    for checkpointer in list(_OPEN):
        try:
            checkpointer.close()
        except (Exception, CheckpointException) as e:  # the save failed: its checkpoint is never committed
            errors.append(f"{type(e).__name__}: {e}")
    return errors
