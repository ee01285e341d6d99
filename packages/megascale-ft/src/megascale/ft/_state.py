"""Splitting a checkpoint state into tensors (for DCP) and JSON (for everything else), and merging back.

Scope: pure functions on nested ``dict`` / ``list`` / ``tuple`` trees; no I/O, no process groups.

Why: DCP 2.13 stores non-tensor leaves by ``torch.save``-pickling them into the ``.distcp`` files and reads
them back with ``torch.load(weights_only=False)``, which would execute whatever a crafted file says. So only
tensors go to DCP, and the rest of the tree is kept as JSON, which cannot execute anything.

Encoding of the JSON tree: scalars (int, float, str, bool, None) are themselves; every container or tensor
is a one-key object, so the two never collide:
``{"dict": [[key, value], ...]}`` (keys str or int, order kept), ``{"list": [...]}``, ``{"tuple": [...]}``,
``{"tensor": null}`` (the value lives in DCP under the same path). Lists and tuples enter the DCP tree as
dicts keyed by their int index, so DCP's flattened names (``optim.state.0.exp_avg``) are the same on save
and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_SCALARS = (int, float, str, bool, type(None))
_KEY_TYPES = (str, int)


def _name(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def split_for_save(value: Any, path: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    """Split ``value`` into (tensor tree or None, JSON-able encoding).

    Raises:
        TypeError: a leaf is neither a tensor nor an int/float/str/bool/None, or a dict key is neither
            str nor int; the message names the key.
    """
    if isinstance(value, torch.Tensor):
        return value, {"tensor": None}
    if type(value) in _SCALARS:
        return None, value
    if isinstance(value, dict):
        tensors: dict[Any, Any] = {}
        items = []
        for k, v in value.items():
            if type(k) not in _KEY_TYPES:
                raise TypeError(
                    f"checkpoint state {_name(path)} has a key {k!r} of type {type(k).__name__}: "
                    "only str and int keys can be saved; convert the key to a str"
                )
            t, e = split_for_save(v, (*path, k))
            if t is not None:
                tensors[k] = t
            items.append([k, e])
        return (tensors or None), {"dict": items}
    if type(value) in (list, tuple):  # not namedtuples: their class would be lost
        tensors = {}
        encoded = []
        for i, v in enumerate(value):
            t, e = split_for_save(v, (*path, i))
            if t is not None:
                tensors[i] = t
            encoded.append(e)
        return (tensors or None), {type(value).__name__: encoded}
    raise TypeError(
        f"checkpoint state {_name(path)} is a {type(value).__module__}.{type(value).__qualname__}, which "
        "cannot be saved: leaves must be tensors or int/float/str/bool/None, inside dicts, lists and tuples "
        "(what torch.load(weights_only=True) accepts); convert it (e.g. to a dict of those) or leave it out"
    )


def tensors_of(value: Any) -> Any:
    """The tensor tree of a state to load into: same shape as `split_for_save`'s, other leaves ignored."""
    if isinstance(value, torch.Tensor):
        return value
    pairs: Any
    if isinstance(value, dict):
        pairs = value.items()
    elif isinstance(value, list | tuple):
        pairs = enumerate(value)
    else:
        return None
    tensors = {}
    for k, v in pairs:
        t = tensors_of(v)
        if t is not None:
            tensors[k] = t
    return tensors or None


def _has_tensor(encoded: Any) -> bool:
    if not isinstance(encoded, dict):
        return False
    ((tag, body),) = encoded.items()
    if tag == "tensor":
        return True
    if tag == "dict":
        return any(_has_tensor(v) for _, v in body)
    return any(_has_tensor(v) for v in body)


def decode(encoded: Any, path: tuple[Any, ...]) -> Any:
    """Rebuild a tensor-free value from its encoding."""
    if not isinstance(encoded, dict):
        return encoded
    ((tag, body),) = encoded.items()
    if tag == "dict":
        return {k: decode(v, (*path, k)) for k, v in body}
    if tag == "list":
        return [decode(v, (*path, i)) for i, v in enumerate(body)]
    if tag == "tuple":
        return tuple(decode(v, (*path, i)) for i, v in enumerate(body))
    raise ValueError(f"checkpoint entry {_name(path)} has an unknown tag {tag!r}")


def merge(target: Any, encoded: Any, path: tuple[Any, ...], *, partial: bool = False) -> Any:
    """Merge decoded non-tensor values into ``target``; return the value to store at ``path``.

    Tensors are not touched here (DCP loaded them in place). Dicts and same-length lists are updated in
    place; tuples are rebuilt around the same tensor objects. A subtree without tensors is replaced whole.
    In a dict holding tensors, a key the target lacks is an error, or skipped with ``partial`` (the target
    holds only its part of the checkpoint: a pipeline stage, a ZeRO-1 owner's optimizer states).

    Raises:
        ValueError: the checkpoint holds a tensor where the target has none (it cannot be loaded in place),
            or the checkpoint encoding is malformed.
    """
    if not isinstance(encoded, dict):
        return encoded
    ((tag, body),) = encoded.items()
    if tag == "tensor":
        if not isinstance(target, torch.Tensor):
            raise ValueError(
                f"checkpoint holds a tensor at {_name(path)} but the state to load into has a "
                f"{type(target).__name__}: put a tensor of the right shape there before loading"
            )
        return target
    if not _has_tensor(encoded):
        return decode(encoded, path)
    if tag == "dict" and isinstance(target, dict):
        for k, v in body:
            if k not in target and partial:
                continue
            if k not in target:
                raise ValueError(
                    f"checkpoint holds tensors under {_name((*path, k))} but the state to load into has no "
                    "such entry: build the full state first (e.g. step the optimizer once) before loading"
                )
            target[k] = merge(target[k], v, (*path, k), partial=partial)
        return target
    if tag in ("list", "tuple") and isinstance(target, list | tuple) and len(target) == len(body):
        merged = [merge(t, v, (*path, i), partial=partial) for i, (t, v) in enumerate(zip(target, body))]
        if tag == "list" and isinstance(target, list):
            target[:] = merged
            return target
        return tuple(merged) if tag == "tuple" else merged
    raise ValueError(
        f"checkpoint holds a {tag} with tensors at {_name(path)} but the state to load into has a "
        f"{type(target).__name__} there: give it the same structure as the saved state"
    )


def missing(target: Any, encoded: Any, path: tuple[Any, ...]) -> list[str]:
    """Names of the entries of ``target`` that the checkpoint's ``encoded`` lacks and `merge` would keep.

    Checked where `merge` walks key by key: in dicts (and same-length lists, tuples) holding tensors. A
    subtree without tensors is replaced whole by the checkpoint's, so its keys are not compared.
    """
    if not _has_tensor(encoded):
        return []
    ((tag, body),) = encoded.items()
    pairs: list[tuple[Any, Any, Any]]
    if tag == "dict" and isinstance(target, dict):
        saved = dict(body)
        lacking = [_name((*path, k)) for k in target if k not in saved]
        pairs = [(k, v, saved[k]) for k, v in target.items() if k in saved]
    elif tag in ("list", "tuple") and isinstance(target, list | tuple) and len(target) == len(body):
        lacking, pairs = [], [(i, t, v) for i, (t, v) in enumerate(zip(target, body))]
    else:
        return []  # a mismatch `merge` reports
    return lacking + [m for k, t, v in pairs for m in missing(t, v, (*path, k))]


def union(encodings: Sequence[Any]) -> Any:
    """One encoding holding every rank's keys: dicts are merged key by key, elsewhere the first wins.

    So per-rank entries (``{"rng": {"rank1": tensor}}`` on rank 1 only) appear in the one JSON file rank
    0 writes, while a value every rank holds is taken from rank 0, as DCP does.
    """
    first = encodings[0]
    if not (isinstance(first, dict) and "dict" in first):
        return first
    merged: dict[Any, list[Any]] = {}
    for enc in encodings:
        if isinstance(enc, dict) and "dict" in enc:
            for k, v in enc["dict"]:
                merged.setdefault(k, []).append(v)
    return {"dict": [[k, union(vs)] for k, vs in merged.items()]}
