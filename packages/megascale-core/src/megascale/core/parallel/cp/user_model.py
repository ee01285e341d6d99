"""Context parallelism for a model of your own: what it declares, and what is refused by name.

A model joins by a ``context_parallel_plan``, three module-name patterns (``fnmatch``, as a
``tensor_parallel_plan``'s):

    context_parallel_plan = {
        "tokens": "embed",             # its first argument (B, T, ...) is cut to the rank's chunks (and, if it
                                   # declares ``context_parallel``, it is given one: positions to embed)
        "attention": "blocks.*.attn",  # each gets a ContextParallel in ``context_parallel``
        "loss": "loss_fn",             # (logits, targets) -> mean over targets != ignore_index
    }

and each attention module declares ``context_parallel = None`` and uses it when set: rotary angles at
``context_parallel.positions(T, device)`` (the rank's places in the whole sequence) and
``context_parallel.attention(q, k, v, window=...)`` (q (B, T, H, hd), k, v (B, T, KV, hd), rotated) instead of
its own causal attention — docs/guides/core.md shows one. The model keeps taking whole sequences, as a GPT
does: the tokens module keeps the rank's chunks, the loss those of the targets (``ContextParallelLoss``:
the whole sequence's mean on every rank).

Refused before any collective, by name: a pattern matching nothing (or, for tokens and loss, more than one
module), an attention module that does not declare ``context_parallel``, and modules that mix tokens
along the sequence with no context-parallel form (convolutions, recurrent layers, ``nn.MultiheadAttention``):
they would see only the rank's chunks, silently. What cannot be seen from the modules — a cumulative sum or a
shift along the sequence written in a forward — is the model's to avoid.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megascale.core.parallel.cp.attention import ContextParallel
from megascale.core.parallel.cp.loss import ContextParallelLoss
from megascale.core.parallel.cp.sharding import shard_sequence

__all__ = ["ROLES", "apply_context_parallel_plan", "check_context_parallel_plan", "context_parallel_plans"]

ROLES = ("tokens", "attention", "loss")
# modules that mix tokens along the sequence and have no context-parallel form here
_TOKEN_MIXERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.RNNBase, nn.MultiheadAttention)


def context_parallel_plans(module: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    """(name, module, plan) of every module under ``module`` declaring a ``context_parallel_plan``."""
    return [
        (n, m, dict(p)) for n, m in module.named_modules() if (p := getattr(m, "context_parallel_plan", None))
    ]


def _matches(root: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in root.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]


def check_context_parallel_plan(root: nn.Module, plan: dict[str, str], cp: int, name: str = "") -> None:
    """Raise ValueError naming what ``root``'s plan cannot do under ``cp`` ranks (module docstring)."""
    where = name or type(root).__name__
    unknown = sorted(set(plan) - set(ROLES))
    missing = [role for role in ROLES if role not in plan]
    if unknown or missing:
        raise ValueError(
            f"{where}.context_parallel_plan needs exactly the roles {list(ROLES)}: "
            + ", ".join(f"{k} {v}" for k, v in (("unknown", unknown), ("missing", missing)) if v)
        )
    for role, pattern in plan.items():
        found = _matches(root, pattern)
        if not found:
            raise ValueError(f"{where}.context_parallel_plan['{role}'] = {pattern!r} matches no module")
        if role in ("tokens", "loss") and len(found) != 1:
            raise ValueError(
                f"{where}.context_parallel_plan['{role}'] = {pattern!r} matches {[n for n, _ in found]}: one module"
            )
    ((loss_name, loss),) = _matches(root, plan["loss"])
    held = [f"{loss_name}.{n}" for n, _ in loss.named_parameters()]
    if held:  # it is wrapped (ContextParallelLoss): they would be renamed, in checkpoints too
        raise ValueError(
            f"cp={cp}: {where}.context_parallel_plan['loss'] = {loss_name!r} holds parameters {held}, which "
            "context parallelism does not take in the loss module (it wraps it): move them into a layer the "
            "logits come from, or use cp=1"
        )
    for n, m in _matches(root, plan["attention"]):
        if not hasattr(m, "context_parallel"):
            raise ValueError(
                f"cp={cp}: {where}.{n} ({type(m).__name__}) is named as attention in context_parallel_plan but "
                "does not declare `context_parallel = None` and use it (rotary positions and attention over the "
                "keys brought in): see docs/guides/core.md, 'Context parallelism'"
            )
    attention = {id(m) for _, m in _matches(root, plan["attention"])}
    for n, m in root.named_modules():
        if isinstance(m, _TOKEN_MIXERS) and not any(id(a) in attention for a in _ancestors(root, n)):
            raise ValueError(
                f"cp={cp}: {where}.{n} ({type(m).__name__}) mixes tokens along the sequence, which context "
                "parallelism splits over ranks: it would see only each rank's chunks. It has no context-parallel "
                "form here; use cp=1 (or tensor/pipeline parallelism) for this model"
            )


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]


def _keep_chunks(rank: int, cp: int) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        tokens, *rest = args
        return (shard_sequence(tokens, rank, cp), *rest)

    return hook


def apply_context_parallel_plan(root: nn.Module, plan: dict[str, str], cp_mesh: DeviceMesh) -> None:
    """Apply ``root``'s ``context_parallel_plan`` (checked first) over ``cp_mesh``'s ranks."""
    cp = cp_mesh.size()
    check_context_parallel_plan(root, plan, cp)
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    ((_, tokens),) = _matches(root, plan["tokens"])
    tokens.register_forward_pre_hook(_keep_chunks(rank, cp))
    if hasattr(tokens, "context_parallel"):  # it asks where its tokens sit (learned position embeddings)
        setattr(tokens, "context_parallel", ContextParallel(group, rank, cp))  # noqa: B010
    for _, m in _matches(root, plan["attention"]):
        setattr(m, "context_parallel", ContextParallel(group, rank, cp))  # noqa: B010 - a plain attribute, not a Module
    ((loss_name, loss),) = _matches(root, plan["loss"])
    parent_name, _, attr = loss_name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, ContextParallelLoss(loss, group))
