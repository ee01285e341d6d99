"""ZeRO stages 2 and 3 on FSDP2 (``torch.distributed.fsdp.fully_shard``).

Why FSDP2 here: it already is ZeRO-2/3 for DTensor parameters — it shards each parameter on the
data-parallel mesh dimension (composing with our tensor-parallel DTensors into 2-D shards), reduce-scatters
gradients per unit as backward reaches it, keeps fp32 sharded master weights with bf16 compute copies, and
its shards are DTensors, so ``torch.distributed.checkpoint`` reshards them across layouts. Re-implementing
that would add risk and no capability. Stages 0/1 are megascale's own (``grad_reduce.py``, ``optimizer_state.py``), where replicated
parameters make a DDP-style bucketed all-reduce cheaper than FSDP2's per-parameter machinery.

- stage 2: ``reshard_after_forward=False``. Parameters stay gathered from forward to backward; gradients are
  reduce-scattered unit by unit during backward; optimizer state and gradients are sharded. PyTorch
  documents this mode (SHARD_GRAD_OP) as ZeRO-2; parameters are also sharded between steps, which only
  saves memory (they are gathered again, prefetched, in the next forward).
- stage 3: ``reshard_after_forward=True``. Parameters are gathered per unit just in time in forward and again
  in backward. With ``prefetch``, unit i's forward issues unit i+1's all-gather (and backward the previous
  unit's).

Both stages: ``prefetch_first_unit`` issues the first unit's gather right after the optimizer step, before
the next forward (overlapping the data load); under gradient accumulation the runtime turns FSDP's gradient
sync off for all micro-batches but the last (``ZeroRuntime.no_sync``), so each unit is reduce-scattered once
per step, during the last backward.

A unit ("bucket") is a group of consecutive layers of at most ``bucket_size_mb`` of parameters, in forward
order; the caller says what the layers are (a GPT's embedding, blocks and head; a pipeline stage's; a user
model's blocks). ``overlap_grad_reduce=False`` makes the root the only unit: one reduce-scatter after the whole
backward, nothing overlapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["FSDPUnits", "apply_fsdp", "fsdp_param_groups", "group_layers"]


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """FSDP2's parameter groups (``FSDPParamGroup``) of ``module`` and every FSDP unit under it."""
    return [
        group
        for m in module.modules()
        if isinstance(m, FSDPModule)
        for group in m._get_fsdp_state()._fsdp_param_groups
    ]


class FSDPUnits:
    """The FSDP2 units of a model in forward order, and the prefetch wiring between them."""

    def __init__(self, root: FSDPModule, units: list[FSDPModule]) -> None:
        self.root = root
        self.units = units

    def prefetch_first_unit(self) -> None:
        """Issue the first unit's all-gather now, so the next forward finds it in flight or done."""
        if self.units:
            self.units[0].unshard(async_op=True)

    def finish_backward(self) -> None:
        """FSDP2's end of backward, for a backward autograd ran without it: one run inside the root's own
        forward (Lightning's manual optimization), before the root's output exists, where FSDP hooks it.
        Every unit's gradient still unreduced is reduce-scattered (its parameters resharded); a unit already
        reduced is left as it is (FSDP documents its post-backward as a no-op then)."""
        self.root._get_fsdp_state()._root_post_backward_final_callback()  # FSDP2 has no public call for it

    def follow_requires_grad(self) -> list[Any]:
        """Forward pre-hooks on the modules holding the root's own parameters: each gives the gathered
        parameter the ``requires_grad`` of its shard (the parameter optimizers hold, and so what Lightning's
        toggle_optimizer sets) before the module runs. FSDP2 copies it only when it gathers, and the root stays
        gathered through its whole forward, where user code toggles it. Returns the hooks' handles."""
        by_module: dict[int, tuple[nn.Module, list[Any]]] = {}
        for group in self.root._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                module = fsdp_param._module_info.module
                by_module.setdefault(id(module), (module, []))[1].append(fsdp_param)

        def follow(fsdp_params: list[Any]) -> Any:
            def hook(module: nn.Module, args: Any) -> None:
                for fsdp_param in fsdp_params:
                    gathered = getattr(fsdp_param, "_unsharded_param", None)
                    wanted = fsdp_param.sharded_param.requires_grad
                    if gathered is not None and gathered.requires_grad != wanted:
                        gathered.requires_grad_(wanted)

            return hook

        return [module.register_forward_pre_hook(follow(params)) for module, params in by_module.values()]

    def gather_for_balancing_losses(self) -> list[Any]:
        """Forward hooks on each mixture-of-experts layer: the balancing loss it leaves for the model's loss
        (``MoE.pending_loss``) reaches its router, so its unit's parameters, in backward without passing the
        unit's output, where FSDP2 hooks the unit's gather. Where that output gets no gradient (the loss detached
        after it) ZeRO-3 found them freed ("setStorage ... out of bounds for storage of size 0"). So the unit is
        also gathered when backward reaches the balancing loss (a no-op where its output's hook came first).
        Returns the hooks' handles."""
        from megascale.core.model.moe import MoE

        root: nn.Module = self.root  # type: ignore[assignment]  # an FSDPModule is an nn.Module
        unit_of: dict[int, Any] = {}
        for unit in root.modules():  # pre-order: a nested unit overrides the one around it
            if isinstance(unit, FSDPModule):
                for module in unit.modules():
                    unit_of[id(module)] = unit

        def gather_on_backward(state: Any) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                loss = getattr(module, "pending_loss", None)
                if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
                    loss.grad_fn.register_prehook(lambda grads: state._pre_backward(grads[0]) and None)

            return hook

        return [
            module.register_forward_hook(gather_on_backward(unit_of[id(module)]._get_fsdp_state()))
            for module in root.modules()
            if isinstance(module, MoE) and id(module) in unit_of
        ]

    def root_modules(self) -> list[nn.Module]:
        """The modules holding the root's own parameters (each module a tied parameter is shared with too)."""
        modules: dict[int, nn.Module] = {}
        for group in self.root._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                for module in (info.module, *info.shared_modules):
                    modules.setdefault(id(module), module)
        return list(modules.values())

    def gather_units_once(self) -> None:
        """Gather and free every unit under the root but the root itself (gathered by its forward), once, on
        every rank alike, before the first forward uses them: FSDP2 creates a parameter's gathered copy at its
        first gather, and its post-backward under no_sync reads that copy for every parameter of every unit,
        so a unit that the first micro-batch of an accumulation skipped (LayerDrop, an unrouted expert) failed
        with "'FSDPParam' object has no attribute '_unsharded_param'"."""
        root: nn.Module = self.root  # type: ignore[assignment]  # an FSDPModule is an nn.Module
        for module in root.modules():
            if module is not root and isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()

    def reshard_all(self) -> None:
        """Every unit's and the root's parameters back to their shards (gathered ones freed)."""
        root: nn.Module = self.root  # type: ignore[assignment]  # an FSDPModule is an nn.Module
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def fsdp_params(self) -> list[Any]:
        """FSDP2's record (``FSDPParam``) of every parameter of the root and its units."""
        root: nn.Module = self.root  # type: ignore[assignment]  # an FSDPModule is an nn.Module
        return [fsdp_param for group in fsdp_param_groups(root) for fsdp_param in group.fsdp_params]

    def gather_root(self) -> None:
        """The root's own parameters gathered again, from their current shards (after an optimizer step or a
        reduction inside the root's forward: the rest of that forward reads them)."""
        self.root.reshard()
        self.root.unshard()


def _reduce_in_one_dtype(param_group: Any) -> None:
    """FSDP2's post-backward of ``param_group``, its gradients reduced in ``reduce_dtype`` (fp32 under bf16
    compute) whatever their history:

    - accumulating, a gradient FSDP2 kept from a no-sync micro-batch is in ``reduce_dtype``; one first made by
      the reducing micro-batch (a layer the earlier ones skipped), and the zeros FSDP2 reduce-scatters for an
      unused parameter, in ``param_dtype``: one unit holding both failed with "FSDP reduce-scatter expects
      uniform gradient dtype". The latter are cast up first (the reduce-scatter casts them anyway);
    - a unit frozen whole when FSDP2 first ran it (``BaseFinetuning``) got no dtypes (FSDP2 takes them from
      trainable parameters only), so once unfrozen its bf16 gradients were reduced in bf16 and refused by its
      fp32 parameters ("attempting to assign a gradient with dtype BFloat16"). They are taken again then."""
    post_backward = param_group.post_backward  # FSDP2 has no hook before it; it is called by attribute

    def upcast_then_post_backward(*args: Any) -> Any:
        if param_group._orig_dtype is None and any(
            fp.sharded_param.requires_grad for fp in param_group.fsdp_params
        ):
            param_group._init_mp_dtypes()
        if not param_group.reduce_grads or param_group._reduce_dtype is None:  # nothing to cast: as FSDP2
            return post_backward(*args)
        gathered = [fp for fp in param_group.fsdp_params if hasattr(fp, "_unsharded_param")]
        if any(fp.unsharded_accumulated_grad is not None for fp in gathered):
            for fsdp_param in gathered:
                param = fsdp_param._unsharded_param
                if fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.reduce_dtype is None:
                    continue
                if param.grad is not None:
                    fsdp_param.to_accumulated_grad_if_needed()
                elif param_group.reduce_scatter_unused_params and param.requires_grad:
                    fsdp_param.unsharded_accumulated_grad = torch.zeros_like(
                        param, dtype=fsdp_param.reduce_dtype
                    )
        return post_backward(*args)

    param_group.post_backward = upcast_then_post_backward


def _bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def group_layers(layers: Sequence[nn.Module], bucket_size_mb: float) -> list[list[nn.Module]]:
    """Consecutive ``layers`` grouped into units of at most ``bucket_size_mb`` of parameters (0: one each)."""
    bucket_bytes = bucket_size_mb * 2**20
    groups: list[list[nn.Module]] = []
    for layer in layers:
        if groups and _bytes(groups[-1] + [layer]) <= bucket_bytes:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def _untied(units: Sequence[Sequence[nn.Module]]) -> list[list[nn.Module]]:
    """``units`` less those sharing a parameter with another (tied embeddings: the embedding and the output
    layer), which the root then holds: FSDP2 refuses one parameter in two units, and the root's gather spans
    both uses."""
    owners: dict[int, int] = {}
    shared: set[int] = set()
    for i, group in enumerate(units):
        for p in {id(p) for m in group for p in m.parameters()}:
            if p in owners:
                shared |= {owners[p], i}
            owners[p] = i
    return [list(group) for i, group in enumerate(units) if i not in shared]


def apply_fsdp(
    root: nn.Module,
    units: Sequence[Sequence[nn.Module]],
    dp_mesh: DeviceMesh,
    *,
    stage: int,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    prefetch: bool = True,
    cast_root_inputs: bool = True,
) -> FSDPUnits:
    """Shard ``root`` (already tensor-parallel, if at all) over ``dp_mesh`` as ZeRO ``stage`` 2 or 3.

    Each entry of ``units`` (modules of ``root``'s tree, in forward order) becomes one FSDP unit, gathered and
    reduce-scattered together; ``root`` then holds every parameter no unit does (and the units that share a
    parameter with another: tied weights). The root must be the module
    whose forward runs around the units' (a pipeline stage for the schedule; the LightningModule, whose
    training_step the strategy runs inside its forward).

    Args:
        param_dtype: compute dtype of the gathered parameters (bf16 for mixed precision); the sharded
            master parameters keep their own dtype (fp32).
        reduce_dtype: dtype of the gradient reduce-scatter (fp32: gradients are summed in full precision).
        prefetch: gather unit i+1 while unit i computes (forward and backward).
        cast_root_inputs: let the root cast its floating-point inputs to ``param_dtype`` (FSDP2's default);
            False for a root whose inputs are the user's batch (targets must keep their precision).
    """
    if stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, not {stage}")

    def kwargs(cast: bool) -> dict[str, Any]:
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast
        )
        return {"mesh": dp_mesh, "reshard_after_forward": stage == 3, "mp_policy": policy}

    sharded: list[FSDPModule] = []
    for group in _untied(units):
        # a list becomes one unit (one parameter group) whose modules share its state: keep the first
        out = (
            fully_shard(group, **kwargs(True)) if len(group) > 1 else [fully_shard(group[0], **kwargs(True))]
        )
        sharded.append(out[0])
    top = fully_shard(root, **kwargs(cast_root_inputs))
    for param_group in {id(g): g for g in fsdp_param_groups(root)}.values():  # a unit's modules share one
        _reduce_in_one_dtype(param_group)
    if not sharded:
        sharded = [top]
    if prefetch and len(sharded) > 1:
        for i, unit in enumerate(sharded):
            unit.set_modules_to_forward_prefetch(sharded[i + 1 : i + 2])
            unit.set_modules_to_backward_prefetch(sharded[i - 1 : i] if i > 0 else [])
    elif len(sharded) > 1:
        for unit in sharded:
            unit.set_modules_to_backward_prefetch([])
    return FSDPUnits(top, sharded)
