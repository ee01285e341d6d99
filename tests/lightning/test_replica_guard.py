"""MegaScaleStrategy's run-time replica check (``replica_check_steps``, default 2) in Lightning fits.

A norm in the sequence-parallel region whose gradient nobody sums over tp (the plan's first-forward check
opted out with 'replicated_unsummed'), and a gradient changed on one data-parallel rank after the reduction,
are stopped at the first optimizer step with one error naming the parameter, the group and the ranks; the
clean transformer at tp2 and the same broken one with the check turned off (replica_check_steps=0) run on.
"""

from __future__ import annotations

import pytest

from tests.lightning._launch import fit
from tests.lightning.test_own_module import own_job

GUARD = "tests.lightning._guard_modules"


def _job(name: str, module: str, strategy: dict, dp: int) -> dict:
    job = own_job(name, "OwnTransformerModule", strategy, dp, steps=3)
    job["module_class"] = f"{GUARD}.{module}" if module else job["module_class"]
    return job


def test_clean_runs_and_a_check_turned_off_run_on(tmp_path):
    jobs = [_job("clean tp2", "", dict(tp=2), 1),
            _job("unsummed, check off", "UnsummedNormModule", dict(tp=2, replica_check_steps=0), 1)]  # fmt: skip
    results = fit(jobs, 2, tmp_path)
    assert len(results["clean tp2"]["losses"]) == 3 and len(results["unsummed, check off"]["losses"]) == 3


@pytest.mark.parametrize(
    ("module", "strategy", "dp", "messages"),
    [
        ("UnsummedNormModule", dict(tp=2), 1, ["blocks.0.mlp_norm.weight over tp ranks [0, 1]: rank 0 has sum"]),
        # one parameter named, over dp; ZeRO-1 by parameters all-reduces whole gradients, so it is checked too
        ("PerturbedGradientModule", dict(zero_stage=0), 2,
         ["(1 disagreeing)", "model.head.proj.weight over dp ranks [0, 1]: rank 0 has sum"]),
        ("PerturbedGradientModule", dict(zero_stage=1, zero1_sharding="parameters"), 2,
         ["(1 disagreeing)", "model.head.proj.weight over dp ranks [0, 1]: rank 0 has sum"]),
    ],
)  # fmt: skip
def test_replicas_that_disagree_stop_the_run_at_the_first_step_naming_the_parameter(
    tmp_path, module, strategy, dp, messages
):
    job = _job(module, module, strategy, dp)
    job["trainer"]["gradient_clip_val"] = None  # else rank 1's changed norm rescales all its gradients
    with pytest.raises(RuntimeError) as info:
        fit([job], 2, tmp_path)
    text = str(info.value)
    assert (
        "ReplicaMismatchError: replica check at optimizer step 1: ranks that should hold the same gradients"
        in text
    )
    for message in messages:
        assert message in text, text[-3000:]
