"""`FaultTolerance` in a Lightning DDP fit under ``megascale-ft launch``: faults are reported, and the restarted
fit resumes from the last committed checkpoint and ends bit for bit where an uninterrupted fit does.

Every fit is ``tests/ft/_fit_lightning.py`` on 2 CPU ranks (8 AdamW steps, a checkpoint every 2), launched as a
subprocess (a multi-process fit cannot run inside pytest: shared notes). Only lightning and megascale-ft are
needed. A resumed fit is also checked to have really resumed (``restored_step``): a fit that silently started
over would end with the same weights too.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.ft._launch import launch_fit

SCRIPT = "tests/ft/_fit_lightning.py"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    result, report = launch_fit(tmp_path, SCRIPT)
    assert len(report["attempts"]) == 1 and report["attempts"][0]["fault"] is None
    assert result["restored_step"] is None
    # every rank's step timings reached the driver, sections included
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}
    for rank in (0, 1):
        assert {(rank, n) for n in ("step", "forward", "backward", "optimizer")} <= names
    return result


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs by {(a[key] - b[key]).abs().max().item()}"


@pytest.mark.parametrize(
    ("fault", "kind"), [("sigkill@5:1", "dead"), pytest.param("nan@5:1", "nan", marks=pytest.mark.slow)]
)  # CI tier: the death; a NaN is detected the same way as in tests/ft/test_faults.py
def test_a_fault_is_reported_and_the_restarted_fit_ends_bitwise_equal(
    uninterrupted: dict[str, Any], tmp_path: Path, fault: str, kind: str
) -> None:
    result, report = launch_fit(tmp_path, SCRIPT, "--fault", fault)
    attempts = report["attempts"]
    assert len(attempts) == 2 and report["ok"]
    assert attempts[0]["fault"]["kind"] == kind and attempts[0]["fault"]["rank"] == 1
    assert attempts[1]["fault"] is None
    # the fault came at step 5, after the checkpoints of steps 2 and 4 (4 may still have been persisting)
    assert result["restored_step"] in (2, 4)
    _assert_bitwise_equal(result["weights"], uninterrupted["weights"])


def test_lightning_state_is_kept_as_json_and_what_json_cannot_hold_is_refused_by_name() -> None:
    from megascale.ft.lightning import _from_json, _to_json

    state = {
        "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {
            "best_model_score": torch.tensor(0.25), "kth_value": torch.tensor(float("inf")),
            "best_k_models": {"a.ckpt": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)},
        }},
        "lr_schedulers": [{"base_lrs": [0.01], "lr_lambdas": [None], "betas": (0.9, 0.95)}],
        "numpy_scalar": np.float64(0.5),
    }  # fmt: skip
    encoded = {k: _to_json(v, k) for k, v in state.items()}
    json.dumps(encoded)  # nothing but JSON types
    back = _from_json(encoded)
    (saved,) = back["callbacks"].values()
    assert saved["best_model_score"].dtype == torch.float32 and float(saved["best_model_score"]) == 0.25
    assert torch.isinf(saved["kth_value"])
    assert saved["best_k_models"]["a.ckpt"].dtype == torch.bfloat16
    assert saved["best_k_models"]["a.ckpt"].tolist() == [[1.5, -2.0]]
    assert back["lr_schedulers"][0]["betas"] == (0.9, 0.95) and type(back["numpy_scalar"]) is float
    with pytest.raises(TypeError, match=r"callbacks\.Timer\.started_at is a datetime\.datetime"):
        _to_json({"Timer": {"started_at": datetime.now()}}, "callbacks")


def test_strategies_with_their_own_checkpoint_engines_are_refused() -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from megascale.ft.lightning import _check_strategy

    _check_strategy(SingleDeviceStrategy("cpu"))
    _check_strategy(DDPStrategy())
    with pytest.raises(ValueError, match="FaultTolerance does not support ModelParallelStrategy"):
        _check_strategy(ModelParallelStrategy())
