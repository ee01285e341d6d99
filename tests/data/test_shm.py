"""The shared-memory ring's protocol where it races: a batch published just before the ring closed."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from megascale.data.shm import RingClosedError, ShmRing, ring_path


@pytest.fixture
def ring():
    ring = ShmRing.create(ring_path(uuid.uuid4().hex[:8], 0, 0), consumers=2, slots=2, slot_bytes=64)
    ring.register(0, 0)
    ring.register(1, 0)
    yield ring
    ring.unlink()
    ring.close()


def test_a_batch_published_while_a_rank_looked_away_is_read_though_the_ring_closed_meanwhile(ring):
    # the consumer finds slot 0 empty; before its check runs, the writer publishes batch 0 and the node's
    # first rank, done, closes the ring (CI 2026-12-07: the other rank ended one batch short)
    def writer_publishes_then_owner_closes() -> None:
        if ring.state != 3:
            ring.write(0, np.arange(4, dtype=np.int32), b"{}", timeout=1, check=lambda: None)
            ring.mark_closed()
        raise RingClosedError("the data reader finished")

    payload, meta = ring.read(1, 0, timeout=5, check=writer_publishes_then_owner_closes)
    assert np.frombuffer(payload, dtype=np.int32).tolist() == [0, 1, 2, 3] and meta == b"{}"


def test_a_batch_never_published_ends_the_reading_when_the_ring_closes(ring):
    ring.mark_closed()

    def closed() -> None:
        raise RingClosedError("the data reader finished")

    with pytest.raises(RingClosedError):
        ring.read(1, 0, timeout=5, check=closed)
