"""Position ids of packed windows, for attention kept inside each document (``WebDataConfig.document_mask``).

The packer (``packing.py``) ends every document with the end-of-sequence token, so a window's document starts
are the tokens right after an eos, and its first token. Positions count up from 0 at each of them:
transformers' and torchtitan's convention for packed rows, and Megatron's ``reset_position_ids`` (a document
cut by a window boundary restarts at 0 there: the window cannot see its beginning anyway). Computed from the
window alone, so a resumed run gets exactly the positions of the run it continues.
"""

from __future__ import annotations

import torch

__all__ = ["positions_after_eos"]


def positions_after_eos(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int64 positions of ``inputs`` (B, T): 0 at each row's first token and after every ``eos_id``."""
    B, T = inputs.shape
    index = torch.arange(T, device=inputs.device).expand(B, T)
    starts = torch.ones(B, T, dtype=torch.bool, device=inputs.device)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start
