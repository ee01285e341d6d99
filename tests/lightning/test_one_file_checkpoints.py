"""``MegaScaleStrategy(save_distributed_checkpoint=False)``: one checkpoint file in Lightning's own form (issue 48
case 6), which Lightning's readers take (``os.path.isfile``, ``torch.load(weights_only=True)``,
``load_from_checkpoint``) and every layout resumes, DDP's included, both ways.

Each layout trains the GPT 4 steps with a ModelCheckpoint every 2 (as DDP does, which writes the same form);
another layout resumes its step-2 file (a cycle through all, DDP -> ZeRO-3 and pp2 -> DDP among them) and must
end as DDP's own 4 steps: losses of steps 3-4, samples, weights and AdamW's state, to test_resume_layouts's
tolerances. The files' weights must be the saving run's exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from megascale.lightning import GPTModule
from tests.lightning._launch import fit
from tests.lightning.test_resume_layouts import _compare_all
from tests.lightning.test_strategy import job

STEPS, SAVED_AT = 4, 2
ONE_FILE = dict(save_distributed_checkpoint=False)
# name: (strategy kwargs or None for Lightning's DDPStrategy, dp size); world 2
SAVERS = {
    "ddp": (None, 2),
    "dp2/zero0": (dict(zero_stage=0, **ONE_FILE), 2),
    "dp2/zero1": (dict(zero_stage=1, **ONE_FILE), 2),
    "dp2/zero1 by parameters": (dict(zero_stage=1, zero1_sharding="parameters", **ONE_FILE), 2),
    "dp2/zero2": (dict(zero_stage=2, **ONE_FILE), 2),
    "dp2/zero3": (dict(zero_stage=3, **ONE_FILE), 2),
    "tp2": (dict(tp=2, **ONE_FILE), 1),
    "pp2": (dict(pp=2, **ONE_FILE), 1),
}
# resumed layout <- the layout whose file it resumes: one cycle through every layout
RESUMES = {
    "dp2/zero3": "ddp",
    "ddp": "pp2",
    "pp2": "dp2/zero1 by parameters",
    "dp2/zero1 by parameters": "dp2/zero0",
    "dp2/zero0": "tp2",
    "tp2": "dp2/zero1",
    "dp2/zero1": "dp2/zero2",
    "dp2/zero2": "dp2/zero3",
}


def _slug(name: str) -> str:
    return name.replace("/", "-").replace(" ", "-")


def test_one_file_checkpoints_are_lightnings_and_resume_under_every_layout_and_ddp(tmp_path):
    root = tmp_path / "checkpoints"
    jobs = []
    for name, (strategy, dp) in SAVERS.items():
        jobs.append(job(name, strategy, dp, steps=STEPS, checkpoint_every=SAVED_AT, checkpoint_dir=str(root / _slug(name)),
                        optimizer_state=True))  # fmt: skip
    for name, saved in RESUMES.items():
        strategy, dp = SAVERS[name]
        strategy = None if strategy is None else {k: v for k, v in strategy.items() if k not in ONE_FILE}
        jobs.append(job(f"{name} <- {saved}", strategy, dp, steps=STEPS, optimizer_state=True,
                        resume_from=str(root / _slug(saved) / f"step={SAVED_AT}.ckpt")))  # fmt: skip
    results = fit(jobs, 2, tmp_path, timeout=900)
    reference = results["ddp"]
    for name in SAVERS:
        _compare_all(results[name], reference, name)
        last = root / _slug(name) / f"step={STEPS}.ckpt"
        assert os.path.isfile(last), f"{name}: {last} is not one file"
        saved = torch.load(last, weights_only=True, map_location="cpu")
        assert len(saved["optimizer_states"]) == 1 and saved["optimizer_states"][0]["state"], name
        loaded = GPTModule.load_from_checkpoint(last).state_dict()
        assert loaded.keys() == results[name]["weights"].keys(), name
        for key, value in results[name]["weights"].items():
            assert torch.equal(saved["state_dict"][key].float(), value), f"{name}: {key} saved otherwise"
            assert torch.equal(loaded[key].float(), value), f"{name}: {key} loaded otherwise"
    for name, saved in RESUMES.items():
        _compare_all(results[f"{name} <- {saved}"], reference, f"{name} <- {saved}", first_step=SAVED_AT)


def test_the_best_checkpoint_serves_validate_test_and_predict_in_either_form(tmp_path):
    # ModelCheckpoint keeping the 2 best by val/loss, then trainer.validate/test/predict(ckpt_path="best"): each
    # loads that checkpoint (a directory or a file) into the split model, so validation gives back the very
    # score it was kept for. mode="max" keeps the earliest validations: "best" is not the weights fit ended
    # with, which a load that did nothing would also validate
    forms = {
        "dp2/zero3 directory": (dict(zero_stage=3), 2),
        "dp2/zero1 file": (dict(zero_stage=1, **ONE_FILE), 2),
        "tp2 file": (dict(tp=2, **ONE_FILE), 1),
    }
    jobs = []
    for name, (strategy, dp) in forms.items():
        j = job(name, strategy, dp, steps=6, best_dir=str(tmp_path / _slug(name)), best_mode="max")
        j["trainer"] = dict(j["trainer"], val_check_interval=2, limit_val_batches=2, limit_test_batches=2,
                            limit_predict_batches=2)  # fmt: skip
        jobs.append(j)
    results = fit(jobs, 2, tmp_path)
    for name in forms:
        result = results[name]
        assert len(result["kept"]) == 2 and not result["best_path"].endswith("step=6.ckpt"), name
        assert os.path.isfile(result["best_path"]) == name.endswith("file"), name
        assert result["validated"]["val/loss"] == pytest.approx(result["best_score"], abs=1e-6), name
        assert result["tested"]["test/loss"] == pytest.approx(result["best_score"], abs=1e-6), name
        assert result["predicted"] is not None and result["predicted"].shape[-1] == 100, name


def test_a_one_file_checkpoint_goes_to_and_comes_from_a_url(tmp_path):
    # written by the strategy's CheckpointIO (fsspec) on rank 0 and read on every rank: a file:// URL here, as
    # an s3:// one would be (Lightning's TorchCheckpointIO takes both); saved after a ZeRO-1 fit, resumed at ZeRO-3
    url = f"file://{tmp_path}/remote/step2.ckpt"
    jobs = [
        job("uninterrupted", dict(zero_stage=3), 2, steps=STEPS, optimizer_state=True),
        job("saved", dict(zero_stage=1, **ONE_FILE), 2, steps=SAVED_AT, save_at_end=url),
        job("resumed", dict(zero_stage=3), 2, steps=STEPS, resume_from=url, optimizer_state=True),
    ]
    results = fit(jobs, 2, tmp_path)
    assert os.path.isfile(tmp_path / "remote" / "step2.ckpt")
    _compare_all(results["resumed"], results["uninterrupted"], "resumed from a URL", first_step=SAVED_AT)


def test_a_checkpoint_directory_at_a_url_is_refused_by_name(tmp_path):
    # DCP directories are written with local paths: an s3:// URL made a local folder named "s3:" silently
    jobs = [
        job(
            "directory",
            dict(zero_stage=1),
            2,
            steps=1,
            save_at_end="s3://bucket/run/end.ckpt",
            expect_error=True,
        )
    ]
    results = fit(jobs, 2, tmp_path)
    assert (
        "save one file instead (MegaScaleStrategy(save_distributed_checkpoint=False)"
        in results["directory"]["error"]
    )
