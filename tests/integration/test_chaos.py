"""The chaos soak's short version (tests/integration/chaos.py; `nox -s chaos` runs it for 30 minutes with every
kind of fault): the main job's model on 2 loopback nodes × 2 ranks under `megascale-ft launch`, hit once by
each of a killed rank, a corrupted checkpoint followed by a killed rank, a killed data reader
and an idle connection to the driver, in a random order at random moments. Every fault is named as what it
was in report.json, no resume loses or loads a bad checkpoint, and the final checkpoint (weights, LAMB's
moments) equals an uninterrupted run's bit for bit. The kinds left to the soak are proven in CI by their own
tests: a node's processes or its agent killed (tests/ft/test_multinode.py, test_warm_restart.py), a frozen rank
(tests/ft/test_faults.py), a slowed rank (test_ft_megascale_strategy.py); a checkpoint write killed midway is
in test_faults.py's slow tier and the soak."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.chaos import SoakConfig, soak

FAULTS = ("kill-rank", "corrupt-checkpoint", "kill-reader", "idle-connection")


def test_a_short_chaos_soak_names_every_fault_loses_nothing_and_ends_bitwise_equal(tmp_path: Path) -> None:
    config = SoakConfig(minutes=5, steps=50, faults=FAULTS, seed=1, pause=(1.0, 2.0), rounds=1)
    result = soak(tmp_path, config)
    summary = json.dumps({k: v for k, v in result.items() if k != "injected"}, indent=1)
    assert not result["problems"], summary
    assert sorted(result["faults"]) == sorted(FAULTS), summary  # each kind hit once
    assert result["bitwise_equal"], summary
    stops = sum(result["faults"][k] for k in FAULTS if k != "idle-connection")
    assert result["attempts"] == stops + 1, summary
    assert 0 < result["effective_training_time"] < 1, summary
