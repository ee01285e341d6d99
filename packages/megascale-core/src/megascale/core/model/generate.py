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
    # a split model may need the sequence length to be a multiple (sequence parallelism) and hold only its
    # vocabulary shard of the logits (vocabulary parallelism): pad on the right, where a causal model cannot
    # see it, and gather the vocabulary
    multiple = getattr(model, "sequence_multiple", 1)
    gather = getattr(model.loss_fn, "gather_logits", None)
    for _ in range(max_new_tokens):
        context = tokens[:, -model.config.max_seq_len :]
        length = context.shape[1]
        pad = -length % multiple
        if pad:
            context = torch.cat([context, context[:, -1:].expand(-1, pad)], dim=1)
        logits = model(context)[:, length - 1]
        if gather is not None:
            logits = gather(logits)
        logits = logits[:, :vocab].float()  # padded vocabulary columns are never sampled
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
