"""``dist.all_reduce(p.grad)`` by hand in a hook, as under DDP (issue 48, case 4).

ZeRO-2/3 (and tp, ep) gradients are DTensors, which torch.distributed's collectives refuse with torch's own
"c10d.allreduce_ ... does not have a sharding strategy registered". The run must stop with the layout's cause and
the change (``full_tensor()``, or the strategy's reduce), wherever the hook is; following that advice must give
DDP's values. At c8520fd on_before_optimizer_step's refusal spoke of grad_norm and clipping only, and
on_train_batch_end's was torch's alone.
"""

from __future__ import annotations

import pytest

from tests.lightning._launch import fit
from tests.lightning.test_own_module import own_job

MODULE = "HandReducedGradientsModule"
STAGES = {"ddp": None, **{f"zero{z}": dict(zero_stage=z) for z in (0, 1, 2, 3)}}
TOL = 1e-6


def _job(name: str, strategy: dict | None, where: str, **extra) -> dict:
    j = own_job(name, MODULE, strategy, 2, module_args=dict(where=where), steps=3, **extra)
    j["trainer"] = dict(max_steps=3)
    return j


def test_gradients_reduced_by_hand_match_ddp_or_stop_with_the_layouts_cause(tmp_path):
    jobs = [_job(f"whole {name}", strategy, "whole") for name, strategy in STAGES.items()]
    jobs += [
        _job(f"plain {name}", dict(zero_stage=z), "before_step") for name, z in (("zero0", 0), ("zero1", 1))
    ]
    jobs += [
        _job("before_step zero3", dict(zero_stage=3), "before_step", expect_error=True),
        _job("batch_end zero2", dict(zero_stage=2), "batch_end", expect_error=True),
    ]
    results = fit(jobs, 2, tmp_path)

    ddp = results["whole ddp"]["losses"]
    assert len(ddp) == 3 and all(value != 0 for value in ddp)
    for name in [*(f"whole {n}" for n in STAGES), "plain zero0", "plain zero1"]:
        assert results[name]["losses"] == pytest.approx(ddp, abs=TOL), name

    before = results["before_step zero3"]["error"]
    assert (
        "on_before_optimizer_step or configure_gradient_clipping called a torch.distributed collective"
        in before
    )
    assert "c10d.allreduce_" in before and "full_tensor()" in before
    after = results["batch_end zero2"]["error"]
    assert "c10d.allreduce_" in after  # torch's own error, raised as it is by Lightning...
    assert (
        "MegaScaleStrategy: torch.distributed's collectives take plain tensors" in after
    )  # ...with our note
