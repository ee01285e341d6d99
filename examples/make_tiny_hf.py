"""Write a tiny random-initialised Llama as a Hugging Face model directory (config.json + model.safetensors),
the checkpoint that examples/configs/hf_continue_cpu.yaml continues pretraining.

Its vocabulary is megascale-data's byte tokenizer's: 256 bytes + the end-of-document token 256 (257 ids), so
the stdlib shards train it without a tokenizer file; the end-of-document token is its eos token, so
transformers' ``generate`` stops at the end of a document. Sizes: width 128, 4 layers of 4 query heads on 2
key/value heads (each tensor-parallel rank of tp=2 gets whole heads), SwiGLU 352 wide, 128 positions
(the config's seq_len), untied embeddings (pipeline stages hold the embedding and the output projection
apart): 0.8M parameters. Written by transformers' own ``save_pretrained`` (needs ``pip install transformers``),
so it is exactly what a checkpoint from the Hub looks like.

    python examples/make_tiny_hf.py .cache/megascale/tiny-llama
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 257  # megascale-data's byte tokenizer: bytes 0-255 and end-of-document 256
END_OF_DOCUMENT = 256


def tiny_llama_config() -> LlamaConfig:
    """The tiny Llama's architecture."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=END_OF_DOCUMENT,
        pad_token_id=None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="the directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model.save_pretrained(args.output)
    files = sorted(p.name for p in args.output.iterdir())
    print(f"wrote {args.output}: {files} ({model.num_parameters() / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
