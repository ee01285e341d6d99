"""Loading a Hugging Face checkpoint into a GPT in any layout: ``GPT.weights_source`` + ``parallelize``.

A tiny Llama (llama3 rope scaling, GQA, untied, vocabulary 200 padded to 256) and a tiny Qwen2 (q/k/v biases,
tied embeddings) are saved by transformers, then loaded on real gloo ranks under tp2, pp2, dp2 ZeRO-3 and
tp2 × pp2. Against one process (``gpt_from_hf``):

- the weights, gathered from every rank, are bitwise equal (loading copies stored values, no arithmetic);
- the loss of the first batch agrees to 1e-5: float32, the layouts differ only in the order of sums (tensor-
  parallel partial products over 2 ranks, the vocabulary-parallel cross-entropy's max and sum over 2 shards,
  the mean over dp), ~1e-7 relative on a loss of ~5.3; observed equal in every layout here; a shard read
  from the wrong offset (every tensor-parallel rank reading the first) moves it by 3e-3;
- each rank reads exactly the bytes of the slices it holds (counted under safetensors, by a wrapper of
  ``safe_open``): the rows (q, k, v, gate, up; the vocabulary up to its 200 stored rows) or columns (o, down)
  of its tensor-parallel rank, of its pipeline stage's layers only, plus the norm weights every tensor-
  parallel rank keeps whole. Under tp2 × pp2 that is about a quarter of the checkpoint per rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megascale.core import GPT, GPTConfig
from megascale.core.hf import HFWeights, gpt_from_hf, load_hf_weights_
from tests._dist import run_distributed
from tests.core.hf._load_worker import batch, load_and_evaluate
from tests.core.hf._tiny_hf import save_tiny

LOSS_TOL = 1e-5
# rows split over tp: column-parallel projections (weights and biases) and the (padded) vocabulary
_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_COLUMNS = ("o_proj", "down_proj")  # row-parallel: input features split
_VOCAB = ("embed_tokens", "lm_head")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expected_bytes(tensors: dict[str, torch.Tensor], padded_vocab: int, held: dict) -> int:
    """The bytes a rank must read: the part of each stored tensor it holds (see the module docstring)."""
    tp_rank, tp = held["tp"]
    total = 0
    for name, t in tensors.items():
        layer = _LAYER.match(name)
        if layer and int(layer[1]) not in held["layers"]:
            continue
        if "embed_tokens" in name and not held["first"]:
            continue
        if name in ("model.norm.weight", "lm_head.weight") and not held["last"]:
            continue
        if any(k in name for k in _VOCAB):
            rows = padded_vocab // tp
            stored = max(0, min((tp_rank + 1) * rows, t.shape[0]) - tp_rank * rows)
            total += stored * t.shape[1] * t.element_size()
        elif any(k in name for k in _ROWS + _COLUMNS):
            total += t.numel() // tp * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def _reference(hf_dir: Path) -> tuple[float, dict[str, torch.Tensor], GPTConfig]:
    model = gpt_from_hf(hf_dir)
    inputs, targets = batch(model.config.vocab_size)
    with torch.no_grad():
        loss = float(model(inputs, targets))
    weights = {k: v.float() for k, v in model.state_dict().items() if "rope" not in k}
    return loss, weights, model.config


def _check(results: list[dict], hf_dir: Path) -> None:
    loss, weights, config = _reference(hf_dir)
    stored = load_file(hf_dir / "model.safetensors")
    whole = sum(t.numel() * t.element_size() for t in stored.values())
    for name in results[0]:
        for rank, result in enumerate(results):
            got = result[name]
            assert got["loss"] == pytest.approx(loss, abs=LOSS_TOL), (
                f"{name} rank {rank}: {got['loss']} vs {loss}"
            )
            assert got["weights"].keys() == weights.keys(), name
            unequal = [k for k in weights if not torch.equal(got["weights"][k], weights[k])]
            assert not unequal, f"{name}: weights differ from one process's: {unequal}"
            read = sum(n for _, n in got["reads"])
            want = expected_bytes(stored, config.padded_vocab_size, got)
            assert read == want, (
                f"{name} rank {rank}: read {read} bytes, holds {want} ({read / whole:.2f} of all)"
            )
            assert len({t for t, _ in got["reads"]}) == len(got["reads"]), f"{name}: a tensor read twice"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny("llama", False, path)
    return path


def test_two_rank_layouts_load_the_one_process_weights_reading_only_their_slices(llama, tmp_path):
    save_tiny("qwen2", True, tmp_path / "qwen2")
    layouts = {
        "tp2": dict(tp=2),
        "pp2": dict(pp=2),
        "dp2 zero3": dict(zero_stage=3),
    }
    _check(run_distributed(load_and_evaluate, 2, str(llama), layouts), llama)
    tied = {"tp2 qwen2 tied": dict(tp=2, sequence_parallel=False)}
    _check(run_distributed(load_and_evaluate, 2, str(tmp_path / "qwen2"), tied), tmp_path / "qwen2")


def test_tp2_x_pp2_ranks_each_read_about_a_quarter(llama):
    results = run_distributed(load_and_evaluate, 4, str(llama), {"tp2×pp2": dict(tp=2, pp=2)})
    _check(results, llama)
    whole = sum(t.numel() * t.element_size() for t in load_file(llama / "model.safetensors").values())
    shares = [sum(n for _, n in r["tp2×pp2"]["reads"]) / whole for r in results]
    assert all(0.2 < s < 0.3 for s in shares), shares
    assert sum(shares) == pytest.approx(1.0, abs=0.02)  # + the norm weights both tp ranks read


# ---- one process ---------------------------------------------------------------------------------------


def test_a_config_that_builds_another_network_is_refused_naming_the_field(llama):
    config = gpt_from_hf(llama).config
    wrong = GPTConfig(**{**config.to_dict(), "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"rope_theta=10000\.0 \(reference: 500000\.0\)"):
        load_hf_weights_(GPT(wrong), llama)
    fine = GPTConfig(**{**config.to_dict(), "max_seq_len": 32, "pad_vocab_to_multiple_of": 64})
    report = load_hf_weights_(GPT(fine), llama)
    assert report.bytes_read == report.bytes_in_checkpoint and report.tensors == 21


def test_meta_parameters_and_a_seed_with_pretrained_are_refused(llama):
    config = gpt_from_hf(llama).config
    with torch.device("meta"):
        model = GPT(config)
    with pytest.raises(ValueError, match="meta device"):
        load_hf_weights_(model, llama)
    model = GPT(config)
    model.weights_source = HFWeights(llama)
    with pytest.raises(ValueError, match="loads its weights from"):
        model.init_weights(seed=3)
    # the attribute before the HF side held the loader: refused by name, never silently random weights
    with pytest.raises(AttributeError, match=r"model.weights_source = megascale.core.hf.HFWeights"):
        model.pretrained = llama
