"""`WebLoader`: a rank's view of the node's data reader — batches, exact resume state, clean shutdown.

Tree loading (MegaScale §3.5): the node's first rank lists the shards, creates the shared-memory ring and
starts one reader process; every rank of the node attaches to the ring, says which data-parallel rank it is,
and copies its own batch out of each slot. Ranks with the same DP rank (a tensor- or pipeline-parallel
group) get the same batch; different DP ranks get disjoint positions of the canonical order.

``tree=False`` runs the same reading inline, in a thread of this process (for validation sets, notebooks,
and tests), with identical batches.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import socket
import subprocess
import threading
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megascale.data.config import WebDataConfig
from megascale.data.lanes import ReadOptions
from megascale.data.order import CanonicalOrder
from megascale.data.packing import TextPreprocess
from megascale.data.positions import positions_after_eos
from megascale.data.reader import ReaderSpec, iter_batches, launch_reader, pickle_spec
from megascale.data.shm import (
    CLOSED,
    ERROR,
    RingClosedError,
    ShmRing,
    cleanup_stale,
    find_ring,
    pid_alive,
    ring_path,
)
from megascale.data.sources import DataSourceError, list_shards
from megascale.data.tokenize import load_tokenizer

__all__ = ["STATE_VERSION", "WebLoader", "merge_states"]

STATE_VERSION = 1


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One resume state from every rank's ``state_dict()`` (each node knows the lanes it read)."""
    first = states[0]
    for other in states[1:]:
        for key in ("version", "fingerprint", "lanes", "consumed"):
            if other[key] != first[key]:
                raise ValueError(f"ranks disagree on the data state's {key}: {first[key]} vs {other[key]}")
    cursors: dict[str, list[Any]] = {}
    for state in states:
        for lane, cursor in state["cursors"].items():
            if lane not in cursors or cursor[0] > cursors[lane][0]:
                cursors[lane] = cursor
    return {**first, "cursors": cursors}


class WebLoader:
    """Batches ``(inputs, targets)`` of shape (batch_size, seq_len), int64, for one data-parallel rank.

    Args:
        config: sources and reader settings.
        dp_rank: this rank's data-parallel rank (from the strategy: ranks of one TP/PP group share it).
        dp_size: the data-parallel size.
        tree: one reader process per node in shared memory (True) or reading inline in this process.
        local_rank: this process's rank on its node (default: $LOCAL_RANK or 0).
        local_world_size: processes on the node (default: $LOCAL_WORLD_SIZE or 1).
        node_rank: the node (default: $GROUP_RANK / $NODE_RANK or 0).
        run_id: shared by the node's ranks, different between concurrent runs (default:
            $TORCHELASTIC_RUN_ID unless torchrun's default "none", else $MASTER_ADDR:$MASTER_PORT, else
            this process id).
        max_steps: stop after this many batches (None: endless, the trainer's max_steps decides).
    """

    def __init__(
        self,
        config: WebDataConfig,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        tree: bool = True,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node_rank: int | None = None,
        run_id: str | None = None,
        max_steps: int | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.config, self.dp_rank, self.dp_size, self.tree, self.max_steps = (
            config,
            dp_rank,
            dp_size,
            tree,
            max_steps,
        )
        env = os.environ
        self.local_rank = int(env.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        self.local_world_size = (
            int(env.get("LOCAL_WORLD_SIZE", 1)) if local_world_size is None else local_world_size
        )
        self.node_rank = (
            int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))) if node_rank is None else node_rank
        )
        if run_id is None:
            # torchrun's default id is "none" for every job (--rdzv-id): two single-node jobs on one machine
            # would share their readers' rings; their store ports differ
            elastic_id = env.get("TORCHELASTIC_RUN_ID", "none")
            run_id = (elastic_id if elastic_id != "none" else "") or (
                f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_PORT" in env else str(os.getpid())
            )
        self.run_id = run_id
        self.tokenizer = load_tokenizer(config.tokenizer)
        self._resume: dict[str, Any] | None = None
        self._started = False
        self._delivered = 0  # batches handed out since the start
        self._history: deque[tuple[int, dict[str, Any]]] = deque(maxlen=config.prefetch + 8)
        self._base_cursors: dict[str, list[Any]] = {}
        self._start = 0
        self._fingerprint = ""
        self._lanes = 0
        self._stats: dict[str, Any] = {}
        self._ring: ShmRing | None = None
        self._process: Any = None
        self._thread_queue: queue.Queue | None = None
        self._iterator: Iterator[tuple[torch.Tensor, ...]] | None = None
        self._exhausted = False

    # --- state -----------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether the first batch was requested (the reader runs)."""
        return self._started

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def stats(self) -> dict[str, Any]:
        """Read statistics of this node's reader (shards opened, samples, retries, corrupt shards, ...)."""
        return dict(self._stats)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` (a ``state_dict()``, possibly of a run with another dp size) left off."""
        if self._started:
            raise RuntimeError("load_state_dict() must come before the first batch is read")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {STATE_VERSION}")
        self._resume = dict(state)

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """JSON-serialisable resume state after the first ``batches`` batches of this loader (default: all
        delivered so far; a trainer that fetches ahead passes the number its completed steps used)."""
        n = self._delivered if batches is None else batches
        if not self._started:
            if self._resume is not None:
                return dict(self._resume)
            raise RuntimeError("state_dict() before the loader started: read a batch first (or load a state)")
        if n > self._delivered:
            raise ValueError(f"state after {n} batches requested, only {self._delivered} were delivered")
        cursors = dict(self._base_cursors)
        oldest = self._history[0][0] if self._history else self._delivered
        if n < oldest - 1:
            raise ValueError(f"state after {n} batches is no longer kept (oldest kept: {oldest - 1})")
        for number, meta in self._history:
            if number <= n:
                cursors.update(meta["cursors"])
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "lanes": self._lanes,
            "consumed": self._start + n * self.dp_size * self.config.batch_size,
            "cursors": cursors,
        }

    # --- starting --------------------------------------------------------------------------------------

    def _order(self) -> CanonicalOrder:
        cfg = self.config
        lanes = self._resume["lanes"] if self._resume else (cfg.lanes or self.dp_size * cfg.batch_size)
        shards = tuple(tuple(list_shards(s)) for s in cfg.sources)
        for source, listed in zip(cfg.sources, shards, strict=True):
            if len(listed) < lanes:
                warnings.warn(
                    f"source {source.urls!r} has {len(listed)} shards for {lanes} lanes: lanes share shards "
                    "of different epochs, so data repeats sooner than once per epoch; write more, smaller "
                    "shards (megascale-data shard --max-docs) or set fewer lanes",
                    stacklevel=3,
                )
        order = CanonicalOrder(
            shards, tuple(float(s.weight) for s in cfg.sources), lanes, cfg.seed, cfg.shuffle
        )
        if self._resume and self._resume["fingerprint"] != order.fingerprint():
            raise ValueError(
                "the resume state was made for other data (the sources' shard lists, weights, seed or lanes "
                "differ): resume with the same WebDataConfig, or start the data from the beginning"
            )
        return order

    def _spec(self, order: CanonicalOrder) -> ReaderSpec:
        cfg = self.config
        preprocess = tuple(
            cfg.preprocess or TextPreprocess(self.tokenizer, s.text_key_of(order.shards[i][0]))
            for i, s in enumerate(cfg.sources)
        )
        options = ReadOptions(
            seq_len=cfg.seq_len, eos_id=self.tokenizer.eos_id, preprocess=preprocess, retries=cfg.retries,
            backoff=cfg.backoff, on_corrupt=cfg.on_corrupt,
        )  # fmt: skip
        resume = self._resume or {}
        return ReaderSpec(
            order=order, sources=tuple(cfg.sources), options=options, batch_size=cfg.batch_size,
            dp_size=self.dp_size, start=int(resume.get("consumed", 0)),
            cursors={int(k): v for k, v in resume.get("cursors", {}).items()},
            num_workers=cfg.num_workers, prefetch=cfg.prefetch, timeout=cfg.timeout, max_steps=self.max_steps,
        )  # fmt: skip

    def _begin(self) -> None:
        self._started = True
        resume = self._resume or {}
        self._start = int(resume.get("consumed", 0))
        self._base_cursors = dict(resume.get("cursors", {}))
        if not self.tree:
            order = self._order()
            self._fingerprint, self._lanes = order.fingerprint(), order.lanes
            self._iterator = self._inline(self._spec(order))
            return
        if self.local_rank == 0:
            cleanup_stale()
            order = self._order()  # lists the shards: a missing shard or bucket fails here, in the rank
            # a hook the reader could not import fails here, before the ring exists
            payload = pickle_spec(self._spec(order))
            path = ring_path(self.run_id, self.node_rank, os.getpid())
            slot_bytes = self.local_world_size * self.config.batch_size * (self.config.seq_len + 1) * 4
            self._ring = ShmRing.create(
                path,
                consumers=self.local_world_size,
                slots=self.config.prefetch,
                slot_bytes=_round8(slot_bytes),
            )
            atexit.register(self.close)
            self._process = launch_reader(payload, path)
        else:
            self._ring = self._attach()
        self._ring.register(self.local_rank, self.dp_rank)
        self._ring.set_next(self.local_rank, 0)
        # longer than the reader waits for the node's ranks, so its error (naming who is missing) comes first
        _wait_ready(self._ring, self.config.timeout + 10, self._check)
        info = self._ring.info()
        self._fingerprint, self._lanes = info["fingerprint"], info["lanes"]
        if self._resume and self._resume["fingerprint"] != self._fingerprint:
            raise ValueError("the resume state was made for other data than this node's reader reads")
        self._row = info["dp_ranks"].index(self.dp_rank)
        self._n_rows = len(info["dp_ranks"])
        self._iterator = self._from_ring()

    def _attach(self) -> ShmRing:
        from megascale.data.shm import _wait

        found: list[Path] = []

        def present() -> bool:
            path = find_ring(self.run_id, self.node_rank)
            if path is not None:
                found.append(path)
            return path is not None

        _wait(
            present,
            self.config.timeout,
            lambda: None,
            f"the data reader of node {self._node} (local rank 0)",
        )
        return ShmRing.attach(found[-1])

    @property
    def _node(self) -> str:
        # the attempt's node rank can change across restarts; the host says which machine to look at
        return f"{self.node_rank} ({socket.gethostname()})"

    def _check(self) -> None:
        ring = self._ring
        assert ring is not None
        if ring.state == ERROR:
            raise DataSourceError(f"the data reader of node {self._node} failed:\n{ring.error()}")
        pid = ring.writer_pid or ring.creator_pid
        code = self._process.poll() if self._process is not None else None
        if code is not None or (pid and not pid_alive(pid)):
            raise DataSourceError(
                f"the data reader of node {self._node} (pid {pid}) died"
                + (f" (exit code {code})" if code is not None else "")
                + ": see its output above; the run cannot continue without it"
            )
        if ring.state == CLOSED:
            raise RingClosedError("the data reader finished")

    # --- reading ---------------------------------------------------------------------------------------

    def _deliver(self, tokens: np.ndarray, meta: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        self._delivered += 1
        self._history.append((self._delivered, meta))
        corrupt_before = self._stats.get("corrupt_shards", 0)
        self._stats = meta.get("stats", {})
        if self._stats.get("corrupt_shards", 0) > corrupt_before:
            warnings.warn(
                f"megascale-data skipped {self._stats['corrupt_shards'] - corrupt_before} corrupt or truncated "
                f"shard(s) (total {self._stats['corrupt_shards']}); see the reader's warnings for which",
                stacklevel=3,
            )
        batch = torch.from_numpy(tokens.astype(np.int64))
        if torch.cuda.is_available():
            batch = batch.pin_memory()
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.config.document_mask:
            return inputs, targets, positions_after_eos(inputs, self.tokenizer.eos_id)
        return inputs, targets

    def _fold_history(self) -> None:
        while len(self._history) >= self._history.maxlen - 1:  # type: ignore[operator]
            _, meta = self._history.popleft()
            self._base_cursors.update(meta["cursors"])

    def _from_ring(self) -> Iterator[tuple[torch.Tensor, ...]]:
        ring = self._ring
        assert ring is not None
        shape = (self._n_rows, self.config.batch_size, self.config.seq_len + 1)
        seq = 0
        while self.max_steps is None or seq < self.max_steps:
            try:
                payload, raw_meta = ring.read(
                    self.local_rank, seq, timeout=self.config.timeout, check=self._check
                )
            except RingClosedError:
                return
            tokens = np.frombuffer(payload, dtype=np.int32).reshape(shape)[self._row]
            self._fold_history()
            yield self._deliver(tokens, json.loads(raw_meta))
            seq += 1

    def _inline(self, spec: ReaderSpec) -> Iterator[tuple[torch.Tensor, ...]]:
        spec = replace(spec, num_workers=0)
        out: queue.Queue = queue.Queue(maxsize=spec.prefetch)
        stop = threading.Event()

        def run() -> None:
            try:
                for batch in iter_batches(spec, [self.dp_rank]):
                    meta = {"cursors": batch.cursors, "stats": batch.stats}
                    while not stop.is_set():
                        try:
                            out.put(("ok", (batch.tokens[0], meta)), timeout=0.2)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                out.put(("end", None))
            except BaseException as e:
                out.put(("error", e))

        thread = threading.Thread(target=run, name="megascale-data-inline", daemon=True)
        thread.start()
        try:
            while True:
                kind, item = out.get(timeout=self.config.timeout)
                if kind == "end":
                    self._exhausted = True
                    return
                if kind == "error":
                    raise item
                self._fold_history()
                yield self._deliver(*item)
        finally:
            stop.set()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """An endless stream continues across ``iter()`` calls (a trainer's epochs are windows over it); a
        finite one (``max_steps``, inline) is read again from its start once it ended (validation)."""
        if self._started and not self.tree and self.max_steps is not None and self._exhausted:
            self._started, self._delivered, self._exhausted = False, 0, False  # a finite set: read it again
            self._history.clear()
        return self._stream()

    def _stream(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # a generator: nothing starts before the first next() (Lightning calls iter() just to check)
        if not self._started:
            self._begin()
        assert self._iterator is not None
        yield from self._iterator

    def close(self) -> None:
        """Stop the reader (first rank of the node) and drop the shared memory; safe to call twice."""
        ring, self._ring = self._ring, None
        if ring is not None:
            if self.local_rank == 0:
                ring.mark_closed()
            ring.unlink() if self.local_rank == 0 else None
            ring.close()
        process, self._process = self._process, None
        if process is not None:
            try:
                process.wait(2)  # it sees the closed ring and leaves
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown, modules may be gone
            self.close()


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _wait_ready(ring: ShmRing, timeout: float, check: Any) -> None:
    from megascale.data.shm import READY, _wait

    _wait(lambda: ring.state in (READY, CLOSED), timeout, check, "the data reader to start")
