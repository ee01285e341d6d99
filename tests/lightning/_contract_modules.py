"""Lightning workflows that touch the parameter contract, for test_zero_contract.py, and the worker that fits them.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.lightning._contract_modules SPEC.json OUT.pt
    python -m tests.lightning._contract_modules SPEC.json OUT.pt      # one process: plain Lightning ("auto")

SPEC.json: {"jobs": [{"name", "scenario", "strategy": {MegaScaleStrategy kwargs} | null, "dp"}, ...]}. OUT.pt
(written by rank 0): {name: {"losses": [[per batch, as logged] per rank], "norms": [[per step] per rank],
"weights": {name: full fp32 tensor}}}. The one-process reference reads the data through
``DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=0)``: the union of what Lightning's injected
sampler gives the dp ranks of a distributed run, batch by batch.

Scenarios (``SCENARIOS``): a tiny language model (embedding, three MLP blocks, head; a tensor-parallel plan
for tp runs) trained with AdamW (weight decay 0.1, so a zero gradient where one process has None moves a
weight) and one of: Lightning's BaseFinetuning freeze → unfreeze at epoch 1; a param group added at step 3;
a block frozen at step 3; a block skipped on odd batches (LayerDrop); a parameter never used; manual
optimization with two optimizers, the second forward reading what the first step updated (a GAN's shape);
manual gradient accumulation over two batches; ``grad_norm`` logged with the user's own ``clip_grad_norm_``
in ``configure_gradient_clipping``, or with ``gradient_clip_val`` (clipping through the precision plugin).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._models import Head, LayeredLM, MLPBlock

VOCAB, WIDTH, SEQ = 32, 16, 8
SAMPLES, GLOBAL_BATCH = 32, 8  # 4 steps per epoch
LR = 1e-2


class ContractLM(LayeredLM):
    tensor_parallel_plan: ClassVar[dict[str, str]] = {
        "embed": "rowwise",
        "blocks.*.norm": "sequence_parallel",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "head.norm": "sequence_parallel",
        "head.proj": "colwise_rep",
    }

    def __init__(self) -> None:
        super().__init__(VOCAB, WIDTH, [MLPBlock(WIDTH) for _ in range(3)], Head(WIDTH, VOCAB))


class ContractModule(LightningModule):
    """The model is built in ``__init__`` (BaseFinetuning freezes in ``setup``, before ``configure_model``)
    and initialised in ``configure_model`` by ``init_weights``: the same weights on one process and under
    any layout."""

    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario
        self.model = ContractLM()
        if scenario == "unused":
            self.unused = nn.Linear(WIDTH, WIDTH)
        if scenario == "late_group":
            self.model.head.requires_grad_(False)  # joins the optimizer at step 3 (LateGroup)

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=gen, device="cpu")  # configure_model may run under meta
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)

    def configure_model(self) -> None:
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        h = self.model.embed(inputs)
        for i, block in enumerate(self.model.blocks):
            if self.scenario == "layerdrop" and i == 1 and batch_idx % 2 == 1:
                continue  # LayerDrop, by batch: skipped on every rank alike
            h = block(h)
        return F.cross_entropy(self.model.head(h).flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch, batch_idx)
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1)


class TwoOptimizers(ContractModule):
    """Manual optimization, a GAN's shape: the body steps, then a second forward reads the updated body and
    the head steps on the gradients of both losses (its own are not zeroed by the body's zero_grad)."""

    def __init__(self, scenario: str) -> None:
        super().__init__(scenario)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        body, head = self.optimizers()  # type: ignore[misc]
        self.manual_backward(self.loss(batch, batch_idx))
        body.step()
        body.zero_grad()
        loss = self.loss(batch, batch_idx)
        self.manual_backward(loss)
        head.step()
        head.zero_grad()
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        body = [*self.model.embed.parameters(), *self.model.blocks.parameters()]
        return (
            torch.optim.AdamW(body, lr=LR, weight_decay=0.1),
            torch.optim.AdamW(self.model.head.parameters(), lr=LR, weight_decay=0.1),
        )


class ManualAccumulation(ContractModule):
    """Manual optimization accumulating the gradients of two batches by hand."""

    def __init__(self, scenario: str) -> None:
        super().__init__(scenario)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.loss(batch, batch_idx)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]
        self.log("train/loss", loss.detach(), on_step=True, sync_dist=True)
        return loss


class LogsGradNorm(ContractModule):
    """Logs Lightning's ``grad_norm`` (not synced: what this rank's gradients say) before each step."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("grad_norm", grad_norm(self, norm_type=2)["grad_2.0_norm_total"], on_step=True)


class ClipsItself(LogsGradNorm):
    """Clips with torch's own ``clip_grad_norm_``, which trusts every rank to hold whole gradients."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:  # fmt: skip
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


class Finetune(BaseFinetuning):
    """Lightning's own: the embedding and the first block frozen before training, unfrozen at epoch 1."""

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze([pl_module.model.embed, pl_module.model.blocks[0]])

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            modules = [pl_module.model.embed, pl_module.model.blocks[0]]
            self.unfreeze_and_add_param_group(modules, optimizer, lr=LR / 2)


class AtStep(Callback):
    """Does ``scenario``'s change before the forward of step 3."""

    reads_weights_between_steps = False  # (MegaScaleStrategy would otherwise wait for ZeRO-1's gathers)

    def __init__(self, scenario: str) -> None:
        self.scenario = scenario

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != 3 or batch_idx != 3:
            return
        if self.scenario == "late_group":
            pl_module.model.head.requires_grad_(True)
            trainer.optimizers[0].add_param_group(
                {"params": list(pl_module.model.head.parameters()), "lr": LR / 2}
            )
        elif self.scenario == "freeze_mid":
            pl_module.model.blocks[1].requires_grad_(False)  # stays in the optimizer: must not move from here


SCENARIOS: dict[str, dict[str, Any]] = {
    "finetune": dict(max_epochs=3),
    "late_group": dict(max_epochs=2),
    "freeze_mid": dict(max_epochs=2),
    "layerdrop": dict(max_epochs=2),
    "unused": dict(max_epochs=2),
    "two_optimizers": dict(max_epochs=2),
    "manual_accumulation": dict(max_epochs=2),
    "grad_norm_own_clip": dict(max_epochs=2),
    "grad_norm_clip_val": dict(max_epochs=2, gradient_clip_val=0.05),
}
_CLASSES = {
    "two_optimizers": TwoOptimizers,
    "manual_accumulation": ManualAccumulation,
    "grad_norm_own_clip": ClipsItself,
    "grad_norm_clip_val": LogsGradNorm,
}


class Record(Callback):
    """The logged loss of every batch and the logged gradient norm (if any), as this rank's loggers see them."""

    reads_weights_between_steps = False

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if "grad_norm" in trainer.callback_metrics:
            self.norms.append(float(trainer.callback_metrics["grad_norm"]))


def _data(dp: int, distributed: bool) -> DataLoader:
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    dataset = TensorDataset(inputs, (inputs * 5 + 3) % VOCAB)
    if distributed:  # Lightning injects DistributedSampler(shuffle=True, seed=0) over the dp ranks
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from megascale.lightning import MegaScaleStrategy

    seed_everything(0)
    scenario = job["scenario"]
    module = _CLASSES.get(scenario, ContractModule)(scenario)
    record = Record()
    callbacks: list[Callback] = [record]
    if scenario == "finetune":
        callbacks.append(Finetune())
    elif scenario in ("late_group", "freeze_mid"):
        callbacks.append(AtStep(scenario))
    distributed = job["strategy"] is not None
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=MegaScaleStrategy(**job["strategy"]) if distributed else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **SCENARIOS[scenario],
    )
    trainer.fit(module, train_dataloaders=_data(job["dp"], distributed))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {
        "losses": _gather(record.losses),
        "norms": _gather(record.norms),
        "weights": {k: v.detach().float().clone() for k, v in state.items()},
    }


def _gather(value: Any) -> list[Any]:
    if not torch.distributed.is_initialized():
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def main(spec_path: str, out_path: str) -> None:
    from tests._dist import finish_and_exit

    torch.set_num_threads(1)
    with open(spec_path) as f:
        jobs = json.load(f)["jobs"]
    results = {job["name"]: run_job(job) for job in jobs}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_path)
    if torch.distributed.is_initialized():
        finish_and_exit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
