"""Linear maps grouped by what they share: one input fanned out to several outputs, or several inputs summed.

A transformer's projections come in such groups: Q, K and V read the same normed input (and in a parallel
block so do the MLP's gate and up), and a parallel block sums its attention and MLP outputs. Keeping each
group one module lets tensor parallelism gather the shared input once and reduce the summed output once,
which is how MegaScale halves the communication of a parallel block. Parameters are created empty;
``GPT.init_weights`` fills them (so building on the meta device and building directly agree).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FanInLinear", "FanOutLinear", "Projection"]


class Projection(nn.Module):
    """A weight (out_features, in_features) and an optional bias (out_features); applied by its group."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"


class FanOutLinear(nn.ModuleDict):
    """y_name = x W_name^T + b_name for several projections of one input, returned in declaration order.

    ``bias``: True = every projection has one, or the names of those that do (Qwen2's q, k, v beside an
    unbiased MLP in one parallel block). Names in ``fused_bias`` get no bias added here: the next kernel adds
    it (fused bias-GeLU), reading it through ``bias_of``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: Mapping[str, int],
        bias: bool | Collection[str],
        fused_bias: Iterable[str] = (),
    ) -> None:
        biased = set(out_features) if bias is True else set() if bias is False else set(bias)
        super().__init__(
            {name: Projection(in_features, n, name in biased) for name, n in out_features.items()}
        )
        self.fused_bias = frozenset(fused_bias)

    def projections(self) -> Iterator[tuple[str, Projection]]:
        return ((name, cast(Projection, p)) for name, p in self.items())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            F.linear(x, p.weight, None if name in self.fused_bias else p.bias)
            for name, p in self.projections()
        )

    def bias_of(self, name: str) -> torch.Tensor | None:
        return cast(Projection, self[name]).bias


class FanInLinear(nn.ModuleDict):
    """y = Σ_name x_name W_name^T + b: several inputs projected to one output and summed, one shared bias."""

    def __init__(self, in_features: Mapping[str, int], out_features: int, bias: bool) -> None:
        super().__init__({name: Projection(n, out_features, bias=False) for name, n in in_features.items()})
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def projections(self) -> Iterator[tuple[str, Projection]]:
        return ((name, cast(Projection, p)) for name, p in self.items())

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        ys = [F.linear(x, p.weight) for x, (_, p) in zip(xs, self.projections(), strict=True)]
        y = ys[0]
        for other in ys[1:]:
            y = y + other
        return y if self.bias is None else y + self.bias
