# GPTModule: megascale-core's GPT as a LightningModule, written to run under any strategy (single device,
# DDP, MegaScaleStrategy's tensor × pipeline × ZeRO layout).
#
# The module builds the GPT in `configure_model` (not __init__), so a strategy can build it on the meta
# device (Lightning's empty-init context) and parallelise/materialise it afterwards: MegaScaleStrategy finds
# every megascale GPT in the module, applies TP/activation checkpointing/ZeRO, then `to_empty` +
# `GPT.init_weights()`. Nothing here materialises or assumes plain tensors: parameters may be DTensors by the
# time `configure_optimizers` runs (param groups use the logical `ndim`; LAMB and AdamW take DTensors).
#
# Continuing from a Hugging Face checkpoint (`pretrained=DIR`): the config comes from DIR/config.json, and the
# GPT is told where its weights are (`GPT.weights_source`), so whoever materialises it loads them through
# `init_weights()` — a strategy after the tensor/pipeline split and before ZeRO, each rank reading only its
# slices; without a meta-device context (one process, DDP) `configure_model` itself.
#
# Choices where the brief left room:
# - Hyperparameters are saved as one explicit dict, the config as `GPTConfig.to_dict()`, so a checkpoint
#   holds only plain Python types and loads with `torch.load(weights_only=True)`; `__init__` accepts that
#   dict back for `config` (what `load_from_checkpoint` passes). The dict is passed explicitly rather than
#   collected from the frame so that LightningCLI's own hparams (which hold the config as a dict too) cannot
#   make Lightning record `config` as "the" hparams argument, which would break loading.
# - Dict batches: `labels` are the next-token targets aligned with `input_ids` (already shifted, like
#   (inputs, targets) tuples); -100 marks positions left out of the loss.
# - `train/tokens` counts micro-batches seen by the fit loop × tokens per micro-batch × dp size (float64, so
#   counts stay exact far past 2^24): it assumes the layout did not change during the run.
# - `train/grad_norm` is the norm of all gradients (after unscaling, before clipping: Lightning calls
#   `on_before_optimizer_step` between the two), every step, by megascale.core.parallel.grad_clip (each
#   tensor counted once, plain, tensor-parallel or ZeRO-sharded). Pipeline stages would also need its
#   `sum_group` (the stages' group, which the strategy owns): to be passed when pipeline parallelism lands.
#
# FLOPs and Lightning's ThroughputMonitor (lightning 2.6: pytorch/callbacks/throughput_monitor.py,
# fabric/utilities/throughput.py). The callback runs on global rank 0 only, reads `pl_module.flops_per_batch`
# after every batch and hands it to `Throughput.update(flops=...)`, whose contract is "FLOPs per DEVICE for
# this batch"; Throughput multiplies by `trainer.world_size` for the global `flops_per_sec` and divides by the
# device's peak for `device/mfu`. One data-parallel replica processes a micro-batch of B×T tokens spread over
# its tp × pp devices, so the per-device figure is
#     flops_per_batch = flops_per_token(config, T) × B × T × dp / world_size
# (= flops_per_token × B × T under DDP). It is model FLOPs (6·N + attention; no recomputation from
# activation checkpointing), so the MFU is the paper's MFU, not hardware utilisation. In validation it is a
# third of that (forward only). MFU needs the device's peak FLOPs: Lightning knows them for listed CUDA GPUs
# and reports `train/device/mfu`; on CPU it reports FLOPs/s without MFU. Use the module-level `batch_size_fn`
# and `length_fn` with the callback (in YAML: `batch_size_fn: megascale.lightning.module.batch_size_fn`).
# Throughput also multiplies samples and items per second by the world size: with tp × pp > 1 those global
# figures count each sample once per model-parallel device. megascale.lightning.SpeedMonitor (speed.py)
# mends both: a given or measured peak, global rates × dp; and it defaults to these two functions.

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn

from megascale.core import GPT, GPTConfig, flops_per_token
from megascale.core import generate as _generate
from megascale.core.hf import OVERRIDABLE, HFCheckpoint, HFWeights, config_conflicts, gpt_config_from_hf
from megascale.core.optim import LAMB
from megascale.core.parallel.grad_clip import grad_norm
from megascale.lightning.data import data_parallel_layout

__all__ = ["GPTModule", "batch_size_fn", "length_fn", "position_ids_of", "split_batch", "warmup_cosine"]


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """(inputs, targets) of a batch: an (inputs, targets) pair, an (inputs, targets, position_ids) triple, or a
    dict with ``input_ids`` and ``labels`` (and ``position_ids``)."""
    if isinstance(batch, Mapping):
        return batch["input_ids"], batch["labels"]
    if isinstance(batch, Sequence) and len(batch) in (2, 3):
        return batch[0], batch[1]
    raise TypeError(
        f"expected a batch (inputs, targets[, position_ids]) or {{'input_ids': ..., 'labels': ...}}, got "
        f"{type(batch).__name__}"
    )


def position_ids_of(batch: Any) -> Tensor | None:
    """The batch's ``position_ids`` (packed documents: positions restarting at 0 at each document; the data
    modules' ``document_mask=True``), or None."""
    if isinstance(batch, Mapping):
        return batch.get("position_ids")
    if isinstance(batch, Sequence) and not isinstance(batch, Tensor) and len(batch) == 3:
        return batch[2]
    return None


def batch_size_fn(batch: Any) -> int:
    """Samples in a batch, for ``ThroughputMonitor(batch_size_fn=...)``."""
    return int(split_batch(batch)[0].shape[0])


def length_fn(batch: Any) -> int:
    """Tokens in a batch, for ``ThroughputMonitor(length_fn=...)`` (its items/s are then tokens/s)."""
    return int(split_batch(batch)[0].numel())


def warmup_cosine(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step``: linear warmup from 1/warmup_steps to 1 over ``warmup_steps``
    steps, then cosine decay to ``min_lr_ratio`` at ``decay_steps``, constant after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _plain(t: Tensor) -> Tensor:
    # a DTensor (sharded loss or norm) as the whole value; plain tensors as they are
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _moe_layer_names(gpt: GPT) -> list[str]:
    """The block number of each MoE layer this rank holds, in ``moe_layers`` order."""
    from megascale.core.model.moe import MoE

    return [name.split(".")[1] for name, m in gpt.named_modules() if isinstance(m, MoE)]


def _with_fp8(model: GPT) -> GPT:
    """``model`` with fp8 GEMMs in its blocks when its config asks (``GPTConfig.fp8``), so that the module
    trains in fp8 under any strategy; MegaScaleStrategy's ``parallelize`` converts the split layers again."""
    if model.config.fp8 is not None:
        from megascale.core.fp8 import convert_to_float8  # torchao: only when a config asks for fp8

        convert_to_float8(model)
    return model


def _config_of_pretrained(pretrained: str, given: GPTConfig | None) -> GPTConfig:
    """The GPTConfig of the Hugging Face checkpoint ``pretrained``, or ``given`` if it builds the same network."""
    with HFCheckpoint(pretrained) as checkpoint:
        config = gpt_config_from_hf(checkpoint.config)
    if given is None:
        return config
    conflicts = config_conflicts(given, config)
    if conflicts:
        raise ValueError(
            f"model.config conflicts with the architecture of model.pretrained ({pretrained}/config.json) in: "
            + "; ".join(conflicts)
            + ". Leave model.config out to take the checkpoint's; only the fields that say how to train or run "
            f"may differ: {sorted(OVERRIDABLE)}"
        )
    return given


class GPTModule(LightningModule):
    """Next-token pretraining of a megascale-core GPT.

    Args:
        config: the GPT's architecture (nested in YAML as ``model.config.*``); a plain dict is accepted too,
            which is how a checkpoint's hyperparameters give it back. With ``pretrained`` it may be left out
            (the checkpoint's config.json gives it); given, it must build the same network (only the fields
            that say how to train or run may differ: ``max_seq_len``, ``dropout``, ``kernels``,
            ``pad_vocab_to_multiple_of``, ``init_std``), otherwise ValueError naming the conflicting fields.
        optimizer: "adamw" (torch AdamW, fused/foreach as torch chooses) or "lamb" (megascale LAMB, for
            large batches; trust ratios over whole tensors even when sharded).
        lr: peak learning rate.
        min_lr_ratio: the learning rate at the end of the cosine decay, as a fraction of ``lr``.
        warmup_steps: optimizer steps of linear warmup from ~0 to ``lr``.
        decay_steps: optimizer step at which the cosine decay reaches ``min_lr_ratio × lr`` (counting the
            warmup); None = the trainer's total steps (``max_steps``, or what ``max_epochs`` implies).
        weight_decay: decoupled weight decay of matrices and embeddings (≥2-D parameters); norm weights and
            biases get none.
        betas: the optimizer's moment decay rates.
        eps: the optimizer's denominator epsilon.
        init_seed: seed of the weight init (``GPT.init_weights(seed)``: the same values under any parallel
            layout); None = the global RNG (``seed_everything``). Read by strategies that materialise a
            meta-device model. Not with ``pretrained``.
        pretrained: a Hugging Face model directory (config.json + safetensors of a llama, qwen2, qwen3 or
            mistral model) to continue training from: its architecture becomes the config, and its weights
            the initial weights under any layout, each rank reading only the slices it holds
            (``megascale.core.hf.load_hf_weights_``). Needs ``pip install 'megascale-core[hf]'``.
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        optimizer: Literal["adamw", "lamb"] = "adamw",
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        init_seed: int | None = None,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(config, Mapping):  # from a checkpoint's hyperparameters
            config = GPTConfig(**config)
        problems = []
        if pretrained is not None:
            pretrained = str(pretrained)
            config = _config_of_pretrained(pretrained, config)
            if init_seed is not None:
                problems.append(f"init_seed={init_seed} has no effect: the weights come from pretrained")
        elif config is None:
            raise ValueError(
                "GPTModule needs a config (model.config) or a Hugging Face checkpoint to start from "
                "(model.pretrained)"
            )
        if optimizer not in ("adamw", "lamb"):
            problems.append(f"optimizer={optimizer!r} must be 'adamw' or 'lamb'")
        if lr <= 0:
            problems.append(f"lr={lr} must be > 0")
        if not 0.0 <= min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        if warmup_steps < 0:
            problems.append(f"warmup_steps={warmup_steps} must be >= 0")
        if decay_steps is not None and decay_steps < 1:
            problems.append(f"decay_steps={decay_steps} must be >= 1 (or None for the trainer's total steps)")
        if problems:
            raise ValueError("invalid GPTModule arguments: " + "; ".join(problems))
        self.save_hyperparameters(
            {
                "config": config.to_dict(),
                "optimizer": optimizer,
                "lr": lr,
                "min_lr_ratio": min_lr_ratio,
                "warmup_steps": warmup_steps,
                "decay_steps": decay_steps,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "eps": eps,
                "init_seed": init_seed,
                "pretrained": pretrained,
            }
        )
        self.config = config
        self.optimizer_name = optimizer
        self.lr = lr
        self.min_lr_ratio = min_lr_ratio
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.weight_decay = weight_decay
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = eps
        self.init_seed = init_seed
        self.pretrained = pretrained
        self.model: GPT | None = None
        # Per-device FLOPs of the last batch's shape, for ThroughputMonitor (see the header); None until the
        # first batch.
        self.flops_per_batch: int | None = None
        self._flops_key: tuple[int, int, bool, int, int] | None = None

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``, also for the checkpoint directories MegaScaleStrategy writes
        (read whole on this process, ``checkpoint_io.checkpoint_file``)."""
        from megascale.lightning import checkpoint_io  # the strategy's module, imported only where used

        if isinstance(checkpoint_path, (str, Path)) and checkpoint_io.is_checkpoint(checkpoint_path):
            checkpoint_path = checkpoint_io.checkpoint_file(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # -- model ------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the GPT once (Lightning may call this again: later calls do nothing).

        Under a meta-device context (a strategy's empty init) the GPT allocates nothing and is not
        initialised: whoever materialises it calls ``to_empty`` and ``init_weights(init_seed)``. Otherwise the
        GPT initialises itself from the global RNG, and again from ``init_seed`` if one is given. Either way
        ``init_seed`` becomes the GPT's ``init_seed``, which its ``init_weights()`` uses.

        With ``pretrained`` the GPT is built on the meta device and told where its weights are
        (``GPT.weights_source``): under a meta-device context it stays there, for the strategy to split and then
        materialise (``init_weights()`` loads each rank's slices); otherwise it is given memory on the context's
        device and loaded at once, without drawing random weights first.
        """
        if self.model is not None:
            return
        if self.pretrained is not None:
            device = torch.get_default_device()  # the strategy's tensor_init_context: meta, or its device
            with torch.device("meta"):
                model = _with_fp8(GPT(self.config))
            model.weights_source = HFWeights(self.pretrained)
            if device.type != "meta":
                model.to_empty(device=device)
                model.init_weights()
            self.model = model
            return
        model = _with_fp8(GPT(self.config))
        if self.init_seed is not None:
            if any(p.is_meta for p in model.parameters()):
                model.init_seed = self.init_seed  # what a later init_weights() (no argument) uses
            else:
                model.init_weights(seed=self.init_seed)
        self.model = model

    @property
    def gpt(self) -> GPT:
        """The GPT (after ``configure_model``)."""
        if self.model is None:
            raise RuntimeError(
                "GPTModule.configure_model() has not run: the Trainer calls it, or call it yourself"
            )
        return self.model

    def forward(
        self, tokens: Tensor, targets: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, padded vocab) of ``tokens``, or the mean next-token loss when ``targets`` are given;
        ``position_ids`` for packed documents (see ``GPT.forward``)."""
        return self.gpt(tokens, targets, position_ids=position_ids)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend ``prompt`` (B, T) by ``max_new_tokens`` sampled tokens (single process; temperature 0 =
        greedy). See ``megascale.core.generate``."""
        model = self.gpt
        was_training = model.training
        model.eval()
        try:
            return _generate(
                model, prompt.to(self.device), max_new_tokens, temperature, top_k=top_k, generator=generator
            )
        finally:
            model.train(was_training)

    # -- steps ------------------------------------------------------------------------------------------------

    def _dp_size(self) -> int:
        return data_parallel_layout(self.trainer)[0]

    def _update_flops(self, inputs: Tensor, training: bool) -> None:
        batch, seq = int(inputs.shape[0]), int(inputs.shape[-1])
        dp, world = self._dp_size(), int(self.trainer.world_size)
        key = (batch, seq, training, dp, world)
        if key == self._flops_key:
            return
        per_replica = flops_per_token(self.config, seq) * batch * seq * (1.0 if training else 1.0 / 3.0)
        self.flops_per_batch = int(per_replica * dp / world)
        self._flops_key = key

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = split_batch(batch)
        self._update_flops(inputs, training=True)
        loss = self.gpt(inputs, targets, position_ids=position_ids_of(batch))
        size = int(inputs.shape[0])
        self.log(
            "train/loss", _plain(loss.detach()), prog_bar=True, on_step=True, on_epoch=False, sync_dist=True,
            batch_size=size,
        )  # fmt: skip
        optimizers = self.trainer.optimizers
        if optimizers:
            lr = float(optimizers[0].param_groups[0]["lr"])
            self.log("train/lr", lr, on_step=True, on_epoch=False, batch_size=size)
        micro_batches = self.trainer.fit_loop.total_batch_idx + 1
        tokens = micro_batches * inputs.numel() * self._dp_size()
        self.log(
            "train/tokens", torch.tensor(float(tokens), dtype=torch.float64), on_step=True, on_epoch=False,
            batch_size=size,
        )  # fmt: skip
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = split_batch(batch)
        self._update_flops(inputs, training=False)
        loss = self.gpt(inputs, targets, position_ids=position_ids_of(batch))
        self.log("val/loss", _plain(loss), prog_bar=True, sync_dist=True, batch_size=int(inputs.shape[0]))
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = split_batch(batch)
        loss = self.gpt(inputs, targets, position_ids=position_ids_of(batch))
        self.log("test/loss", _plain(loss), sync_dist=True, batch_size=int(inputs.shape[0]))
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Next-token logits (B, T, vocab_size) over the real vocabulary for the batch's inputs (a tensor, an
        (inputs, targets) pair or a dict with ``input_ids``) — the whole vocabulary on every rank, also
        when tensor parallelism splits it."""
        if isinstance(batch, Tensor):
            inputs, position_ids = batch, None
        else:
            inputs, position_ids = split_batch(batch)[0], position_ids_of(batch)
        logits = self.gpt(inputs, position_ids=position_ids)
        gather = getattr(self.gpt.loss_fn, "gather_logits", None)
        if gather is not None:
            logits = gather(logits)
        return logits[..., : self.config.vocab_size]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # each tensor counted once whether plain, tensor-parallel or ZeRO-sharded; the same on every rank
        # pipeline stages hold different parameters: the strategy names the group to sum their norms over
        strategy = self._trainer.strategy if self._trainer is not None else None
        norm = grad_norm(self.parameters(), sum_group=getattr(strategy, "gradient_norm_group", None))
        self.log("train/grad_norm", _plain(norm).detach().float(), on_step=True, on_epoch=False)
        if self.config.moe is not None:
            self._balance_experts(strategy)

    def _balance_experts(self, strategy: Any) -> None:
        """Once per optimizer step (its counts complete, its next forward not begun): the routers' loss-free
        bias update from the step's tokens per expert, summed over the data-parallel ranks, and the load in the
        logs: ``moe/load`` (progress bar) is the busiest expert's tokens over the mean, in the most unbalanced
        layer (1.0 = balanced), ``moe/load/<layer>`` each layer's."""
        import torch.distributed as dist

        from megascale.core.model.moe import update_expert_biases

        if hasattr(strategy, "data_parallel_group"):
            group = strategy.data_parallel_group
        else:  # DDP, FSDP...: every rank a data-parallel replica
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        counts = update_expert_biases(self.gpt, group)
        if counts is None:  # a pipeline rank holding no MoE layer
            return
        load = counts.max(-1).values / counts.mean(-1).clamp_min(1e-9)
        self.log("moe/load", float(load.max()), prog_bar=True, on_step=True, on_epoch=False)
        for name, value in zip(_moe_layer_names(self.gpt), load.tolist(), strict=True):
            self.log(f"moe/load/{name}", value, on_step=True, on_epoch=False)

    # -- optimisation -----------------------------------------------------------------------------------------

    def _total_decay_steps(self) -> int:
        if self.decay_steps is not None:
            return self.decay_steps
        if self._trainer is None:
            raise RuntimeError(
                "decay_steps=None takes the trainer's total steps: attach a Trainer or set decay_steps"
            )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the trainer's total steps are unknown (an endless dataloader): set decay_steps")
        return int(total)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """AdamW or LAMB with weight decay on ≥2-D parameters only, and a per-step warmup + cosine schedule."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for param in self.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        groups = [
            group
            for group in (
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            )
            if group["params"]
        ]
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "lamb":
            optimizer = LAMB(
                groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
            )
        else:
            optimizer = torch.optim.AdamW(
                groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
            )
        schedule = functools.partial(
            warmup_cosine,
            warmup_steps=self.warmup_steps,
            decay_steps=self._total_decay_steps(),
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
