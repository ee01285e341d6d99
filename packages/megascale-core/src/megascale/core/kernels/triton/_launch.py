"""Launch-size helpers shared by the Triton kernels: row flattening, block sizes, warps, reduction split."""

from __future__ import annotations

from functools import cache

import torch
import triton

# One program holds a whole row in registers (norms) or one vocabulary block (cross-entropy). 64K fp32 values
# is the most a program can keep live before spilling ruins the kernel; wider rows need a split-row kernel.
MAX_ROW_BLOCK = 65536


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim) with unit column stride; a view when the layout allows, a copy otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_block(n: int, what: str) -> int:
    """The power-of-two block that covers a row of ``n`` elements."""
    block = triton.next_power_of_2(n)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"the Triton {what} kernel holds a row in registers: {n} > {MAX_ROW_BLOCK} columns")
    return block


def num_warps(block: int) -> int:
    """Warps for a program working on ``block`` elements at a time (more lanes for wider rows)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) for a backward pass that sums a per-column gradient (weight, bias) over
    rows: each program takes a contiguous run of rows and writes one fp32 partial row, which torch then sums.
    Two programs per SM keep the GPU busy while the partial buffer stays a few MB; on the CPU interpreter a
    few programs still exercise the partial sums."""
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4
    per_program = max(1, triton.cdiv(rows, max(1, min(rows, target))))
    return triton.cdiv(rows, per_program), per_program
