"""What a run reads and how: one typed dataclass that jsonargparse (LightningCLI) can fill from YAML."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megascale.data.packing import Preprocess
from megascale.data.sources import Source

__all__ = ["WebDataConfig"]


@dataclass
class WebDataConfig:
    """Sources, sequence shape and reader settings of a WebDataset token stream.

    Args:
        sources: the datasets, mixed by their ``weight``.
        seq_len: tokens per training sequence (each packed window holds seq_len + 1).
        batch_size: sequences per data-parallel rank and step.
        tokenizer: "bytes" (byte-level, vocabulary 257) or a path to a Hugging Face ``tokenizers`` JSON file.
        preprocess: per-sample hook returning a document's token ids (default: decode ``Source.text_key``
            and tokenize); must be picklable.
        lanes: independent read streams of the canonical order (see ``megascale.data.order``); fixed for the
            life of a run, so a resume uses the checkpoint's. Default: the first run's global batch size
            (dp × batch_size), with which every DP rank reads only its own lanes. Prefer a multiple of every
            global batch size you may resume with, and at most the number of shards.
        seed: shuffles shards per epoch and draws sources.
        shuffle: shuffle the shard order of every epoch.
        num_workers: processes of the node reader that read and tokenize (0: the reader does it itself).
        prefetch: batches prepared ahead of the training step (ring slots).
        retries: attempts per shard on transient read errors (with exponential backoff from ``backoff`` s).
        backoff: first retry delay in seconds.
        on_corrupt: a corrupt or truncated shard is skipped with a warning and counted ("warn"), or raises.
        timeout: seconds a rank waits for a batch (and the reader for the ranks) before an error.
        document_mask: batches are ``(inputs, targets, position_ids)``, the positions restarting at 0 at every
            document (the token after each end-of-sequence) and at each window's start, so the model keeps
            attention inside each document (``GPT.forward(..., position_ids)``). Off by default: pretraining
            as Megatron packs (documents see the ones before them in a window); on for fine-tuning and long
            context, where recipes mask across documents.
    """

    sources: list[Source]
    seq_len: int
    batch_size: int
    tokenizer: str = "bytes"
    preprocess: Preprocess | None = None
    lanes: int | None = None
    seed: int = 0
    shuffle: bool = True
    num_workers: int = 1
    prefetch: int = 4
    retries: int = 3
    backoff: float = 0.5
    on_corrupt: Literal["warn", "raise"] = "warn"
    timeout: float = 300.0
    document_mask: bool = False

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("WebDataConfig(sources=[]): give at least one Source")
        for i, source in enumerate(self.sources):
            if not isinstance(source, Source):
                raise TypeError(
                    f"WebDataConfig.sources[{i}] is {source!r}, not a Source: give Source(urls=..., weight=..., "
                    "storage_options=..., text_key=...) (in YAML: a mapping with those keys, 'urls' required)"
                )
        for name in ("seq_len", "batch_size", "prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"WebDataConfig({name}={getattr(self, name)}): must be >= 1")
        if self.num_workers < 0:
            raise ValueError(f"WebDataConfig(num_workers={self.num_workers}): must be >= 0")
        if self.lanes is not None and self.lanes < 1:
            raise ValueError(f"WebDataConfig(lanes={self.lanes}): must be >= 1 (or None)")
        if self.on_corrupt not in ("warn", "raise"):
            raise ValueError(f"WebDataConfig(on_corrupt={self.on_corrupt!r}): 'warn' or 'raise'")
