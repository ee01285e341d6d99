"""User code that combines split parameters: torch's DTensor error, said in the layout's terms.

Under MegaScaleStrategy a parameter may be a DTensor: a tensor-parallel or ZeRO-2/3 shard on the data-parallel
mesh, or an expert on the ("edp", "ep") mesh. Code written for whole tensors that combines values of several
parameters (an L2 penalty summed over ``self.parameters()``) then fails inside torch with a message about
meshes and placements. ``named`` turns that failure into one that names the layout's cause and the change.
"""

from __future__ import annotations

__all__ = ["first_line", "is_dtensor_mixing", "named"]

_MIXING = ("different meshes", "same mesh", "mixed torch.Tensor and DTensor")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_dtensor_mixing(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal to combine DTensors of different meshes, or DTensors and tensors."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _MIXING)


def named(error: RuntimeError, hook: str) -> RuntimeError:
    """The error to raise instead of ``error`` (raised by torch in the user's ``hook``)."""
    return RuntimeError(
        f"{hook} combined parameters that MegaScaleStrategy holds split in different ways, and torch refused "
        f"({first_line(error)}): tensor-parallel and ZeRO-2/3 shards are DTensors on the data-parallel mesh and "
        "experts (ep > 1) DTensors on the ('edp', 'ep') mesh, which torch cannot add together. Make each "
        "parameter's term whole before combining them (a DTensor's .full_tensor(), e.g. "
        "p.pow(2).sum().full_tensor() for an L2 penalty), or log megascale.lightning.grad_norm for gradients"
    )
