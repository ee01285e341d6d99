"""Packed documents (issue 34, the model): ``GPT.forward(tokens, position_ids=...)`` with positions restarting at
each document gives every document the logits it gets alone, and the attention backends agree on the mask.
"""

from __future__ import annotations

import pytest
import torch

from megascale.core import GPT, GPTConfig, kernels
from megascale.core.config import MoEConfig
from tests.core._tiny import TINY_GQA_GPT

LENGTHS = (5, 7, 4)  # three documents in one row of 16 tokens
CASES = {
    "parallel-block": {},
    "sequential-block": {"parallel_block": False},
    "sliding-window": {"sliding_window": 3},
    "multi-head": {"n_kv_heads": 4},
    "moe": {"moe": MoEConfig(num_experts=4, top_k=2)},
}


def _positions(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.mark.parametrize("case", list(CASES))
def test_each_packed_document_gets_the_logits_it_gets_alone(case: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY_GQA_GPT, **CASES[case]})).eval()
    docs = [torch.randint(0, 60, (1, n)) for n in LENGTHS]
    packed = torch.cat(docs, dim=1)
    with torch.no_grad():
        together = model(packed, position_ids=_positions(LENGTHS))
        start = 0
        for doc in docs:
            alone = model(doc)
            part = together[:, start : start + doc.shape[1]]
            assert torch.allclose(part, alone, atol=2e-5, rtol=1e-5), (
                case,
                float((part - alone).abs().max()),
            )
            start += doc.shape[1]
        # without position_ids the later documents see the earlier ones: the test can tell the two apart
        causal = model(packed)
    assert not torch.allclose(causal[:, LENGTHS[0] :], together[:, LENGTHS[0] :], atol=1e-3)
    assert torch.equal(causal[:, : LENGTHS[0]], together[:, : LENGTHS[0]])  # the first document: the same


def test_the_loss_and_gradients_of_a_packed_row_are_those_of_its_documents() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GQA_GPT))
    docs = [torch.randint(0, 60, (1, n + 1)) for n in LENGTHS]  # inputs and targets of each document
    packed_in = torch.cat([d[:, :-1] for d in docs], dim=1)
    packed_target = torch.cat([d[:, 1:] for d in docs], dim=1)
    model(packed_in, packed_target, position_ids=_positions(LENGTHS)).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = sum(model(d[:, :-1], d[:, 1:]) * d[:, 1:].numel() for d in docs) / packed_target.numel()
    total.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(packed_grads[name], p.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_attention_backends_keep_each_token_inside_its_document(backend: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True)
    positions = torch.cat([_positions(LENGTHS), _positions((9, 7))])
    documents = kernels.document_ids(positions)
    assert documents.tolist()[1] == [1] * 9 + [2] * 7
    ref = kernels.attention(q, k, v, window=window, documents=documents, backend="torch")
    got = kernels.attention(q, k, v, window=window, documents=documents, backend=backend)
    assert torch.allclose(got, ref, atol=1e-5)
    (g_ref,) = torch.autograd.grad(ref.sum(), q)
    (g_got,) = torch.autograd.grad(got.sum(), q)
    assert torch.allclose(g_got, g_ref, atol=1e-5)
    # a query never reads another document's values: changing them leaves the first document unchanged
    v2 = v.detach().clone()
    v2[:, LENGTHS[0] :] += 1.0
    other = kernels.attention(q, k, v2, window=window, documents=documents, backend=backend)
    assert torch.equal(other[0, : LENGTHS[0]], got[0, : LENGTHS[0]])


def test_position_ids_of_another_shape_are_refused() -> None:
    model = GPT(GPTConfig(**TINY_GQA_GPT))
    with pytest.raises(ValueError, match=r"position_ids must have the tokens' shape \(B, T\) = \(1, 8\)"):
        model(torch.zeros(1, 8, dtype=torch.long), position_ids=torch.zeros(1, 7, dtype=torch.long))
