"""Self-check diagnostics before every (re)start: device matmul, collectives, storage reachability.

Scope: `run_self_checks` (collective over a process group) and the `SelfCheckReport` it returns. The
launcher runs ``python -m megascale.ft.selfcheck --report PATH [--storage URL] [--timeout S]`` under
torchrun before every start; rank 0 writes the JSON report and the exit code is 0 only when every check on
every rank passed. A node's warm spares (`megascale.ft.warm`) run the same checks through `check_node_local`,
in processes forked from an interpreter that imported torch already, over a node-local `FileStore`.

Checks, on every rank; each records its own error as a failed `CheckResult` instead of raising:

- **matmul**: a seeded float32 matmul on the rank's device against a float64 CPU reference, within the
  worst-case rounding bound ``|Ĉ - C| ≤ γ_n |A||B|`` (γ_n = n·u / (1 - n·u), u = 2^-24; Higham, *Accuracy
  and Stability*, §3.5), which float32 meets in any summation order. TF32 is off for the check. Exceeding
  the bound, or a NaN/inf, means wrong arithmetic, not rounding.
- **allreduce**: rank r contributes ``r % 64 + 1``; the sum must be exact (every partial sum is an integer
  ≤ 64·W < 2^24, so float32 adds exactly in any order). Algorithm bandwidth = bytes / mean time of a few
  iterations after one warm-up, in GB/s (10^9 bytes/s, nccl-tests' "algbw").
- **alltoall**: ``all_to_all_single``; the chunk group rank s sends to d holds s·W + d, so each received
  chunk shows where it came from and whom it was meant for.
- **storage** (when a URL is given): write, read back and delete a random token at
  ``URL/.megascale-selfcheck/<host>-<rank>``, in a thread bounded by a timeout, so an unreachable endpoint
  fails instead of hanging.

Every rank issues the same collectives whatever its local verdicts, so a wrong result never desynchronises
the group. When a collective *raises* (a peer died or timed out), the rank skips its remaining collectives
and the gather and keeps only its own results; the CLI then collects every rank's results through the
rendezvous store (reachable from every host, unlike files next to the report) and marks ranks that never
report as failed.

Fault injection for tests and drills: ``inject="CHECK:RANK"`` (CLI: ``--inject`` or the environment
variable ``MEGASCALE_FT_SELFCHECK_INJECT``) makes that check fail on that global rank: matmul, allreduce and
alltoall perturb their result; storage probes an unreachable path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "CHECKS",
    "INJECT_ENV",
    "CheckResult",
    "SelfCheckReport",
    "check_node_local",
    "load_report",
    "run_self_checks",
]

CHECKS = ("matmul", "allreduce", "alltoall", "storage")
INJECT_ENV = "MEGASCALE_FT_SELFCHECK_INJECT"
MISSING = "rank did not report (crashed, hung, or unreachable): see its log"
_PROBE_DIR = ".megascale-selfcheck"
_ITERATIONS = 3  # timed collective iterations after one warm-up
_NETWORK_ADVICE = "check this host's network (NIC, links, switch port) and that every rank is alive"
_ADVICE = {
    "matmul": "the device computes wrong results: drain this host and test or replace its accelerator",
    "allreduce": _NETWORK_ADVICE,
    "alltoall": _NETWORK_ADVICE,
    "storage": "check this host's access to storage (endpoint, credentials, DNS, mounts)",
}
_log = logging.getLogger(__name__)

Outcome = tuple[bool, str, float | None]  # ok, detail, bandwidth in GB/s


@dataclass
class CheckResult:
    """One check on one rank. ``detail`` is a sentence for people; ``bandwidth_gbps`` is GB/s or None."""

    name: str
    rank: int
    host: str
    ok: bool
    seconds: float
    detail: str
    bandwidth_gbps: float | None = None


@dataclass
class SelfCheckReport:
    """Check results of every rank (only the local rank's after a failed gather); `ok` when all passed."""

    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ranks(self) -> set[int]:
        return {r.rank for r in self.results}

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "results": [asdict(r) for r in self.results]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SelfCheckReport:
        return cls([CheckResult(**r) for r in json.loads(text)["results"]])

    def summary(self) -> str:
        """A few lines for a log: the verdict, one line per failure (host, rank, what to do), bandwidths."""
        n, failures = len(self.results), self.failures
        ranks = f"{len(self.ranks)} rank{'s' * (len(self.ranks) != 1)}"
        verdict = f"FAILED: {len(failures)} of {n} checks" if failures else f"passed: {n} checks"
        lines = [f"self-check {verdict} on {ranks}"]
        for r in failures:
            advice = "check its log" if r.detail == MISSING else _ADVICE.get(r.name, "see the detail")
            lines.append(f"  FAIL {r.name} on host {r.host} rank {r.rank}: {r.detail} -> {advice}")
        for name in CHECKS:
            measured = [r for r in self.results if r.name == name and r.bandwidth_gbps is not None]
            if measured:
                slow = min(measured, key=lambda r: r.bandwidth_gbps or 0.0)
                median = statistics.median(r.bandwidth_gbps or 0.0 for r in measured)
                lines.append(
                    f"  {name} bandwidth: min {slow.bandwidth_gbps:.3g} GB/s (host {slow.host} rank "
                    f"{slow.rank}), median {median:.3g} GB/s over {len(measured)} ranks"
                )
        return "\n".join(lines)


def load_report(path: str | os.PathLike[str]) -> SelfCheckReport:
    """Read a report written by ``python -m megascale.ft.selfcheck --report PATH``."""
    return SelfCheckReport.from_json(Path(path).read_text())


def run_self_checks(
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    storage: str | None = None,
    storage_options: dict[str, Any] | None = None,
    matmul_size: int = 256,
    collective_bytes: int = 1 << 20,
    inject: str | None = None,
    storage_timeout: float = 10.0,
) -> SelfCheckReport:
    """Run the self-checks on this rank and gather every rank's results; call it on every rank of ``group``.

    Args:
        group: process group for the collective checks and the gather (default: world). Without an
            initialised ``torch.distributed``, only matmul and storage run, as rank ``$RANK`` (default 0).
        device: device for the matmul and collectives (default: current CUDA device, else CPU). Collectives
            fall back to CPU on a plain gloo group.
        storage: fsspec URL (``s3://bucket/run``, a local directory) to probe; ``None`` skips the check.
        storage_options: fsspec options for ``storage`` (``endpoint_url``, ``key``, ``secret``, ...).
        matmul_size: n of the n×n matmul.
        collective_bytes: bytes per rank for all-reduce and all-to-all.
        inject: ``"CHECK:RANK"`` makes that check fail on that global rank (see the module docstring).
        storage_timeout: seconds the storage probe may take; keep it below the group's collective timeout,
            or the other ranks' gather times out waiting for this one.

    Returns:
        Every rank's results on every rank; only this rank's when a collective failed.
    """
    target = _parse_inject(inject)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
    host = socket.gethostname()
    device = device or _default_device()

    def run(name: str, check: Callable[[bool], Outcome]) -> tuple[CheckResult, bool]:
        """Time ``check(inject_here)``; an exception becomes a failed result (and the flag says so)."""
        start, raised = time.perf_counter(), False
        try:
            ok, detail, bandwidth = check(target == (name, rank))
        except Exception as e:  # a check reports its failure, it never stops the others
            ok, detail, bandwidth, raised = False, f"{type(e).__name__}: {e}", None, True
        return CheckResult(
            name, rank, host, ok, round(time.perf_counter() - start, 6), detail, bandwidth
        ), raised

    results = [run("matmul", lambda bad: _matmul(device, matmul_size, bad))[0]]
    healthy = distributed
    if distributed:
        coll_device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
        for name, check in (("allreduce", _allreduce), ("alltoall", _alltoall)):
            if not healthy:  # the group is broken: another collective would only wait for its timeout
                results.append(
                    CheckResult(name, rank, host, False, 0.0, "skipped: an earlier collective failed")
                )
                continue
            result, raised = run(name, partial(check, group, coll_device, collective_bytes))
            results.append(result)
            healthy = not raised
    if storage is not None:
        url, options = storage, storage_options or {}
        if target == ("storage", rank):
            url, options = f"{os.devnull}/megascale-selfcheck-injected-fault", {}
        results.append(run("storage", lambda _: _storage(url, options, f"{host}-{rank}", storage_timeout))[0])
    if healthy:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(gathered, results, group=group)
            results = [r for part in gathered for r in part]
        except Exception as e:  # keep this rank's results; the caller can collect the rest another way
            _log.warning("self-check: gathering results failed (%s); keeping this rank's only", e)
    return SelfCheckReport(results)


# --- the checks -------------------------------------------------------------------------------------------
def _matmul(device: torch.device, n: int, perturb: bool) -> Outcome:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 would exceed the float32 bound legitimately
    try:
        out = a.to(device) @ b.to(device)
    finally:
        torch.set_float32_matmul_precision(precision)
    if perturb:
        out[n // 2, n // 2] += 1.0
    got = out.cpu().double()  # float32 -> float64 is exact
    if not torch.isfinite(got).all():
        return False, f"{int((~torch.isfinite(got)).sum())} NaN/inf values in the {n}x{n} result", None
    unit = 2.0**-24
    bound = (n * unit / (1 - n * unit)) * (a.double().abs() @ b.double().abs())
    error = (got - a.double() @ b.double()).abs()
    worst = int((error - bound).argmax())
    i, j = divmod(worst, n)
    if error[i, j] > bound[i, j]:
        return (
            False,
            f"error {error[i, j]:.3g} at [{i}, {j}] exceeds the float32 rounding bound {bound[i, j]:.3g}",
            None,
        )
    ratio = float((error / bound).max())
    return True, f"max abs error {error.max():.3g}, at most {ratio:.0%} of the float32 rounding bound", None


def _allreduce(group: dist.ProcessGroup | None, device: torch.device, nbytes: int, perturb: bool) -> Outcome:
    world, me = dist.get_world_size(group), dist.get_rank(group)
    x = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device)
    expected = float(sum(r % 64 + 1 for r in range(world)))
    wrong, times = 0, []
    for i in range(1 + _ITERATIONS):  # every iteration on every rank, whatever the verdict: stay in step
        x.fill_(me % 64 + 1)
        seconds = _timed(device, lambda: dist.all_reduce(x, group=group))
        if i:
            times.append(seconds)
        if perturb:
            x[-1] += 1.0
        wrong = max(wrong, int((x != expected).sum()))
    bandwidth = x.numel() * 4 / statistics.mean(times) / 1e9
    if wrong:
        return False, f"{wrong} of {x.numel()} elements differ from the expected sum {expected:g}", bandwidth
    return True, f"sum {expected:g} exact on {x.numel()} elements", bandwidth


def _alltoall(group: dist.ProcessGroup | None, device: torch.device, nbytes: int, perturb: bool) -> Outcome:
    world, me = dist.get_world_size(group), dist.get_rank(group)
    per = max(1, nbytes // 4 // world)
    ranks = torch.arange(world, dtype=torch.int32)
    send = (me * world + ranks).repeat_interleave(per).to(device)  # chunk d: from me, meant for d
    expected = (ranks * world + me).repeat_interleave(per).view(world, per)  # chunk s: from s, meant for me
    recv = torch.empty_like(send)
    bad: set[int] = set()
    times = []
    for i in range(1 + _ITERATIONS):
        recv.fill_(-1)
        seconds = _timed(device, lambda: dist.all_to_all_single(recv, send, group=group))
        if i:
            times.append(seconds)
        if perturb:
            recv[0] += 1
        bad |= set((recv.cpu().view(world, per) != expected).any(dim=1).nonzero().flatten().tolist())
    bandwidth = send.numel() * 4 / statistics.mean(times) / 1e9
    if bad:
        return False, f"wrong data in the chunks received from group ranks {sorted(bad)}", bandwidth
    return True, f"{world} chunks of {per} int32 each from the right ranks", bandwidth


def _storage(url: str, options: dict[str, Any], name: str, timeout: float) -> Outcome:
    def probe() -> None:
        fs, base = url_to_fs(url, **{"skip_instance_cache": True, **options})  # a fresh connection
        path = f"{base.rstrip('/')}/{_PROBE_DIR}/{name}"
        if isinstance(fs, LocalFileSystem):  # object stores have no directories to make
            fs.makedirs(f"{base.rstrip('/')}/{_PROBE_DIR}", exist_ok=True)
        token = secrets.token_hex(16).encode()
        with fs.open(path, "wb") as f:
            f.write(token)
        with fs.open(path, "rb") as f:
            back = f.read()
        fs.rm(path)
        if back != token:
            raise OSError(f"read back {back!r}, wrote {token!r}")

    errors: list[BaseException] = []
    # A daemon thread, not an executor: a hung probe must neither block the caller nor interpreter exit.
    thread = threading.Thread(target=_capture(probe, errors), name="megascale-selfcheck-storage", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, f"{url}: no answer within {timeout:g} s (endpoint unreachable or storage hung)", None
    if errors:
        return False, f"{url}: {type(errors[0]).__name__}: {errors[0]}", None
    return True, f"{url}: probe written, read back and deleted", None


# --- helpers ----------------------------------------------------------------------------------------------
def _capture(fn: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    def target() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the waiting thread
            errors.append(e)

    return target


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _parse_inject(inject: str | None) -> tuple[str, int] | None:
    if not inject:
        return None
    name, _, rank = inject.partition(":")
    if name not in CHECKS or not rank.isdigit():
        raise ValueError(f"inject must be CHECK:RANK with CHECK one of {CHECKS}, got {inject!r}")
    return name, int(rank)


def _mark_missing(report: SelfCheckReport, world: int) -> SelfCheckReport:
    """``report`` plus a failed result for each check the others ran, for each rank absent from it."""
    names = [n for n in CHECKS if any(r.name == n for r in report.results)]
    absent = sorted(set(range(world)) - report.ranks)
    return SelfCheckReport(
        report.results + [CheckResult(n, r, "unknown", False, 0.0, MISSING) for r in absent for n in names]
    )


# --- command line -----------------------------------------------------------------------------------------
def _collect_via_store(report: SelfCheckReport, rank: int, world: int, wait_s: float) -> SelfCheckReport:
    """Publish this rank's results in the rendezvous store; on rank 0, add those of the ranks the gather
    missed, waiting up to ``wait_s`` for them."""
    store = dist.distributed_c10d._get_default_store()
    key = f"megascale-selfcheck/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank"
    mine = SelfCheckReport([r for r in report.results if r.rank == rank])
    store.set(f"{key}{rank}", mine.to_json())
    pending = set(range(world)) - report.ranks
    if rank != 0 or not pending:
        return report
    results, deadline = list(report.results), time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            if store.check([f"{key}{r}"]):
                results += SelfCheckReport.from_json(store.get(f"{key}{r}").decode()).results
                pending.discard(r)
        time.sleep(0.1)
    return SelfCheckReport(results)


def main(argv: list[str] | None = None) -> int:
    """The CLI: run the checks on every rank of a torchrun job; rank 0 writes ``--report`` and prints a
    summary. Returns the exit code: on rank 0, 0 if every check passed else 1; 0 on the other ranks (a
    failing worker would make torchrun stop rank 0 before it writes the report)."""
    parser = argparse.ArgumentParser(
        prog="python -m megascale.ft.selfcheck", description="Self-check diagnostics before a (re)start."
    )
    parser.add_argument("--report", required=True, help="JSON report path, written by rank 0")
    parser.add_argument("--storage", help="fsspec URL to probe (s3://bucket/run, a directory)")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout in s (storage: half)")
    parser.add_argument("--inject", default=os.environ.get(INJECT_ENV), help="CHECK:RANK fault to inject")
    args = parser.parse_args(argv)

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # ranks sharing a host's cores oversubscribe badly otherwise
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    init = None
    if "MASTER_ADDR" in os.environ:
        init = partial(dist.init_process_group, backend, timeout=timedelta(seconds=args.timeout))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return _check_rank(
        rank, world, local_rank, init, Path(args.report), args.storage, args.timeout, args.inject
    )


def check_node_local(
    rank: int, world: int, store: str, report: str, storage: str | None, timeout: float
) -> int:
    """The checks of one of a node's ``world`` ranks in a node-local group over a `FileStore` at ``store``
    (a fresh path: no socket listens for it), as the warm spares of `megascale.ft.warm` run them; rank 0
    writes ``report``. The exit code as `main`'s."""
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    timeout_td = timedelta(seconds=timeout)

    def init() -> None:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo", store=dist.FileStore(store, world), rank=rank,
            world_size=world, timeout=timeout_td,
        )  # fmt: skip

    return _check_rank(rank, world, rank, init, Path(report), storage, timeout, os.environ.get(INJECT_ENV))


def _check_rank(
    rank: int, world: int, local_rank: int, init: Callable[[], None] | None, path: Path, storage: str | None,
    timeout: float, inject: str | None,
) -> int:  # fmt: skip
    """One rank's checks (``init`` forms the group; None: no group), its results collected on rank 0,
    which writes the report at ``path`` and prints a summary; the exit code as `main`'s."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_error = None
    if init is not None:
        try:  # CPU tensors (the gather) over gloo, device tensors over NCCL
            init()
        except Exception as e:
            init_error = f"process group init failed: {type(e).__name__}: {e}"
    report = run_self_checks(device=device, storage=storage, inject=inject, storage_timeout=timeout / 2)
    if init_error:
        host = socket.gethostname()
        report.results += [
            CheckResult(n, rank, host, False, 0.0, init_error) for n in ("allreduce", "alltoall")
        ]
    complete = report.ranks >= set(range(world))
    if dist.is_initialized():
        try:  # a rank stuck in a collective times out, then still probes storage: give it both
            report = _collect_via_store(report, rank, world, wait_s=1.5 * timeout + 5)
        except Exception as e:
            _log.warning("self-check: collecting results through the store failed: %s", e)
        if complete:  # tearing down a broken group could hang; os._exit follows anyway
            dist.destroy_process_group()
    if rank != 0:
        return 0
    report = _mark_missing(report, world)  # also when the group never came up: no store to collect from
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(report.to_json())
    os.replace(tmp, path)  # readers see the old report or the whole new one
    print(report.summary(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except SystemExit as e:  # argparse: --help, usage errors
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:
        traceback.print_exc()
    finally:
        # os._exit: gloo sometimes aborts at interpreter exit, and a hung storage thread must not block it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
