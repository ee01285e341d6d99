"""User code that torch refuses on split parameters: torch's DTensor error, said in the layout's terms.

Under MegaScaleStrategy a parameter may be a DTensor: a tensor-parallel or ZeRO-2/3 shard on the data-parallel
mesh, or an expert on the ("edp", "ep") mesh; so are their gradients. Code written for whole tensors then fails
inside torch with a message about meshes, placements or sharding strategies: when it combines values of several
parameters (an L2 penalty summed over ``self.parameters()``), compares one with a plain tensor, or hands one to
a ``torch.distributed`` collective (``dist.all_reduce(p.grad)``). ``named`` and ``advice`` turn that failure
into one that names the layout's cause and the change.
"""

from __future__ import annotations

__all__ = [
    "advice",
    "first_line",
    "is_collective_on_dtensor",
    "is_dtensor_mixing",
    "is_dtensor_refusal",
    "named",
]

_MIXING = ("different meshes", "same mesh", "mixed torch.Tensor and DTensor")
_NO_STRATEGY = "does not have a sharding strategy registered"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_dtensor_mixing(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal to combine DTensors of different meshes, or DTensors and tensors."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _MIXING)


def is_collective_on_dtensor(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of a ``torch.distributed`` collective (a c10d op) on a DTensor."""
    text = str(error)
    return isinstance(error, NotImplementedError) and "c10d." in text and _NO_STRATEGY in text


def is_dtensor_refusal(error: BaseException) -> bool:
    """Whether ``error`` is one of the DTensor refusals this module names."""
    return is_dtensor_mixing(error) or is_collective_on_dtensor(error)


def advice(error: BaseException) -> str:
    """The layout's cause of ``error`` (a DTensor refusal) and what to change, in a sentence or two."""
    if is_collective_on_dtensor(error):
        return (
            "torch.distributed's collectives take plain tensors, and under MegaScaleStrategy tensor-parallel, expert-parallel and ZeRO-2/3 parameters and their gradients are DTensors (the "
            "gradients hooks read are whole and already averaged over the data-parallel ranks, as under DDP). "
            "Pass the collective t.full_tensor() (a plain tensor), or reduce with self.all_gather(...) or "
            "self.trainer.strategy.reduce(...), which take DTensors"
        )
    return (
        "tensor-parallel and ZeRO-2/3 shards are DTensors on the data-parallel mesh and experts (ep > 1) "
        "DTensors on the ('edp', 'ep') mesh, which torch cannot add together. Make each parameter's term whole "
        "before combining them (a DTensor's .full_tensor(), e.g. p.pow(2).sum().full_tensor() for an L2 "
        "penalty), or log megascale.lightning.grad_norm for gradients"
    )


def named(error: BaseException, hook: str) -> RuntimeError:
    """The error to raise instead of ``error`` (a DTensor refusal raised by torch in the user's ``hook``)."""
    what = (
        "called a torch.distributed collective on a DTensor"
        if is_collective_on_dtensor(error)
        else "combined parameters that MegaScaleStrategy holds split in different ways"
    )
    return RuntimeError(f"{hook} {what}, and torch refused ({first_line(error)}): {advice(error)}")
