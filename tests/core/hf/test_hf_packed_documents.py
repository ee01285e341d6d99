"""A Hugging Face checkpoint fed packed documents (issue 34, part 5): for each document, transformers' logits for
that document run alone. (On the CPU transformers' sdpa/eager paths do not separate documents by
``position_ids`` themselves, so each document goes through transformers alone, as the reference.)"""

from __future__ import annotations

import pytest
import torch

from megascale.core.hf import gpt_from_hf
from tests.core.hf._tiny_hf import FAMILIES, MOE_FAMILIES, VOCAB, save_tiny, tokens

ATOL = 1e-5
LENGTHS = (13, 9, 18)  # Mistral's and Mixtral's window of 8 is shorter than each


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_each_packed_document_gets_transformers_logits_for_it_alone(family, tmp_path):
    hf = save_tiny(family, False, tmp_path)
    model = gpt_from_hf(tmp_path).eval()
    docs = tokens(batch=1, length=sum(LENGTHS)).split(list(LENGTHS), dim=1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), position_ids=positions)[..., :VOCAB]
        for doc, part in zip(docs, packed.split(list(LENGTHS), dim=1), strict=True):
            alone = hf(doc).logits
            assert (part - alone).abs().max().item() <= ATOL, family
