"""megascale-ft's `FaultTolerance` with megascale-lightning's MegaScaleStrategy, under ``megascale-ft launch``.

A tiny GPT (dropout on, AdamW, warmup + cosine, clipping) on the resumable TokenDataModule, 8 steps with a
checkpoint every 3: the last rank is killed at step 7 of the first attempt; the driver reports it dead,
restarts, and the fit resumes from the last committed checkpoint and ends with weights bit for bit equal to
an uninterrupted fit of the same layout. The data holds 12 windows, so an epoch is 3 steps with dp=1 (1 at
dp2) and every checkpoint falls on an epoch boundary, where the uninterrupted run draws from the global RNG
for its new data iterator between the checkpoint step's end and the next step's start.

Layouts: tp2 (DTensor shards, sequence-parallel dropout on each rank's own generator); dp2 with ZeRO-2 (FSDP2:
parameters and optimizer states as DTensor shards over dp), ZeRO-1 (each rank holds the optimizer states it
owns: partial load) and ZeRO-0 (replicas: one rank reads, the other receives by broadcast); pp2 (each rank
holds one pipeline stage: partial load); tp2 × pp2 on 4 ranks (the main job's layout).
Bitwise holds because every reduction here adds two values (dp2, tp2), which is commutative, or none (pp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megascale.ft.checkpoint import TwoStageCheckpointer
from tests.ft._launch import launch_fit, launch_job

SCRIPT = "tests/integration/_fit_megascale.py"
FT_LIGHTNING_SCRIPT = "tests/ft/_fit_lightning.py"  # its --strategy megascale needs megascale-lightning too
LAYOUTS = {  # name: (ranks, script arguments)
    "tp2": (2, ["--tp", "2"]),
    "dp2/zero2": (2, ["--tp", "1", "--zero-stage", "2"]),
    "dp2/zero1": (2, ["--tp", "1", "--zero-stage", "1"]),
    "dp2/zero0": (2, ["--tp", "1", "--zero-stage", "0"]),
    "pp2": (2, ["--tp", "1", "--pp", "2"]),
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2"]),
    "ep2": (2, ["--tp", "1", "--ep", "2", "--zero-stage", "0"]),  # experts split over the ranks (MoE GPT)
}
DATA = ["--every", "3", "--max-bytes", "210"]


# tp2×pp2 restores tensor- and pipeline-split layers, dp2/zero1 the optimizer state ZeRO shards; the other
# layouts' checkpoints are what these are made of (and resume across layouts: tests/conformance)
# CI tier: none here: tests/integration/test_chaos.py kills ranks of the main job's model at tp2×pp2 (and more);
# a ZeRO-1 checkpoint's replicas reading once is tests/ft/test_restore.py's, and resuming ZeRO-1
# state under other layouts the conformance matrix's
KILLED = [
    pytest.param("tp2xpp2", marks=pytest.mark.slow),  # CI: the chaos soak's short version (test_chaos.py)
    pytest.param("dp2/zero1", marks=pytest.mark.slow),
    pytest.param("ep2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layout", KILLED)
def test_a_killed_rank_restarts_and_the_fit_ends_bitwise_equal(tmp_path: Path, layout: str) -> None:
    ranks, args = LAYOUTS[layout]
    reference, report = launch_fit(tmp_path / "uninterrupted", SCRIPT, *args, *DATA, ranks=ranks)
    assert len(report["attempts"]) == 1 and reference["restored_step"] is None
    whole = {"model.embed.weight", "model.blocks.0.norm.weight", "model.blocks.1.norm.weight"}
    assert whole | {"model.head.proj.logits.weight"} <= reference["weights"].keys()  # every stage's layers
    last = ranks - 1  # with a pipeline: a rank of the last stage
    result, report = launch_fit(
        tmp_path / "faulty", SCRIPT, *args, *DATA, "--fault", f"sigkill@7:{last}", ranks=ranks
    )
    attempts = report["attempts"]
    assert report["ok"] and len(attempts) == 2
    assert attempts[0]["fault"]["kind"] == "dead" and attempts[0]["fault"]["rank"] == last
    assert result["restored_step"] in (3, 6)  # 6 may still have been persisting at the kill
    readers = [r["reader"] for r in result["restores"]]
    # dp replicas (ZeRO-0, and ZeRO-1 whose optimizer state a checkpoint holds whole) read once and broadcast
    replicated = layout in ("dp2/zero0", "dp2/zero1")
    assert readers == ([True, False] if replicated else [True] * ranks)
    assert result["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        assert torch.equal(result["weights"][key], value), f"{layout}: {key} differs"


# layout: (the slow rank, the wait its peers show, extra script arguments, launcher arguments)
STRAGGLERS: dict[str, tuple[int, str, list[str], list[str]]] = {
    "dp2/zero1": (1, "wait/grad-reduce", [], []),
    "pp2": (0, "wait/pipeline-recv", [], []),
    # rank 1 is stage 0's second tp rank: its tp peer waits in the TP collectives of the first forward, the
    # next stage in its receives, and the last stage's wait for the first stage's last backward is timed too
    # (the loss broadcast, "pipeline-loss"). What stays in the last stage's compute (the head and the loss of
    # this tiny model) put it at ~1.25x the median in clean runs on 2 busy cores, the slow rank at 3-4.5x:
    # hence the threshold 1.5, and 4 microbatches (a shorter last backward to wait for)
    "tp2xpp2": (1, "wait/tp-", ["--microbatches", "4"], ["--straggler-threshold=1.5"]),
    # its peer waits for the slow rank's tokens in each MoE layer's all-to-all (MegaScale-MoE's overlap shows
    # in these sections: the later parts' waits shrink)
    "ep2": (1, "wait/ep-all-to-all", [], []),
}


@pytest.mark.parametrize(
    "layout",
    [layout if layout == "pp2" else pytest.param(layout, marks=pytest.mark.slow) for layout in STRAGGLERS],
)  # CI tier: pp2
def test_a_slow_rank_is_named_a_straggler_while_its_peers_wait(tmp_path: Path, layout: str) -> None:
    """One rank sleeps 0.2 s in every training step from step 2; its peers wait for it — in the gradient
    reduction (dp2), in the pipeline's receives (pp2, the first stage slow), in the tensor-parallel
    collectives (tp2×pp2) — which the strategy times as wait sections for FaultTolerance. Only the compute
    time (step minus waits) tells them apart: their step times are equal. A clean run flags no one. With a
    pipeline, the trace holds a bar per microbatch's forward and backward on every stage."""
    ranks, args = LAYOUTS[layout]
    slow, wait, extra, launcher = STRAGGLERS[layout]
    args = [*args, *extra, "--steps", "12"]
    _launch(tmp_path / "slow", *args, "--fault", f"slow@2:{slow}", ranks=ranks, launcher=launcher)
    trace = json.loads((tmp_path / "slow" / "run" / "timeline.json").read_text())
    assert any(str(e.get("name", "")).startswith(wait) for e in trace["traceEvents"]), f"no {wait} sections"
    # the loader's time between steps, on every rank
    fetched = {e["pid"] for e in trace["traceEvents"] if e.get("name") == "data" and e.get("ph") == "X"}
    assert fetched == set(range(ranks)), fetched
    # rows labelled with each rank's parallel coordinates, grouped by stage, tp rank, dp replica
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert all(" pp" in n and " tp" in n and "dp" in n for n in names), names
    if "pp2" in layout:
        _assert_microbatch_bars(trace, ranks, microbatches=4 if "--microbatches" in extra else 2)
    assert _stragglers(tmp_path / "slow") == [slow]
    _launch(tmp_path / "clean", *args, ranks=ranks, launcher=launcher)
    assert _stragglers(tmp_path / "clean") == []


def _launch(tmp: Path, *args: str, ranks: int, launcher: list[str]) -> None:
    result, report = launch_job(tmp, SCRIPT, *args, ranks=ranks, launcher_args=tuple(launcher))
    assert result.returncode == 0 and report["ok"], f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def _assert_microbatch_bars(trace: dict, ranks: int, microbatches: int) -> None:
    """Every rank's every step shows F0 B0 F1 B1 ... as slices of its stage, nested in the step."""
    events = trace["traceEvents"]
    steps = {(e["pid"], e["args"]["step"]): e for e in events if e.get("name") == "step" and e["ph"] == "X"}
    assert {pid for pid, _ in steps} == set(range(ranks))
    bars: dict[tuple[int, int], list[str]] = {}
    for e in events:
        if e.get("cat") != "microbatch":
            continue
        step = steps[(e["pid"], e["args"]["step"])]
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1, e
        assert e["args"]["stage"] == e["pid"] // (ranks // 2), e  # the rank's pp coordinate
        bars.setdefault((e["pid"], e["args"]["step"]), []).append(e["name"])
    assert bars.keys() == steps.keys()
    expected = sorted(f"{kind}{mb}" for kind in "FB" for mb in range(microbatches))
    assert all(sorted(names) == expected for names in bars.values()), bars


def _stragglers(tmp: Path) -> list[int]:
    """The ranks the driver flagged (straggler instant events of its timeline.json)."""
    trace = json.loads((tmp / "run" / "timeline.json").read_text())
    return sorted({e["pid"] for e in trace["traceEvents"] if e.get("cat") == "straggler"})


def test_sigterm_to_the_launcher_is_forwarded_the_ranks_save_and_it_exits_0_without_restart(
    tmp_path: Path,
) -> None:
    """megascale-ft launch under SIGTERM (a scheduler's preemption) with MegaScaleStrategy (the stop is the
    strategy's, issue 25 finding 5): nothing is restarted, the run saves where it stopped and exits 0."""
    # rank 1 sends SIGTERM to the launcher in step 3's training_step: the launcher forwards it to both ranks,
    # which finish step 3, take FaultTolerance's snapshot of step 4 (committed before the clean end) and exit
    result, report = launch_job(
        tmp_path, FT_LIGHTNING_SCRIPT, "--steps", "1000", "--every", "1000", "--strategy", "megascale",
        "--fault", "sigterm@3:1", max_restarts=2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    assert report["ok"] and len(report["attempts"]) == 1 and "stopped by SIGTERM" in report["reason"]
    assert torch.load(tmp_path / "out.pt", weights_only=True)["end"] == 4
    assert TwoStageCheckpointer(str(tmp_path / "ckpt")).latest() == 4  # committed, whole, where it stopped
