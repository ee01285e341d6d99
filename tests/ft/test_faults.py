"""Fault injection through the launcher: each fault is detected in time, the job is stopped, restarted from
the latest good checkpoint, and ends with weights bitwise equal to an uninterrupted run.

The job is examples/ft_ddp.py (2 DDP ranks on gloo, a checkpoint every 2 of 8 steps) under
``megascale-ft launch``; the fault fires in the first attempt only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ft._launch import HANG, HEARTBEAT, launch_job

SCRIPT = str(Path(__file__).parents[2] / "examples" / "ft_ddp.py")


def _launch(tmp: Path, *train_args: str, self_check: bool = False, max_restarts: int = 2, env=None):
    return launch_job(
        tmp, SCRIPT, *train_args, self_check=self_check, max_restarts=max_restarts, env=env,
        launcher_args=("--repeat-limit=2", f"--storage={tmp / 'ckpt'}"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result, report = _launch(tmp)
    assert report["ok"] and len(report["attempts"]) == 1, result.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=True)


FAULTS = {
    # fault: (expected kind, rank, detection bound in s, text the restarted run must print)
    "sigkill@4:1": ("dead", 1, 2 * HEARTBEAT + 1, None),
    "sigstop@4:1": ("hung", 1, HANG + 1.5, None),
    "exception@4:0": ("exception", 0, 2.0, None),
    "nan@5:1": ("nan", 1, 2.0, None),
    "kill-persist@3:1": ("dead", 1, 2 * HEARTBEAT + 1, "partial"),
    "corrupt-latest@3:0": ("dead", 0, 2 * HEARTBEAT + 1, "corrupt"),
}


# CI tier: a death (with the self-checks), a hang, a NaN and a damaged checkpoint; an exception is a death with
# its message, a checkpoint cut mid-persist a damaged one found another way (tests/ft/test_restore.py too)
SLOW_FAULTS = ("exception@4:0", "kill-persist@3:1")


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAULTS else f for f in FAULTS]
)
def test_a_fault_is_detected_and_the_restarted_run_ends_bitwise_equal(fault, uninterrupted, tmp_path):
    kind, rank, bound, skipped = FAULTS[fault]
    self_check = fault.startswith("sigkill")  # once with the self-checks before every attempt (~5 s each)
    result, report = _launch(tmp_path, "--fault", fault, self_check=self_check)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and report["ok"], output[-4000:]
    first, second = report["attempts"]
    if self_check:
        assert first["self_check"]["ok"] and second["self_check"]["ok"]
        assert "self-checks passed" in output
    assert (first["fault"]["kind"], first["fault"]["rank"]) == (kind, rank), first
    assert first["fault"]["latency"] <= bound, f"detected after {first['fault']['latency']:.2f} s > {bound} s"
    assert second["fault"] is None
    empty = [str(p) for p in (tmp_path / "run").rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert not empty, f"the launcher left empty files: {empty}"  # stacks are kept only when a hang wrote them
    if kind == "hung":  # every rank's stacks were taken before the kill; the frozen rank is named
        stacks = first["fault"]["stacks"]
        assert list(stacks["suspects"]) == [str(rank)], stacks
        # frozen inside the training script's calls: its stack (the innermost frame is wherever SIGSTOP landed,
        # a library's under load: contextlib's once in CI)
        assert "ft_ddp.py" in Path(stacks["files"][str(rank)]).read_text(), stacks
        assert all(Path(f).is_file() for f in stacks["files"].values()) and len(stacks["files"]) == 2
        assert Path(stacks["map"]).is_file() and f"rank {1 - rank} waits for rank {rank} (world)" in output
        assert f"rank {rank} differs, in" in output
    if skipped is not None:  # the damaged newest checkpoint was passed over for the one before it
        assert f"skipping checkpoint step-000000004 under {tmp_path / 'ckpt'}: {skipped}" in output, output[
            -4000:
        ]
    final = torch.load(tmp_path / "out.pt", weights_only=True)
    assert final.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(final[name], value), f"{name} differs after the restart"


def test_a_run_that_fails_the_same_way_again_stops_with_a_report(tmp_path):
    result, report = _launch(tmp_path, "--fault", "exception@2:0", "--always", max_restarts=5)
    assert result.returncode == 1 and not report["ok"]
    assert len(report["attempts"]) == 2  # --repeat-limit=2, well within --max-restarts=5
    assert "failed the same way 2 times in a row" in report["reason"]
    assert "RuntimeError: injected failure at step 2" in report["reason"]
    assert "FAILED after 2 attempt(s)" in result.stderr


@pytest.mark.slow  # CI tier: the run that fails the same way again stops (above)
def test_restarts_are_bounded(tmp_path):
    result, report = _launch(tmp_path, "--fault", "sigkill@1:1", "--always", max_restarts=1)
    assert result.returncode == 1 and len(report["attempts"]) == 2
    assert "--max-restarts" in report["reason"] or "same way" in report["reason"]


def test_a_failing_self_check_stops_the_run_before_training_and_names_the_rank(tmp_path):
    result, report = _launch(tmp_path, self_check=True, env={"MEGASCALE_FT_SELFCHECK_INJECT": "matmul:1"})
    assert result.returncode == 1 and not report["ok"]
    assert len(report["attempts"]) == 1 and "fault" not in report["attempts"][0]  # training never started
    assert "self-checks failed" in report["reason"] and "FAIL matmul on host" in report["reason"]
    assert "rank 1" in report["reason"]
    assert not list((tmp_path / "ckpt").glob("step-*"))  # no training, no checkpoint
