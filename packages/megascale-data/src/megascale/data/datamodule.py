"""`WebDataModule`: the WebLoader inside Lightning (the ``lightning`` extra).

The data-parallel rank and size come from the trainer's strategy (``distributed_sampler_kwargs``, which
MegaScaleStrategy sets to the DP layout and DDP/FSDP to the world), the node layout from the trainer, and the
run id from a broadcast of rank 0, so the node's ranks find their reader. The resume state goes into
Lightning checkpoints: at save time every rank contributes the lanes its node read (a collective), counted
at ``global_step × accumulate_grad_batches`` batches, not at what Lightning has fetched ahead.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch import Tensor

from megascale.data.config import WebDataConfig
from megascale.data.loader import WebLoader, merge_states
from megascale.data.tokenize import Tokenizer, load_tokenizer

__all__ = ["WebDataModule"]


class WebDataModule(LightningDataModule):
    """Training (and optionally validation) batches ``(inputs, targets)`` from WebDataset shards;
    ``(inputs, targets, position_ids)`` with ``document_mask`` set in a stream's config.

    Args:
        train: the training stream (endless: set the trainer's ``max_steps``).
        val: a validation stream; each validation reads its first ``val_batches`` batches per rank again.
        val_batches: batches per rank and validation.
        tree: one reader process per node in shared memory (False: every rank reads inline).
    """

    def __init__(
        self, train: WebDataConfig, val: WebDataConfig | None = None, val_batches: int = 8, tree: bool = True
    ) -> None:
        super().__init__()
        self.train, self.val, self.val_batches, self.tree = train, val, val_batches, tree
        self._train_loader: WebLoader | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._base_step = 0
        self._final_state: dict[str, Any] | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The training stream's tokenizer (``encode``/``decode``; e.g. for sampling from the trained model)."""
        return load_tokenizer(self.train.tokenizer)

    @property
    def document_mask(self) -> bool:
        """Whether batches carry ``position_ids`` restarting at each document (either stream's config)."""
        return self.train.document_mask or (self.val is not None and self.val.document_mask)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer produces (set the model's vocabulary to at least this)."""
        return self.tokenizer.vocab_size

    def setup(self, stage: str) -> None:
        # a vocabulary too small for the tokenizer's ids would fail later, deep inside the embedding
        model = self.trainer.lightning_module if self.trainer is not None else None
        model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(model_vocab, int) and model_vocab < self.vocab_size:
            raise ValueError(
                f"the tokenizer {self.train.tokenizer!r} produces {self.vocab_size} token ids but the model's "
                f"vocab_size is {model_vocab}: set model.config.vocab_size >= {self.vocab_size}"
            )

    def _layout(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None:
            return {"dp_rank": 0, "dp_size": 1}
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        run_id = trainer.strategy.broadcast(uuid.uuid4().hex[:12], src=0)
        return {
            "dp_rank": int(kwargs.get("rank", 0)),
            "dp_size": int(kwargs.get("num_replicas", 1)),
            "local_rank": trainer.local_rank,
            "local_world_size": trainer.num_devices,
            "node_rank": trainer.node_rank,
            "run_id": f"lightning-{run_id}",
        }

    def train_dataloader(self) -> Iterable[tuple[Tensor, ...]]:
        if self._train_loader is not None:
            self._train_loader.close()
        self._final_state = None
        loader = WebLoader(self.train, tree=self.tree, **self._layout())
        if self._loaded_state:
            loader.load_state_dict(self._loaded_state)
        self._base_step = self.trainer.global_step if self.trainer is not None else 0
        self._train_loader = loader
        return _Batches(loader)

    def val_dataloader(self) -> Iterable[tuple[Tensor, ...]]:
        if self.val is None:
            return []
        layout = self._layout()
        return _Batches(
            WebLoader(
                self.val,
                tree=False,
                dp_rank=layout["dp_rank"],
                dp_size=layout["dp_size"],
                max_steps=self.val_batches,
            )
        )

    def state_dict(self) -> dict[str, Any]:
        """The training stream's resume state, merged over all ranks (called on every rank at save)."""
        state = self._local_state()
        if state is None:
            return dict(self._loaded_state or {})
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
            state = merge_states(states)
        return state

    def _local_state(self) -> dict[str, Any] | None:
        loader = self._train_loader
        if loader is None or not loader.started:
            return self._final_state
        batches = None
        if self.trainer is not None:
            batches = (self.trainer.global_step - self._base_step) * self.trainer.accumulate_grad_batches
        return loader.state_dict(batches)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training stream from a checkpoint's state (with any data-parallel size)."""
        self._loaded_state = dict(state_dict) if state_dict else None

    def teardown(self, stage: str) -> None:
        if self._train_loader is not None:
            self._final_state = self._local_state()  # trainer.save_checkpoint after fit still has it
            self._train_loader.close()
            self._train_loader = None


class _Batches:
    """The loader's batches without its state methods: Lightning would otherwise save the loader's state
    itself, counted at what it fetched ahead, and load it over the data module's."""

    def __init__(self, loader: WebLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return iter(self.loader)
