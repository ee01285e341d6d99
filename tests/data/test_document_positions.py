"""Packed documents' positions (issue 34, the data): ``WebDataConfig(document_mask=True)`` batches are
``(inputs, targets, position_ids)``, the positions restarting at 0 at each window's first token and after every
end-of-sequence token, i.e. at each document's first token. Exact resume carries over: the positions are a
function of the window.
"""

from __future__ import annotations

import torch

from megascale.data import Source, WebDataConfig, WebLoader
from megascale.data.positions import positions_after_eos
from megascale.data.tokenize import ByteTokenizer
from tests.data._shards import write_text_shards

SEQ_LEN, BATCH = 32, 2
EOS = ByteTokenizer().eos_id


def test_positions_restart_after_each_eos_and_at_the_window_start() -> None:
    inputs = torch.tensor([[7, 8, EOS, 1, 2, 3, EOS, 4], [EOS, 5, 6, 7, 8, 9, 10, 11]])
    assert positions_after_eos(inputs, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def _loader(url: str, document_mask: bool, steps: int, state=None) -> WebLoader:
    config = WebDataConfig(
        sources=[Source(url)], seq_len=SEQ_LEN, batch_size=BATCH, num_workers=0, document_mask=document_mask
    )
    loader = WebLoader(config, tree=False, max_steps=steps)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def test_a_document_masked_stream_carries_each_documents_positions_and_resumes_exactly(tmp_path) -> None:
    url, _ = write_text_shards(str(tmp_path), 2, 6, doc_chars=20, seed=3)  # documents shorter than a window
    plain = list(_loader(url, False, 6))
    masked = list(_loader(url, True, 6))
    assert all(len(b) == 2 for b in plain) and all(len(b) == 3 for b in masked)
    for (x, y), (mx, my, positions) in zip(plain, masked, strict=True):
        assert torch.equal(x, mx) and torch.equal(y, my)  # the same tokens, positions added
        assert positions.dtype == torch.int64 and positions.shape == x.shape
        for row, pos in zip(x.tolist(), positions.tolist(), strict=True):
            expected, count = [], 0
            for t in range(len(row)):
                if t > 0 and row[t - 1] == EOS:
                    count = 0
                expected.append(count)
                count += 1
            assert pos == expected
    starts = sum(int((p == 0).sum()) for _, _, p in masked)
    assert starts > 2 * len(masked) * BATCH  # several documents per window: the positions restart inside
    # a loader resumed after three batches yields the rest with the same positions
    first = _loader(url, True, 3)
    taken = list(first)
    resumed = list(_loader(url, True, 3, state=first.state_dict()))
    for a, b in zip(taken + resumed, masked, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
