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


class _FakeFlash:
    """flash-attn 2's ``flash_attn_varlen_func`` as its documentation states it, in plain torch: each
    ``cu_seqlens`` segment its own causal sequence, the window (left, 0) keys before each query."""

    calls = 0

    @classmethod
    def flash_attn_varlen_func(cls, q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal,
                               window_size):  # fmt: skip
        cls.calls += 1
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and causal and dropout_p == 0
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            window = None if window_size[0] < 0 else window_size[0] + 1
            seg = [t[a:b].unsqueeze(0) for t in (q, k, v)]
            out.append(kernels.attention(*seg, window=window, scale=softmax_scale, backend="torch")[0])
        return torch.cat(out)


@pytest.mark.parametrize("window", [None, 3])
def test_flash_varlen_cuts_the_rows_at_every_document_and_row_start(window: int | None) -> None:
    """The cu_seqlens flash-attn's varlen kernel is given: segments at each document's start and at each row's
    (a document never continues into the next row), built once for every layer of a microbatch."""
    from megascale.core.kernels.attention import flash_varlen
    from megascale.core.kernels.documents import varlen_segments

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 16, 4, 8, generator=gen)
    k, v = torch.randn(2, 16, 2, 8, generator=gen), torch.randn(2, 16, 2, 8, generator=gen)
    documents = kernels.document_ids(torch.cat([_positions(LENGTHS), _positions((9, 7))]))
    assert varlen_segments(documents).cu_seqlens.tolist() == [0, 5, 12, 16, 25, 32]
    assert varlen_segments(documents) is varlen_segments(documents)  # once per microbatch
    got = flash_varlen(_FakeFlash, q, k, v, documents=documents, window=window, scale=0.3, dropout_p=0.0)
    want = kernels.attention(q, k, v, window=window, documents=documents, scale=0.3, backend="torch")
    torch.testing.assert_close(got, want)


def test_what_is_built_from_a_microbatch_s_positions_is_built_once_for_every_layer() -> None:
    from megascale.core.kernels.attention import flex_document_mask

    positions = torch.cat([_positions(LENGTHS), _positions((9, 7))])
    documents = kernels.document_ids(positions)
    assert kernels.document_ids(positions) is documents  # every layer of the forward: the same ids
    assert flex_document_mask(documents, 3) is flex_document_mask(documents, 3)
    assert flex_document_mask(documents, None) is not flex_document_mask(documents, 3)
    again = positions.clone()  # another microbatch with the same values: its own
    assert kernels.document_ids(again) is not documents
    positions[0, 3] = 0  # changed in place: computed again
    assert kernels.document_ids(positions).tolist() != documents.tolist()


def test_on_a_gpu_packed_documents_choose_flash_varlen_then_flex_never_a_dense_mask() -> None:
    """The cases each backend is passed by for (devices aside: flash-attn and FlexAttention's compiled
    kernels are CUDA's; their numbers against the reference are the tests above and benchmarks/gpu.py)."""
    from megascale.core.kernels.attention import DOCUMENTS

    reasons = {b.name: b.skips(DOCUMENTS) for b in kernels.attention.backends}
    order = [name for name in reasons if reasons[name] is None]
    assert order[:2] == ["flash", "flex"], reasons
    assert reasons["flash4"] is not None  # it takes no mask
