"""FP8 training of a GPT's transformer-block projections with torchao's float8 recipes (``GPTConfig.fp8``).

    GPT(GPTConfig(..., fp8="rowwise"))  # parallelize() converts it; convert_to_float8(gpt) does it by hand

Recipes (torchao's ``Float8LinearConfig.from_recipe_name``), all with dynamic scales recomputed every step:

- ``"tensorwise"``: one scale per tensor: the fastest GEMMs (torchtitan's default; it reports 1.28x tokens/s
  on Llama-3-8B on H100), but one outlier coarsens the whole tensor's resolution.
- ``"rowwise"``: a scale per row of every GEMM operand (e4m3 for the forward's operands and the gradients):
  more accurate, somewhat slower GEMMs.
- ``"rowwise_with_gw_hp"``: rowwise, with the weight-gradient GEMM in high precision (the most accurate).

What converts (``float8_projections``): the projections of every block (q, k, v, o; gate, up, down; a mixture
of experts' shared experts) whose weight has both dimensions multiples of 16, ``torch._scaled_mm``'s
requirement (torchtitan's filter), checked on this rank's tensor-parallel shard. Never converted: the output
head (the logits keep the training precision; the vocabulary GEMM is where fp8 costs most accuracy), the
embedding, MoE routers and grouped experts (``grouped_mm``), norms.

How: each projection group (``FanOutLinear``/``FanInLinear`` and their tensor-parallel forms) becomes a
subclass whose forward runs torchao's float8 GEMMs (``matmul_with_hp_or_float8_args``, the autograd function
of torchao's ``Float8Linear``) in place of ``F.linear``. Parameters, their dtype and the state-dict keys stay
as they are: checkpoints move between fp8 and bf16 runs, and ZeRO, the optimizer and gradient clipping see the
same high-precision master weights. Under bf16 autocast the input is cast to bf16 first (as ``F.linear``
would); the scales and casts to fp8 happen inside the GEMM call.

Order in ``parallelize`` (as torchtitan: convert, then tensor parallelism with float8-aware styles, then
FSDP): after the tensor-parallel split, on its layers, and before materialisation and ZeRO, so every ZeRO
stage shards the unchanged parameters and the fp8 cast sees the whole (gathered) weight, as on one process.
Under tensor parallelism the converted layers gather their input / reduce their output with the same
collectives as the bf16 layers, but unchunked: ``overlap_tp_comm`` does not apply to them (yet), and
activations travel in bf16, not fp8 (torchtitan's ``Float8ColwiseParallel`` all-gathers fp8). ZeRO-2/3 gather
weights in the training precision, not fp8 (torchao's ``enable_fsdp_float8_all_gather`` is not wired).

Devices: CUDA GPUs of compute capability >= 8.9 (Hopper H100/H200, Ada L4/L40/RTX 4090, Blackwell), where
the fp8 GEMMs run on tensor cores, and the CPU, where torch's ``_scaled_mm`` runs them slowly (for tests). On
any other device the conversion is refused by name. torchao is imported here only, on first use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from megascale.core._dtensor import local
from megascale.core.config import FLOAT8_RECIPES
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.parallel.tp.apply import ColumnParallelLinear, RowParallelLinear
from megascale.core.parallel.tp.comm import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

__all__ = [
    "FP8_MIN_CAPABILITY",
    "Float8ColumnParallelLinear",
    "Float8FanInLinear",
    "Float8FanOutLinear",
    "Float8RowParallelLinear",
    "check_fp8_device",
    "convert_to_float8",
    "float8_projections",
    "torchao_float8",
]

FP8_MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability of the first GPUs with fp8 tensor cores (Ada; Hopper is 9.0)."""

_MULTIPLE = 16  # torch._scaled_mm needs both GEMM dimensions of the weight divisible by 16
_INSTALL = "pip install 'megascale-core[fp8]' (torchao)"


# ---- torchao: the one import point -----------------------------------------------------------------------


@cache
def _torchao_float8() -> tuple[ModuleType | None, str]:
    try:
        # torchao's import logs a warning for each CUDA extension it cannot load (mxfp8, cutlass kernels; on a
        # CPU build all of them, none of which float8 training uses) and torch one about torchao registering
        # an Enum with torch.compile: nothing a user can act on. Quiet for the import only.
        logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [log.level for log in logs]
        for log in logs:
            log.setLevel(logging.ERROR)
        try:
            import torchao.float8 as float8
            import torchao.float8.float8_linear  # noqa: F401  (matmul_with_hp_or_float8_args)
        finally:
            for log, level in zip(logs, levels):
                log.setLevel(level)
    except Exception as exc:  # ImportError, or a torchao built for another torch raising at import
        return None, f"torchao is not importable ({type(exc).__name__}: {exc})"
    return float8, ""


def torchao_float8() -> ModuleType:
    """``torchao.float8``, imported on first use (~6 s: torchao imports its quantization package); raises
    ImportError naming the install command when torchao is missing or broken."""
    float8, reason = _torchao_float8()
    if float8 is None:
        raise ImportError(f"GPTConfig.fp8 needs torchao: {reason}; {_INSTALL}, or set fp8=None")
    return float8


# ---- which devices, which projections --------------------------------------------------------------------


def check_fp8_device(device: torch.device | str) -> None:
    """Raise RuntimeError unless fp8 GEMMs run on ``device``: a CUDA GPU of compute capability >= 8.9, or the
    CPU (slow: for tests); the meta device passes (nothing runs there)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_MIN_CAPABILITY:
            return
        name = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    else:
        name = str(device)
    raise RuntimeError(
        f"fp8 needs a CUDA GPU of compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
        f"(Hopper/Ada), or the CPU for tests; this device is {name}; set fp8=None"
    )


def _fits(weight: torch.Tensor) -> bool:
    return all(n % _MULTIPLE == 0 for n in local(weight).shape)


def float8_projections(model: nn.Module) -> list[str]:
    """Names of the projections ``convert_to_float8`` gives fp8 GEMMs (``blocks.0.in_proj.q``, ...): those of
    ``model.blocks`` whose weight (this rank's shard) has both dimensions multiples of 16."""
    blocks = cast(nn.Module, model.blocks)
    return [
        f"blocks.{prefix}.{name}"
        for prefix, group in blocks.named_modules()
        if type(group) in _FLOAT8_CLASS or type(group) in _FLOAT8_CLASS.values()
        for name, proj in cast(Any, group).projections()
        if _fits(proj.weight)
    ]


# ---- the fp8 GEMM ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Recipe:
    """What torchao's float8 GEMM needs: its config and the per-GEMM scaled-mm settings."""

    name: str
    config: Any  # torchao.float8.Float8LinearConfig
    mm_config: Any  # torchao.float8.float8_training_tensor.LinearMMConfig
    # torchao's autograd function, looked up here: an import inside the forward breaks torch.compile's graph
    matmul: Any


@cache
def _recipe(name: str) -> _Recipe:
    float8 = torchao_float8()
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = float8.Float8LinearConfig.from_recipe_name(name)

    def mm(gemm: Any) -> Any:  # as torchao's Float8Linear builds it, GEMM by GEMM
        return ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)

    mm_config = LinearMMConfig(
        mm(config.gemm_config_output), mm(config.gemm_config_grad_input), mm(config.gemm_config_grad_weight)
    )
    return _Recipe(name, config, mm_config, matmul_with_hp_or_float8_args)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _linear(
    recipe: _Recipe, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b with fp8 GEMMs in forward and backward; the output in x's (autocast's) dtype."""
    device = x.device.type
    x = x.to(_compute_dtype(x))
    # Autocast would cast the fp8 operands inside torchao's GEMM back to bf16: off for the call (backward
    # runs outside autocast anyway); the output takes the input's dtype, as F.linear's under autocast.
    with torch.autocast(device, enabled=False):
        y = recipe.matmul.apply(x, weight.t(), recipe.mm_config, recipe.config)
    return y if bias is None else y + bias.to(y.dtype)


class _Float8Group:
    """Mixed into a projection group: ``fp8`` (the recipe) and which of its projections run in fp8."""

    fp8: _Recipe
    fp8_names: frozenset[str]

    def _project(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if name in self.fp8_names:
            return _linear(self.fp8, x, weight, bias)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"fp8={self.fp8.name}: {sorted(self.fp8_names)}"


class Float8FanOutLinear(_Float8Group, FanOutLinear):
    """A ``FanOutLinear`` whose listed projections run fp8 GEMMs."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            self._project(name, x, p.weight, None if name in self.fused_bias else p.bias)
            for name, p in self.projections()
        )


class Float8FanInLinear(_Float8Group, FanInLinear):
    """A ``FanInLinear`` whose listed projections run fp8 GEMMs; the shared bias is added once, after."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        ys = [
            self._project(name, x, p.weight, None)
            for x, (name, p) in zip(xs, self.projections(), strict=True)
        ]
        y = ys[0]
        for other in ys[1:]:
            y = y + other
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Float8ColumnParallelLinear(_Float8Group, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` running fp8 GEMMs on this rank's weight shards: the input all-gathered over
    the sequence (sequence parallelism) or taken as replicated, in one piece (not overlapped)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.to(_compute_dtype(x))  # gathered in the GEMM's dtype, as the bf16 layer does
        if self.sequence_parallel:
            x = gather_from_sp_region(x, self.group, timer=self.wait_timer)
        else:
            x = copy_to_tp_region(x, self.group, timer=self.wait_timer)
        return tuple(
            self._project(name, x, local(p.weight), None if name in self.fused_bias else local(p.bias))
            for name, p in self.projections()
        )

    def extra_repr(self) -> str:
        return f"{ColumnParallelLinear.extra_repr(self)}, {_Float8Group.extra_repr(self)}"


class Float8RowParallelLinear(_Float8Group, RowParallelLinear):
    """A ``RowParallelLinear`` running fp8 GEMMs on this rank's weight shards; the partial sums reduced (or
    reduce-scattered under sequence parallelism) in one piece (not overlapped), then the bias added."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        ys = [
            self._project(name, x, local(p.weight), None)
            for x, (name, p) in zip(xs, self.projections(), strict=True)
        ]
        y = ys[0]
        for other in ys[1:]:
            y = y + other
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, self.group, timer=self.wait_timer)
        else:
            y = reduce_from_tp_region(y, self.group, timer=self.wait_timer)
        bias = local(self.bias)
        if bias is None:
            return y
        if self.sequence_parallel:  # each rank's gradient covers its tokens: summed in backward
            bias = copy_to_tp_region(bias, self.group, timer=self.wait_timer)
        return y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{RowParallelLinear.extra_repr(self)}, {_Float8Group.extra_repr(self)}"


# exact types only: a subclass of a group of someone else's may compute something else in forward
_FLOAT8_CLASS: dict[type[nn.Module], type[nn.Module]] = {
    FanOutLinear: Float8FanOutLinear,
    FanInLinear: Float8FanInLinear,
    ColumnParallelLinear: Float8ColumnParallelLinear,
    RowParallelLinear: Float8RowParallelLinear,
}


def convert_to_float8(
    model: nn.Module, recipe: str | None = None, *, device: torch.device | str | None = None
) -> list[str]:
    """Give the projections of ``model``'s blocks fp8 GEMMs (``float8_projections``), in place; return their
    names. Call it after tensor parallelism (it converts the split layers) and before ZeRO; on the meta device
    too. Calling it again (after a tensor-parallel split replaced the layers) converts what is not yet fp8.

    Args:
        model: a megascale GPT (anything with ``blocks`` of megascale projection groups).
        recipe: "tensorwise", "rowwise" or "rowwise_with_gw_hp"; None = ``model.config.fp8``.
        device: where the model will run, checked by ``check_fp8_device``; None = its parameters' device.

    Raises:
        ValueError: an unknown recipe, or none given and none in the config.
        ImportError: torchao is missing.
        RuntimeError: the device has no fp8 GEMMs.
    """
    name = recipe if recipe is not None else getattr(getattr(model, "config", None), "fp8", None)
    if name not in FLOAT8_RECIPES:
        raise ValueError(f"fp8 recipe {name!r} is not one of {list(FLOAT8_RECIPES)}")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    check_fp8_device(device)
    found = _recipe(str(name))
    converted: list[str] = []
    blocks = cast(nn.Module, model.blocks)
    for prefix, group in blocks.named_modules():
        cls = _FLOAT8_CLASS.get(type(group), type(group) if type(group) in _FLOAT8_CLASS.values() else None)
        if cls is None:
            continue
        names = frozenset(n for n, proj in cast(Any, group).projections() if _fits(proj.weight))
        if not names:
            continue
        group.__class__ = cls  # same parameters, buffers and state-dict keys; only forward changes
        typed = cast(_Float8Group, group)
        typed.fp8, typed.fp8_names = found, names
        converted += [f"blocks.{prefix}.{n}" for n in sorted(names)]
    return converted
