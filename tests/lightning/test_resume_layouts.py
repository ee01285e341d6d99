"""A checkpoint saved under one layout and resumed under another continues exactly like one process.

The conformance matrix (tests/conformance) resumes every pair of its twelve layouts; here megascale's GPT under
the layouts it lacks (issue 22 item 10's pp2 × dp2 ZeRO-1 → dp4 ZeRO-1, dp4 → dp2, dp2 → pp2 × dp2). Each
saves once, after step 3 of 6, and resumes once, another layout's checkpoint, for steps 4-6; the resumed run
must then end as one process running all 6 steps does: the logged loss of each step, the samples of each
global batch, the final weights and the final optimizer state (AdamW's moments and step count, and the
learning rate the scheduler reached). The dp4 checkpoint is also resumed on one process. The world-4
checkpoints are written by ``trainer.save_checkpoint`` after a 3-step fit (once Lightning tore the strategy
down: ZeRO-1's state is still in pieces then and must be gathered whole, issue 22 item 10), the dp2 one by a
ModelCheckpoint at step 3 of a 6-step fit (whose own six steps are compared too). A checkpoint no layout can load is refused on every rank by a message naming
both layouts.

Tolerances: test_strategy.py's for losses (1e-5) and weights (2e-5 after AdamW), for its reasons (float32,
only the order of sums differs). AdamW's moments are not amplified as its update is: m is an average of
gradients and v of their squares, which differ between layouts by the order of sums (~1e-6 relative after six
steps), so each moment must agree within 1e-4 of its tensor's largest magnitude; lost or restarted moments
(or moments of another parameter) differ by their whole size, and a step count or learning rate by 1e-3 or
more (warmup).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.lightning._launch import fit
from tests.lightning.test_strategy import CONFIG, LOSS_TOL, _compare, job

STEPS, SAVED_AT = 6, 3
STATE_TOL = 1e-4  # relative to the largest magnitude of each optimizer-state tensor

# name: (strategy kwargs, dp size); world = dp × tp × pp. The conformance matrix (tests/conformance) resumes
# every pair of its twelve layouts with a model of a user's own; these are the layouts it lacks, with the GPT,
# and the save after fit (Lightning has torn the strategy down then).
WORLD2 = {
    "dp2/zero1 elements": (dict(zero_stage=1), 2),
    "cp2/zero1": (dict(cp=2, zero_stage=1), 1),  # issue 26: saved at cp2, resumed at cp4 and on one process
}
WORLD4 = {
    "pp2×dp2/zero1": (dict(pp=2, zero_stage=1), 2),  # the layout of issue 22 item 10
    "dp4/zero1": (dict(zero_stage=1), 4),
    "cp4/zero1": (dict(cp=4, zero_stage=1), 1),
}
LAYOUTS = {**WORLD2, **WORLD4}
# saved by a ModelCheckpoint during a 6-step fit; the others by trainer.save_checkpoint after a 3-step fit
SAVED_DURING_FIT = {"dp2/zero1 elements"}
# resumed layout <- saved layout: one cycle through every layout
RESUMES = {
    "dp4/zero1": "pp2×dp2/zero1",  # issue 22 item 10: pp2×dp2 ZeRO-1 elements -> dp4 ZeRO-1
    "dp2/zero1 elements": "dp4/zero1",  # 4 -> 2: a run shrunk after losing ranks
    "pp2×dp2/zero1": "dp2/zero1 elements",  # 2 -> 4, no pp -> pp
    "cp4/zero1": "cp2/zero1",  # the sequence split 4 ways instead of 2
    "cp2/zero1": "cp4/zero1",
}
ONE_PROCESS_RESUMES = ("dp4/zero1", "cp2/zero1")  # cp2 -> cp1


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _checkpoint(root: Path, saved: str) -> str:
    if saved in SAVED_DURING_FIT:
        return str(root / _slug(saved) / f"step={SAVED_AT}.ckpt")
    return str(root / f"{_slug(saved)}-step{SAVED_AT}.ckpt")


def _save_job(name: str, root: Path) -> dict:
    kwargs, dp = LAYOUTS[name]
    if name in SAVED_DURING_FIT:
        extra = dict(checkpoint_every=SAVED_AT, checkpoint_dir=str(root / _slug(name)), optimizer_state=True)
        return job(f"save {name}", kwargs, dp, steps=STEPS, **extra)
    return job(f"save {name}", kwargs, dp, steps=SAVED_AT, save_at_end=_checkpoint(root, name))


def _resume_job(name: str, saved: str, root: Path) -> dict:
    kwargs, dp = LAYOUTS.get(name, (dict(), 1))
    return job(f"{name} <- {saved}", kwargs, dp, steps=STEPS, resume_from=_checkpoint(root, saved),
               optimizer_state=True)  # fmt: skip


def _compare_all(result: dict, reference: dict, name: str, first_step: int = 0) -> None:
    """Losses, weights, samples and optimizer state against one process's steps from ``first_step`` on."""
    tail = {"losses": reference["losses"][first_step:], "weights": reference["weights"]}
    _compare(result, tail, name)
    assert result["samples"] == reference["samples"][first_step:], f"{name}: other samples than one process"
    state, want = result["optimizer"], reference["optimizer"]
    assert state.keys() == want.keys(), f"{name}: optimizer state keys {sorted(state.keys() ^ want.keys())}"
    for key, value in want.items():
        worst = (state[key] - value).abs().max().item()
        assert worst <= STATE_TOL * max(value.abs().max().item(), 1e-12), (
            f"{name}: {key} differs by {worst:.2e}"
        )


def _pieces_checkpoint(source: str, target: Path) -> str:
    """``source`` rewritten as megascale wrote a ZeRO-1 elements checkpoint after fit before issue 22: one
    optimizer state as this rank's flat piece of the parameter (half of it) instead of the whole."""
    reader = FileSystemReader(source)
    state = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if hasattr(item, "size"):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    key = "optimizer_0.state.model.embed.weight.exp_avg"
    state[key] = state[key].flatten()[: state[key].numel() // 2].clone()
    target.mkdir(parents=True)
    dcp.save(state, checkpoint_id=target, no_dist=True)
    shutil.copy(Path(source) / "meta.pt", target / "meta.pt")
    return str(target)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_checkpoint_resumes_under_every_other_layout_exactly_like_one_process(tmp_path):
    root = tmp_path / "checkpoints"
    saves4 = fit([_save_job(name, root) for name in WORLD4], 4, tmp_path / "save4")
    jobs2 = [_save_job(name, root) for name in WORLD2]
    jobs2 += [_resume_job(name, RESUMES[name], root) for name in WORLD2]
    broken = _pieces_checkpoint(_checkpoint(root, "dp4/zero1"), tmp_path / "pieces.ckpt")
    jobs2.append(job("refused", dict(zero_stage=1), 2, steps=STEPS, resume_from=broken, expect_error=True))
    runs2 = fit(jobs2, 2, tmp_path / "run2", timeout=900)
    resumes4 = fit([_resume_job(name, RESUMES[name], root) for name in WORLD4], 4, tmp_path / "resume4")
    ones = [job("one process", None, 1, steps=STEPS, optimizer_state=True)]
    ones += [_resume_job("one process", saved, root) for saved in ONE_PROCESS_RESUMES]
    other_model = dict(CONFIG, d_model=48)
    ones.append({**job("other model", dict(), 1, steps=STEPS, expect_error=True), "config": other_model,
                 "resume_from": _checkpoint(root, "pp2×dp2/zero1")})  # fmt: skip
    runs1 = fit(ones, 1, tmp_path / "run1")
    reference = runs1.pop("one process")
    assert all(len(step) == 8 for step in reference["samples"])  # the global batch, distinct samples

    results = {**saves4, **runs2, **resumes4, **runs1}
    for name in LAYOUTS:
        saved = results.pop(f"save {name}")
        if name in SAVED_DURING_FIT:
            _compare_all(saved, reference, f"{name} (6 steps, saved at {SAVED_AT})")
        else:
            assert saved["losses"] == pytest.approx(reference["losses"][:SAVED_AT], abs=LOSS_TOL), name
            assert saved["samples"] == reference["samples"][:SAVED_AT], name
    for name in results:
        if name in ("refused", "other model"):
            continue
        _compare_all(results[name], reference, f"resumed {name}", first_step=SAVED_AT)
    message = results["refused"]["error"]
    assert "ZeRO-1 pieces" in message and "embed.weight.exp_avg" in message, message
    assert "dp4 × pp1 × tp1, ZeRO-1 (zero1_sharding='elements')" in message, message  # as saved
    assert "under dp2 × pp1 × tp1, ZeRO-1 (zero1_sharding='elements')" in message, message  # this run
    message = results["other model"]["error"]
    assert "the model differs" in message and "dp2 × pp2 × tp1" in message, message


def test_a_checkpoint_of_another_optimizer_or_model_is_refused_by_name(tmp_path):
    """One process, checkpoint_io directly: what the checkpoint lacks is named with both layouts before DCP
    reads anything (DCP's own error would name neither)."""
    from megascale.lightning import checkpoint_io

    layout = dict(dp=2, pp=1, tp=2, zero_stage=2, zero1_sharding="elements", sequence_parallel=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adamw.step()
    path = tmp_path / "adamw.ckpt"
    meta = {checkpoint_io.LAYOUT_KEY: layout}
    checkpoint_io.save(path, model, [adamw], meta, is_global_zero=True, barrier=lambda: None)

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="cannot resume") as info:
        checkpoint_io.load(path, model, [sgd], layout=dict(layout, dp=1))
    message = str(info.value)
    assert "saved under dp2 × pp1 × tp2 (sequence parallel), ZeRO-2) under dp1 × pp1 × tp2" in message
    assert "it has no optimizer_0." in message and "momentum" in message and "same optimizer" in message

    wider = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match=r"state_dict.weight has shape \(3, 4\), this run's \(5, 4\)"):
        checkpoint_io.load(path, wider, [torch.optim.AdamW(wider.parameters())])
    loaded = checkpoint_io.load(path, model, [torch.optim.AdamW(model.parameters())])
    assert loaded[checkpoint_io.LAYOUT_KEY] == layout
