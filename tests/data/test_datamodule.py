"""WebDataModule inside Lightning: DP layout from the strategy, state in checkpoints, exact resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from tests.data._shards import write_text_shards
from tests.lightning._launch import clean_env, free_port

SCRIPT = "tests/data/_fit_web.py"


def _fit(shards: str, out: str, steps: int, *extra: str, ranks: int = 2) -> list[list]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
               SCRIPT, shards, out, str(steps), *extra]  # fmt: skip
    subprocess.run(command, check=True, env=clean_env(), timeout=240)
    return [json.load(open(f"{out}.rank{r}")) for r in range(ranks)]


def test_a_resumed_fit_sees_exactly_the_batches_of_an_uninterrupted_one(tmp_path):
    shards, _ = write_text_shards(str(tmp_path / "shards"), 8, 10, doc_chars=50)
    whole = _fit(shards, str(tmp_path / "whole"), 6)
    ckpt = str(tmp_path / "half.ckpt")
    first = _fit(shards, str(tmp_path / "first"), 3, "--save", ckpt)
    second = _fit(shards, str(tmp_path / "second"), 6, "--resume", ckpt)
    for rank in range(2):
        assert len(whole[rank]) == 6
        assert first[rank] + second[rank] == whole[rank]
    # the two data-parallel ranks read different sequences
    assert not {str(s) for b in whole[0] for s in b} & {str(s) for b in whole[1] for s in b}


def test_tensor_parallel_peers_get_the_same_batches_and_data_parallel_ranks_disjoint_ones(tmp_path):
    """The DP layout comes from the strategy (dp=2 × tp=2 over 4 ranks), not from the world size."""
    shards, _ = write_text_shards(str(tmp_path / "shards"), 8, 10, doc_chars=50)
    seen = _fit(shards, str(tmp_path / "tp"), 3, "--tp", "2", ranks=4)
    assert all(len(s) == 3 for s in seen)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # ModelParallelStrategy's mesh: (dp, tp), tp innermost
    assert not {str(s) for b in seen[0] for s in b} & {str(s) for b in seen[2] for s in b}


def test_the_data_modules_tokenizer_is_the_training_streams_for_sampling_from_the_model():
    from megascale.data import Source, WebDataConfig, WebDataModule

    module = WebDataModule(WebDataConfig(sources=[Source(urls="unused-*.tar")], seq_len=8, batch_size=1))
    tokenizer = module.tokenizer  # what RunSummary encodes its prompt with and decodes the sample with
    assert module.vocab_size == tokenizer.vocab_size == 257 and tokenizer.eos_id == 256
    assert tokenizer.decode([*tokenizer.encode("def f():"), tokenizer.eos_id]) == "def f():"


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_before_any_data_is_read():
    from types import SimpleNamespace

    from megascale.data import Source, WebDataConfig, WebDataModule

    module = WebDataModule(WebDataConfig(sources=[Source(urls="unused-*.tar")], seq_len=8, batch_size=1))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=256))  # the bytes tokenizer needs 257 (+ eos)
    module.trainer = SimpleNamespace(lightning_module=model)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"produces 257 token ids .* set model.config.vocab_size >= 257"):
        module.setup("fit")
    model.config.vocab_size = 257
    module.setup("fit")


def test_a_checkpoints_tokenizer_larger_than_its_vocabulary_is_refused_naming_it(tmp_path):
    from types import SimpleNamespace

    from megascale.data import Source, WebDataConfig, WebDataModule
    from tests.data.test_tokenize import _model_dir

    root = _model_dir(tmp_path, tokenizer_config={"eos_token": "</s>"})  # a tokenizer of up to 80 ids
    config = WebDataConfig(
        sources=[Source(urls="unused-*.tar")], seq_len=8, batch_size=1, tokenizer=str(root)
    )
    module = WebDataModule(config)
    ids = module.vocab_size
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=ids - 1))
    module.trainer = SimpleNamespace(lightning_module=model)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=rf"tokenizer '{root}' produces {ids} token ids .* >= {ids}"):
        module.setup("fit")
    model.config.vocab_size = ids
    module.setup("fit")
