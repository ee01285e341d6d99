"""RMSNorm and LayerNorm modules over the registry's kernels (apex → Triton → torch)."""

from __future__ import annotations

import torch
from torch import nn

from megascale.core import kernels
from megascale.core.config import GPTConfig

__all__ = ["LayerNorm", "RMSNorm", "make_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, backend: str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, backend=self.backend)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, backend: str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def make_norm(config: GPTConfig, dim: int | None = None) -> RMSNorm | LayerNorm:
    """The config's norm over ``dim`` features (default: the residual stream's d_model)."""
    dim = config.d_model if dim is None else dim
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps, backend=config.kernels.get("rms_norm"))
    return LayerNorm(dim, config.norm_eps, bias=config.bias, backend=config.kernels.get("layer_norm"))
