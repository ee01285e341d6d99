"""Tensor-parallel GEMMs with their communication overlapped, chunk by chunk (MegaScale §3.2).

Column-parallel (input gathered, output split by features):
  forward   all-gather the sequence in ``chunks`` pieces; the GEMMs of piece c run while piece c+1 arrives.
  backward  start re-gathering the input, compute the input gradient piece by piece and reduce-scatter
            each piece while the next is computed, then the weight gradients while those finish.
Row-parallel (input split by features, output reduced):
  forward   the GEMM in pieces; piece c is reduce-scattered (SP) or all-reduced while piece c+1 computes.
  backward  all-gather the output gradient in pieces; the input-gradient GEMM of piece c runs while
            piece c+1 arrives.
Without sequence parallelism the column-parallel input is replicated: its backward all-reduce runs
asynchronously under the weight-gradient GEMMs (Megatron's async grad all-reduce).

Under autocast (bf16-mixed) the functions cast their inputs and weights to autocast's dtype themselves, so
activations travel in bf16 and backward (which runs outside autocast) sees consistent dtypes; weight
gradients come back in bf16 and autograd accumulates them into the fp32 parameters' gradients.

``chunks=1`` is the plain, unoverlapped computation through the same code, so on/off give equal results.
Pieces are taken from each rank's sequence shard, so piece c of every rank forms one collective and the
result lands in place; rows are only regrouped, never reordered within a GEMM's dot products.
Several weights may share one input (Q, K, V, gate, up) and several inputs may feed one sum (attention
and MLP outputs of a parallel block): one collective serves all of them.

Every wait on a collective runs inside the caller's ``timer`` (``wait_timer.py``) as a wait of kind
``"tp-all-gather"``, ``"tp-reduce-scatter"`` or ``"tp-all-reduce"`` (straggler detection); only the wait,
never the GEMMs overlapping it, and only when the collective has not completed by then (one that finished
under the GEMMs cost no waiting). The default times nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megascale.core.parallel.tp.comm import all_gather_flat, reduce_scatter_flat
from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["column_parallel_matmul", "row_parallel_matmul"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's (bf16-mixed training) when it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _cast(tensors: Sequence[Any], dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _spans(length: int, chunks: int) -> list[tuple[int, int]]:
    """(offset, size) of ``chunks`` near-equal pieces of range(length) (as torch.tensor_split)."""
    chunks = max(1, min(chunks, length))
    base, extra = divmod(length, chunks)
    spans, offset = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        spans.append((offset, size))
        offset += size
    return spans


def _wait(work: dist.Work, timer: WaitTimer, kind: str) -> None:
    """Wait for ``work``, timed as a wait of ``kind`` unless it had already completed (under the GEMMs it
    overlapped): only real waits become timer sections, which keeps a timeline's event count down."""
    if work.is_completed():
        work.wait()
    else:
        with timer(kind):
            work.wait()


def _start_gather(piece: torch.Tensor, tp: int, group: ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    piece = piece.contiguous()
    buf = piece.new_empty((tp * piece.shape[0], *piece.shape[1:]))
    work = all_gather_flat(buf, piece, group=group, async_op=True)
    assert work is not None
    return buf, work


def _gather_in_pieces(
    x: torch.Tensor, spans: list[tuple[int, int]], tp: int, group: ProcessGroup, timer: WaitTimer
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (offset, size, all-gathered piece) for each span of x's sequence dimension; the all-gather of
    piece c+1 is in flight while the caller computes on piece c."""
    pending = _start_gather(x[:, spans[0][0] : spans[0][0] + spans[0][1]], tp, group)
    for c, (off, size) in enumerate(spans):
        buf, work = pending
        _wait(work, timer, "tp-all-gather")
        if c + 1 < len(spans):
            nxt_off, nxt_size = spans[c + 1]
            pending = _start_gather(x[:, nxt_off : nxt_off + nxt_size], tp, group)
        yield off, size, buf


def _by_position(x: torch.Tensor, tp: int) -> torch.Tensor:
    """(B, T, F) → (B, tp, T/tp, F) view: [:, r] is rank r's sequence shard. Free for contiguous x, and the
    (B, tp) dimensions merge, so a GEMM on a slice [:, :, a:b] runs without copying its input."""
    B, T = x.shape[:2]
    return x.view(B, tp, T // tp, x.shape[-1])


def _rank_major(parts: torch.Tensor) -> torch.Tensor:
    """(B, tp, n, F) → (tp·B, n, F) contiguous, the layout a reduce-scatter sends (block r to rank r)."""
    return parts.transpose(0, 1).contiguous().flatten(0, 1)


def _position_major(gathered: torch.Tensor, tp: int) -> torch.Tensor:
    """(tp·B, n, F) as an all-gather returns it → (B, tp, n, F) contiguous (a copy only when B > 1)."""
    return gathered.view(tp, -1, *gathered.shape[1:]).transpose(0, 1).contiguous()


# Only d_model-wide tensors (gathered inputs, reduce-scatter partials, output gradients) are ever reordered
# between rank-major and position-major; the wider projection inputs and outputs are GEMM operands read or
# written in place through _by_position views.


def _weight_grads(
    grads: Sequence[torch.Tensor | None], x_rows: torch.Tensor, has_bias: Sequence[bool]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Weight and bias gradients of y_i = x W_i^T + b_i, given x's rows in the order of each g_i's rows."""
    grad_w: list[torch.Tensor | None] = []
    grad_b: list[torch.Tensor | None] = []
    for g, bias in zip(grads, has_bias):
        g_rows = None if g is None else g.reshape(-1, g.shape[-1])
        grad_w.append(None if g_rows is None else g_rows.t() @ x_rows)
        grad_b.append(g_rows.sum(0) if g_rows is not None and bias else None)
    return grad_w, grad_b


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timer, chunks, n, *params):
        dtype = _compute_dtype(x)
        x, weights, biases = x.to(dtype), _cast(params[:n], dtype), _cast(params[n:], dtype)
        tp = dist.get_world_size(group)
        B, Ts, D = x.shape
        spans = _spans(Ts, chunks)
        if len(spans) == 1:
            buf, work = _start_gather(x, tp, group)
            _wait(work, timer, "tp-all-gather")
            rows = _position_major(buf, tp).view(B, tp * Ts, D)
            outs = [F.linear(rows, w, b) for w, b in zip(weights, biases)]
        else:
            outs = [x.new_empty(B, tp * Ts, w.shape[0]) for w in weights]
            for off, size, buf in _gather_in_pieces(x, spans, tp, group, timer):
                rows = _position_major(buf, tp)  # (B, tp, size, D)
                for out, w, b in zip(outs, weights, biases):
                    _by_position(out, tp)[:, :, off : off + size] = F.linear(rows, w, b)
        ctx.save_for_backward(x, *params[:n])
        ctx.group, ctx.timer, ctx.spans, ctx.has_bias = group, timer, spans, [b is not None for b in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        weights, grads = _cast(weights, x.dtype), _cast(grads, x.dtype)
        group, spans = ctx.group, ctx.spans
        tp = dist.get_world_size(group)
        B, Ts, D = x.shape
        live = [(_by_position(g.contiguous(), tp), w) for g, w in zip(grads, weights) if g is not None]
        # The input is needed again for the weight gradients: gather it while the input gradient computes.
        x_all, x_work = _start_gather(x, tp, group)
        scatters = []
        for off, size in spans:
            part = sum(g[:, :, off : off + size] @ w for g, w in live)  # (B, tp, size, D)
            part = part if isinstance(part, torch.Tensor) else x.new_zeros(B, tp, size, D)
            out = x.new_empty(B, size, D)
            work = reduce_scatter_flat(out, _rank_major(part), group=group, async_op=True)
            scatters.append((off, size, out, work))
        _wait(x_work, ctx.timer, "tp-all-gather")
        x_rows = _position_major(x_all, tp).view(-1, D)  # rows in sequence order, as g.view(-1, N)
        grad_w, grad_b = _weight_grads(grads, x_rows, ctx.has_bias)
        grad_x = x.new_empty(B, Ts, D)
        for off, size, out, work in scatters:
            _wait(work, ctx.timer, "tp-reduce-scatter")
            grad_x[:, off : off + size] = out
        return grad_x, None, None, None, None, *grad_w, *grad_b


class _CopyMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timer, overlap, n, *params):
        dtype = _compute_dtype(x)
        x, weights, biases = x.to(dtype), _cast(params[:n], dtype), _cast(params[n:], dtype)
        ctx.save_for_backward(x, *params[:n])
        ctx.group, ctx.timer, ctx.overlap = group, timer, overlap
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        weights, grads = _cast(weights, x.dtype), _cast(grads, x.dtype)
        live = [(g, w) for g, w in zip(grads, weights) if g is not None]
        grad_x = sum(g @ w for g, w in live)
        grad_x = grad_x if isinstance(grad_x, torch.Tensor) else torch.zeros_like(x)
        grad_x = grad_x.contiguous()
        # overlapped: in flight under the weight-gradient GEMMs; otherwise done (and timed) right here
        work = dist.all_reduce(grad_x, group=ctx.group, async_op=True) if ctx.overlap else None
        if work is None:
            with ctx.timer("tp-all-reduce"):
                dist.all_reduce(grad_x, group=ctx.group)
        grad_w, grad_b = _weight_grads(grads, x.reshape(-1, x.shape[-1]), ctx.has_bias)
        if work is not None:
            _wait(work, ctx.timer, "tp-all-reduce")
        return grad_x, None, None, None, None, *grad_w, *grad_b


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, timer, chunks, n, *params):
        dtype = _compute_dtype(params[0])
        xs, weights = _cast(params[:n], dtype), _cast(params[n:], dtype)
        tp = dist.get_world_size(group)
        B, T = xs[0].shape[:2]
        if T % tp:
            raise ValueError(
                f"sequence parallelism splits the sequence over tp={tp} ranks, but the sequence has {T} "
                f"tokens: use a sequence length divisible by {tp}, or sequence_parallel=False"
            )
        Ts, D = T // tp, weights[0].shape[0]
        spans = _spans(Ts, chunks)
        by_pos = [_by_position(x.contiguous(), tp) for x in xs]
        scatters = []
        for off, size in spans:
            part = sum(x[:, :, off : off + size] @ w.t() for x, w in zip(by_pos, weights))
            assert isinstance(part, torch.Tensor)  # (B, tp, size, D)
            out = xs[0].new_empty(B, size, D)
            work = reduce_scatter_flat(out, _rank_major(part), group=group, async_op=True)
            scatters.append((off, size, out, work))  # the next piece's GEMM overlaps this reduce-scatter
        if len(scatters) == 1:
            _wait(scatters[0][3], timer, "tp-reduce-scatter")
            y = scatters[0][2]
        else:
            y = xs[0].new_empty(B, Ts, D)
            for off, size, out, work in scatters:
                _wait(work, timer, "tp-reduce-scatter")
                y[:, off : off + size] = out
        ctx.save_for_backward(*xs, *params[n:])
        ctx.group, ctx.timer, ctx.spans, ctx.n = group, timer, spans, n
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved = ctx.saved_tensors
        xs, weights = saved[: ctx.n], _cast(saved[ctx.n :], saved[0].dtype)
        grad_y = grad_y.to(saved[0].dtype)
        group, spans = ctx.group, ctx.spans
        tp = dist.get_world_size(group)
        B, Ts, D = grad_y.shape
        g_all = grad_y.new_empty(B, tp, Ts, D)  # the full output gradient, in sequence order
        grad_xs = [x.new_empty(B, tp * Ts, x.shape[-1]) for x in xs]
        for off, size, buf in _gather_in_pieces(grad_y, spans, tp, group, ctx.timer):
            g = _position_major(buf, tp)  # (B, tp, size, D)
            g_all[:, :, off : off + size] = g
            for gx, w in zip(grad_xs, weights):
                _by_position(gx, tp)[:, :, off : off + size] = g @ w
        g_rows = g_all.view(-1, D)
        grad_w = [g_rows.t() @ x.reshape(-1, x.shape[-1]) for x in xs]
        return None, None, None, None, *grad_xs, *grad_w


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, timer, chunks, n, *params):
        dtype = _compute_dtype(params[0])
        xs, weights = _cast(params[:n], dtype), _cast(params[n:], dtype)
        spans = _spans(xs[0].shape[1], chunks)
        reduces = []
        for off, size in spans:
            part = sum(x[:, off : off + size] @ w.t() for x, w in zip(xs, weights))
            assert isinstance(part, torch.Tensor)
            part = part.contiguous()
            reduces.append((part, dist.all_reduce(part, group=group, async_op=True)))
        for _, work in reduces:
            _wait(work, timer, "tp-all-reduce")
        ctx.save_for_backward(*xs, *params[n:])
        ctx.n = n
        return torch.cat([part for part, _ in reduces], dim=1)

    @staticmethod
    def backward(ctx, grad_y):
        saved = ctx.saved_tensors
        xs, weights = saved[: ctx.n], _cast(saved[ctx.n :], saved[0].dtype)
        grad_y = grad_y.to(saved[0].dtype)
        g_rows = grad_y.reshape(-1, grad_y.shape[-1])
        grad_xs = [grad_y @ w for w in weights]
        grad_w = [g_rows.t() @ x.reshape(-1, x.shape[-1]) for x in xs]
        return None, None, None, None, *grad_xs, *grad_w


def column_parallel_matmul(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    group: ProcessGroup,
    *,
    sequence_parallel: bool,
    chunks: int,
    timer: WaitTimer = untimed,
) -> tuple[torch.Tensor, ...]:
    """x W_i^T + b_i for each local weight shard; x is this rank's sequence shard under SP, else replicated.

    ``chunks`` > 1 overlaps the communication with the GEMMs; 1 runs them one after the other. ``timer``
    spans each wait on a collective (see the module docstring).
    """
    if sequence_parallel:
        return _AllGatherMatmul.apply(x, group, timer, chunks, len(weights), *weights, *biases)
    return _CopyMatmul.apply(x, group, timer, chunks > 1, len(weights), *weights, *biases)


def row_parallel_matmul(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
    group: ProcessGroup,
    *,
    sequence_parallel: bool,
    chunks: int,
    timer: WaitTimer = untimed,
) -> torch.Tensor:
    """Σ_i x_i W_i^T summed over the group: reduce-scattered to sequence shards under SP, else all-reduced.
    ``timer`` spans each wait on a collective (see the module docstring)."""
    if sequence_parallel:
        return _MatmulReduceScatter.apply(group, timer, chunks, len(xs), *xs, *weights)
    return _MatmulAllReduce.apply(group, timer, chunks, len(xs), *xs, *weights)
