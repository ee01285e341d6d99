"""ZeRO: sharding the training state over the data-parallel replicas, stages 0–3 behind one interface.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"). Data
parallelism keeps a full copy of parameters, gradients and optimizer state (for Adam or LAMB two more tensors
per parameter, the largest part) on every rank; ZeRO shards them over the dp ranks in stages:

    stage 0  nothing sharded: gradients all-reduced in buckets during backward  (``grad_reduce.py``; unlike
             DDP it takes tensor-parallel DTensor parameters)
    stage 1  + optimizer state: gradients reduce-scattered, each rank steps its 1/dp of every bucket (to the
             element, across parameters) and the new values are all-gathered: DDP's bytes
             (``sharded_step.py``; ``zero1_sharding="parameters"``: whole parameters by owner, gradients
             all-reduced and new values broadcast, 1.5x the bytes, for optimizers that are not
             elementwise: ``optimizer_state.py``)
    stage 2  + gradients (reduce-scatter per unit during backward)               (``fsdp.py``, FSDP2)
    stage 3  + parameters (gathered per unit, just in time, prefetched)          (``fsdp.py``, FSDP2)

Every stage is a ``ZeroRuntime`` with the same hooks, which a training loop calls in this order::

    with zero.no_sync(): loss.backward()      # micro-batches of a gradient accumulation but the last
    zero.before_backward(loss).backward(); zero.after_backward()   # gradients averaged (or reduce-scattered)
    clip_grad_norm_(..., sum_group=zero.grad_sum_group())   # megascale's: every tensor once
    zero.before_optimizer_step(optimizer)      # stage 1: the optimizer gets this rank's share
    optimizer.step(); zero.after_optimizer_step(optimizer)   # stage 1: new values sent; 2/3: prefetch
    zero.wait_for_params()                     # before reading parameters outside a forward

``apply_zero`` chooses and sets one up. What it shards is given as ``UnitTree``s: a root module whose forward
runs around everything (the LightningModule, whose training_step runs inside its forward; or each pipeline
stage) and its layers in forward order. Every parameter under a root is covered, in a unit or by the root,
whatever its ``requires_grad`` at setup (frozen ones train once unfrozen).

Lightning's parameter contract holds at stages 0 and 1 as on one process: a parameter that got a gradient on
no rank keeps ``p.grad`` None (the optimizer leaves it alone: no momentum, no weight decay); parameters that
join an optimizer later (``add_param_group``) are stepped from the next step on, the states kept; and with
``set_whole_gradients(True)`` every gradient user code reads is whole. At stages 2 and 3 too, and a block
some ranks' forward does not call is gathered and reduce-scattered with the others (``skipped_units.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from megascale.core.parallel.wait_timer import WaitTimer
from megascale.core.parallel.zero.grad_reduce import BucketedGradReduce
from megascale.core.parallel.zero.optimizer_state import OptimizerStateSharding
from megascale.core.parallel.zero.sharded_step import ShardedOptimizerStep
from megascale.core.parallel.zero.skipped_units import SkippedUnits
from megascale.core.parallel.zero.used_params import UsedParams

__all__ = [
    "BucketedGradReduce",
    "OptimizerStateSharding",
    "ShardedOptimizerStep",
    "UnitTree",
    "ZeroRuntime",
    "apply_zero",
    "apply_zero_to_params",
]


@dataclass
class UnitTree:
    """A root module and its layers in forward order, as segments: runs of consecutive layers that may be
    grouped into one unit (a GPT's blocks), apart from those that must not (its embedding, its head)."""

    root: nn.Module
    segments: list[list[nn.Module]] = field(default_factory=list)
    cast_inputs: bool = True  # stages 2/3 under mixed precision: the root casts float inputs to param_dtype

    def layers(self) -> list[nn.Module]:
        return [layer for segment in self.segments for layer in segment]


class ZeroRuntime:
    """The hooks of one ZeRO stage. This base class is what runs when there is nothing to shard (dp = 1, or a
    module that sharded itself): every hook does nothing."""

    stage: int | None = None
    #: ranks hold different optimizer states at checkpoint time (each loads only its own)
    checkpoint_partial: bool = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally; the next backward outside reduces the sums."""
        yield

    def reshard(self) -> None:
        """Parameters gathered for an accumulation's micro-batches split again into shards, as after a step."""

    def before_backward(self, loss: Tensor) -> Tensor:
        """``loss`` as the backward about to run should take it (stages 2/3 hook the units a forward passed
        over onto it when the backward runs inside the root's forward)."""
        return loss

    def after_backward(self) -> None:
        """After the (last) backward of a step: gradients reduced over dp."""

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Called once the optimizers exist (stage 1 decides who steps what)."""

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        """After clipping, before ``optimizer.step()``."""

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """After ``optimizer.step()``."""

    def wait_for_params(self) -> None:
        """Until every parameter holds this step's values (call before reading them outside a forward)."""

    def prepare_optimizer_state(self, optimizer: Optimizer) -> None:
        """Before reading or loading ``optimizer``'s state dict (stage 1 creates the state it owns)."""

    def holds_all_optimizer_states(self, optimizer: Optimizer) -> bool:
        """False where this rank keeps only its own share of ``optimizer``'s states (stage 1)."""
        return True

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding exactly this rank's parameters and optimizer state (stage 0), else None."""
        return None

    def grad_sum_group(self) -> dist.ProcessGroup | None:
        """The group over which plain gradients hold different shares (stage 1's scattered pieces): a global
        gradient norm adds their shares over it. None where every rank holds them whole."""
        return None

    def gradient_piece(self, p: Tensor) -> tuple[int, int] | None:
        """Where ``p.grad`` holds only this rank's piece of the average after the reduction (stage 1's
        ``"elements"``): the elements ``[start, stop)`` of its flattened local tensor, zeros elsewhere; None
        where it is whole."""
        return None

    def set_whole_gradients(self, whole: bool) -> None:
        """``whole``: user code reads gradients between backward and the optimizer step (a logged gradient
        norm, its own clipping, manual optimization), so every ``p.grad`` must be the whole average after
        the reduction. Only stage 1's ``"elements"`` holds pieces otherwise; it then all-reduces instead of
        reduce-scattering (1.5x DDP's bytes in all) and still steps each rank's pieces."""

    def set_wait_timer(self, timer: WaitTimer) -> None:
        """Time the waits for other ranks with ``timer`` (``megascale.core.parallel.wait_timer``)."""

    def remove(self) -> None:
        """Unregister hooks (waits for parameters in flight first)."""


class _ReplicatedGradients(ZeroRuntime):
    """Stage 0: every rank holds everything; gradients all-reduced in buckets, overlapped with backward."""

    stage = 0

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, bucket_size_mb: float,
                 overlap: bool, accumulations: int, scatter: bool = False) -> None:  # fmt: skip
        self.group = group
        self.reduce = BucketedGradReduce(
            params, group, bucket_size_mb=bucket_size_mb, overlap=overlap, accumulations=accumulations,
            scatter=scatter,
        )  # fmt: skip
        self._sync = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            with self.reduce.no_sync():
                yield
        finally:
            self._sync = True

    def after_backward(self) -> None:
        if self._sync:
            self.reduce.finish()

    def replica_group(self) -> dist.ProcessGroup | None:
        return self.group

    def set_wait_timer(self, timer: WaitTimer) -> None:
        self.reduce.wait_timer = timer

    def remove(self) -> None:
        self.reduce.remove()


class _ScatteredGradients(_ReplicatedGradients):
    """Stage 1 (``zero1_sharding="elements"``): gradient buckets reduce-scattered, each rank steps its 1/dp of
    every bucket, the new values all-gathered and waited for unit by unit by the next forward."""

    stage = 1

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, root: nn.Module,
                 units: list[nn.Module], bucket_size_mb: float, overlap_grad_reduce: bool,
                 overlap_param_gather: bool, accumulations: int) -> None:  # fmt: skip
        super().__init__(params, group, bucket_size_mb=bucket_size_mb, overlap=overlap_grad_reduce,
                         accumulations=accumulations, scatter=True)  # fmt: skip
        self.root, self.units, self.overlap_param_gather = root, units, overlap_param_gather
        self.steps: dict[int, ShardedOptimizerStep] = {}

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        self._remove_steps()
        self.steps = {
            id(opt): ShardedOptimizerStep(
                opt, self.reduce, self.root, overlap_param_gather=self.overlap_param_gather, units=self.units
            )
            for opt in optimizers
        }

    def _of(self, optimizer: Optimizer) -> ShardedOptimizerStep | None:
        return self.steps.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def after_backward(self) -> None:
        if self._sync:
            self.reduce.finish()
            for step in self.steps.values():
                step.arm()

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        step = self._of(optimizer)
        if step is not None:
            _wait_for_shared(step, self.steps.values())
            step.begin_step()

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        step = self._of(optimizer)
        if step is not None:
            step.end_step()

    def wait_for_params(self) -> None:
        for step in self.steps.values():
            step.wait()

    def prepare_optimizer_state(self, optimizer: Optimizer) -> None:
        step = self._of(optimizer)
        if step is not None:
            step.gather_state()

    def grad_sum_group(self) -> dist.ProcessGroup | None:
        return None if self.reduce.whole else self.group

    def gradient_piece(self, p: Tensor) -> tuple[int, int] | None:
        return self.reduce.gradient_piece(p)

    def set_whole_gradients(self, whole: bool) -> None:
        self.reduce.whole = whole

    def _remove_steps(self) -> None:
        for step in self.steps.values():
            step.remove()
        self.steps = {}

    def remove(self) -> None:
        # The steps are kept, their hooks removed: the optimizer state stays in this rank's pieces, and a
        # checkpoint written after fit (Lightning tears the strategy down before trainer.save_checkpoint)
        # still needs prepare_optimizer_state to gather it whole.
        for step in self.steps.values():
            step.remove()
        super().remove()


class _ShardedOptimizerState(_ReplicatedGradients):
    """Stage 1 with ``zero1_sharding="parameters"``: stage 0's gradients; each parameter stepped by its
    owner, whose new values the next forward waits for unit by unit (``overlap_param_gather``)."""

    stage = 1
    checkpoint_partial = True

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, root: nn.Module,
                 units: list[nn.Module], bucket_size_mb: float, overlap_grad_reduce: bool,
                 overlap_param_gather: bool, accumulations: int) -> None:  # fmt: skip
        super().__init__(params, group, bucket_size_mb=bucket_size_mb, overlap=overlap_grad_reduce,
                         accumulations=accumulations)  # fmt: skip
        self.root, self.units = root, units
        self.overlap_param_gather, self.bucket_size_mb = overlap_param_gather, bucket_size_mb
        self.sharding: dict[int, OptimizerStateSharding] = {}

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        self.remove_sharding()
        self.sharding = {
            id(opt): OptimizerStateSharding(
                opt,
                self.root,
                self.group,
                overlap_param_gather=self.overlap_param_gather,
                bucket_size_mb=self.bucket_size_mb,
                units=self.units,
                covers=self.reduce.covers,
            )
            for opt in optimizers
        }
        self.set_wait_timer(self.reduce.wait_timer)

    def _of(self, optimizer: Optimizer) -> OptimizerStateSharding | None:
        # Lightning may hand over its wrapper (LightningOptimizer) of the optimizer
        return self.sharding.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        sharding = self._of(optimizer)
        if sharding is not None:
            _wait_for_shared(sharding, self.sharding.values())
            sharding.drop_unowned_grads()

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        sharding = self._of(optimizer)
        if sharding is not None:
            sharding.broadcast_updated()

    def wait_for_params(self) -> None:
        for sharding in self.sharding.values():
            sharding.wait()

    def prepare_optimizer_state(self, optimizer: Optimizer) -> None:
        sharding = self._of(optimizer)
        if sharding is not None:
            sharding.init_owned_state()

    def holds_all_optimizer_states(self, optimizer: Optimizer) -> bool:
        return self._of(optimizer) is None

    def set_wait_timer(self, timer: WaitTimer) -> None:
        super().set_wait_timer(timer)
        for sharding in self.sharding.values():
            sharding.wait_timer = timer

    def replica_group(self) -> dist.ProcessGroup | None:
        return None

    def remove_sharding(self) -> None:
        for sharding in self.sharding.values():
            sharding.wait()
            sharding.remove()
        self.sharding = {}

    def remove(self) -> None:
        self.remove_sharding()
        super().remove()


_Stepper = ShardedOptimizerStep | OptimizerStateSharding


def _wait_for_shared(stepping: _Stepper, others: Iterable[_Stepper]) -> None:
    """Before ``stepping`` steps: the new values of parameters it shares with another optimizer (each steps
    them with its own state, as on one process), sent by that one's last step, must have landed first: the
    owner of a piece under one optimizer need not be its owner under the other, and a late gather would
    overwrite the newer values."""
    mine = {id(p) for p in stepping.params}
    for other in others:
        if other is not stepping and any(id(p) in mine for p in other.params):
            other.wait()


class _FullySharded(ZeroRuntime):
    """Stages 2 and 3 on FSDP2: one FSDP root per tree, a unit per group of layers.

    Gradient accumulation (``no_sync``): gradients accumulate unsharded and are reduce-scattered once, by the
    backward of the step's last micro-batch, unit by unit as it goes. Stage 2 also keeps its parameters
    gathered between the micro-batches (nothing gathered twice per step); stage 3 still re-gathers them for
    each forward and backward, its reason to exist being that they are not all held at once. The first
    unit's gather of the next step is issued right after the optimizer step (both stages), so it overlaps
    whatever comes before the next forward (the data load).

    Backward and optimizer steps inside a root's forward (Lightning's manual optimization: training_step runs
    inside the LightningModule's forward) are seen by hooks on the roots: FSDP2 would reduce-scatter only the
    units that backward reached through their own outputs, and never the root's own parameters (its output,
    which FSDP hooks, does not exist yet), so the runtime finishes FSDP's backward itself after each one, and
    leaves the root's parameters sharded after each reduction and step (code reading gradients there finds the
    shards that hold them, as between steps), to be gathered again, fresh, when a module holding them next runs
    in that forward; they are sharded again when the forward ends, as after any step. The root's gathered parameters
    follow their shards' ``requires_grad`` as their modules run (toggle_optimizer inside the forward). Every
    unit is gathered once at the first forward (``FSDPUnits.gather_units_once``), so one that the first
    micro-batch of an accumulation skips still has what FSDP's post-backward reads. Every rank reduce-scatters
    every parameter, whether its data used it or not, and ``p.grad`` stays None where no rank did
    (``used_params.py``)."""

    def __init__(self, stage: int, units: list, group: dist.ProcessGroup) -> None:  # list[FSDPUnits]
        self.stage = stage
        self.units = units
        self._sync = True
        # every rank reduce-scatters every parameter, used by its data or not (``used_params.py``)
        for tree in units:
            tree.root.set_reduce_scatter_unused_params(True)
        self.used = [UsedParams(tree.fsdp_params(), group) for tree in units]
        # units a rank's forward passes over still gather and reduce-scatter with the others' (skipped_units.py)
        self.skipped = {
            id(tree.root): SkippedUnits(tree.root, tree.units, used.before_reductions)
            for tree, used in zip(units, self.used)
        }
        self._inside_forward = 0  # roots' forwards now running (they may nest: a root calling another)
        self._gathered_inside = False
        self._stale_roots: set[int] = set()  # roots sharded inside a forward, gathered when next used
        self._units_gathered_once = False  # see FSDPUnits.gather_units_once
        self._hooks = [
            hook
            for tree in units
            for hook in (
                tree.root.register_forward_pre_hook(self._enter_root),
                tree.root.register_forward_hook(self._leave_root),
                *tree.follow_requires_grad(),
                *tree.gather_for_balancing_losses(),
            )
        ]
        self._hooks += [
            module.register_forward_pre_hook(self._gather_if_stale(tree), prepend=True)
            for tree in units
            for module in tree.root_modules()
        ]

    def _enter_root(self, module: nn.Module, args: object) -> None:
        self._inside_forward += 1
        self.skipped[id(module)].start()
        if not self._units_gathered_once:
            self._units_gathered_once = True
            for tree in self.units:
                tree.gather_units_once()
        for used in self.used:
            used.watch_gathered()

    def _leave_root(self, module: nn.Module, args: object, output: object) -> None:
        self._inside_forward -= 1
        if not self._inside_forward and self._gathered_inside:
            self._gathered_inside = False
            self._stale_roots = set()
            for tree in self.units:
                tree.root.reshard()  # between steps the shards are registered, as after any backward

    def _gather_roots_inside_forward(self) -> None:
        """After a reduction or a step inside a root's forward: each root's parameters sharded, so code reading
        them or their gradients meanwhile (a manual training_step, on_before_optimizer_step) finds the shards
        holding the reduced gradients, as between steps; gathered again, fresh, when a module holding them
        next runs in that forward (``_gather_if_stale``)."""
        self._gathered_inside = True
        for tree in self.units:
            tree.root.reshard()
            self._stale_roots.add(id(tree.root))

    def _gather_if_stale(self, tree: Any) -> Callable[..., None]:  # tree: FSDPUnits
        def hook(module: nn.Module, args: object) -> None:
            if id(tree.root) in self._stale_roots:
                self._stale_roots.discard(id(tree.root))
                tree.gather_root()

        return hook

    def reshard(self) -> None:
        for tree in self.units:
            tree.reshard_all()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        for units in self.units:
            units.root.set_requires_gradient_sync(False)
            if self.stage == 2:
                units.root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self._sync = True
            for units in self.units:
                units.root.set_requires_gradient_sync(True)
                units.root.set_reshard_after_backward(True)

    def before_backward(self, loss: Tensor) -> Tensor:
        if self._inside_forward:  # the backward of a manual training_step: later units will not run first
            for skipped in self.skipped.values():
                loss = skipped.before_backward(loss)
        return loss

    def after_backward(self) -> None:
        if self._inside_forward:
            for tree in self.units:
                tree.finish_backward()
        if self._sync:
            for used in self.used:
                used.after_reduction()
        if self._inside_forward:
            self._gather_roots_inside_forward()

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self._inside_forward:
            self._gather_roots_inside_forward()
            return
        for units in self.units:
            units.prefetch_first_unit()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for skipped in self.skipped.values():
            skipped.remove()
        super().remove()


def apply_zero(
    trees: Sequence[UnitTree],
    dp_mesh: DeviceMesh,
    *,
    stage: int,
    bucket_size_mb: float = 25.0,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    param_dtype: torch.dtype | None = None,
    accumulations: int = 1,
    zero1_root: nn.Module | None = None,
    zero1_sharding: str = "elements",
    exclude: Sequence[nn.Parameter] = (),
) -> ZeroRuntime:
    """Shard the parameters under ``trees`` over ``dp_mesh`` as ZeRO ``stage`` and return its hooks.

    Args:
        trees: what to shard: each root with its layers (see ``UnitTree``).
        stage: 0, 1, 2 or 3.
        bucket_size_mb: gradient-reduction buckets (0/1), layers per unit (2/3).
        overlap_grad_reduce: reduce during backward, per bucket/unit.
        overlap_param_gather: stage 1: the next forward waits per unit; stages 2/3: prefetch.
        param_dtype: stages 2/3: the dtype parameters are gathered in (bf16 under mixed precision).
        accumulations: backward passes per synchronised step (one per pipeline microbatch).
        zero1_root: stage 1: the module whose forward pre-hook waits for every parameter no unit does
            (default: the first tree's root).
        zero1_sharding: stage 1: "elements" (reduce-scatter, each rank steps 1/dp of every bucket, all-gather:
            DDP's bytes; elementwise optimizers and LAMB) or "parameters" (whole parameters by owner,
            all-reduce + broadcast: 1.5x the bytes; any optimizer that skips parameters without gradients).
        exclude: parameters under ``trees`` that are not replicas over ``dp_mesh`` (experts split over "ep",
            averaged over their own replicas): stage 0 only.
    """
    if dp_mesh.size() == 1:
        return ZeroRuntime()
    excluded = {id(p) for p in exclude}
    if excluded and not (stage == 0 or (stage == 1 and zero1_sharding == "parameters")):
        raise ValueError(
            f"ZeRO-{stage}{' with zero1_sharding=' + repr(zero1_sharding) if stage == 1 else ''} cannot leave "
            "parameters out (exclude): only stage 0 and stage 1 by parameters can"
        )
    params = [p for p in _unique_params(t.root for t in trees) if id(p) not in excluded]
    group = dp_mesh.get_group()
    if stage == 0:
        return _ReplicatedGradients(params, group, bucket_size_mb=bucket_size_mb, overlap=overlap_grad_reduce,
                                    accumulations=accumulations)  # fmt: skip
    if stage == 1:
        units = [m for t in trees for m in (t.root, *t.layers())]
        root = zero1_root if zero1_root is not None else trees[0].root
        if zero1_sharding not in ("elements", "parameters"):
            raise ValueError(f"zero1_sharding={zero1_sharding!r} must be 'elements' or 'parameters'")
        kind = _ScatteredGradients if zero1_sharding == "elements" else _ShardedOptimizerState
        return kind(
            params, group, root=root, units=units, bucket_size_mb=bucket_size_mb,
            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
            accumulations=accumulations,
        )  # fmt: skip
    if stage in (2, 3):
        from megascale.core.parallel.zero.fsdp import apply_fsdp, group_layers

        sharded = []
        for tree in trees:
            groups = [g for seg in tree.segments for g in group_layers(seg, bucket_size_mb)]
            sharded.append(
                apply_fsdp(
                    tree.root,
                    groups if overlap_grad_reduce else [],
                    dp_mesh,
                    stage=stage,
                    param_dtype=param_dtype,
                    prefetch=overlap_param_gather,
                    cast_root_inputs=tree.cast_inputs,
                )
            )
        return _FullySharded(stage, sharded, group)
    raise ValueError(f"ZeRO stage {stage!r} must be 0, 1, 2 or 3")


def apply_zero_to_params(
    params: Sequence[nn.Parameter], dp_mesh: DeviceMesh, *, stage: int, root: nn.Module,
    units: Sequence[nn.Module] = (), bucket_size_mb: float = 25.0, overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True, accumulations: int = 1,
) -> ZeroRuntime:  # fmt: skip
    """ZeRO over ``params`` alone, for parameters replicated over another group than the model's (a mixture of
    experts' experts over "edp"): stage 0 (gradients averaged over ``dp_mesh`` in buckets) or stage 1 by
    parameters (also each parameter's optimizer state kept by one owner, which broadcasts its new values;
    ``root`` and ``units`` wait for them as in ``apply_zero``)."""
    if dp_mesh.size() == 1:
        return ZeroRuntime()
    group = dp_mesh.get_group()
    if stage == 0:
        return _ReplicatedGradients(list(params), group, bucket_size_mb=bucket_size_mb,
                                    overlap=overlap_grad_reduce, accumulations=accumulations)  # fmt: skip
    if stage == 1:
        return _ShardedOptimizerState(
            list(params), group, root=root, units=list(units), bucket_size_mb=bucket_size_mb,
            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
            accumulations=accumulations,
        )  # fmt: skip
    raise ValueError(f"ZeRO-{stage} over some parameters alone is not built: stages 0 and 1 (by parameters)")


def _unique_params(roots: Iterator[nn.Module] | Sequence[nn.Module]) -> Iterator[nn.Parameter]:
    # Frozen parameters too: they may train later (Lightning's BaseFinetuning); ZeRO-0/1 skip their buckets
    # while they stay frozen.
    seen: set[int] = set()
    for root in roots:
        for p in root.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p
