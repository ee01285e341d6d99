"""Materialise a model built on the meta device, after it was split, with every tensor initialised.

Building on the meta device allocates nothing, so no rank ever holds the whole model; the price is that no
init code has run on real memory. After the split (tensor parallel shards, pipeline stages), this gives every
meta tensor real memory and values, by the module's own init, in this order:

1. a module with an ``init_weights()`` method (a megascale GPT, or a user's model or LightningModule)
   initialises its whole subtree; the outermost such module wins, nothing inside it is touched again. It sees
   its split parameters (DTensors) as whole-size plain tensors, of which each rank then keeps its shard, so
   its code runs as on one process (random draws included; peak memory: its split parameters at full size),
   unless it says it handles shards itself (``init_weights_handles_shards = True``, as a GPT does);
2. every other module holding meta parameters or buffers of its own runs ``reset_parameters()`` (what
   ``torch.nn`` layers define), under a random seed derived from ``seed`` and the module's name;
3. a module that has neither is an error naming it, raised before anything is allocated (its values would be
   whatever memory ``to_empty`` returned);
4. a buffer that the init of step 1 or 2 did not write is an error naming it (a causal mask or a position
   table computed in ``__init__``: on the meta device that computation produced nothing, and
   ``reset_parameters()`` of most modules writes parameters only; found by the buffer's version counter, and
   by a sentinel fill for writes through ``.data``). The fixes the message names: write the buffer in
   ``reset_parameters()``/``init_weights()`` too, or create it in ``__init__`` with an explicit device
   (``torch.ones(T, T, device="cpu")``: computed for real even under the meta device, it moves with the model),
   or build on a real device (``meta_init=False``).

Step 2 is layout independent: each module draws from its own seeded generator, and a module whose
parameters are split (DTensors) is reset on whole-size temporaries, of which each rank keeps its shard; so a
tensor-parallel shard, a pipeline stage or one process get the same values for the same seed, one layer's
full size at a time. ``init_weights`` is the model's own business (a GPT's is layout independent too).

Tensors outside the meta device are left as they are, and weights tied before (one Parameter in two modules)
are tied again afterwards (``to_empty`` would otherwise give each module its own copy).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megascale.core._dtensor import is_dtensor, local

__all__ = ["has_meta_tensors", "materialize", "uninitialisable"]


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` (or of its subtree) is on the meta device."""
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(t.is_meta for t in tensors)


def _plan(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]], list[str]]:
    """(owners with init_weights, modules to reset, modules that cannot be initialised), by qualified name."""
    owners: list[tuple[str, nn.Module]] = []
    resets: list[tuple[str, nn.Module]] = []
    missing: list[str] = []
    owned: set[int] = set()
    for name, m in module.named_modules():
        if id(m) in owned:
            continue
        if callable(getattr(m, "init_weights", None)) and has_meta_tensors(m):
            owners.append((name, m))
            owned.update(id(sub) for sub in m.modules())
            continue
        if not has_meta_tensors(m, recurse=False):
            continue
        if callable(getattr(m, "reset_parameters", None)):
            resets.append((name, m))
        else:
            tensors = [n for n, _ in m.named_parameters(recurse=False)] + [
                n for n, _ in m.named_buffers(recurse=False)
            ]
            missing.append(f"{name or '<root>'} ({type(m).__name__}: {', '.join(tensors)})")
    return owners, resets, missing


def uninitialisable(module: nn.Module) -> list[str]:
    """Modules (qualified name, class, tensors) whose meta tensors nothing would initialise."""
    return _plan(module)[2]


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        yield


@contextmanager
def _whole(modules: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Within: the split parameters (DTensors) of ``modules`` are whole-size plain tensors (a parameter shared
    by several stays shared); after: each rank keeps its shard of their values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sites = [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None and is_dtensor(p)]
    whole: dict[int, nn.Parameter] = {}
    for m, n, p in sites:
        if id(p) not in whole:
            whole[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        m._parameters[n] = whole[id(p)]
    try:
        yield
    finally:
        done: set[int] = set()
        for m, n, p in sites:
            m._parameters[n] = p
            if id(p) in done:
                continue
            done.add(id(p))
            dt: DTensor = p  # type: ignore[assignment]
            # every rank holds the same whole tensor: each keeps its slice, no communication
            shard = distribute_tensor(
                whole[id(p)].detach(), dt.device_mesh, dt.placements, src_data_rank=None
            )
            local(p).copy_(shard.to_local())


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device | str, *, seed: int) -> list[str]:
    """Give every meta tensor of ``module`` memory on ``device`` and its module's initial values (see the
    module docstring); ``seed`` must be the same on every rank. Returns the qualified names of the modules
    that ``reset_parameters()`` initialised. Raises ValueError, before allocating, naming every module
    nothing would initialise."""
    device = torch.device(device)
    owners, resets, missing = _plan(module)
    if missing:
        raise ValueError(
            "meta-device init (meta_init=True) cannot initialise these modules: they hold parameters or buffers "
            "but have no reset_parameters(), and no init_weights() of a module above them covers them: "
            f"{'; '.join(missing)}. Give each a reset_parameters(), give the model (or the LightningModule) an "
            "init_weights() that initialises its subtree, or build the model on a real device (meta_init=False)."
        )
    if not owners and not resets:
        return []
    meta_buffers = [(f"{prefix}.{n}" if prefix else n, m, n) for prefix, m in module.named_modules()
                    for n, b in m._buffers.items() if b is not None and b.is_meta]  # fmt: skip
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None and p.is_meta:
                sites.setdefault(id(p), []).append((m, n))
    for m in module.modules():
        if has_meta_tensors(m, recurse=False):
            m.to_empty(device=device, recurse=False)
    fresh = _fresh_buffers(meta_buffers)
    for tied in (s for s in sites.values() if len(s) > 1):
        first_module, first_name = tied[0]
        for m, n in tied[1:]:
            m._parameters[n] = first_module._parameters[first_name]
    for name, owner in owners:
        whole = [] if getattr(owner, "init_weights_handles_shards", False) else list(owner.modules())
        with _seeded(_seed_of(seed, name), device), _whole(whole, device):
            owner.init_weights()  # type: ignore[operator]
    for name, m in resets:
        with _seeded(_seed_of(seed, name), device), _whole([m], device):
            m.reset_parameters()  # type: ignore[operator]
    unwritten = [name for name, m, b, version in fresh if _unwritten(m, name, b, version)]
    if unwritten:
        raise ValueError(
            "meta-device init (meta_init=True): the buffers "
            f"{[f'{q} ({type(m).__name__})' for q, m, _, _ in fresh if q in unwritten]} were computed on the meta "
            "device in __init__ (so they hold nothing) and neither reset_parameters() nor an init_weights() "
            "above them wrote them: their values would be whatever memory was allocated. Write them in "
            "reset_parameters()/init_weights() too (e.g. self.mask.copy_(torch.tril(...))), or create them in "
            "__init__ with an explicit device (torch.ones(..., device='cpu'): computed for real even under the "
            "meta device, they move with the model), or build the model on a real device (meta_init=False)."
        )
    return [name for name, _ in resets]


def _fresh_buffers(
    sites: list[tuple[str, nn.Module, str]],
) -> list[tuple[str, nn.Module, torch.Tensor, int]]:
    """(qualified name, module, tensor, version) of each buffer just allocated from the meta device, filled
    with a sentinel (NaN; the largest integer; False) so that a write through ``.data``, which the version
    counter does not see, shows in the values."""
    out = []
    for qualified, m, name in sites:
        b = m._buffers[name]
        assert b is not None
        b.fill_(_sentinel(b))
        out.append((qualified, m, b, b._version))
    return out


def _sentinel(b: torch.Tensor) -> float | int | bool:
    if b.is_floating_point() or b.is_complex():
        return float("nan")
    if b.dtype == torch.bool:
        return False
    return torch.iinfo(b.dtype).max


def _unwritten(m: nn.Module, qualified: str, b: torch.Tensor, version: int) -> bool:
    name = qualified.rpartition(".")[2]
    if m._buffers.get(name) is not b or b._version != version or b.numel() == 0:
        return False  # replaced, or written in place (or nothing to write)
    if b.is_floating_point() or b.is_complex():
        return bool(b.isnan().all())
    return bool((b == _sentinel(b)).all())


def _seed_of(seed: int, name: str) -> int:
    return (seed + zlib.crc32(name.encode())) % 2**63
