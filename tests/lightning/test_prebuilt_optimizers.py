"""An optimizer built before fit (issue 48, case 1): ``configure_optimizers`` returns an optimizer made in
``__init__`` over ``self.parameters()``, before the strategy splits the model.

Splitting replaces the parameters (FSDP2's shards at ZeRO-2/3, DTensors under tp), so such an optimizer stepped
tensors the model no longer used: the weights never moved (a weight sum stayed where it started), silently,
and the first checkpoint then failed with ``KeyError: 0``. Now it steps the split parameters and every layout
ends where one process does (tolerances of test_strategy.py); under pp, where a rank holds its own stage's
layers only, the run stops at start-up saying to build the optimizer in ``configure_optimizers``.
"""

from __future__ import annotations

from tests.lightning._launch import fit
from tests.lightning.test_own_module import own_job
from tests.lightning.test_strategy import _compare

MODULE = "PrebuiltOptimizerModule"


def test_an_optimizer_built_before_fit_trains_the_split_model(tmp_path):
    reference = fit([own_job("one", MODULE, None, 1)], 1, tmp_path / "ref")["one"]
    jobs = [
        own_job("dp2/zero2", MODULE, dict(zero_stage=2), 2),
        own_job("dp2/zero3", MODULE, dict(zero_stage=3), 2, checkpoint_every=2,
                checkpoint_dir=str(tmp_path / "ckpt")),
        own_job("tp2", MODULE, dict(tp=2), 1),
        own_job("pp2", MODULE, dict(pp=2), 1, expect_error=True),
    ]  # fmt: skip
    results = fit(jobs, 2, tmp_path)
    for name in ("dp2/zero2", "dp2/zero3", "tp2"):
        _compare(results[name], reference, name)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=2.ckpt", "step=4.ckpt"]
    assert "Build the optimizer inside configure_optimizers" in results["pp2"]["error"]
