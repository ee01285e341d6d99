"""`megascale convert --from-hf` and `--to-hf`: a Hugging Face model becomes the one-file format `load_gpt`
reads and computes transformers' logits; that file, or a checkpoint directory, becomes a Hugging Face model
transformers loads, with every tensor of the original bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Qwen2Config
from transformers.utils import logging

from megascale.core import GPTConfig
from megascale.lightning import GPTModule
from megascale.lightning.checkpoint_io import load_gpt, save
from megascale.lightning.cli import main

logging.set_verbosity_error()
VOCAB = 150


def _tiny_qwen2(path) -> torch.nn.Module:
    """A random Qwen2 (q/k/v biases, tied embeddings), perturbed so biases and norms are not their init;
    its tokenizer's ids: bos 148, eos 149."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         initializer_range=0.1, tie_word_embeddings=True, bos_token_id=148,
                         eos_token_id=149)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_from_hf_then_to_hf_through_the_command(tmp_path, capsys):
    hf = _tiny_qwen2(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "model.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load_gpt(tmp_path / "model.pt").eval()
    assert model.config.qkv_bias and model.embed.weight is model.head.proj["logits"].weight
    x = _tokens()
    with torch.no_grad():
        assert (model(x)[..., :VOCAB] - hf(x).logits).abs().max().item() <= 1e-5

    out = tmp_path / "back"
    assert main(["convert", "--to-hf", str(tmp_path / "model.pt"), str(out), "--model-type", "qwen2",
          "--max-shard-size", "30KB"]) == 0  # fmt: skip
    assert (out / "model.safetensors.index.json").is_file()
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = {}
    for shard in out.glob("model-*.safetensors"):
        exported.update(load_file(shard))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as intended
def test_to_hf_from_a_checkpoint_directory(tmp_path, capsys):
    """A MegaScaleStrategy checkpoint (DCP directory + meta.pt) of a GPTModule, written by checkpoint_io.save."""
    config = GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_size=16,
                       max_seq_len=32, parallel_block=False, qk_norm=True)  # fmt: skip
    module = GPTModule(config=config)
    module.configure_model()
    ckpt = tmp_path / "last.ckpt"
    save(
        ckpt,
        module,
        [],
        {"hyper_parameters": dict(module.hparams)},
        is_global_zero=True,
        barrier=lambda: None,
    )

    capsys.readouterr()
    assert main(["convert", "--to-hf", str(ckpt), str(tmp_path / "hf")]) == 0  # q/k norms: qwen3
    out, err = capsys.readouterr()
    assert "qwen3 (from the architecture)" in out and "no eos token id is known" in err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.eos_token_id is None
    x = _tokens()
    with torch.no_grad():
        assert (hf(x).logits - module.model.eval()(x)[..., :VOCAB]).abs().max().item() <= 1e-5


def test_wrong_combinations_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--from-hf", "--to-hf", "a", "b"])
    assert main(["convert", "--from-hf", "a", "b", "--model-type", "qwen2"]) == 2
    assert "--model-type, --max-shard-size and --*-token-id go with --to-hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--to-hf", "a", "b", "--model-type", "gpt2"])
    torch.save({"weights": 1}, tmp_path / "not_ours.pt")
    assert main(["convert", "--to-hf", str(tmp_path / "not_ours.pt"), str(tmp_path / "hf")]) == 2
    assert "is not a file written by convert_to_torch or convert_from_hf" in capsys.readouterr().err


def test_the_family_and_token_ids_travel_from_hf_to_hf(tmp_path, capsys):
    """Qwen2 in, out without --model-type: Qwen2 again, with its eos/bos ids and generation_config.json."""
    _tiny_qwen2(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "model.pt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "model.pt"), str(tmp_path / "out")]) == 0
    assert "qwen2 (as converted in)" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.model_type == "qwen2" and (config.bos_token_id, config.eos_token_id) == (148, 149)
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == 149
    # given by hand, an id wins over the stored one
    main(["convert", "--to-hf", str(tmp_path / "model.pt"), str(tmp_path / "out2"), "--eos-token-id", "7"])
    assert GenerationConfig.from_pretrained(tmp_path / "out2").eos_token_id == 7


def _checkpoint(path, module) -> None:
    save(
        path,
        module,
        [],
        {"hyper_parameters": dict(module.hparams)},
        is_global_zero=True,
        barrier=lambda: None,
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_trained_from_pretrained_exports_as_its_family(tmp_path, capsys):
    _tiny_qwen2(tmp_path / "hf")
    module = GPTModule(pretrained=str(tmp_path / "hf"))
    module.configure_model()
    _checkpoint(tmp_path / "ckpt" / "last.ckpt", module)
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "out")]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.model_type == "qwen2" and config.eos_token_id == 149


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_directory_of_checkpoints_means_the_newest(tmp_path, capsys):
    """A second run writes last-v1.ckpt beside the first run's last.ckpt: the directory (or DIR/last) converts
    the newest; naming last.ckpt converts that one, with a note that a newer one lies beside it."""
    config = GPTConfig(
        vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=32, parallel_block=False
    )
    modules = []
    for i, name in enumerate(["last.ckpt", "last-v1.ckpt"]):
        module = GPTModule(config=config, init_seed=i)
        module.configure_model()
        _checkpoint(tmp_path / "ckpt" / name, module)
        os.utime(tmp_path / "ckpt" / name / "meta.pt", (1e9 + i, 1e9 + i))  # the second run's is newer
        modules.append(module)
    first, second = (m.model.state_dict()["embed.weight"] for m in modules)
    assert not torch.equal(first, second)

    def exported(source: str) -> torch.Tensor:
        assert main(["convert", source, str(tmp_path / "model.pt")]) == 0
        return load_gpt(tmp_path / "model.pt").state_dict()["embed.weight"]

    assert torch.equal(exported(str(tmp_path / "ckpt")), second)
    assert torch.equal(exported(str(tmp_path / "ckpt" / "last")), second)
    capsys.readouterr()
    assert torch.equal(exported(str(tmp_path / "ckpt" / "last.ckpt")), first)
    assert "last-v1.ckpt beside it is newer" in capsys.readouterr().err
