"""``GPTModule(pretrained=HF_DIR)``: continue training a Hugging Face checkpoint under any layout, and export it.

The tiny Llama of tests/core/hf (llama3 rope scaling, GQA, vocabulary 200 padded to 256; for tp2 × pp2 with
tied embeddings, the first stage holding the embedding and the last a copy) is fitted three
AdamW steps on one process (Lightning's default strategy, no meta device: ``configure_model`` loads it) and
under MegaScaleStrategy tp2 × pp2 on 4 gloo ranks (meta device: loaded by ``parallelize`` after the split,
each rank reading its slices). The loss of the first step, computed from the loaded weights, agrees to 1e-5
(float32, sums in another order: see test_strategy.py), as do the later losses and the final weights (2e-5,
AdamW's bound there); observed 1e-6 and 1.8e-6. The final weights lie within 0.01 of the checkpoint's (three
AdamW steps of lr ≤ 1e-3): a run that ignored the checkpoint (a fresh init of the same seed on both sides,
which would agree with each other) is 0.6 away. The tp2 × pp2 checkpoint then goes through
``megascale convert --to-hf``: transformers loads the export, and its logits equal those of megascale's GPT
rebuilt on one process from the same checkpoint (1e-5; observed equal). A tiny Mixtral continues under ep2
(its experts split over the two ranks, each reading its own) as it does on one process, with the same bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megascale.core import GPTConfig
from megascale.core.hf import gpt_from_hf
from megascale.lightning import GPTModule
from megascale.lightning.checkpoint_io import convert_to_torch, load_gpt
from megascale.lightning.cli import main
from tests.core.hf._tiny_hf import VOCAB, save_tiny, tokens
from tests.lightning._launch import fit

LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5
LOGIT_TOL = 1e-5
MODULE = dict(optimizer="adamw", lr=1e-3, warmup_steps=1, decay_steps=20, weight_decay=0.1)


def _job(name: str, hf_dir: Path, strategy: dict | None, **extra) -> dict:
    return dict(
        name=name,
        strategy=strategy,
        module_class="megascale.lightning.GPTModule",
        module={**MODULE, "pretrained": str(hf_dir)},
        data=dict(source=f"random:{VOCAB}", seq_len=16, batch_size=8, max_bytes=20_000, shuffle=True),
        trainer=dict(max_steps=3, gradient_clip_val=1.0),
        **extra,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny("llama", False, path)
    return path


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tied_llama")
    save_tiny("llama", True, path)
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process export reads DCP alone
def test_tp2_x_pp2_continues_from_the_checkpoint_as_one_process_does_and_exports(tied_llama, tmp_path):
    """The Llama's embeddings are tied (tie_word_embeddings=True): under pp the first stage holds the embedding
    and the last a copy (issue 47); the checkpoint holds one tensor and the export ties them again."""
    llama = tied_llama
    one = fit([_job("one process", llama, None)], 1, tmp_path / "one")["one process"]
    ckpt = tmp_path / "tp2pp2.ckpt"
    split = fit([_job("tp2×pp2", llama, dict(tp=2, pp=2), save_at_end=str(ckpt))], 4, tmp_path / "four")
    split = split["tp2×pp2"]

    # step 0: the loaded weights' loss; then the same training
    assert len(one["losses"]) == len(split["losses"]) == 3
    for step, (got, want) in enumerate(zip(split["losses"], one["losses"])):
        assert got == pytest.approx(want, abs=LOSS_TOL), f"step {step}: {got} vs {want}"
    worst = max((split["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
    assert worst <= WEIGHT_TOL, worst
    # it continued from the checkpoint: AdamW moves an element by at most ~lr (1e-3) per step, while an
    # independent init (std 0.1 here) would differ by ~0.1
    start = gpt_from_hf(llama).state_dict()
    moved = [
        (split["weights"][f"model.{k}"] - v).abs().max().item() for k, v in start.items() if "rope" not in k
    ]
    assert 1e-4 < max(moved) <= 0.01, moved

    out = tmp_path / "export"
    assert main(["convert", "--to-hf", str(ckpt), str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    convert_to_torch(ckpt, tmp_path / "model.pt")
    ours = load_gpt(tmp_path / "model.pt").eval()
    x = tokens()
    with torch.no_grad():
        assert (hf(x).logits - ours(x)[..., :VOCAB]).abs().max().item() <= LOGIT_TOL
    trained = {k.removeprefix("model."): v for k, v in split["weights"].items()}
    assert all(torch.equal(ours.state_dict()[k].float(), trained[k]) for k in trained if "rope" not in k)


# ---- one process, no Trainer -------------------------------------------------------------------------------


def test_configure_model_loads_the_checkpoint_without_a_strategy(llama):
    module = GPTModule(pretrained=str(llama))
    assert module.config == gpt_from_hf(llama).config
    module.configure_model()
    hf = AutoModelForCausalLM.from_pretrained(llama).eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(module(x)[..., :VOCAB], hf(x).logits)
    # a checkpoint's hyperparameters give the same module back
    again = GPTModule(**module.hparams)
    assert again.config == module.config and again.pretrained == str(llama)


def test_a_given_config_must_build_the_checkpoints_network(llama):
    hf_config = gpt_from_hf(llama).config.to_dict()
    with pytest.raises(ValueError, match=r"model\.config conflicts .* n_layers=3 \(reference: 2\)"):
        GPTModule(GPTConfig(**{**hf_config, "n_layers": 3}), pretrained=str(llama))
    with pytest.raises(ValueError, match="d_model=768"):  # a partial config: the defaults conflict
        GPTModule(GPTConfig(vocab_size=VOCAB), pretrained=str(llama))
    shorter = GPTModule(GPTConfig(**{**hf_config, "max_seq_len": 32, "dropout": 0.1}), pretrained=str(llama))
    assert shorter.config.max_seq_len == 32 and shorter.config.dropout == 0.1
    with pytest.raises(ValueError, match="init_seed=1 has no effect"):
        GPTModule(pretrained=str(llama), init_seed=1)
    with pytest.raises(ValueError, match="needs a config"):
        GPTModule()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        GPTModule(pretrained=str(llama.parent))


def test_a_mixtral_checkpoint_continues_under_expert_parallelism_as_one_process_does(tmp_path):
    """The tiny Mixtral (4 experts, top 2) of tests/core/hf loaded under ep2 (each rank reading its own
    experts, ``parallelize`` after the split) trains three steps as one process does (Lightning's default
    strategy, loaded by ``configure_model``): the first step's loss is the loaded weights'."""
    path = tmp_path / "mixtral"
    save_tiny("mixtral", False, path)
    one = fit([_job("one process", path, None)], 1, tmp_path / "one")["one process"]
    ep2 = _job("ep2", path, dict(ep=2, zero_stage=0))
    ep2["data"]["batch_size"] = 4  # per rank: the same 8 sequences a step over the two data-parallel ranks
    split = fit([ep2], 2, tmp_path / "two")["ep2"]
    assert split["layout"]["ep"] == 2 and len(one["losses"]) == len(split["losses"]) == 3
    for step, (got, want) in enumerate(zip(split["losses"], one["losses"])):
        assert got == pytest.approx(want, abs=LOSS_TOL), f"step {step}: {got} vs {want}"
    worst = max((split["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
    assert worst <= WEIGHT_TOL, worst
    start = gpt_from_hf(path).state_dict()
    moved = [
        (split["weights"][f"model.{k}"] - v).abs().max().item() for k, v in start.items() if "rope" not in k
    ]
    assert 1e-4 < max(moved) <= 0.01, moved  # it continued from the checkpoint
