"""Self-checks: all passing on 2 gloo ranks, injected faults named by rank and host, an unreachable S3
endpoint failing fast, a rank that never reports, the CLI under torchrun, and the single-process mode."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from megascale.ft import selfcheck
from megascale.ft.selfcheck import CheckResult, SelfCheckReport, load_report, run_self_checks
from tests._dist import run_distributed
from tests.lightning._launch import ROOT, clean_env, free_port

HOST = socket.gethostname()


def _checks_worker(rank: int, world_size: int, kwargs: dict[str, Any]) -> str:
    return run_self_checks(**kwargs).to_json()


def _reports(world_size: int, **kwargs: Any) -> list[SelfCheckReport]:
    return [SelfCheckReport.from_json(r) for r in run_distributed(_checks_worker, world_size, kwargs)]


def _failed(report: SelfCheckReport) -> list[tuple[str, int]]:
    return [(r.name, r.rank) for r in report.failures]


def test_two_ranks_pass_with_bandwidths_and_leave_no_probe(tmp_path: Path):
    reports = _reports(2, storage=str(tmp_path))
    for report in reports:  # every rank gets every rank's results
        assert report.ok, report.summary()
        assert sorted((r.rank, r.name) for r in report.results) == [
            (rank, name) for rank in (0, 1) for name in sorted(selfcheck.CHECKS)
        ]
    for r in reports[0].results:
        assert r.host == HOST and r.seconds >= 0
        if r.name in ("allreduce", "alltoall"):
            assert r.bandwidth_gbps is not None and r.bandwidth_gbps > 0
        else:
            assert r.bandwidth_gbps is None
    assert list((tmp_path / ".megascale-selfcheck").iterdir()) == []
    summary = reports[0].summary()
    assert "passed" in summary and "allreduce bandwidth: min" in summary and "alltoall bandwidth" in summary


def test_injected_matmul_fault_names_rank_and_host(tmp_path: Path):
    report = _reports(2, storage=str(tmp_path), inject="matmul:1")[0]
    assert not report.ok
    assert _failed(report) == [("matmul", 1)]
    assert "exceeds the float32 rounding bound" in report.failures[0].detail
    fail_lines = [line for line in report.summary().splitlines() if "FAIL " in line]
    assert fail_lines == [fail_lines[0]] and f"host {HOST} rank 1" in fail_lines[0]


@pytest.mark.parametrize("check", ["allreduce", "alltoall", "storage"])
def test_injected_faults_fail_only_their_check(tmp_path: Path, check: str):
    report = _reports(2, storage=str(tmp_path), inject=f"{check}:0", collective_bytes=4096)[0]
    assert _failed(report) == [(check, 0)]


def test_unreachable_s3_endpoint_fails_fast_naming_the_url(s3_env: None):
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing"}
    url = "s3://no-such-endpoint/run"
    start = time.monotonic()
    report = _reports(2, storage=url, storage_options=options, storage_timeout=4)[0]
    assert time.monotonic() - start < 30  # spawning two ranks included
    assert sorted(_failed(report)) == [("storage", 0), ("storage", 1)]
    for r in report.failures:
        assert r.seconds < 4 + 2 and url in r.detail  # the timeout bounds it, not s3fs retries (~10 s)
    assert "FAIL storage" in report.summary()


def test_s3_storage_probe_passes_and_cleans_up(s3_server: Any, s3_bucket: str):
    url = f"s3://{s3_bucket}/run"
    report = run_self_checks(storage=url, storage_options=s3_server.storage_options)
    assert report.ok, report.summary()
    assert s3_server.fs().find(f"{s3_bucket}/run") == []


def _one_rank_silent_worker(rank: int, world_size: int) -> str | None:
    """Rank 2 skips the checks: the others' collectives time out, and rank 0 collects through the store."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    # new_group returns on each rank once its own pairs connect; without this barrier rank 2 could leave
    # while rank 0 still handshakes, and new_group itself fails ("Connection closed by peer"; CI, stop 30).
    dist.barrier()
    if rank == 2:
        return None
    report = run_self_checks(group=group, collective_bytes=4096)
    report = selfcheck._collect_via_store(report, rank, world_size, wait_s=1.0)
    return selfcheck._mark_missing(report, world_size).to_json() if rank == 0 else None


def test_rank_that_never_reports_is_marked_failed_and_the_rest_still_arrive():
    report = SelfCheckReport.from_json(run_distributed(_one_rank_silent_worker, 3)[0])
    by_rank = {rank: {r.name: r for r in report.results if r.rank == rank} for rank in (0, 1, 2)}
    for rank in (0, 1):  # their own results, collected through the store after the failed collective
        assert by_rank[rank]["matmul"].ok and not by_rank[rank]["allreduce"].ok
        assert "skipped" in by_rank[rank]["alltoall"].detail
    assert set(by_rank[2]) == {"matmul", "allreduce", "alltoall"}
    assert all(r.detail == selfcheck.MISSING and not r.ok for r in by_rank[2].values())
    assert "rank 2: rank did not report" in report.summary()


def _torchrun(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           "-m", "megascale.ft.selfcheck", "--report", str(tmp_path / "report.json"),
           "--storage", str(tmp_path / "storage"), "--timeout", "30", *args]  # fmt: skip
    full_env = clean_env()
    full_env.pop(selfcheck.INJECT_ENV, None)
    full_env.update(env or {})
    return subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_under_torchrun_reports_both_ranks(tmp_path: Path):
    proc = _torchrun(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = load_report(tmp_path / "report.json")
    assert report.ok and report.ranks == {0, 1} and len(report.results) == 8
    assert "self-check passed: 8 checks on 2 ranks" in proc.stdout
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True


def test_cli_injected_fault_from_env_exits_1_naming_rank_0(tmp_path: Path):
    proc = _torchrun(tmp_path, env={selfcheck.INJECT_ENV: "alltoall:0"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = load_report(tmp_path / "report.json")
    assert report.ranks == {0, 1} and _failed(report) == [("alltoall", 0)]
    assert f"FAIL alltoall on host {HOST} rank 0" in proc.stdout


def test_without_torch_distributed_runs_matmul_and_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    report = run_self_checks(storage=str(tmp_path))
    assert [(r.name, r.rank, r.ok) for r in report.results] == [("matmul", 0, True), ("storage", 0, True)]
    assert run_self_checks().ranks == {0} and len(run_self_checks().results) == 1  # no storage: no probe
    assert _failed(run_self_checks(inject="matmul:0")) == [("matmul", 0)]


def test_report_json_round_trip_and_bad_inject(tmp_path: Path):
    report = SelfCheckReport([CheckResult("allreduce", 3, "h", True, 0.1, "fine", 2.5)])
    (tmp_path / "r.json").write_text(report.to_json())
    assert load_report(tmp_path / "r.json") == report
    with pytest.raises(ValueError, match="CHECK:RANK"):
        run_self_checks(inject="disk:0")
