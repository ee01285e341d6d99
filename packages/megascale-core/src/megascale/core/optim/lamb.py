# LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes") for
# plain, tensor-parallel and FSDP2-sharded parameters.
#
# Scope: the optimizer only (no gradient clipping, no LR schedule, no loss scaling). Per parameter tensor w
# with gradient g, at step t:
#     m = β1·m + (1-β1)·g            v = β2·v + (1-β2)·g²
#     m̂ = m/(1-β1^t)  v̂ = v/(1-β2^t)  (or m̂ = m, v̂ = v without bias correction)
#     u = m̂/(√v̂ + ε) + λ·w           (decoupled weight decay inside the update, as the paper and apex do)
#     r = ‖w‖/‖u‖ if both > 0 else 1,  then r = min(r, max_trust_ratio) unless that is None
#     w = w - lr·r·u
#
# Groups with weight_decay=0 (norms, biases) still get the trust ratio. That is NVIDIA's NVLAMB convention
# (apex FusedLAMB with use_nvlamb=True; apex's own default, use_nvlamb=False, and the paper's TF code skip it
# for such tensors). We apply it everywhere so that every tensor's step is scaled the same way.
#
# Sharded parameters. The trust ratio needs the norms of the WHOLE logical tensor. A DTensor parameter
# (tensor-parallel Shard(d), Replicate(), or FSDP2 × TP on a 2-D mesh) is updated through its local tensor;
# all elementwise math is local. Only ‖w‖² and ‖u‖² need communication: each rank computes local squared
# norms and all-reduces them (SUM) over exactly the mesh dimensions whose placement is Shard (or FSDP2's
# _StridedShard; Partial parameters are refused). Over a Replicate dimension every rank holds the same
# values, so summing there would count them several times. (That scales ‖w‖ and ‖u‖ by the same factor and
# leaves r unchanged, so it would be wasted traffic rather than a wrong result.)
# Communication is batched: all sharded tensors' squared norms of a step (all parameter groups) go in one
# tensor, and there is one all-reduce per distinct mesh dimension (its process group) that some tensor is
# sharded on, e.g. one per step on a 1-D TP or FSDP mesh, two on a 2-D mesh with tensors sharded on both
# dimensions. The reduction is `all_reduce_over_shards` in parallel/grad_norm.py, shared with clipping.
# Plain tensors are taken to be whole (unsharded) and cost no communication. Like any SPMD code, every rank
# must step the same parameters (same grads present) in the same order.
#
# State lives in the type of the parameter: exp_avg/exp_avg_sq of a DTensor parameter are DTensors with
# its placements (torch.zeros_like), as torch's own optimizers keep them. That is what makes optimizer state
# work with torch.distributed.checkpoint and get_optimizer_state_dict (each rank saves its shard with
# global metadata, and can load into another sharding); local tensors saved under the same key on every
# rank could not be resharded. `step` is a CPU float32 scalar tensor, as in torch.optim.AdamW.
#
# Backends. "foreach" (default): torch._foreach_* over each group's tensors and one _foreach_norm batch.
# "for-loop" (foreach=False): the same math one tensor at a time; it is the readable reference the tests
# compare against. "apex": NVIDIA apex FusedLAMB, only for plain CUDA fp32/fp16 tensors, because its kernel
# computes each norm over the tensor it is handed: for a DTensor that is a local shard, which gives a wrong
# trust ratio. apex has no trust-ratio clamp, so it runs only with max_trust_ratio=None; we pass
# use_nvlamb=True (trust ratio on weight_decay=0 groups, as above) and max_grad_norm=inf: FusedLAMB clips
# by the global grad norm by default (max_grad_norm=1.0), and its kernel divides by max_grad_norm whenever
# the norm exceeds it, so 0 would zero every gradient; inf never clips. apex writes the update into p.grad.

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT  # ParamsT at run time: jsonargparse reads the signature

from megascale.core import _optional
from megascale.core._dtensor import ShardSpec, is_dtensor, local, shard_spec
from megascale.core.parallel.grad_clip import all_reduce_over_shards

if TYPE_CHECKING:
    pass

__all__ = ["LAMB"]

_APEX_DTYPES = (torch.float32, torch.float16)


def _local_grad(p: Any) -> Tensor:
    g: Any = p.grad
    assert g is not None
    if not is_dtensor(p):
        return g
    if not is_dtensor(g):
        raise RuntimeError("a DTensor parameter has a plain-tensor gradient; LAMB needs a DTensor gradient")
    if g.placements != p.placements:
        # e.g. a Partial gradient of a replicated parameter: the update needs the full (reduced) gradient.
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


@dataclass
class _GroupWork:
    """One parameter group's local tensors for this step, carried between the phases of step()."""

    group: dict[str, Any]
    params: list[Tensor] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)
    specs: list[ShardSpec | None] = field(default_factory=list)
    updates: list[Tensor] = field(default_factory=list)
    w_norms: list[Tensor] = field(default_factory=list)
    u_norms: list[Tensor] = field(default_factory=list)


def _bias_corrections(work: _GroupWork) -> tuple[list[float], list[float]]:
    beta1, beta2 = work.group["betas"]
    counts = [s.item() for s in work.steps]  # CPU scalars: no device sync
    return [1 - beta1**t for t in counts], [1 - beta2**t for t in counts]


def _updates_foreach(work: _GroupWork) -> None:
    group = work.group
    beta1, beta2 = group["betas"]
    w, g, m, v = work.weights, work.grads, work.exp_avgs, work.exp_avg_sqs
    torch._foreach_add_(work.steps, 1)
    torch._foreach_lerp_(m, g, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    if group["bias_correction"]:
        bc1, bc2 = _bias_corrections(work)
        denom = torch._foreach_div(v, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        u = torch._foreach_div(m, bc1)
        torch._foreach_div_(u, denom)
    else:
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, group["eps"])
        u = torch._foreach_div(m, denom)
    del denom
    if group["weight_decay"] != 0:
        torch._foreach_add_(u, w, alpha=group["weight_decay"])
    work.updates = list(u)
    # fp32 norms also for bf16/fp16 tensors: the trust ratio should not carry half-precision error.
    work.w_norms = list(torch._foreach_norm(w, 2, dtype=torch.float32))
    work.u_norms = list(torch._foreach_norm(u, 2, dtype=torch.float32))


def _updates_for_loop(work: _GroupWork) -> None:
    group = work.group
    beta1, beta2 = group["betas"]
    for step in work.steps:
        step.add_(1)
    bc1, bc2 = _bias_corrections(work) if group["bias_correction"] else (None, None)
    for i, (w, g, m, v) in enumerate(zip(work.weights, work.grads, work.exp_avgs, work.exp_avg_sqs)):
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if bc1 is not None and bc2 is not None:
            denom = (v / bc2[i]).sqrt_().add_(group["eps"])
            u = (m / bc1[i]).div_(denom)
        else:
            u = m / v.sqrt().add_(group["eps"])
        if group["weight_decay"] != 0:
            u.add_(w, alpha=group["weight_decay"])
        work.updates.append(u)
        work.w_norms.append(torch.linalg.vector_norm(w, 2, dtype=torch.float32))
        work.u_norms.append(torch.linalg.vector_norm(u, 2, dtype=torch.float32))


def _indices_by_device(tensors: list[Tensor]) -> dict[torch.device, list[int]]:
    out: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.device, []).append(i)
    return out


def _reduce_sharded_norms(works: list[_GroupWork]) -> None:
    """Turn the local norms of sharded tensors into norms of the whole tensors, in place.

    Per device, the squares of all sharded tensors' ‖w‖ and ‖u‖ go in one vector, reduced by
    ``all_reduce_over_shards`` (shared with gradient clipping): one all-reduce per mesh dimension's process
    group that some tensor is sharded on; a tensor sharded on several dimensions takes part in several.
    """
    members = [(work, i) for work in works for i, spec in enumerate(work.specs) if spec is not None]
    by_device: dict[torch.device, list[tuple[_GroupWork, int]]] = {}
    for work, i in members:
        by_device.setdefault(work.w_norms[i].device, []).append((work, i))
    for items in by_device.values():
        n = len(items)
        squares = torch.stack([w.w_norms[i] for w, i in items] + [w.u_norms[i] for w, i in items]).square()
        specs = [w.specs[i] for w, i in items]
        norms = all_reduce_over_shards(squares, specs + specs).sqrt().unbind()
        for k, (work, i) in enumerate(items):
            work.w_norms[i] = norms[k]
            work.u_norms[i] = norms[n + k]


def _step_scales(work: _GroupWork) -> list[Tensor]:
    """-lr·r per tensor, as 0-d fp32 tensors on each tensor's device (no host sync)."""
    lr, max_ratio = work.group["lr"], work.group["max_trust_ratio"]
    scales: list[Tensor] = [None] * len(work.w_norms)  # type: ignore[list-item]  # all filled below
    for indices in _indices_by_device(work.w_norms).values():
        w_norm = torch.stack([work.w_norms[i] for i in indices])
        u_norm = torch.stack([work.u_norms[i] for i in indices])
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        if max_ratio is not None:
            ratio = ratio.clamp_max(max_ratio)
        for i, s in zip(indices, ratio.mul_(-lr).unbind()):
            scales[i] = s
    return scales


def _check_hyperparameters(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor) or not isinstance(lr, (int, float)):
        raise ValueError(f"lr must be a float (LR schedulers change param_group['lr']), got {lr!r}")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not isinstance(group["eps"], (int, float)) or not group["eps"] >= 0.0:
        raise ValueError(f"Invalid epsilon value: {group['eps']!r} (must be >= 0)")
    betas = group["betas"]
    if not isinstance(betas, tuple) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta!r} (must be in [0, 1))")
    wd = group["weight_decay"]
    if not isinstance(wd, (int, float)) or not wd >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {wd!r} (must be >= 0)")
    max_ratio = group["max_trust_ratio"]
    if max_ratio is not None and (not isinstance(max_ratio, (int, float)) or not max_ratio > 0.0):
        raise ValueError(f"Invalid max_trust_ratio: {max_ratio!r} (must be > 0, or None for no clamp)")
    if not isinstance(group["bias_correction"], bool):
        raise ValueError(f"bias_correction must be a bool, got {group['bias_correction']!r}")


class LAMB(Optimizer):
    """LAMB: Adam moments, decoupled weight decay, and a per-tensor trust ratio ‖w‖/‖u‖.

    Works on plain tensors and on DTensor parameters (tensor parallel, FSDP2, FSDP2 × TP): the norms in the
    trust ratio are those of the whole logical tensor, all-reduced over the mesh dimensions it is sharded
    on. The trust ratio is applied to every tensor, also in groups with ``weight_decay=0`` (NVLAMB).

    Args:
        params: Parameters to optimize, or dicts defining parameter groups. Every hyperparameter below
            except ``foreach`` and ``fused`` can be set per group.
        lr: Learning rate (a float; LR schedulers change ``param_group["lr"]``).
        betas: Decay rates of the first and second moment estimates, each in [0, 1).
        eps: Added to the square root of the second moment estimate, for numerical stability.
        weight_decay: Decoupled weight decay λ, added to the update as λ·w before the trust ratio.
        bias_correction: Divide the moments by (1 - β^t), as Adam does.
        max_trust_ratio: Upper bound of the trust ratio ‖w‖/‖u‖; None for no bound.
        foreach: Use the torch._foreach_* implementation (default, None) or a per-tensor loop (False).
        fused: Use NVIDIA apex FusedLAMB. None (default) uses it when it is installed and applies: all
            parameters plain CUDA fp32/fp16 tensors (never DTensors: apex's norms would be those of the
            local shard) and ``max_trust_ratio=None`` in every group (apex has no clamp). True demands it
            and raises otherwise; False never uses it.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: float | None = 10.0,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        if fused and foreach:
            raise ValueError("`fused` and `foreach` cannot be True together")
        self.foreach = foreach
        self.fused = fused
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "max_trust_ratio": max_trust_ratio,
        }
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)
        if fused:
            self._check_apex()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, validating its hyperparameters (``Optimizer.__init__`` calls this too)."""
        if isinstance(param_group.get("betas"), list):
            param_group["betas"] = tuple(param_group["betas"])
        _check_hyperparameters({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}})
        super().add_param_group(param_group)

    # foreach/fused are choices of the whole optimizer, not group hyperparameters (one apex FusedLAMB runs
    # all groups), so they are attributes; Optimizer.__getstate__ would drop them on copy.deepcopy/pickle.
    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "foreach": self.foreach, "fused": self.fused}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("foreach", None)
        self.__dict__.setdefault("fused", None)

    # ---- backend choice -------------------------------------------------------------------------------

    def _apex_blocker(self) -> str | None:
        """Why apex FusedLAMB cannot run these parameter groups correctly, or None if it can."""
        for group in self.param_groups:
            if group["max_trust_ratio"] is not None:
                return "apex FusedLAMB has no trust-ratio clamp: set max_trust_ratio=None in every group"
            for p in group["params"]:
                if is_dtensor(p):
                    return (
                        "DTensor parameters need trust-ratio norms of the whole tensor; apex FusedLAMB "
                        "computes them over the local shard"
                    )
                if p.device.type != "cuda":
                    return f"apex FusedLAMB needs CUDA parameters, found one on {p.device}"
                if p.dtype not in _APEX_DTYPES:
                    return f"apex FusedLAMB supports fp32 and fp16 parameters only, found {p.dtype}"
        return None

    def _check_apex(self) -> None:
        blocker = self._apex_blocker()
        if blocker is not None:
            raise ValueError(f"fused=True: {blocker}")
        if _optional.apex_optimizers() is None:
            reason = _optional.missing_reason("apex.optimizers")
            raise RuntimeError(f"fused=True needs NVIDIA apex (apex.optimizers and amp_C). {reason}".strip())

    @property
    def backend(self) -> str:
        """The implementation the next ``step()`` runs: ``"apex"``, ``"foreach"`` or ``"for-loop"``."""
        if self.fused:
            return "apex"
        if self.fused is None and _optional.apex_optimizers() is not None and self._apex_blocker() is None:
            return "apex"
        return "for-loop" if self.foreach is False else "foreach"

    # ---- the step -------------------------------------------------------------------------------------

    def _state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            # zeros_like keeps a DTensor parameter's mesh and placements (see the header comment).
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _collect(self, group: dict[str, Any]) -> _GroupWork:
        work = _GroupWork(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self._state(p)
            w = local(p)
            m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
            if m.shape != w.shape or v.shape != w.shape:
                raise RuntimeError(
                    f"LAMB state of shape {tuple(m.shape)} does not match its parameter's local shape "
                    f"{tuple(w.shape)}: was a state dict of another sharding loaded?"
                )
            work.params.append(p)
            work.weights.append(w)
            work.grads.append(_local_grad(p))
            work.exp_avgs.append(m)
            work.exp_avg_sqs.append(v)
            work.steps.append(state["step"])
            work.specs.append(shard_spec(p))
        return work

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        backend = self.backend
        if backend == "apex":
            if self.fused:
                self._check_apex()  # groups may have been added since __init__
            self._step_apex()
            return loss
        # Phase 1 (local): moments, updates and local norms, per group. Phase 2: one batch of all-reduces
        # for the norms of all sharded tensors of all groups. Phase 3 (local): trust ratios and the update.
        works = [work for work in map(self._collect, self.param_groups) if work.params]
        compute = _updates_for_loop if backend == "for-loop" else _updates_foreach
        for work in works:
            compute(work)
        _reduce_sharded_norms(works)
        for work in works:
            scales = _step_scales(work)
            if backend == "for-loop":
                for w, u, s in zip(work.weights, work.updates, scales):
                    w.addcmul_(u, s)
            else:
                torch._foreach_addcmul_(work.weights, work.updates, scales)
        return loss

    def _step_apex(self) -> None:
        # A FusedLAMB built per step over our own state tensors, so that the state dict has one format
        # whatever the backend. FusedLAMB keeps one step count per group: group tensors by their count.
        apex = _optional.apex_optimizers()
        assert apex is not None
        groups: list[dict[str, Any]] = []
        stepped: list[Tensor] = []
        for group in self.param_groups:
            by_count: dict[int, list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_count.setdefault(int(self._state(p)["step"].item()), []).append(p)
            for count, params in by_count.items():
                hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction")}
                groups.append({"params": params, "step": count, **hyper})  # FusedLAMB adds 1 first
                stepped.extend(params)
        if not groups:
            return
        fused = apex.FusedLAMB(
            groups, adam_w_mode=True, grad_averaging=True, max_grad_norm=math.inf, use_nvlamb=True
        )
        for p in stepped:
            state = self.state[p]
            fused.state[p] = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        fused.step()
        for p in stepped:
            self.state[p]["step"] += 1
