"""The first forward after a ``tensor_parallel_plan`` is applied checks that no gradient is silently partial.

Under tensor parallelism a rank sees only its part of some activations: under sequence parallelism (SP) the
hidden states between blocks are its T/tp positions; between a ``colwise`` and a ``rowwise`` layer, its share
of the features (its heads). A trainable plain (replicated) parameter used on such a part gets a gradient
that covers that part only: a norm left out of the plan, a per-head q/k norm, a LayerScale/ReZero gain held
by a block, a learned position table. Each tp rank then steps with a different gradient and the replicas
drift apart without a word (0.054 after 3 AdamW steps for an unmarked norm). Styles that sum such gradients
over tp (``sequence_parallel``, ``replicated_with_grad_allreduce``) exist; this check finds the parameters
that need one and have none, and refuses them by name, before the first optimizer step.

Where a parameter is used cannot be read from the module tree (it is whatever the user's forward does), so
it is watched during the first forward: the styles mark their outputs (a sequence shard, this rank's
features, or whole again), a ``TorchFunctionMode`` carries the mark through every torch operation to the
tensors computed from them, and also carries which plain trainable parameters a tensor was computed from
(``(1 + self.weight)`` still counts as the weight). An operation that combines a marked tensor with such a
parameter raises ValueError naming the parameter, what it was used on and the style that fixes it. An
operation that fails on a sequence shard against a tensor spanning the whole sequence (a position table or a
mask computed from T) is reported the same way instead of as a raw shape error.

Refused rather than summed by default: a parameter used both on a part and on whole activations would be
over-counted by a blind sum, and a plan that says what each layer is keeps working when it is moved to
another model or framework. A module that makes such a gradient whole itself (its own collective) is marked
``replicated_unsummed`` and left alone.

Cost: the mode is active during the first forward of the model only (each torch operation pays a Python
call); the hooks that scope it are removed afterwards. Pipeline stages after the first receive their inputs
from another rank, unmarked: there the run-time replica check (``replica_check.py``) is the safety net.

Under pipeline parallelism a refusal raised in one stage's forward would leave the other stages waiting for
its activations until the collective timeout; there (``defer=True``) a parameter refusal is recorded, the
step goes on, and ``verdict(group)``, which every rank calls before the first optimizer step
(MegaScaleStrategy does), raises it on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from megascale.core._dtensor import is_dtensor

__all__ = [
    "MARKS",
    "PART_FEATURES",
    "PART_SEQUENCE",
    "RegionCheck",
    "install_region_check",
    "mark_covered",
    "mark_part",
]

PART_SEQUENCE = "sequence"  # this rank's T/tp positions
PART_FEATURES = "features"  # this rank's share of the features (heads) between colwise and rowwise layers
_PART = "_megascale_tp_part"
_USES = "_megascale_tp_uses"
_COVERED = "_megascale_tp_covered"  # set on modules whose own parameters a style takes care of
MARKS = _MARKS = "_megascale_tp_marks"  # on style layers: mark outputs now (a check is watching)

_FIX = {
    PART_SEQUENCE: (
        "a sequence shard (under sequence parallelism: this rank's T/tp positions)",
        "'sequence_parallel' (a norm, or a block holding a LayerScale/ReZero gain, on sequence shards: its "
        "gradients summed over tp)",
    ),
    PART_FEATURES: (
        "this rank's share of the features (its heads, between a 'colwise' and a 'rowwise' layer)",
        "'replicated_with_grad_allreduce' (a per-head q/k norm or anything inside attention: its gradients "
        "summed over tp)",
    ),
}


def mark_part(t: Any, part: str | None) -> Any:
    """Record on the activation ``t`` (a tensor, or a tuple/list of them), a style's output, which part of the
    whole this rank holds (``PART_SEQUENCE``, ``PART_FEATURES``, or None: whole); returns ``t``. Styles call it on their
    outputs while a check is watching (their ``MARKS`` attribute is True)."""
    for x in tree_leaves(t):
        if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
            setattr(x, _PART, part)
            # every style's backward hands its input a whole gradient (the colwise input's all-reduce or
            # reduce-scatter, a gather's slice, a scatter's all-gather): what its input was computed from is
            # not partial on account of what comes after
            setattr(x, _USES, frozenset())
    return t


def mark_covered(module: nn.Module) -> None:
    """A style takes care of ``module``'s own parameters (split, or gradients summed over tp)."""
    setattr(module, _COVERED, True)


class _Mode(TorchFunctionMode):
    def __init__(self, check: RegionCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        part: str | None = None
        uses: set[str] = set()
        for x in tensors:
            part = part or getattr(x, _PART, None)
            uses.update(getattr(x, _USES, ()))
            name = self.check.candidate(x)
            if name is not None:
                uses.add(name)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            shapes = any(w in str(e).lower() for w in ("size", "shape")) and not isinstance(
                e, torch.OutOfMemoryError
            )
            if part == PART_SEQUENCE and shapes and any(getattr(x, _PART, None) is None for x in tensors):
                self.check.refuse_shape(func, tensors, e)
            raise
        if part is not None and uses:
            self.check.refuse(sorted(uses), part)
        if part is not None or uses:
            for x in tree_leaves(out):
                if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
                    if part is not None:
                        setattr(x, _PART, part)
                    if uses:
                        setattr(x, _USES, frozenset(uses))
        return out


class RegionCheck:
    """Watches the first forward of ``root`` (see the module docstring); removes itself afterwards.

    Args:
        root: the module whose forward is watched (the LightningModule, or a model with a plan).
        owners: (qualified name, module) of the modules declaring a plan, for messages.
        tp: tensor-parallel size; sequence_parallel: whether SP is on (for messages).
    """

    def __init__(
        self, root: nn.Module, owners: list[tuple[str, nn.Module]], *, tp: int, sequence_parallel: bool,
        defer: bool = False,
    ) -> None:  # fmt: skip
        self.tp, self.sequence_parallel, self.defer = tp, sequence_parallel, defer
        self.finding: str | None = None  # a deferred refusal, raised by verdict()
        self._settled = False
        self._mode: _Mode | None = None
        self._owner_of_scope: nn.Module | None = None
        self._done_scopes: set[int] = set()
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._refused = False
        owner_names = sorted(((n, m) for n, m in owners), key=lambda nm: -len(nm[0]))
        # (module, parameter name, qualified parameter name, plan owner or None, name relative to the owner)
        self._sites: list[tuple[nn.Module, str, str, str | None, str]] = []
        self._names: dict[int, str] = {}
        for name, m in root.named_modules():
            self._watch(m, name)
            if getattr(m, _COVERED, False):
                continue
            for pname, p in m._parameters.items():
                if p is None or not p.requires_grad or is_dtensor(p):
                    continue
                qualified = f"{name}.{pname}" if name else pname
                owner, relative = _owner(name, owner_names)
                self._sites.append((m, pname, qualified, owner, relative))
        self._marking = [m for m in root.modules() if hasattr(m, _MARKS)]
        self._refresh()

    # ---- scope: the outermost watched forward runs under the mode -------------------------------------

    def _watch(self, module: nn.Module, name: str) -> None:
        self._handles.append(module.register_forward_pre_hook(self._pre(module, name)))
        self._handles.append(module.register_forward_hook(self._post(module), always_call=True))

    def _pre(self, module: nn.Module, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._stack.append(name)
            if self._owner_of_scope is not None:
                return
            if id(module) in self._done_scopes:  # a second round (next microbatch or step): enough seen
                self.remove()
                return
            self._owner_of_scope = module
            self._mode = _Mode(self)
            self._set_marking(True)
            self._mode.__enter__()

        return hook

    def _post(self, module: nn.Module) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            if self._stack:
                self._stack.pop()
            if self._owner_of_scope is not module:
                return
            self._close()
            self._done_scopes.add(id(module))
            if self._refused:  # the first forward raised our refusal: nothing more to watch
                self.remove()

        return hook

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        self._mode, self._owner_of_scope = None, None
        self._set_marking(False)

    def _set_marking(self, on: bool) -> None:
        for m in self._marking:  # the styles mark their outputs only while watched (no cost otherwise)
            setattr(m, _MARKS, on)

    def remove(self) -> None:
        """Stop watching (also when the first forward raised)."""
        self._close()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- what is watched ------------------------------------------------------------------------------

    def _refresh(self) -> None:
        # by identity of the tensor a module holds now: FSDP2 swaps in unsharded parameters around forward
        self._names = {
            id(m._parameters[pn]): q for m, pn, q, _, _ in self._sites if m._parameters.get(pn) is not None
        }

    def candidate(self, x: torch.Tensor) -> str | None:
        """The qualified name of ``x`` if it is a watched parameter."""
        if not isinstance(x, nn.Parameter) or is_dtensor(x) or not x.requires_grad:
            return None
        name = self._names.get(id(x))
        if name is None:
            self._refresh()
            name = self._names.get(id(x))
        return name

    # ---- refusals ------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"in {self._stack[-1] or '<root>'}" if self._stack else "in the forward"

    def refuse(self, names: list[str], part: str) -> None:
        what, style = _FIX[part]
        sites = {q: (owner, rel) for _, _, q, owner, rel in self._sites}
        fixes: list[str] = []
        for q in names:  # one fix per module holding them
            owner, relative = sites.get(q, (None, q.rpartition(".")[0]))
            if owner is None:
                fix = (
                    f"no module above {relative!r} declares a tensor_parallel_plan: declare one that marks it"
                )
            elif not relative:
                fix = f"{q} is held by {owner} itself, which declares the plan: move it into a submodule, mark that"
            else:
                fix = f"in the tensor_parallel_plan of {owner}, mark {relative!r}"
            if fix not in fixes:
                fixes.append(fix)
        message = (
            f"tensor parallelism (tp={self.tp}, sequence_parallel={self.sequence_parallel}): the trainable "
            f"parameter(s) {names} are used {self._where()} on {what}, so each rank's gradient would cover its "
            "part only and the replicas would drift apart, and no style in the plan sums them over tp. Fix: "
            f"{'; '.join(fixes)} as {style}; a module that makes these gradients whole itself: "
            "'replicated_unsummed'. (Found in the first forward, before any optimizer step.)"
        )
        if self.defer:  # raised on every rank by verdict(), before the first optimizer step
            self.finding = self.finding or message
            return
        self._refused = True  # raised from inside the mode: the scope's hook closes it on the way out
        raise ValueError(message)

    def verdict(self, group: Any = None) -> None:
        """With ``defer``: raise the first forward's refusal, found on any rank of ``group`` (default: all), on
        every rank. Every rank calls it once the first step's forward and backward are done; later calls do
        nothing."""
        if not self.defer or self._settled:
            return
        self._settled = True
        import torch.distributed as dist

        if not dist.is_initialized():
            found = [self.finding] if self.finding else []
        else:
            texts: list[str | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(texts, self.finding, group=group)
            found = [t for t in texts if t is not None]
        if found:
            raise ValueError(found[0])

    def refuse_shape(self, func: Any, tensors: list[torch.Tensor], error: Exception) -> None:
        shards = [tuple(x.shape) for x in tensors if getattr(x, _PART, None) == PART_SEQUENCE]
        others = [tuple(x.shape) for x in tensors if getattr(x, _PART, None) is None]
        uses = sorted({n for x in tensors for n in getattr(x, _USES, ())})
        made_from = f" (computed from {uses})" if uses else ""
        self._refused = True
        raise ValueError(
            f"sequence parallelism (tp={self.tp}): {getattr(func, '__name__', func)} {self._where()} combines a "
            f"sequence shard {shards[0] if shards else ''} (this rank's T/tp positions) with a tensor of shape "
            f"{others[0] if others else '?'}{made_from} that spans the whole sequence: {error}. A learned "
            "position embedding (nn.Embedding) added to the hidden states: mark it 'position_embedding' in the "
            "tensor_parallel_plan (each rank looks up its own positions); a position table or mask of your own: "
            "take this rank's positions of it inside a module marked 'sequence_scatter', or set "
            "sequence_parallel=False"
        ) from error


def _owner(name: str, owners: Iterable[tuple[str, nn.Module]]) -> tuple[str | None, str]:
    """(owner's name, ``name`` relative to it) of the innermost plan owner containing module ``name``; None
    for a module under no plan (a head of the LightningModule's own)."""
    for owner, _ in owners:  # longest names first: the innermost
        if owner == "" or name == owner or name.startswith(owner + "."):
            relative = name[len(owner) + 1 :] if owner else name
            return owner or "<root>", relative
    return None, name


def install_region_check(
    root: nn.Module,
    owners: list[tuple[str, nn.Module]],
    *,
    tp: int,
    sequence_parallel: bool,
    defer: bool = False,
) -> RegionCheck:
    """Watch ``root``'s first forward (see the module docstring); the check removes itself after it."""
    return RegionCheck(root, owners, tp=tp, sequence_parallel=sequence_parallel, defer=defer)
