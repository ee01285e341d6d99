"""Sampling from a trained GPT (no KV cache: the whole context is recomputed, fine for small demos)."""

from __future__ import annotations

import torch

from megascale.core.model.gpt import GPT

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``prompt`` (B, T) by ``max_new_tokens`` sampled tokens; temperature 0 = greedy."""
    tokens = prompt
    vocab = model.config.vocab_size
    for _ in range(max_new_tokens):
        context = tokens[:, -model.config.max_seq_len :]
        logits = model(context)[:, -1, :vocab].float()  # padded columns are never sampled
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, vocab)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat((tokens, nxt), dim=1)
    return tokens
