"""Producing batches: the per-step read plan, the worker pool, and the node reader process (no torch here).

`produce` is the whole data path of one worker: for every step it walks the node's positions of the
canonical order, reads the lanes it owns (lane mod workers) and returns their sequences with the lanes'
cursors. The node reader (`reader_main`, one process per node, started by the node's first rank) runs
`produce` in `num_workers` processes, assembles each step's batches of every data-parallel rank on the node
and writes them into the shared-memory ring, `prefetch` steps ahead of the slowest rank.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import pickletools
import queue
import subprocess
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megascale.data.lanes import LaneReader, ReadOptions
from megascale.data.order import CanonicalOrder, LaneCursor
from megascale.data.shm import RingClosedError, ShmRing, pid_alive
from megascale.data.sources import ReadStats, Source

__all__ = [
    "ReaderSpec", "StepBatch", "iter_batches", "launch_reader", "pickle_spec", "produce", "reader_main",
]  # fmt: skip


@dataclass(frozen=True)
class ReaderSpec:
    """Everything a reader needs, picklable: the order, how to read, and where the run resumes."""

    order: CanonicalOrder
    sources: tuple[Source, ...]
    options: ReadOptions
    batch_size: int
    dp_size: int
    start: int = 0  # global position of the first sequence
    cursors: dict[int, list[Any]] = field(default_factory=dict)  # lane -> LaneCursor JSON
    num_workers: int = 0
    prefetch: int = 4
    timeout: float = 300.0
    max_steps: int | None = None

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.batch_size


@dataclass
class StepBatch:
    """One step's batches of some data-parallel ranks, and what a resume after it needs."""

    step: int
    tokens: np.ndarray  # (len(dp_ranks), batch_size, seq_len + 1) int32
    cursors: dict[int, list[Any]]  # lanes read in this step -> cursor after it
    stats: dict[str, Any]


def _stats_dict(stats: ReadStats) -> dict[str, Any]:
    return dict(stats.as_dict())


def produce(
    spec: ReaderSpec, dp_ranks: Sequence[int], worker: int = 0, workers: int = 1
) -> Iterator[tuple[int, list[tuple[int, int, np.ndarray]], dict[int, list[Any]], dict[str, Any]]]:
    """Per step: ((rank index, row, sequence) for the lanes this worker owns, touched cursors, stats)."""
    order, options = spec.order, spec.options
    stats = options.stats
    readers: dict[int, LaneReader] = {}
    for step in range(spec.max_steps) if spec.max_steps is not None else _count():
        parts, touched = [], {}
        base = spec.start + step * spec.global_batch
        for r_index, rank in enumerate(dp_ranks):
            for row in range(spec.batch_size):
                lane, index = order.position(base + rank * spec.batch_size + row, order.lanes)
                if lane % workers != worker:
                    continue
                reader = readers.get(lane)
                if reader is None:
                    saved = spec.cursors.get(lane)
                    cursor = LaneCursor.from_json(saved) if saved else LaneCursor.start(order.n_sources)
                    reader = readers[lane] = LaneReader(order, spec.sources, lane, cursor, options)
                if reader.cursor.index > index:
                    raise RuntimeError(
                        f"lane {lane} is at index {reader.cursor.index}, past {index}: bad state"
                    )
                while reader.cursor.index < index:
                    reader.next()  # another rank's sequence in a lane this rank shares
                parts.append((r_index, row, reader.next()))
                touched[lane] = reader.cursor.to_json()
        yield step, parts, touched, _stats_dict(stats)


def _count() -> Iterator[int]:
    step = 0
    while True:
        yield step
        step += 1


def _merge_stats(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for stats in per_worker:
        for key, value in stats.items():
            if isinstance(value, list):
                merged[key] = sorted(set(merged.get(key, [])) | set(value))
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def _worker_main(spec: ReaderSpec, dp_ranks: list[int], worker: int, workers: int, out: Any) -> None:
    try:
        for item in produce(spec, dp_ranks, worker, workers):
            out.put(("ok", item))
        out.put(("end", None))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def iter_batches(spec: ReaderSpec, dp_ranks: list[int], alive: Any = None) -> Iterator[StepBatch]:
    """Each step's batches for ``dp_ranks``, read by ``spec.num_workers`` processes (or inline with 0)."""
    shape = (len(dp_ranks), spec.batch_size, spec.options.seq_len + 1)
    if spec.num_workers == 0:
        for step, parts, cursors, stats in produce(spec, dp_ranks):
            tokens = np.empty(shape, dtype=np.int32)
            for r_index, row, sequence in parts:
                tokens[r_index, row] = sequence
            yield StepBatch(step, tokens, cursors, stats)
        return
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue(maxsize=spec.prefetch) for _ in range(spec.num_workers)]
    procs = [
        ctx.Process(target=_worker_main, args=(spec, dp_ranks, w, spec.num_workers, q), daemon=True)
        for w, q in enumerate(queues)
    ]
    for p in procs:
        p.start()
    try:
        step_stats: list[dict[str, Any]] = [{} for _ in procs]
        while True:
            tokens = np.empty(shape, dtype=np.int32)
            step_cursors: dict[int, list[Any]] = {}
            step = -1
            for w, (q, p) in enumerate(zip(queues, procs, strict=True)):
                kind, item = _get(q, p, spec.timeout, alive)
                if kind == "end":
                    return
                if kind == "error":
                    raise RuntimeError(f"data worker {w} failed:\n{item}")
                step, parts, touched, stats = item
                for r_index, row, sequence in parts:
                    tokens[r_index, row] = sequence
                step_cursors.update(touched)
                step_stats[w] = stats
            yield StepBatch(step, tokens, step_cursors, _merge_stats(step_stats))
    finally:
        for p in procs:
            p.kill()
            p.join(5)


def _get(q: Any, proc: Any, timeout: float, alive: Any) -> tuple[str, Any]:
    waited = 0.0
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            waited += 0.5
            if not proc.is_alive():
                raise RuntimeError(
                    f"data worker (pid {proc.pid}) died with exit code {proc.exitcode}"
                ) from None
            if alive is not None:
                alive()
            if waited > timeout:
                raise TimeoutError(f"a data worker produced nothing for {timeout:.0f} s") from None


def reader_main(spec: ReaderSpec, path: str, parent_pid: int) -> None:
    """The node reader process: wait for the node's ranks, then fill the ring until they are gone."""
    ring = ShmRing.attach(Path(path))

    def check() -> None:  # stop when the ranks are gone: nobody would read or clean up after us
        if not pid_alive(parent_pid) or os.getppid() != parent_pid:
            raise RingClosedError("the rank that started the data reader exited")
        for _, _, pid in ring.registered():
            if not pid_alive(pid):
                raise RingClosedError(f"rank process {pid} exited")
        if ring.state == 3:  # CLOSED by the ranks
            raise RingClosedError("closed")

    try:
        from megascale.data.shm import _wait

        try:
            _wait(
                lambda: len(ring.registered()) == ring.consumers,
                spec.timeout,
                check,
                "every local rank to attach",
            )
        except TimeoutError as e:
            attached = [c for c, _, _ in ring.registered()]
            raise TimeoutError(
                f"{e}: {ring.consumers} local ranks expected (local_world_size), only local ranks {attached} "
                "attached; every rank of the node must start its loader (or fix local_world_size)"
            ) from None
        ring.unlink()  # everyone has it mapped: the memory now goes away with the last process, however it ends
        dp_ranks = sorted({dp for _, dp, _ in ring.registered()})
        ring.publish_info(
            {"dp_ranks": dp_ranks, "fingerprint": spec.order.fingerprint(), "lanes": spec.order.lanes}
        )
        for batch in iter_batches(spec, dp_ranks, alive=check):
            meta = json.dumps({"step": batch.step, "cursors": batch.cursors, "stats": batch.stats}).encode()
            ring.write(batch.step, batch.tokens, meta, timeout=spec.timeout, check=check)
        ring.mark_closed()
    except RingClosedError:
        pass
    except BaseException:
        ring.publish_error(traceback.format_exc())
    finally:
        ring.unlink()
        ring.close()


def pickle_spec(spec: ReaderSpec) -> bytes:
    """The spec as the reader will load it; refuses what a fresh interpreter could not import.

    The reader does not run the training script, so a preprocess hook defined in it (module ``__main__``)
    would not be found there: say so now, in the rank, instead of letting the reader die on start.
    """
    try:
        payload = pickle.dumps(spec)
        # protocol 2 names every global as one "module name" GLOBAL opcode: easy to check for __main__
        refs = [
            arg for op, arg, _ in pickletools.genops(pickle.dumps(spec, protocol=2)) if op.name == "GLOBAL"
        ]
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            f"the node reader runs in its own process and needs a picklable preprocess hook ({err}): use a "
            "module-level function or a class instance, not a lambda or a closure"
        ) from err
    in_main = sorted({str(ref).split(" ", 1)[1] for ref in refs if str(ref).startswith("__main__ ")})
    if in_main:
        raise TypeError(
            f"preprocess hook is defined in the training script (__main__: {', '.join(in_main)}); the node reader "
            "is a separate process that does not run the script, so it cannot find it: move it into a module "
            "next to the script (e.g. my_preprocess.py) and import it from there, or use tree=False"
        )
    return payload


def launch_reader(payload: bytes, path: Path) -> subprocess.Popen:
    """Start the node reader as ``python -m megascale.data.reader``: a fresh interpreter that imports
    neither torch nor the training script (multiprocessing's spawn would re-run the script's top level).

    ``payload`` is the spec as `pickle_spec` made it (checked, in the rank, before the ring was created). The
    reader gets this process's ``sys.path`` (as ``PYTHONPATH``), so a preprocess hook in a module found
    through the script's directory or a path added at run time imports there as it does here.
    """
    spec_path = path.with_name(path.name + ".spec")
    fd = os.open(spec_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    command = [sys.executable, "-m", "megascale.data.reader", str(path), str(spec_path), str(os.getpid())]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)


def _main(argv: list[str]) -> None:
    path, spec_path, parent = argv
    try:
        with open(spec_path, "rb") as f:
            spec = pickle.load(f)  # written by our own parent a moment ago, mode 0600
    finally:
        Path(spec_path).unlink(missing_ok=True)
    reader_main(spec, path, int(parent))


if __name__ == "__main__":
    _main(sys.argv[1:])
