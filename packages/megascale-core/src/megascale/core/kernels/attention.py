"""Causal self-attention with optional sliding window and grouped-query heads.

Backends, fastest first: ``flash`` (flash-attn 2 on CUDA, fp16/bf16, native sliding window and GQA), ``flash4``
(flash-attn 4's ``flash_attn.cute`` on Hopper/Blackwell, fp16/bf16, native window and GQA; windowed layers
only), ``flex`` (torch's FlexAttention with a cached block mask, compiled on CUDA; windowed layers only: it skips
the key blocks outside the window instead of masking a dense (T, T) score matrix), ``sdpa`` (torch's
scaled_dot_product_attention; a cached boolean (T, T) mask carries the window), ``torch`` (explicit fp32
softmax: the reference). Window semantics, the same in every backend: query i sees keys j with
i - window < j <= i, i.e. ``window`` keys including itself.

Packed documents (``documents``: (B, T) ids, equal for the tokens of one document of a row): a query sees only
the keys of its own document, as well as the causal and window rules. That case ("documents") runs, on a GPU,
on flash-attn 2's varlen kernel where installed (the rows cut into documents by ``cu_seqlens``), else on
FlexAttention with a document block mask; nothing dense in T × T. Elsewhere (and where neither runs) on SDPA
with a (B, 1, T, T) boolean mask, or the torch reference. What each builds from the document ids is built once
per microbatch and shared by the layers (``documents.py``); flash-attn 4 passes the case on.

The automatic choice is made per case of a call (see ``registry``): full causal attention (no window, or one at
least as long as the sequence) keeps flash-attn 2 or SDPA's fused causal kernel; a call with a window shorter
than the sequence (the "window" case) prefers flash-attn 2, then flash-attn 4, then FlexAttention, and only then
SDPA with a dense mask. The first SDPA call of each case, dtype and device type records which SDPA kernel torch
dispatched to (cuDNN, flash, efficient, math), in the log and in ``describe(checks=True)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megascale.core import _optional
from megascale.core.kernels.documents import (
    attention_mask,
    cached,
    document_ids,
    document_mask,
    varlen_segments,
)
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["DOCUMENTS", "WINDOW", "attention", "attention_mask", "document_ids", "document_mask"]

log = logging.getLogger("megascale.core.kernels")
attention = get_kernel("attention")

WINDOW = "window"
"""The case of a call whose sliding window is shorter than the sequence (see ``registry``)."""


DOCUMENTS = "documents"
"""The case of a call over packed documents, each token attending only to its own document's."""


def _case(
    q: torch.Tensor,
    *_args: Any,
    window: int | None = None,
    documents: torch.Tensor | None = None,
    **_kwargs: Any,
) -> str | None:
    if documents is not None:
        return DOCUMENTS
    return WINDOW if window is not None and window < q.shape[1] else None


attention.case_of = _case
attention.cases = (WINDOW, DOCUMENTS)


def _windowed_only(case: str | None) -> str | None:
    if case == WINDOW:
        return None
    if case == DOCUMENTS:
        return _NO_DOCUMENTS
    return (
        "full causal attention keeps flash-attn 2 or SDPA's fused causal kernel (this backend serves windows)"
    )


_NO_DOCUMENTS = (
    "packed documents run on flash-attn 2's varlen kernel or FlexAttention (flash-attn 4 takes no mask)"
)


def _flex_cases(case: str | None) -> str | None:
    return None if case == DOCUMENTS else _windowed_only(case)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    documents: torch.Tensor | None = None,
) -> None:
    if documents is not None and documents.shape != q.shape[:2]:
        raise ValueError(f"documents must be (B, T) = {tuple(q.shape[:2])}; got {tuple(documents.shape)}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention expects q (B, T, H, hd) and k, v (B, T, KV, hd); got {q.shape}, {k.shape}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries as keys; got {q.shape[1]} and {k.shape[1]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token, got {window}")


def _flash_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    if _optional.flash_attn() is None:
        return _optional.missing_reason("flash_attn")
    return None


def _flash4_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash-attn 4 runs on CUDA only"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):
        return f"flash-attn 4 runs on Hopper and Blackwell (compute capability 9.x-11.x); this GPU is {major}.{minor}"
    if _optional.flash_attn_cute() is None:
        return _optional.missing_reason("flash_attn.cute")
    return None


def _flex_module() -> Any:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def _flex_unavailable_if_forced(_device: torch.device) -> str | None:
    if _flex_module() is None:
        return f"FlexAttention needs torch >= 2.5 (this is {torch.__version__})"
    return None


def _flex_unavailable(device: torch.device) -> str | None:
    if (reason := _flex_unavailable_if_forced(device)) is not None:
        return reason
    if device.type != "cuda":
        return (
            f"FlexAttention is compiled on CUDA only; on {device.type} it runs eagerly over a dense score matrix "
            "(backend='flex' still runs it, for tests)"
        )
    return None


def _unfit(q: torch.Tensor, dropout_p: float) -> bool:
    """fp32 (debugging runs) and dropout: flash-attn 4 has a kernel for neither."""
    return q.dtype not in (torch.float16, torch.bfloat16) or dropout_p > 0


def _next_best(q, k, v, *, window: int | None, scale: float | None, dropout_p: float,
               documents: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Where a flash kernel cannot take the inputs: FlexAttention for a window or packed documents (when it runs
    here and passed its check, and no dropout is asked), else SDPA. Correct either way, only slower."""
    case = _case(q, window=window, documents=documents)
    if case in (WINDOW, DOCUMENTS) and dropout_p == 0 and flex_runs_here(q.device):
        return _flex(q, k, v, window=window, scale=scale, documents=documents)
    return _sdpa(q, k, v, window=window, scale=scale, dropout_p=dropout_p, documents=documents)


def flash_varlen(fa: Any, q, k, v, *, documents: torch.Tensor, window: int | None, scale: float | None,
                 dropout_p: float) -> torch.Tensor:  # fmt: skip
    """Packed documents through flash-attn 2's ``flash_attn_varlen_func`` (module ``fa``): each document its own
    sequence of the flattened rows, causal, with the window; grouped-query heads native."""
    B, T, H, hd = q.shape
    segments = varlen_segments(documents)
    out = fa.flash_attn_varlen_func(
        q.reshape(B * T, H, hd),
        k.reshape(B * T, *k.shape[2:]),
        v.reshape(B * T, *v.shape[2:]),
        segments.cu_seqlens,
        segments.cu_seqlens,
        segments.max_seqlen,
        segments.max_seqlen,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )
    return out.reshape(B, T, H, hd)


@attention.register("flash", _flash_unavailable)
def _flash(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
           documents: torch.Tensor | None = None):  # fmt: skip
    _check(q, k, v, window, documents)
    if q.dtype not in (torch.float16, torch.bfloat16):
        # flash-attn has no fp32 kernel; fp32 runs are for debugging, so take the next-best path.
        return _next_best(q, k, v, window=window, scale=scale, dropout_p=dropout_p, documents=documents)
    fa = _optional.flash_attn()
    assert fa is not None
    if documents is not None:
        return flash_varlen(fa, q, k, v, documents=documents, window=window, scale=scale, dropout_p=dropout_p)
    return fa.flash_attn_func(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )


_FLASH4_HEAD_DIMS = (64, 96, 128)  # what flash_attn.cute's forward and backward cover on Hopper


@attention.register("flash4", _flash4_unavailable, skips=_windowed_only)
def _flash4(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
            documents: torch.Tensor | None = None):  # fmt: skip
    _check(q, k, v, window, documents)
    if documents is not None:
        return _next_best(q, k, v, window=window, scale=scale, dropout_p=dropout_p, documents=documents)
    if _unfit(q, dropout_p) or q.shape[3] not in _FLASH4_HEAD_DIMS:
        return _next_best(q, k, v, window=window, scale=scale, dropout_p=dropout_p)
    fa = _optional.flash_attn_cute()
    assert fa is not None
    # (left, right) keys around the query; None = unbounded. causal=True sets right to 0.
    left = None if window is None or window >= q.shape[1] else window - 1
    out = fa.flash_attn_func(
        q, k, v, softmax_scale=scale, causal=True, window_size=(left, None if left is None else 0)
    )
    return out[0] if isinstance(out, tuple) else out  # flash_attn.cute returns (out, lse)


_BLOCK_MASKS: dict[tuple[int, int | None, torch.device], Any] = {}
_COMPILED_FLEX: dict[str, Callable[..., Any]] = {}


def flex_block_mask(t: int, window: int | None, device: torch.device) -> Any:
    """FlexAttention's block mask for causal attention over ``t`` tokens with an optional window, built once per
    (t, window, device) and cached: ``create_block_mask`` evaluates the mask on every (query, key) block, which
    costs far more than the attention it saves if repeated every layer and step."""
    key = (t, window, torch.device(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        fa = _flex_module()

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        def windowed(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

        mask = fa.create_block_mask(
            causal if window is None else windowed, B=None, H=None, Q_LEN=t, KV_LEN=t, device=key[2]
        )
        if len(_BLOCK_MASKS) >= 32:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = mask
    return mask


def flex_document_mask(documents: torch.Tensor, window: int | None) -> Any:
    """FlexAttention's block mask for packed documents (same document, causal, window): blocks wholly outside
    a document are skipped. Built once per microbatch (per window) from its (B, T) document ids."""
    fa = _flex_module()
    B, T = documents.shape

    def same_document(b, h, q_idx, kv_idx):
        allowed = (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])
        return allowed if window is None else allowed & (q_idx - kv_idx < window)

    def build() -> Any:
        return fa.create_block_mask(same_document, B=B, H=None, Q_LEN=T, KV_LEN=T, device=documents.device)

    return cached(documents, ("flex block mask", window), build)


def _flex_fn(device: torch.device) -> Callable[..., Any]:
    """flex_attention compiled once per process on CUDA (eager it runs an unfused reference over the whole
    score matrix); eager elsewhere, and inside a region torch.compile is already tracing."""
    fa = _flex_module()
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fa.flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(fa.flex_attention, dynamic=False)
    return _COMPILED_FLEX["cuda"]


@contextlib.contextmanager
def _cpu_backward(device: torch.device) -> Iterator[None]:
    """Lift FlexAttention's refusal of inputs that require grad on the CPU, for this call only.

    torch refuses them at entry (``flex_attention._validate_device``) because no compiled CPU backward exists;
    the eager path this backend takes on the CPU differentiates its dense math reference, which the registry's
    check compares with the torch reference, forward and backward, before the backend is used. CPU runs are for
    tests: automatic selection never picks FlexAttention there."""
    fa = _flex_module()
    guard = getattr(fa, "_validate_device", None)
    if device.type != "cpu" or guard is None:
        yield
        return
    fa._validate_device = lambda *_args: None
    try:
        yield
    finally:
        fa._validate_device = guard


def flex_attention_call(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """FlexAttention over (B, heads, T, hd) tensors: compiled once per process on CUDA, eager (its dense
    reference, differentiable) on the CPU, for tests; grouped-query heads native."""
    with _cpu_backward(qh.device), warnings.catch_warnings():
        # eager on the CPU by design (tests); the warning that it is unfused says nothing new there
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_fn(qh.device)(
            qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]
        )


def flex_runs_here(device: torch.device) -> bool:
    """Whether FlexAttention is compiled on ``device`` and passed its check against the torch reference."""
    if _flex_unavailable(device) is not None:
        return False
    return attention.verdict(next(b for b in attention.backends if b.name == "flex"), device).passed


@attention.register(
    "flex", _flex_unavailable, unavailable_if_forced=_flex_unavailable_if_forced, skips=_flex_cases
)
def _flex(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
          documents: torch.Tensor | None = None):  # fmt: skip
    _check(q, k, v, window, documents)
    if dropout_p > 0:  # FlexAttention has no dropout
        return _sdpa(q, k, v, window=window, scale=scale, dropout_p=dropout_p, documents=documents)
    T = q.shape[1]
    window = None if window is None or window >= T else window
    if documents is None:
        block_mask = flex_block_mask(T, window, q.device)
    else:
        block_mask = flex_document_mask(documents, window)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
    out = flex_attention_call(qh, kh, vh, block_mask, scale)
    return out.transpose(1, 2)  # (B, T, H, hd)


_SDPA_KERNELS = (  # aten op (a substring of its name) -> the SDPA backend it is, most specific first
    ("_scaled_dot_product_cudnn_attention", "cuDNN"),
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient (memory-efficient)"),
    ("_scaled_dot_product_fused_attention_overrideable", "device-specific (overrideable)"),
)


def _sdpa_kernel_name(ops: list[str]) -> str:
    for op, name in _SDPA_KERNELS:
        if any(op in o for o in ops):
            return f"{name} kernel (aten.{op})"
    return "math kernel (unfused: it materialises the (T, T) scores)"


def _sdpa_observed(
    q: torch.Tensor,
    k: torch.Tensor,
    window: int | None,
    run: Callable[[], torch.Tensor],
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run SDPA; at the first call of each (device type, case, dtype, GQA) record which kernel torch dispatched
    to, by watching the aten ops of that one call. Nothing is watched under torch.compile, or for tensor
    subclasses (DTensor, fake tensors), whose dispatch is not SDPA's own."""
    case = _case(q, window=window, documents=documents)
    if type(q) is not torch.Tensor or torch.compiler.is_compiling() or q.is_meta:
        return run()
    key = ("sdpa kernel", q.device.type, case, q.dtype, q.shape[2] != k.shape[2])
    if not attention.first_time(key):
        return run()
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Record():
        out = run()
    gqa = ", grouped-query" if key[4] else ""
    dtype = str(q.dtype).removeprefix("torch.")
    attention.observe(q.device, case, f"SDPA ran its {_sdpa_kernel_name(ops)} for {dtype}{gqa}")
    return out


@attention.register("sdpa")
def _sdpa(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
          documents: torch.Tensor | None = None):  # fmt: skip
    _check(q, k, v, window, documents)
    T = q.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
    gqa = q.shape[2] != k.shape[2]
    if documents is not None:
        mask = document_mask(documents, window)

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )

    elif window is None or window >= T:

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                qh, kh, vh, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
            )

    else:
        mask = attention_mask(T, window, q.device)

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )

    return _sdpa_observed(q, k, window, run, documents).transpose(1, 2)  # (B, T, H, hd)


@attention.register("torch")
def _reference(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
               documents: torch.Tensor | None = None):  # fmt: skip
    _check(q, k, v, window, documents)
    _, T, H, hd = q.shape
    rep = H // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    mask = attention_mask(T, window, q.device) if documents is None else document_mask(documents, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p, training=dropout_p > 0)
    return torch.einsum("bhts,bshd->bthd", probs, v.float()).to(q.dtype)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    # (B, T, H, head_dim), grouped-query: 2 kv heads; head_dim 64, the smallest flash-attn 4 takes; a window
    # of 6 that does not divide T, so every windowed backend is checked on the case it is chosen for
    q = torch.randn(2, 16, 4, 64, generator=gen)
    k, v = torch.randn(2, 16, 2, 64, generator=gen), torch.randn(2, 16, 2, 64, generator=gen)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)), {"window": 6}, (0, 1, 2)


attention.probe = Probe(_probe, {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)})
