"""Grouped matmul: consecutive row groups of one input, each times its own weight (a mixture of experts' GEMMs).

    grouped_mm(x (N, in), weight (G, out, in), counts (G,)) -> (N, out)
    rows counts[0] times weight[0]ᵀ, the next counts[1] rows times weight[1]ᵀ, ...

Backends, fastest first: ``grouped_mm`` (``torch._grouped_mm``: one kernel for every group, CUTLASS on Hopper,
also on the CPU; its operands' rows must be 16-byte aligned, so widths whose rows are not take the reference),
``torch`` (the reference: one matmul per group, in a loop).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["UNALIGNED", "grouped_mm"]

grouped_mm = get_kernel("grouped_mm")

UNALIGNED = "unaligned"
"""The case of a call whose rows are not a multiple of 16 bytes (``torch._grouped_mm`` cannot take it)."""


def _case(x: torch.Tensor, weight: torch.Tensor, *_args: Any, **_kwargs: Any) -> str | None:
    row_bytes = (weight.shape[1] * weight.element_size(), weight.shape[2] * weight.element_size())
    return UNALIGNED if any(n % 16 for n in row_bytes) else None


grouped_mm.case_of = _case
grouped_mm.cases = (UNALIGNED,)


def _no_grouped_mm(_device: torch.device) -> str | None:
    return None if hasattr(torch, "_grouped_mm") else "this torch has no torch._grouped_mm"


def _not_on_cpu(device: torch.device) -> str | None:
    if device.type == "cpu":  # forced, it runs (and is checked) there too
        return "on the CPU one matmul per expert is as fast (4096 tokens, 8 experts of 256x512, 2 cores: 53 ms against 58 ms a call)"
    return _no_grouped_mm(device)


def _aligned_only(case: str | None) -> str | None:
    return "its operands' rows must be multiples of 16 bytes" if case == UNALIGNED else None


@grouped_mm.register("grouped_mm", _not_on_cpu, unavailable_if_forced=_no_grouped_mm, skips=_aligned_only)
def _grouped(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # offs: where each group's rows end (int32, on the device); the weight read transposed, (G, in, out)
    offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
    if x.shape[0] == 0:
        return _no_rows(x, weight)
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)


@grouped_mm.register("torch")
def _reference(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    sizes = [int(c) for c in counts.tolist()]
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts add up to {sum(sizes)} rows, x has {x.shape[0]}")
    # unbind, not weight[g]: indexing gives each group's backward a zero-filled gradient of the whole stack to
    # add up (96 of them a step in benchmarks/moe.py); unbind's backward stacks the groups' gradients once
    weights = weight.unbind(0)
    outs = [F.linear(rows, weights[g]) for g, rows in enumerate(x.split(sizes)) if sizes[g]]
    if not outs:
        return _no_rows(x, weight)
    # groups that received no rows contribute no gradient: weight.grad is zero there, as with the fused kernel
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _no_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # still a function of x and the weight, so backward reaches both (with zeros), as it does with rows: an
    # expert-parallel rank that received no tokens gives its experts a zero gradient like its peers do. Through
    # F.linear, so that autocast gives it the dtype rows would get: expert-parallel peers exchange these
    # outputs, and a bf16 peer receiving float32 bytes aborts the all-to-all
    return F.linear(x, weight[0]) + weight.sum() * 0


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    x, weight = torch.randn(24, 16, generator=gen), torch.randn(3, 8, 16, generator=gen) / 4
    counts = torch.tensor([7, 0, 17])  # an empty group among them
    return (x.to(device, dtype), weight.to(device, dtype), counts.to(device)), {}, (0, 1)


grouped_mm.probe = Probe(_probe)
