"""The canonical global order of packed sequences, independent of how many ranks read it (no torch here).

A run reads a stream of packed sequences numbered g = 0, 1, 2, ... Step k of a run with data-parallel size D
and per-rank batch B (global batch G = D·B) gives DP rank r the positions k·G + r·B + [0, B). The order of
the stream depends only on the sources, the seed and the number of *lanes* L, never on D or B; so a resume
from position g with another D (or B) neither repeats nor skips a sequence.

Lanes make that order readable without an index of how many sequences each shard holds (Mosaic streaming
needs one; WebDataset shards have none). Position g lives in lane g mod L at index g // L. A lane is a
stream of its own: its i-th sequence comes from source `source_of(lane, i)` (a seeded, weighted draw, so
sources mix by weight) and, within a source, lane l reads the items l, l+L, l+2L, ... of that source's
endless shard sequence (epoch 0's shards shuffled, then epoch 1's, ...), packing each shard in turn. Where L
is a multiple of G each lane is read by exactly one DP rank; otherwise a rank also reads (and drops) the
sequences of a lane that belong to others, which costs reading but never changes what is delivered.

A lane's reading position is its `LaneCursor` (index, and per source the shard ordinal and how many of that
shard's sequences were taken): a few integers, so the resume state stays small and JSON-serialisable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CanonicalOrder", "LaneCursor"]


@dataclass
class LaneCursor:
    """Where a lane's reading stands: its next index, and per source (shard ordinal, sequences taken)."""

    index: int = 0
    shards: list[list[int]] = field(default_factory=list)  # per source: [ordinal, offset]

    def to_json(self) -> list[Any]:
        return [self.index, [list(s) for s in self.shards]]

    @classmethod
    def from_json(cls, value: list[Any]) -> LaneCursor:
        index, shards = value
        return cls(int(index), [[int(o), int(n)] for o, n in shards])

    @classmethod
    def start(cls, n_sources: int) -> LaneCursor:
        return cls(0, [[0, 0] for _ in range(n_sources)])


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) fixed by ``parts`` (counter-based: no generator state to carry)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@functools.lru_cache(maxsize=64)
def _permutation(seed: int, source: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}/{source}/{epoch}").shuffle(order)
    return tuple(order)


@dataclass(frozen=True)
class CanonicalOrder:
    """The stream's order: which shard and source every (lane, index) reads.

    Args:
        shards: per source, its shard URLs in the order they were listed.
        weights: per source, its mixing weight (share of sequences).
        lanes: number of lanes L (fixed for the life of a run; see the module header).
        seed: shuffles the shard order of every epoch and draws the sources.
        shuffle: shuffle shards per epoch (False: listed order every epoch).
    """

    shards: tuple[tuple[str, ...], ...]
    weights: tuple[float, ...]
    lanes: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.shards or any(not s for s in self.shards):
            raise ValueError("every source needs at least one shard")
        if len(self.weights) != len(self.shards) or any(w <= 0 for w in self.weights):
            raise ValueError(f"need one positive weight per source, got {self.weights}")
        if self.lanes < 1:
            raise ValueError(f"lanes={self.lanes} must be >= 1")

    @property
    def n_sources(self) -> int:
        return len(self.shards)

    def fingerprint(self) -> str:
        """Identifies the order: a resume state made for another fingerprint would read other data."""
        spec = {"shards": self.shards, "weights": self.weights, "lanes": self.lanes, "seed": self.seed,
                "shuffle": self.shuffle}  # fmt: skip
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def position(g: int, lanes: int) -> tuple[int, int]:
        """(lane, index within the lane) of global position ``g``."""
        return g % lanes, g // lanes

    def source_of(self, lane: int, index: int) -> int:
        """The source of a lane's ``index``-th sequence: a seeded draw with probabilities ∝ weights."""
        if self.n_sources == 1:
            return 0
        u = _unit(self.seed, "source", lane, index) * sum(self.weights)
        for s, w in enumerate(self.weights):
            u -= w
            if u < 0:
                return s
        return self.n_sources - 1

    def epoch_order(self, source: int, epoch: int) -> tuple[int, ...]:
        """Shard indices of ``source`` in the order epoch ``epoch`` reads them."""
        n = len(self.shards[source])
        return _permutation(self.seed, source, epoch, n) if self.shuffle else tuple(range(n))

    def shard(self, source: int, lane: int, ordinal: int) -> tuple[str, int]:
        """(URL, epoch) of the ``ordinal``-th shard that ``lane`` reads from ``source``."""
        n = len(self.shards[source])
        item = lane + ordinal * self.lanes  # lanes deal the source's endless shard sequence round-robin
        epoch = item // n
        return self.shards[source][self.epoch_order(source, epoch)[item % n]], epoch
