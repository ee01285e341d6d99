"""Optimizers: LAMB for plain, tensor-parallel and FSDP2-sharded (DTensor) parameters."""

from megascale.core.optim.lamb import LAMB

__all__ = ["LAMB"]
