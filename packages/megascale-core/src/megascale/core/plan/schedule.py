"""Pipeline schedules as the planner sees them: which chunk forwards a rank holds at once, and the bubble.

Activations are saved from a microbatch's forward through a stage until its backward there, so a rank's
saved bytes peak at the most forwards it has run and not yet backpropagated. Each schedule's order of
forwards (F) and backwards (B) on rank r of P, with M microbatches and V stages per rank:

    gpipe        F0 … F(M-1), then the backwards: M in flight (Huang et al. 2019)
    1f1b         min(P - r, M) forwards of warm-up, then one backward, one forward (Narayanan et al. 2021,
                 §2.2.1; megascale's ScheduleDecoupled1F1B computes in torch's 1F1B order)
    interleaved  torch's ScheduleInterleaved1F1B order (``_get_warmup_ops``/``_get_1f1b_rank_ops``): warm-up
                 of min((V-1)·R + 2·(P-1-r), M·V) chunk forwards (R microbatches per round), then F, B pairs

``peak_in_flight`` replays that order over the chunks' saved bytes, so uneven chunks (the embedding on the
first stage, the head and loss on the last) are counted where they are; ``receive_buffers`` replays it over the
pipeline's pooled receive buffers (taken when a receive is posted, given back after that backward). The bubble
(idle fraction of the ideal time, Narayanan et al. 2021 eq. in §2.2): (P - 1)/M for GPipe and 1F1B,
(P - 1)/(V·M) interleaved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import islice

from megascale.core.parallel.plan import SCHEDULES

__all__ = ["bubble_fraction", "microbatches_in_flight", "peak_in_flight", "rank_order", "receive_buffers"]


def rank_order(
    schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int = 1
) -> list[tuple[str, int]]:
    """The computations of pipeline rank ``rank`` in order: ("F" | "B", local chunk index)."""
    return list(_order(schedule, pp, rank, microbatches, virtual_stages))


def _warmup(schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int) -> int:
    """Forwards a rank runs before its first backward."""
    m, v = microbatches, virtual_stages
    schedule = _as_one_f_one_b(schedule, v)
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank, m)
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)


def _as_one_f_one_b(schedule: str, virtual_stages: int) -> str:
    """zb1p holds its forwards as 1F1B (interleaved with several stages per rank) does: its W halves run
    between them, releasing no activation earlier (arXiv 2401.10241, ZB-1P: 1F1B's peak memory)."""
    if schedule != "zb1p":
        return schedule
    return "interleaved" if virtual_stages > 1 else "1f1b"


def _order(
    schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int
) -> Iterator[tuple[str, int]]:
    m, v = microbatches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {SCHEDULES}")
    schedule = _as_one_f_one_b(schedule, v)
    if pp == 1:  # one stage: each microbatch's forward then its backward (gradient accumulation)
        for _ in range(m):
            yield from (("F", 0), ("B", 0))
        return
    if schedule != "interleaved":
        w = _warmup(schedule, pp, rank, m, 1)
        yield from [("F", 0)] * w
        for _ in range(m - w):
            yield from (("B", 0), ("F", 0))
        yield from [("B", 0)] * w
        return
    per_round = m // max(1, m // pp)
    warmup = _warmup(schedule, pp, rank, m, v)
    total = m * v
    for k in range(warmup):
        yield ("F", (k // per_round) % v)
    for k in range(warmup, total):
        yield ("F", (k // per_round) % v)
        yield ("B", v - 1 - ((k - warmup) // per_round) % v)
    for k in range(total, total + warmup):
        yield ("B", v - 1 - ((k - warmup) // per_round) % v)


def peak_in_flight(
    schedule: str, pp: int, rank: int, microbatches: int, chunk_bytes: Sequence[float]
) -> float:
    """The most saved bytes rank ``rank`` holds at once: ``chunk_bytes[i]`` is one microbatch's saved bytes
    through its i-th local chunk (stage), held from that chunk's forward to its backward."""
    v = len(chunk_bytes)
    if v == 1:  # one chunk: the most forwards held at once, times its bytes
        return _warmup(schedule, pp, rank, microbatches, 1) * chunk_bytes[0]
    # After the warm-up, F/B pairs repeat with the period of a round of chunks (per_round·V pairs), so the
    # warm-up and two periods hold the peak; the cool-down only releases.
    per_round = microbatches // max(1, microbatches // pp)
    horizon = _warmup(schedule, pp, rank, microbatches, v) + 4 * per_round * v + 2
    held = peak = 0.0
    for kind, chunk in islice(_order(schedule, pp, rank, microbatches, v), horizon):
        held += chunk_bytes[chunk] if kind == "F" else -chunk_bytes[chunk]
        peak = max(peak, held)
    return peak


@lru_cache(maxsize=65536)
def receive_buffers(
    schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[int, int], ...]:
    """Per local chunk of rank ``rank``: the most (activation, gradient) receive buffers it holds at once.

    megascale's stages pool their receive buffers (``parallel/pp/apply.py``, ``_LeanStage``): a microbatch
    takes one when its receive is posted and gives it back after its backward on that chunk. The decoupled
    schedules (1f1b, interleaved) post the receive of microbatch i + 1 of a chunk before computing i (the
    first two at the step's start); torch's GPipe posts each right before its computation. Replaying the
    order: a chunk holds (forwards started + 1) - (backwards done) activation buffers, and gradient buffers
    likewise. Every chunk receives both, except the first stage's (no activations) and the last's (no
    gradients): 1F1B gives min(P - r + 1, M) activations and 2 gradients, GPipe M and 1. Exact for those two;
    interleaved, exact but on the last rank, whose gradient receives torch's plan (its lockstep placement)
    sometimes posts more than one ahead: P=4, V=2, M=8 holds 12 buffers there where this counts 10
    (benchmarks/pipeline_memory.py). Replaying torch's plan instead would cost seconds over a search."""
    m, v = microbatches, virtual_stages
    if pp == 1:
        return ((0, 0),) * v
    if schedule == "zb1p":  # torch's buffers, one per microbatch: W reads a stage's saved inputs late
        return tuple((m * (s > 0), m * (s < pp * v - 1)) for s in (rank + c * pp for c in range(v)))
    ahead = 0 if schedule == "gpipe" else 1
    forwards, backwards = [0] * v, [0] * v
    most_f, most_b = [0] * v, [0] * v
    for kind, c in _order(schedule, pp, rank, m, v):
        if kind == "F":
            forwards[c] += 1
            most_f[c] = max(most_f[c], min(forwards[c] + ahead, m) - backwards[c])
        else:  # this backward's gradient and the prefetched ones, until it is done
            most_b[c] = max(most_b[c], min(backwards[c] + 1 + ahead, m) - backwards[c])
            backwards[c] += 1
    stages = [
        rank + c * pp for c in range(v)
    ]  # looped placement; stage 0 and stage pp·v - 1 receive one kind
    return tuple((most_f[c] * (s > 0), most_b[c] * (s < pp * v - 1)) for c, s in enumerate(stages))


@lru_cache(maxsize=65536)
def microbatches_in_flight(
    schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """The most microbatch-chunks rank ``rank`` holds at once, divided by its chunks: microbatches' worth."""
    return peak_in_flight(schedule, pp, rank, microbatches, (1.0,) * virtual_stages) / virtual_stages


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Pipeline idle time as a fraction of the ideal (bubble-free) compute time of a step."""
    if pp == 1:
        return 0.0
    v = virtual_stages if schedule in ("interleaved", "zb1p") else 1
    if schedule == "zb1p":  # (p-1)(F+B-2W) of 1F1B's (p-1)(F+B), B the whole backward: 1/3 at B = 2F, W = F
        return (pp - 1) / (v * microbatches) / 3
    return (pp - 1) / (v * microbatches)
