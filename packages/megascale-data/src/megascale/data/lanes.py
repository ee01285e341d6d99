"""Reading one lane of the canonical order: shards opened in turn, packed, resumable at a cursor (no torch).

See `order.py` for what a lane is. A `LaneReader` yields the lane's sequences in order and keeps its
`LaneCursor` exact after every sequence, so the cursor saved with a batch resumes right after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from megascale.data.order import CanonicalOrder, LaneCursor
from megascale.data.packing import Preprocess, pack
from megascale.data.sources import DataSourceError, ReadStats, Source, iter_samples

__all__ = ["LaneReader", "ReadOptions"]


@dataclass(frozen=True)
class ReadOptions:
    """How shards are read and turned into sequences (one per run, shared by every lane)."""

    seq_len: int
    eos_id: int
    preprocess: Sequence[Preprocess]  # per source
    retries: int = 3
    backoff: float = 0.5
    on_corrupt: str = "warn"
    stats: ReadStats = field(default_factory=ReadStats, compare=False)


class LaneReader:
    """The sequences of one lane, from a cursor on."""

    def __init__(
        self,
        order: CanonicalOrder,
        sources: Sequence[Source],
        lane: int,
        cursor: LaneCursor,
        options: ReadOptions,
    ) -> None:
        self.order, self.sources, self.lane, self.options = order, sources, lane, options
        self.cursor = cursor
        self._streams: dict[int, Iterator[np.ndarray]] = {}

    def next(self) -> np.ndarray:
        """The lane's sequence at ``cursor.index``; advances the cursor."""
        source = self.order.source_of(self.lane, self.cursor.index)
        stream = self._streams.get(source)
        if stream is None:
            stream = self._streams[source] = self._source_stream(source)
        sequence = next(stream)
        self.cursor.index += 1
        return sequence

    def _documents(self, source: int, url: str) -> Iterator[np.ndarray]:
        opts, src = self.options, self.sources[source]
        samples = iter_samples(
            url, storage_options=src.storage_options, retries=opts.retries, backoff=opts.backoff,
            on_corrupt=opts.on_corrupt, stats=opts.stats,  # type: ignore[arg-type]
            format=src.format, text_key=src.text_key_of(url),
        )  # fmt: skip
        for sample in samples:
            doc = opts.preprocess[source](sample)
            if doc is None or len(doc) == 0:
                opts.stats.skipped_samples += 1
                continue
            yield doc

    def _source_stream(self, source: int) -> Iterator[np.ndarray]:
        position = self.cursor.shards[source]  # [ordinal, offset], updated in place
        n_shards = len(self.order.shards[source])
        empty_in_a_row = 0
        while True:
            url, _ = self.order.shard(source, self.lane, position[0])
            sequences = pack(self._documents(source, url), self.options.seq_len, self.options.eos_id)
            produced = 0
            for k, sequence in enumerate(sequences):
                produced += 1
                if k < position[1]:
                    continue  # taken before the resume
                position[1] = k + 1
                yield sequence
            empty_in_a_row = 0 if produced else empty_in_a_row + 1
            if empty_in_a_row >= n_shards:
                raise DataSourceError(
                    f"source {self.sources[source].urls!r}: {n_shards} shards in a row hold no sequence of "
                    f"seq_len + 1 = {self.options.seq_len + 1} tokens (documents too short, or every "
                    "sample lacks the text key): lower seq_len or check the shards"
                )
            position[0], position[1] = position[0] + 1, 0
