"""The MLP: SwiGLU (gate, up → silu(gate)·up → down) or GeLU (up → gelu(up + b) → down)."""

from __future__ import annotations

import torch
from torch import nn

from megascale.core import kernels
from megascale.core.config import GPTConfig
from megascale.core.model.linear import FanInLinear, FanOutLinear

__all__ = ["MLP", "MLPActivation", "mlp_features"]


def mlp_features(config: GPTConfig, hidden: int | None = None) -> dict[str, int]:
    width = config.ffn_dim if hidden is None else hidden
    if config.activation == "swiglu":
        return {"gate": width, "up": width}
    return {"up": width}


class MLPActivation(nn.Module):
    """The nonlinearity between the MLP's projections, taking the in-projection's outputs.

    For GeLU the up-projection's bias is added inside the fused kernel (``bias_of("up")``), never stored.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind = config.activation
        self.backend = config.kernels.get(self.kind if self.kind == "swiglu" else "bias_gelu")

    def forward(self, in_proj: FanOutLinear, *hidden: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = hidden
            return kernels.swiglu(gate, up, backend=self.backend)
        (up,) = hidden
        return kernels.bias_gelu(up, in_proj.bias_of("up"), backend=self.backend)

    def extra_repr(self) -> str:
        return self.kind


def fused_bias_names(config: GPTConfig) -> tuple[str, ...]:
    """Projections whose bias the activation adds (GeLU's up)."""
    return ("up",) if config.activation == "gelu" and config.bias else ()


class MLP(nn.Module):
    """``hidden``: its width (default ``config.ffn_dim``; a mixture of experts' shared experts set theirs)."""

    def __init__(self, config: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        features = mlp_features(config, hidden)
        self.in_proj = FanOutLinear(config.d_model, features, config.bias, fused_bias_names(config))
        self.act = MLPActivation(config)
        self.out_proj = FanInLinear({"down": features["up"]}, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.in_proj, *self.in_proj(x)))
