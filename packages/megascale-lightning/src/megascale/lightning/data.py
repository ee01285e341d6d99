# TokenDataModule: the simple token source for GPTModule until megascale-data's WebDataset module exists,
# and ResumableDistributedSampler, which gives every data-parallel rank its share of each global batch and
# resumes exactly where a checkpoint left off.
#
# Sources. "stdlib": the Python standard library's .py files in sorted order (tests and site-packages left
# out, as examples/pretrain.py does), byte-level tokens, vocabulary 256. "random:<vocab>": deterministic
# synthetic tokens for tests; they are not i.i.d. noise but a seeded random walk t[i+1] = (t[i] + s[i]) % vocab
# with each step s[i] drawn from 4 fixed offsets, so a model can learn them (loss floor ln 4 ≈ 1.39 nats)
# while the stream still covers the whole vocabulary. Any other string is a path: a text file, or a directory
# whose regular files (recursively, sorted, hidden ones skipped) are concatenated; byte-level tokens.
# All sources stop at max_bytes tokens. The tail val_fraction of the tokens is held out for validation.
# A sample is a window of seq_len + 1 tokens (stride seq_len): (inputs, targets) = (w[:-1], w[1:]).
#
# Data-parallel split. The sampler subclasses torch's DistributedSampler: Lightning then neither replaces it
# (data_connector._requires_distributed_sampler checks `isinstance(dataloader.sampler, DistributedSampler)`)
# nor wraps it. Its rank and size are the DATA-parallel ones, read from
# `trainer.strategy.distributed_sampler_kwargs` (MegaScaleStrategy and ModelParallelStrategy report the dp
# mesh there, so tensor/pipeline-parallel peers get the same batch; DDP reports the world). Every epoch has
# one seeded global order (a permutation with seed + epoch, the same on every rank); a "global batch" is
# G = batch_size × dp consecutive positions of it, and dp rank r takes positions r, r+dp, r+2dp, ... of each
# global batch, so the union of the ranks' micro-batches is exactly the global batch. An epoch holds
# N // G global batches (the tail that cannot fill one is dropped, so every rank has the same number of
# batches, which collectives need).
#
# Exact resume. `state_dict()` returns {"consumed_samples": C, "global_batch_size": G}: C is the number of
# samples (all ranks together, all epochs) consumed by completed optimizer steps, computed as
# trainer.global_step × accumulate_grad_batches × batch_size × dp (counted from the last resume, see
# `consumed_samples`). That assumes checkpoints are taken at optimizer-step boundaries (ModelCheckpoint and
# trainer.save_checkpoint from a callback are) and, across epochs, that accumulate_grad_batches divides the
# batches per epoch (Lightning steps on an epoch's last batch even with a partial accumulation, which this
# count cannot see; always true with accumulation 1). The resumed sampler starts at position C in the global
# order, whatever dp size the resumed run has, since C counts global samples.
#
# Agreement with Lightning's loop (lightning 2.6, loops/fit_loop.py and training_epoch_loop.py). On a
# mid-epoch restart Lightning restores the epoch and `batch_progress.current.ready` (= k batches done this
# epoch), keeps `num_training_batches = len(dataloader)` from setup, continues batch_idx at k and ends the
# epoch after len - k more batches (`_DataFetcher.fetched` starts at k). So `len(sampler)` stays the FULL
# epoch (N // G batches per rank) while a resumed iterator yields only the remaining N // G - k batches:
# batch_idx, is_last_batch and end-of-epoch hooks then match the uninterrupted run. Lightning calls
# `set_epoch` at every epoch start, after creating the first iterator: `__iter__` is lazy (a generator), so the
# epoch is read when the first index is drawn (with num_workers=0; with workers, DataLoader draws indices
# eagerly, so the sampler starts at the epoch its consumed_samples fall in, which is the epoch Lightning
# resumes). If dp (or batch_size) changed between save and resume, Lightning's k counts batches of the old
# size: the sampler then reports max(N // G, k + remaining) batches so Lightning never ends the resumed epoch
# before its data is used. An epoch whose iterator runs out before that length (the resumed one at a smaller
# global batch; every later one of that run at a larger) ends through StopIteration, which Lightning
# handles, only without `is_last_batch`: its end-of-epoch validation is skipped and the progress bar's
# total is off (validation every n batches, the CLI default, is unaffected). Epochs before the resumed one
# are assumed to have run at the saved layout, and every epoch to run whole (limit_train_batches unset).
# Lightning warns on each mid-epoch resume that the dataloader "is not resumable": it only looks for
# state_dict/load_state_dict on the DataLoader itself, not on the data module that holds the state here.
# (Making the DataLoader stateful instead would make a checkpoint refuse to resume with another data module.)
#
# Validation: the held-out tail in order (no shuffling), split over dp ranks the same strided way with a
# granularity of one sample (each rank gets N_val // dp samples; the last partial batch is kept).

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "ResumableDistributedSampler",
    "TokenDataModule",
    "TokenWindows",
    "data_parallel_layout",
    "load_documents",
    "load_tokens",
]

_RANDOM_PREFIX = "random:"
_RANDOM_STEPS = 4  # successors per token in the synthetic source: loss floor ln 4
_RANDOM_DOCUMENT = (4, 65)  # the synthetic source's documents: 4 to 64 tokens (document_mask)


def data_parallel_layout(trainer: Trainer | None) -> tuple[int, int]:
    """(data-parallel size, data-parallel rank) of this process under ``trainer``'s strategy.

    Read from ``strategy.distributed_sampler_kwargs`` (``num_replicas``/``rank``), which Lightning's own
    strategies and MegaScaleStrategy define as the data-parallel layout; strategies without it (single
    device) give the world size and global rank; no trainer gives (1, 0). Call it after the strategy is set
    up (ModelParallelStrategy's mesh exists only then).
    """
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if kwargs and "num_replicas" in kwargs and "rank" in kwargs:
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return int(trainer.world_size), int(trainer.global_rank)


def _stdlib_chunks(max_bytes: int) -> list[bytes]:
    """The standard library's sources, one file each, until ``max_bytes`` are reached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return chunks


def _path_chunks(source: str, max_bytes: int) -> list[bytes]:
    """The files of ``source`` (a file, or a directory's files but hidden ones), until ``max_bytes``."""
    root = Path(source).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    else:
        raise FileNotFoundError(
            f"data source {source!r} is neither 'stdlib', 'random:<vocab>', nor an existing file or directory"
        )
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not any(chunks):
        raise ValueError(f"data source {source!r} holds no bytes")
    return chunks


def _random_vocab(source: str) -> int:
    try:
        vocab = int(source[len(_RANDOM_PREFIX) :])
    except ValueError:
        raise ValueError(
            f"data source {source!r}: expected 'random:<vocab size>', e.g. 'random:100'"
        ) from None
    if vocab < 2:
        raise ValueError(f"data source {source!r}: the vocabulary needs at least 2 tokens")
    return vocab


def _random_tokens(vocab: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randperm(vocab - 1, generator=gen)[: min(_RANDOM_STEPS, vocab - 1)] + 1
    steps = offsets[torch.randint(0, len(offsets), (length,), generator=gen)]
    steps[0] = torch.randint(0, vocab, (), generator=gen)  # the start token
    return torch.cumsum(steps, 0) % vocab


def load_tokens(source: str, max_bytes: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """The token stream of ``source`` (1-D, at most ``max_bytes`` tokens) and its vocabulary size.

    Bytes are kept as uint8 and synthetic tokens in the narrowest integer type that holds them, so a large
    corpus costs one byte per token; samples are widened to int64 when they are read.
    """
    tokens, vocab, _ = load_documents(source, max_bytes, seed)
    return tokens, vocab


def load_documents(source: str, max_bytes: int, seed: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``load_tokens``' stream and vocabulary, and where its documents start (int64 offsets, the first 0): each
    file of a text source (a module of the standard library), and for "random:" synthetic documents of
    ``_RANDOM_DOCUMENT`` tokens (drawn from ``seed``)."""
    if source.startswith(_RANDOM_PREFIX):
        vocab = _random_vocab(source)
        tokens = _random_tokens(vocab, max_bytes, seed)
        dtype = torch.uint8 if vocab <= 256 else torch.int16 if vocab <= 2**15 else torch.int32
        gen = torch.Generator().manual_seed(seed + 1)
        lengths = torch.randint(*_RANDOM_DOCUMENT, (max_bytes // _RANDOM_DOCUMENT[0] + 1,), generator=gen)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return tokens.to(dtype), vocab, starts[starts < max_bytes]
    chunks = _stdlib_chunks(max_bytes) if source == "stdlib" else _path_chunks(source, max_bytes)
    data = b"".join(chunks)[:max_bytes]
    starts = torch.tensor([0] + [len(c) for c in chunks[:-1]], dtype=torch.int64).cumsum(0)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), 256, starts[starts < len(data)]


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len``; item i is (inputs, targets) = (w[:-1], w[1:]).

    With ``document_starts`` (offsets in ``tokens`` where documents begin), item i is (inputs, targets,
    position_ids): the positions restart at 0 at each document start and at the window's first token (a
    document cut by the window restarts there: transformers', torchtitan's and Megatron's convention)."""

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, document_starts: torch.Tensor | None = None
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.tokens = tokens
        self.seq_len = seq_len
        if document_starts is not None and (len(document_starts) == 0 or int(document_starts[0]) != 0):
            document_starts = torch.cat(
                [torch.zeros(1, dtype=torch.int64), document_starts]
            )  # a stream's start
        self.document_starts = document_starts

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        if self.document_starts is None:
            return window[:-1], window[1:]
        offsets = torch.arange(start, start + self.seq_len)
        starts = self.document_starts
        last = starts[(torch.searchsorted(starts, offsets, right=True) - 1).clamp_min(0)]
        return window[:-1], window[1:], offsets - last.clamp_min(start)


class ResumableDistributedSampler(DistributedSampler):
    """Data-parallel sampler with one seeded global order per epoch and an exact resume point.

    Rank ``rank`` of ``num_replicas`` takes positions ``rank, rank + num_replicas, ...`` of each global batch
    of ``batch_size × num_replicas`` consecutive positions in the epoch's global order, starting from
    ``consumed_samples``. It yields sample indices; the DataLoader groups them into micro-batches of
    ``batch_size`` (pass the same ``batch_size`` to both).

    Args:
        dataset: a sized map-style dataset.
        num_replicas: data-parallel size; None = the default process group's size, or 1 without one.
        rank: data-parallel rank; None = the default process group's rank, or 0 without one.
        batch_size: micro-batch size per rank.
        shuffle: permute each epoch (seed + epoch, identical on every rank); False = dataset order.
        seed: base seed of the permutations.
        consumed_samples: samples (all ranks, all epochs) already consumed; iteration resumes after them.
        consumed_global_batch_size: ``batch_size × num_replicas`` of the run that consumed them, if it
            differs from this one (a resume at another dp size); None = this sampler's.
        epoch: the first epoch; None = the epoch ``consumed_samples`` falls in.
        anchor_epoch: False: ``set_epoch(e)`` selects data epoch ``e``. True: the first ``set_epoch`` call
            names the trainer's number for the epoch ``consumed_samples`` falls in, and later calls move
            relative to it (``TokenDataModule`` sets this). The data position is then the sampler's own
            truth: after a checkpoint saved once ``fit`` stopped at ``max_steps``, Lightning counts the
            interrupted epoch as finished and resumes under the next epoch number, while an uninterrupted
            run would go on with the rest of that epoch — which is what the sampler serves.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        consumed_samples: int = 0,
        consumed_global_batch_size: int | None = None,
        epoch: int | None = None,
        anchor_epoch: bool = False,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        self.batch_size = batch_size
        self.consumed_samples = consumed_samples
        self.consumed_global_batch_size = consumed_global_batch_size or self.global_batch_size
        resume_epoch, _, _ = self._resume_point()
        self.epoch = resume_epoch if epoch is None else epoch
        self._epoch_offset: int | None = None if anchor_epoch else 0  # trainer epoch - data epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to the trainer's ``epoch`` (see ``anchor_epoch``)."""
        if self._epoch_offset is None:
            self._epoch_offset = epoch - self.epoch
        self.epoch = epoch - self._epoch_offset

    @property
    def global_batch_size(self) -> int:
        """Samples in one global batch: ``batch_size × num_replicas``."""
        return self.batch_size * self.num_replicas

    def _dataset_len(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _resume_point(self) -> tuple[int, int, int]:
        """(epoch, position in it, batches of that epoch consumed) for ``consumed_samples``, in the layout
        that consumed them."""
        size = self.consumed_global_batch_size
        per_epoch = (self._dataset_len() // size) * size
        if per_epoch == 0 or self.consumed_samples == 0:
            return 0, 0, 0
        epoch, offset = divmod(self.consumed_samples, per_epoch)
        return epoch, offset, offset // size

    def batches_per_epoch(self) -> int:
        """Micro-batches per rank that Lightning counts in every epoch (``len(dataloader)``)."""
        full = self._dataset_len() // self.global_batch_size
        _, offset, done = self._resume_point()
        if offset == 0:
            return full
        # after a resume at another global batch size, Lightning resumes the epoch at `done` batches of the
        # old size: report enough batches that it does not end the epoch before the data is used
        return max(full, done + (self._dataset_len() - offset) // self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() * self.batch_size

    def _start(self, epoch: int) -> int:
        resume_epoch, offset, _ = self._resume_point()
        if epoch < resume_epoch:
            return self._dataset_len()  # consumed already: nothing left
        return offset if epoch == resume_epoch else 0

    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's order of sample indices, identical on every rank."""
        epoch = self.epoch if epoch is None else epoch
        n = self._dataset_len()
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing is computed until the first index is drawn, which is after Lightning's
        # set_epoch even though Lightning creates the epoch's first iterator before calling it.
        epoch = self.epoch
        start = self._start(epoch)
        batches = max(0, (self._dataset_len() - start) // self.global_batch_size)
        positions = start + self.rank + self.num_replicas * torch.arange(batches * self.batch_size)
        yield from self.global_order(epoch)[positions].tolist()


class TokenDataModule(LightningDataModule):
    """Token windows from the Python standard library, a text file/directory, or a synthetic source.

    Args:
        source: "stdlib" (the standard library's .py files, bytes), "random:<vocab>" (deterministic
            learnable synthetic tokens, for tests), or a path to a text file or a directory of text files
            (bytes).
        seq_len: tokens per sample (the model's context; windows hold seq_len + 1 tokens).
        batch_size: micro-batch size per data-parallel rank.
        max_bytes: tokens read from the source at most (for "random:", the stream's length).
        val_fraction: the held-out tail of the token stream, for validation (0 = no validation data).
        shuffle: shuffle training windows, one seeded permutation per epoch.
        seed: seed of the permutations and of the synthetic source.
        num_workers: DataLoader worker processes.
        document_mask: samples are (inputs, targets, position_ids), the positions restarting at 0 at each
            document (a file of a text source; synthetic documents of 4-64 tokens for "random:") and at each
            window's start, so the model keeps attention inside each document. Off by default (documents see
            the ones before them in a window, as Megatron packs for pretraining).
    """

    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 128,
        batch_size: int = 8,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        document_mask: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        if seq_len < 1 or batch_size < 1 or max_bytes < 2:
            raise ValueError("seq_len and batch_size must be >= 1 and max_bytes >= 2")
        self.save_hyperparameters()
        self.source = source
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.document_mask = document_mask
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None
        # Resume bookkeeping: a loaded state waiting for the next train dataloader, and the point the current
        # train dataloader started from: (consumed_samples, global_step, global batch size) at that time.
        self._loaded_state: dict[str, Any] | None = None
        self._base: tuple[int, int, int] | None = None

    @property
    def vocab_size(self) -> int:
        """Tokens the source can produce: 256 for bytes, <vocab> for "random:<vocab>"."""
        return _random_vocab(self.source) if self.source.startswith(_RANDOM_PREFIX) else 256

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            tokens, _, starts = load_documents(self.source, self.max_bytes, self.seed)
            split = len(tokens) - int(len(tokens) * self.val_fraction)
            train_starts = starts[starts < split] if self.document_mask else None
            val_starts = starts[starts >= split] - split if self.document_mask else None
            self.train_dataset = TokenWindows(tokens[:split], self.seq_len, train_starts)
            self.val_dataset = TokenWindows(tokens[split:], self.seq_len, val_starts)
            if len(self.train_dataset) == 0:
                raise ValueError(
                    f"data source {self.source!r} gives {split} training tokens: too few for one window of "
                    f"seq_len + 1 = {self.seq_len + 1}"
                )
        model = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(model, "config", None)
        model_vocab = getattr(config, "vocab_size", None)
        if isinstance(model_vocab, int) and model_vocab < self.vocab_size:
            raise ValueError(
                f"the data has {self.vocab_size} token ids but the model's vocab_size is {model_vocab}: set "
                f"model.config.vocab_size >= {self.vocab_size}"
            )

    def consumed_samples(self) -> int:
        """Samples (all data-parallel ranks together) consumed by completed optimizer steps.

        ``trainer.global_step × accumulate_grad_batches × batch_size × dp``, counted from the point the
        current train dataloader started at (a resume keeps the restored count and adds only the steps taken
        since, so a dp size change between runs keeps the count right).
        """
        if self._base is not None:
            consumed, base_step, global_batch = self._base
            step = self.trainer.global_step if self.trainer is not None else base_step
            accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
            return consumed + (step - base_step) * accumulate * global_batch
        if self._loaded_state is not None:
            return int(self._loaded_state["consumed_samples"])
        if self.trainer is None:
            return 0
        dp, _ = data_parallel_layout(self.trainer)
        return self.trainer.global_step * self.trainer.accumulate_grad_batches * self.batch_size * dp

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "call setup() first"
        dp, rank = data_parallel_layout(self.trainer)
        global_batch = self.batch_size * dp
        step = self.trainer.global_step if self.trainer is not None else 0
        previous_global_batch: int | None = None
        if self._loaded_state is not None:  # resuming: the checkpoint's count and the layout that made it
            consumed = int(self._loaded_state["consumed_samples"])
            previous_global_batch = self._loaded_state.get("global_batch_size")
            self._loaded_state = None
        else:  # a fresh run (0) or a dataloader reload mid-run
            consumed = self.consumed_samples()
            if self._base is not None:
                previous_global_batch = self._base[2]
        self._base = (consumed, step, global_batch)
        sampler = ResumableDistributedSampler(
            self.train_dataset,
            num_replicas=dp,
            rank=rank,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            consumed_samples=consumed,
            consumed_global_batch_size=previous_global_batch,
            anchor_epoch=True,
        )
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_dataset is not None, "call setup() first"
        dp, rank = data_parallel_layout(self.trainer)
        sampler = ResumableDistributedSampler(
            self.val_dataset, num_replicas=dp, rank=rank, batch_size=1, shuffle=False
        )
        return DataLoader(
            self.val_dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers
        )

    def state_dict(self) -> dict[str, Any]:
        """``{"consumed_samples": ..., "global_batch_size": batch_size × dp}`` (JSON-serialisable)."""
        dp, _ = data_parallel_layout(self.trainer)
        return {"consumed_samples": self.consumed_samples(), "global_batch_size": self.batch_size * dp}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s output: the next train dataloader starts after consumed_samples."""
        self._loaded_state = dict(state_dict)
        self._base = None
