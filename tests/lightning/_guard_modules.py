"""LightningModules that break replica equality in ways no setup rule sees, for test_replica_guard.py."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tests.lightning._own_modules import OwnTransformer, OwnTransformerModule


class UnsummedNormTransformer(OwnTransformer):
    """The MLP norms left unsummed on sequence shards, the first-forward check opted out by the plan."""

    tensor_parallel_plan: ClassVar[dict[str, str] | None] = {
        **(OwnTransformer.tensor_parallel_plan or {}),
        "blocks.*.mlp_norm": "replicated_unsummed",
    }


class UnsummedNormModule(OwnTransformerModule):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = UnsummedNormTransformer(self.vocab)


class PerturbedGradientModule(OwnTransformerModule):
    """Global rank 1 changes one gradient after the reduction (what a buggy callback or hook would do)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_rank == 1:
            assert self.model is not None
            grad = self.model.head.proj.weight.grad
            with torch.no_grad():
                (grad.to_local() if hasattr(grad, "to_local") else grad).add_(1e-3)
