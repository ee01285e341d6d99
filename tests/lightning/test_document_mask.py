"""Packed documents through Lightning (issue 34): ``TokenDataModule(document_mask=True)`` yields
``(inputs, targets, position_ids)`` restarting at each document, GPTModule passes the positions to the GPT, and
every layout trains as one process does (pipeline stages get each microbatch's positions, context-parallel
ranks their chunks' positions and their queries' documents).
"""

from __future__ import annotations

import pytest
import torch

from megascale.lightning.data import TokenDataModule, TokenWindows
from tests.lightning._launch import fit
from tests.lightning.test_strategy import _compare, job


def test_windows_restart_positions_at_each_document_and_at_the_window_start() -> None:
    windows = TokenWindows(torch.arange(20), 8, document_starts=torch.tensor([0, 3, 11, 12]))
    _, _, first = windows[0]
    _, _, second = windows[1]
    assert first.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert second.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]  # 8..10 continue a document: restarted at the window
    assert len(TokenWindows(torch.arange(20), 8)[0]) == 2  # without documents: (inputs, targets) as before


def test_a_text_directorys_files_are_its_documents(tmp_path) -> None:
    for name, text in (("a.txt", b"abcde"), ("b.txt", b"fghijklmno"), ("c.txt", b"pqrstuvwxyz")):
        (tmp_path / name).write_bytes(text)
    data = TokenDataModule(str(tmp_path), seq_len=8, batch_size=1, val_fraction=0.0, shuffle=False,
                           document_mask=True)  # fmt: skip
    data.setup()
    assert data.train_dataset is not None
    inputs, _, positions = data.train_dataset[0]
    assert bytes(inputs.tolist()) == b"abcdefgh"
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    _, _, positions = data.train_dataset[1]  # "ijklmnop": b.txt from its 4th byte, then c.txt
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 0]


def _masked(name: str, strategy: dict | None, dp: int, **extra) -> dict:
    j = job(name, strategy, dp, steps=4, **extra)
    j["data"] = {**j["data"], "document_mask": True}
    return j


def test_packed_documents_train_as_one_process_in_every_layout(tmp_path) -> None:
    one = fit([_masked("single", None, 1), job("single causal", None, 1, steps=4)], 1, tmp_path / "one")
    assert one["single"]["losses"] != pytest.approx(one["single causal"]["losses"], abs=1e-4)  # masks matter
    layouts = {"dp2/zero1": (dict(zero_stage=1), 2), "dp2/zero3": (dict(zero_stage=3), 2),
               "tp2+sp": (dict(tp=2, sequence_parallel=True), 1), "pp2": (dict(pp=2), 1),
               "pp2 gpipe": (dict(pp=2, schedule="gpipe"), 1),
               "pp2 interleaved": (dict(pp=2, schedule="interleaved", virtual_stages=2), 1),
               "cp2": (dict(cp=2), 1)}  # fmt: skip
    jobs = [_masked(name, kw, dp) for name, (kw, dp) in layouts.items()]
    results = fit(jobs, 2, tmp_path / "two")
    for name in layouts:  # pp: each microbatch's positions reach every stage's blocks; cp: each rank's chunks
        _compare(results[name], one["single"], name)
