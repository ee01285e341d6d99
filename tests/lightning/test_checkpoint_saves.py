"""What Lightning users do with checkpoints under MegaScaleStrategy (issue 48): a save never changes training.

A checkpoint written before the first optimizer step (a callback saving in ``on_train_start``, a
``ModelCheckpoint`` firing early) used to step every optimizer once: torch.distributed.checkpoint creates the
state of an optimizer that has none by stepping it at learning rate 0 (and ZeRO-1 creates the states a rank
owns), so AdamW's first real step counted 2 and its bias correction moved every weight by ~0.26·lr (2.6e-4
here) from where the same run without the save ends. Each ZeRO stage (and ZeRO-1 by parameters) runs the
same fit with and without that save, in one process group: the weights must be equal to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.lightning._launch import fit
from tests.lightning.test_own_module import own_job
from tests.lightning.test_strategy import job

LAYOUTS = {
    "zero0": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero1-params": dict(zero_stage=1, zero1_sharding="parameters"),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
}
TOL = 1e-6  # the same computation in the same process: observed 0


def test_a_save_before_the_first_step_changes_no_weight(tmp_path):
    jobs = []
    for name, strategy in LAYOUTS.items():
        jobs.append(job(name, strategy, 2, steps=3))
        jobs.append(job(f"{name} saved", strategy, 2, steps=3, save_at_start=str(tmp_path / f"start-{name}")))
    results = fit(jobs, 2, tmp_path)
    for name in LAYOUTS:
        plain, saved = results[name]["weights"], results[f"{name} saved"]["weights"]
        for key, value in plain.items():
            diff = float((saved[key] - value).abs().max())
            assert diff <= TOL, f"{name}: {key} moved {diff:.2e} by a save before the first step"
        assert results[f"{name} saved"]["losses"] == pytest.approx(results[name]["losses"], abs=TOL)


def test_a_fit_resumed_from_a_checkpoint_before_the_first_step_trains_as_the_run_that_saved_it(tmp_path):
    # The save drops the states it created, but they were written: a run resumed from that checkpoint loaded
    # AdamW states of step 1, and its first step counted 2 (the weights moved ~2.6e-4 from the plain run's)
    jobs = []
    for name, strategy in LAYOUTS.items():
        start = str(tmp_path / f"start-{name}")
        jobs.append(job(name, strategy, 2, steps=3, save_at_start=start))
        jobs.append(job(f"{name} resumed", strategy, 2, steps=3, resume_from=start))
    results = fit(jobs, 2, tmp_path)
    for name in LAYOUTS:
        plain, resumed = results[name]["weights"], results[f"{name} resumed"]["weights"]
        for key, value in plain.items():
            diff = float((resumed[key] - value).abs().max())
            assert diff <= TOL, (
                f"{name}: {key} differs by {diff:.2e} after resuming from before the first step"
            )
        assert results[f"{name} resumed"]["losses"] == pytest.approx(results[name]["losses"], abs=TOL)
        # and it holds, converted as a user would, no optimizer state: one process's has none before a step
        converted = tmp_path / f"start-{name}.pt"
        dcp_to_torch_save(tmp_path / f"start-{name}", converted)
        saved = torch.load(converted, weights_only=True)["optimizer_0"]  # DCP's flattened keys
        made_up = [key for key in saved if key.startswith("state.")]
        assert any(key.startswith("param_groups.") for key in saved) and not made_up, f"{name}: {made_up[:3]}"


def test_a_last_checkpoint_linked_under_a_new_name_each_time_replaces_the_old_link(tmp_path):
    # ModelCheckpoint(save_last="link") named "last-{step}": each save links the newest checkpoint under a new
    # name and removes the previous link through the strategy, which used rmtree on it ("Cannot call rmtree on
    # a symbolic link") and must remove the link only
    where = tmp_path / "ckpt"
    job_ = job("dp2/zero1", dict(zero_stage=1), 2, steps=3, checkpoint_every=1, checkpoint_dir=str(where),
               checkpoint_save_last="link", checkpoint_last_name="last-{step}")  # fmt: skip
    fit([job_], 2, tmp_path)
    names = sorted(p.name for p in where.iterdir())
    assert names == ["last-step=3.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"], names
    link = where / "last-step=3.ckpt"
    assert link.is_symlink() and link.resolve() == (where / "step=3.ckpt").resolve()


def test_no_optimizer_trains_saves_and_resumes_and_lbfgs_is_refused_by_name_when_saved(tmp_path):
    # configure_optimizers returning None: Lightning's stand-in optimizer has no state, and the first save
    # failed (KeyError: 'state'), ZeRO-1 refused it naming Lightning's internal _MockOptimizer. LBFGS trains
    # at ZeRO-0/2/3 but its state is not one tensor per parameter: its save failed with torch's words about
    # flattening, now with a message naming it
    jobs = [
        own_job(f"none zero{z}", "NoOptimizerModule", dict(zero_stage=z), 2, steps=2, checkpoint_every=1,
                checkpoint_dir=str(tmp_path / f"none{z}"))
        for z in (0, 1, 2, 3)
    ]  # fmt: skip
    jobs.append(own_job("none resumed", "NoOptimizerModule", dict(zero_stage=3), 2, steps=2,
                        resume_from=str(tmp_path / "none1" / "step=1.ckpt")))  # fmt: skip
    jobs.append(own_job("lbfgs", "LBFGSModule", dict(zero_stage=2), 2, steps=2, checkpoint_every=1,
                        checkpoint_dir=str(tmp_path / "lbfgs"), expect_error=True))  # fmt: skip
    results = fit(jobs, 2, tmp_path)
    for z in (0, 1, 2, 3):
        assert (tmp_path / f"none{z}" / "step=2.ckpt").is_dir(), f"zero{z}"
    assert len(results["none resumed"]["losses"]) == 1  # the step after the checkpoint's
    assert "LBFGS's state cannot be written to a megascale checkpoint" in results["lbfgs"]["error"]


def test_a_resumed_fit_leaves_callbacks_that_can_be_copied(tmp_path):
    # copy.deepcopy(trainer.callbacks) after a fit resumed from ckpt_path failed at ZeRO-0/1 ("cannot pickle
    # ProcessGroup", issue 48 case 9, at 6a71d58); it does not at this test's writing: a guard that it stays so
    saved = str(tmp_path / "saved")
    jobs = [job("zero1", dict(zero_stage=1), 2, steps=2, save_at_end=saved)]
    for z in (0, 1):
        jobs.append(job(f"zero{z} resumed", dict(zero_stage=z), 2, steps=3, resume_from=saved,
                        deepcopy_callbacks=True, checkpoint_every=1, checkpoint_dir=str(tmp_path / f"z{z}")))  # fmt: skip
    results = fit(jobs, 2, tmp_path)
    for z in (0, 1):
        copied = results[f"zero{z} resumed"]["copied_callbacks"]
        assert not any(name.startswith("error") for name in copied), f"zero{z}: {copied}"


def test_load_from_checkpoint_reads_a_checkpoint_directory(tmp_path):
    # MegaScaleStrategy writes directories, and Lightning's load_from_checkpoint raised IsADirectoryError:
    # GPTModule takes the directory, any LightningModule takes checkpoint_io.checkpoint_file(directory)
    import torch

    from megascale.lightning import GPTModule
    from megascale.lightning.checkpoint_io import checkpoint_file
    from tests.lightning._own_modules import PrebuiltOptimizerModule

    gpt, own = str(tmp_path / "gpt"), str(tmp_path / "own")
    jobs = [job("dp2/zero3", dict(zero_stage=3), 2, steps=2, save_at_end=gpt),
            own_job("tp2", "PrebuiltOptimizerModule", dict(tp=2), 1, steps=2, save_at_end=own)]  # fmt: skip
    results = fit(jobs, 2, tmp_path)
    for module, want in [
        (GPTModule.load_from_checkpoint(gpt), results["dp2/zero3"]["weights"]),
        (PrebuiltOptimizerModule.load_from_checkpoint(checkpoint_file(own)), results["tp2"]["weights"]),
    ]:
        got = module.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key].float(), value), key
