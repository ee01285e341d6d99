"""parallelize: the one order in which megascale composes its parallelisms on a model.

    runtime = parallelize(module, plan, mesh, device=device)

``module`` is whatever holds the model: a LightningModule, or any ``nn.Module``, built on the meta device or
not. ``mesh`` is the ("dp", "pp", "cp", "tp") DeviceMesh of ``ParallelDims.build_mesh``. The order:

1. tensor (+ sequence) parallelism on "tp" — first, because it decides what each parameter is: every
   megascale GPT by ``apply_tensor_parallel``, every module declaring a ``tensor_parallel_plan`` by
   ``apply_tensor_parallel_plan``; parameters the module split itself (DTensors on "tp") are kept;
1b. context parallelism on "cp": every megascale GPT's attention cores exchange keys/values and its loss
   becomes the whole sequence's mean (``cp.apply_context_parallel``); another model with cp > 1 is refused;
1c. expert parallelism on "dp" seen as ("edp", "ep"): every megascale GPT's MoE layers keep 1/ep of their
   experts and move tokens by all-to-all (``ep.apply_expert_parallel``); the experts' gradients are averaged
   over "edp" beside the dense parameters' ZeRO (``ep.ExpertReplicas``, ZeRO-0 only so far);
1d. fp8: every megascale GPT with ``GPTConfig.fp8`` gets torchao's float8 GEMMs in its blocks' projections,
   the split ones included (``megascale.core.fp8``), before ZeRO shards their unchanged parameters;
2. pipeline split on "pp": the one model offering ``pipeline_layers()``/``pipeline_loss()`` keeps this
   rank's stages — still on the meta device, so no rank materialises the whole model;
3. materialisation of meta tensors (``materialize``: each module's own init, the same values in any layout;
   a GPT whose ``pretrained`` names a Hugging Face checkpoint reads its slices of it here, before ZeRO, so
   ZeRO-2/3 shard the loaded values);
4. activation checkpointing — wraps the already-split blocks, so recomputation replays their collectives;
4b. ``torch.compile`` of each block in place (``plan.compile``, ``parallel/compile.py``), names unchanged;
5. data-parallel replicas made equal (rank 0's values), then ZeRO on "dp" (on "dp" × "cp" flattened when
   cp > 1: context-parallel ranks hold the same parameters and average their gradients) over *every* parameter of
   ``module`` (``zero.apply_zero``): units per block where the model lists its blocks, the rest under
   ``module`` itself, whose forward must run around the training step (MegaScaleStrategy runs training_step
   inside it, as Lightning does for DDP and FSDP wrappers);
6. the pipeline schedule over the finished stage modules, attached to the model.

Whatever a layout cannot do for a module is an error naming it, raised before the first collective:
a module sharded or wrapped elsewhere (DDP, FSDP1, DTensors on another mesh), pipelining a model that does
not list its layers, parameters outside the pipelined model. A module that applied ``fully_shard`` itself on
the data-parallel mesh keeps its sharding, and no ZeRO is added (with a warning saying so).

The returned ``ParallelRuntime`` holds what the training loop needs afterwards: the ZeRO hooks, the pipeline,
the group over which gradient norms are summed, and the checkpoint layout.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megascale.core._dtensor import is_dtensor, local
from megascale.core.model.gpt import GPT
from megascale.core.model.layers import pipeline_layers_of
from megascale.core.parallel.activation_checkpoint import apply_activation_checkpointing
from megascale.core.parallel.grad_clip import SumGroup
from megascale.core.parallel.materialize import has_meta_tensors, materialize
from megascale.core.parallel.mesh import MESH_DIMS, ParallelDims
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.parallel.rng import ModelParallelRNG
from megascale.core.parallel.wait_timer import WaitTimed, WaitTimer
from megascale.core.parallel.zero import UnitTree, ZeroRuntime, apply_zero, apply_zero_to_params

if TYPE_CHECKING:
    from megascale.core.parallel.pp.apply import Pipeline, StageModule  # torch pipelining: imported when used
    from megascale.core.parallel.pp.tied import TiedCopies
    from megascale.core.parallel.tp.region_check import RegionCheck

__all__ = ["CheckpointLayout", "ParallelRuntime", "parallelize"]


@dataclass(frozen=True)
class CheckpointLayout:
    """Which ranks hold what, for a checkpointer that reads once and broadcasts (megascale-ft).

    partial: ranks hold different entries (pipeline stages; ZeRO-1 optimizer states by owner under
        zero1_sharding="parameters"), so each loads only those it has. replicas: the ranks holding exactly this
        rank's model and optimizer state at checkpoint time (ZeRO-0 and ZeRO-1 "elements", whose pieces are
        gathered whole for a checkpoint: one of them may read and broadcast to the others), or None.
    """

    partial: bool
    replicas: dist.ProcessGroup | None


@dataclass
class ParallelRuntime:
    """What ``parallelize`` set up, for the training loop: ZeRO hooks, the pipeline (pp > 1), and more."""

    plan: ParallelPlan
    dims: ParallelDims
    mesh: DeviceMesh
    zero: ZeroRuntime
    pipeline: Pipeline | None = None
    #: the dropout streams of tp / pp layouts (``megascale.core.parallel.rng``); None with tp = pp = 1
    rng: ModelParallelRNG | None = None
    notes: list[str] = field(default_factory=list)
    #: this rank's tensor-parallel layers (``tensor_parallel.tp_layers``): where the TP collectives wait
    tp_layers: list[WaitTimed] = field(default_factory=list)
    #: the first forward's check of a tensor_parallel_plan (``tp_region_check``), deferred under pp
    region_check: RegionCheck | None = None
    #: with ep > 1: the mesh with "dp" seen as ("edp", "ep") (``ep.expert_mesh``): experts are split over "ep"
    #: and replicated over "edp"
    expert_mesh: DeviceMesh | None = None
    #: with ep > 1: this rank's MoE layers' all-to-all dispatchers (their waits are timed)
    ep_dispatchers: list[WaitTimed] = field(default_factory=list)
    #: weights tied across the first and last pipeline stage (``parallelize(sum_tied_gradients=True)``)
    tied: TiedCopies | None = None

    def sum_tied_gradients(self) -> None:
        """Every rank, after each backward and its ``zero.after_backward()``: the gradients of weights tied
        across the first and last pipeline stage summed over the two (what the backwards since the last sum
        added; nothing inside ``no_sync``, nothing without such weights)."""
        if self.tied is not None and (self.pipeline is None or self.pipeline.sync_gradients):
            self.tied.sum_gradients()

    def check_first_step(self) -> None:
        """Every rank, after the first step's backward and before its optimizer step: raise, on every rank,
        what the first forward's tensor-parallel check found on any pipeline stage (deferred under pp so that
        no stage is left waiting for another's activations). A training loop of your own calls it there;
        MegaScaleStrategy does."""
        if self.region_check is not None:
            self.region_check.verdict()
        if self.pipeline is not None and self.pipeline.foreign is not None:
            self.pipeline.foreign.verdict()  # a stage used a parameter another holds (``pp/foreign.py``)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline stage that read different batches ("dp": tp and cp ranks of a
        replica read the same sequences): what per-batch statistics are summed over, e.g. a mixture of
        experts' tokens per expert (``megascale.core.model.moe.update_expert_biases``; its layers count whole
        sequences on every tp and cp rank alike). None with a single replica."""
        return self.mesh["dp"].get_group() if self.dims.dp > 1 else None

    @property
    def grad_norm_group(self) -> SumGroup:
        """The groups over which ranks hold different gradients (pipeline stages; ZeRO-1's scattered pieces):
        a global gradient norm adds its shares over each (``clip_grad_norm_``'s ``sum_group``). None if no
        rank holds a different share."""
        groups = [self.mesh["pp"].get_group()] if self.dims.pp > 1 else []
        scattered = self.zero.grad_sum_group()
        if scattered is not None:
            groups.append(scattered)
        return None if not groups else groups[0] if len(groups) == 1 else tuple(groups)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches of a gradient accumulation but the last: nothing is reduced over dp inside (ZeRO-0/1
        accumulate locally, ZeRO-2/3 unsharded; pipeline steps included); the step's last backward, outside,
        reduces the sums once."""
        if self.pipeline is not None:
            self.pipeline.sync_gradients = False
        try:
            with self.zero.no_sync():
                yield
        finally:
            if self.pipeline is not None:
                self.pipeline.sync_gradients = True

    def set_wait_timer(self, timer: WaitTimer) -> None:
        """Time the waits for other ranks (``wait_timer.py``): ZeRO-0/1's gradient reduction left after
        backward, ZeRO-1's parameter gathers, the decoupled pipeline schedules' receives and sends, the
        collectives of megascale's tensor-parallel layers; and, when ``timer`` is a ``Timers``, the decoupled
        schedules' per-microbatch forwards and backwards. (Layers split by a ``tensor_parallel_plan``,
        torch's GPipe schedule and FSDP2's waits are not timed yet.)"""
        self.zero.set_wait_timer(timer)
        if self.pipeline is not None:
            self.pipeline.set_wait_timer(timer)
        for layer in self.tp_layers:  # each hands it to its autograd functions, for backward's waits
            layer.wait_timer = timer
        for dispatcher in self.ep_dispatchers:  # the all-to-alls' arrivals
            dispatcher.wait_timer = timer

    def checkpoint_layout(self) -> CheckpointLayout:
        partial = self.dims.pp > 1 or self.zero.checkpoint_partial
        return CheckpointLayout(partial=partial, replicas=self.zero.replica_group())


def parallelize(
    module: nn.Module,
    plan: ParallelPlan,
    mesh: DeviceMesh,
    *,
    device: torch.device | str,
    param_dtype: torch.dtype | None = None,
    sum_tied_gradients: bool = False,
) -> ParallelRuntime:
    """Apply ``plan`` to ``module`` in place, in the order of the module docstring; every rank calls it.

    Args:
        module: the model, or the LightningModule holding it (its forward must run around every use of
            parameters outside the listed blocks under ZeRO; see the module docstring).
        plan: the layout; its sizes must match ``mesh``.
        mesh: the ("dp", "pp", "cp", "tp") mesh (``ParallelDims.build_mesh``).
        device: where materialised and moved tensors go.
        param_dtype: ZeRO-2/3 gather parameters in this dtype (bf16 under mixed precision).
        sum_tied_gradients: weights tied across the first and last pipeline stage (tied embeddings) are
            allowed: the last stage holds a copy, and the training loop calls the runtime's
            ``sum_tied_gradients()`` once per optimizer step, after backward and ``zero.after_backward()``
            (``pp/tied.py``). Refused otherwise.
    """
    cp = mesh["cp"].size() if "cp" in (mesh.mesh_dim_names or ()) else 1
    dims = ParallelDims(dp=mesh["dp"].size(), pp=mesh["pp"].size(), tp=mesh["tp"].size(), cp=cp)
    if (dims.tp, dims.pp, dims.cp) != (plan.tp, plan.pp, plan.cp):
        raise ValueError(
            f"the mesh is dp×pp×cp×tp = {dims.dp}×{dims.pp}×{dims.cp}×{dims.tp}, the plan tp={plan.tp}, "
            f"pp={plan.pp}, cp={plan.cp}"
        )
    plan.check_model(module, sum_tied_gradients=sum_tied_gradients)
    if plan.compile:
        from megascale.core.parallel.compile import compile_targets

        compile_targets(module)  # refused before anything is split
    user_fsdp = _check_foreign_sharding(module, mesh, dims)
    if user_fsdp and dims.cp > 1:
        raise ValueError(
            f"the model applied fully_shard itself on the data-parallel mesh, and cp={dims.cp}: context-parallel "
            "ranks hold the same parameters and must average their gradients too, which that fully_shard does "
            "not do; leave ZeRO to the strategy (zero_stage=2 or 3 shards over dp × cp), or use cp=1"
        )
    if user_fsdp and plan.ep > 1:
        raise ValueError(
            f"the model applied fully_shard itself on the data-parallel mesh, and ep={plan.ep}: expert "
            "parallelism splits the experts over the ep ranks of that mesh (ranks holding different experts), "
            "which a sharding over all of it cannot hold; leave ZeRO to the strategy (zero_stage 0-3 shard the "
            "experts over the ranks holding the same ones), or use ep=1"
        )
    notes: list[str] = []
    region_check: RegionCheck | None = None
    gpts = [m for m in module.modules() if isinstance(m, GPT)]

    _check_own_moe_layers(module, gpts, dims)
    if dims.tp > 1:  # 1.
        tp_notes, region_check = _apply_tensor_parallel(module, gpts, plan, mesh["tp"])
        notes += tp_notes
    if dims.cp > 1:  # 1b.
        _apply_context_parallel(module, gpts, mesh["cp"])
    experts: list[nn.Parameter] = []
    emesh: DeviceMesh | None = None
    dispatchers: list[WaitTimed] = []
    if plan.ep > 1:  # 1c.
        experts, emesh, dispatchers = _apply_expert_parallel(module, gpts, mesh, plan)
    if any(gpt.config.fp8 is not None for gpt in gpts):  # 1d.
        notes += _apply_fp8(gpts, plan, device)
    edp_mesh = emesh["edp"] if emesh is not None else None
    replicas = _replica_mesh(mesh, dims)
    stages: list[StageModule] = []
    pipelined: nn.Module | None = None
    if dims.pp > 1:  # 2.
        from megascale.core.parallel.pp.apply import apply_pipeline

        pipelined, name = _the_pipelined_model(module, user_fsdp)
        stages = apply_pipeline(pipelined, mesh["pp"], plan, name=name, sum_tied_gradients=sum_tied_gradients)
    if has_meta_tensors(module):  # 3.
        notes += _materialize(module, gpts, device)
    module.to(device)
    tied = None
    if stages and stages[0].tied:  # the first stage takes the last stage's values, before any sharding
        from megascale.core.parallel.pp.tied import TiedCopies

        assert pipelined is not None
        tied = TiedCopies(pipelined, stages[0].tied, mesh["pp"].get_group())
        tied.sync_values()
    if dims.tp > 1:  # on the materialised parameters, before ZeRO's hooks (see make_replicated_grads_whole)
        from megascale.core.parallel.tp.user_model import make_replicated_grads_whole

        make_replicated_grads_whole(module)
    rng = _model_parallel_rng(module, gpts, plan, mesh, device)
    blocks = [b for stage in stages for b in stage.segments[1]] if stages else None
    if plan.activation_checkpointing != "none":  # 4.
        apply_activation_checkpointing(
            module, plan.activation_checkpointing, plan.checkpoint_modules, blocks, rng=rng
        )
    if plan.compile:  # 4b.
        from megascale.core.parallel.compile import compile_blocks

        compile_blocks(module, blocks)
    _broadcast_replicas(module, replicas)  # 5.
    if edp_mesh is not None:
        from megascale.core.parallel.ep.apply import broadcast_expert_replicas

        broadcast_expert_replicas(experts, edp_mesh)
    if user_fsdp:
        zero = ZeroRuntime()
        notes.append(
            f"ZeRO: the model applied fully_shard itself on the data-parallel mesh, so it keeps that sharding and "
            f"no ZeRO of the strategy's own is added (zero_stage={plan.zero_stage} does not apply)"
        )
    else:
        trees = (
            [UnitTree(stage, stage.segments) for stage in stages]
            if stages
            else [UnitTree(module, _unit_segments(module, plan.zero_stage >= 2), cast_inputs=False)]
        )
        if edp_mesh is not None and plan.zero_stage >= 2:  # the experts' own units first (over "edp")
            from megascale.core.parallel.ep.apply import shard_experts

            shard_experts(module, edp_mesh, stage=plan.zero_stage, param_dtype=param_dtype)
        assert plan.zero1_sharding is not None  # ParallelPlan resolves None to the layout's choice
        zero = apply_zero(
            trees, replicas, stage=plan.zero_stage, bucket_size_mb=plan.bucket_size_mb,
            overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
            param_dtype=param_dtype, accumulations=plan.microbatches if stages else 1, zero1_root=module,
            zero1_sharding=plan.zero1_sharding, exclude=experts if plan.zero_stage < 2 else (),
        )  # fmt: skip
        if edp_mesh is not None:
            zero = _expert_replicas(zero, experts, edp_mesh, plan, trees, module)
    if tied is not None:  # ZeRO-2/3 replaced the parameters by their shards; stage 1 may leave pieces
        tied.follow_zero(zero)
    tp_layers: list[WaitTimed] = []
    if dims.tp > 1:  # found after the pipeline split: only this rank's stages
        from megascale.core.parallel.tp.apply import tp_layers as find_tp_layers

        tp_layers = find_tp_layers(module)
    pipeline = None
    if stages:  # 6.
        from megascale.core.parallel.pp.apply import build_pipeline

        assert pipelined is not None
        pipeline = build_pipeline(pipelined, stages, mesh["pp"], plan, device=device)
        pipeline.rng = rng
        pipeline.tied = tied
        pipeline.foreign = stages[0].foreign
    if notes and dist.get_rank() == 0:
        for note in notes:
            warnings.warn(note, stacklevel=2)
    return ParallelRuntime(
        plan=plan, dims=dims, mesh=mesh, zero=zero, pipeline=pipeline, rng=rng, notes=notes,
        tp_layers=tp_layers, region_check=region_check, expert_mesh=emesh, ep_dispatchers=dispatchers,
        tied=tied,
    )  # fmt: skip


def _model_parallel_rng(
    module: nn.Module, gpts: list[GPT], plan: ParallelPlan, mesh: DeviceMesh, device: torch.device | str
) -> ModelParallelRNG | None:
    """The dropout streams (``rng.py``), seeded from the run's seed after materialisation (which draws from
    per-layer seeds of its own); a GPT's split regions draw from the tensor-parallel stream: its attention
    cores (local heads) and, under sequence parallelism, every dropout (sequence shards)."""
    dims = (mesh["tp"].size(), mesh["pp"].size())
    if dims == (1, 1):
        return None
    rng = ModelParallelRNG(
        torch.initial_seed(), tp_rank=mesh["tp"].get_local_rank(), pp_rank=mesh["pp"].get_local_rank(),
        pp=dims[1], device=device,
    )  # fmt: skip
    if dims[0] > 1:
        from megascale.core.model.attention import SelfAttention

        for gpt in gpts:
            if gpt.config.dropout == 0:
                continue
            for m in gpt.modules():
                if isinstance(m, SelfAttention) or (plan.sequence_parallel and isinstance(m, nn.Dropout)):
                    rng.fork_around(m)
    for m in module.modules():  # modules a tensor_parallel_plan placed in a split region
        if getattr(m, "_megascale_split_region", False):
            rng.fork_around(m)
    return rng


# ---- 0. what is there ------------------------------------------------------------------------------------


def _submeshes(mesh: DeviceMesh) -> set[str]:
    """Rank layouts of every sub-mesh of ``mesh``, to recognise a DTensor's mesh."""
    out = set()
    names = mesh.mesh_dim_names or MESH_DIMS
    for n in range(1, len(names) + 1):
        for dims in itertools.combinations(names, n):
            out.add(repr(mesh[dims].mesh.tolist()))
    return out


def _check_foreign_sharding(module: nn.Module, mesh: DeviceMesh, dims: ParallelDims) -> bool:
    """Refuse wrappers and shardings that do not compose; True when the module applied FSDP2 itself."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    for name, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):
            raise ValueError(
                f"{name or type(module).__name__} is wrapped in DistributedDataParallel: the strategy does the data "
                "parallelism (ZeRO); build the module unwrapped"
            )
        if type(m).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                f"{name or type(module).__name__} is wrapped in FSDP1 (FullyShardedDataParallel): use "
                "torch.distributed.fsdp.fully_shard on self.device_mesh['dp'], or leave ZeRO to the strategy"
            )
    ours = _submeshes(mesh)
    dp_peers = set(mesh["dp"].mesh.flatten().tolist()) - {dist.get_rank()}
    fsdp_params: set[int] = set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            fsdp_params.update(id(p) for p in m.parameters())
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        layout = p.device_mesh.mesh  # type: ignore[attr-defined]
        if repr(layout.tolist()) not in ours:
            raise ValueError(
                f"parameter {name} is a DTensor on a mesh of ranks {layout.tolist()} that is not the strategy's "
                f"(dp×pp×tp = {dims.dp}×{dims.pp}×{dims.tp}): split your model on self.device_mesh['tp'] "
                "(tensor parallel) or ['dp'] (fully_shard), not on a mesh of your own"
            )
        if id(p) in fsdp_params and dims.dp > 1 and not dp_peers & set(layout.flatten().tolist()):
            raise ValueError(
                f"parameter {name} is sharded by fully_shard on a mesh without the data-parallel ranks "
                f"({layout.tolist()}): fully_shard on self.device_mesh['dp'] (or ['data_parallel'])"
            )
    if not fsdp_params:
        return False
    if dims.pp > 1:
        raise ValueError(
            "the model applied fully_shard itself, and pp > 1: pipeline stages are sharded by the strategy "
            "(zero_stage=2); leave fully_shard out of configure_model, or use pp=1"
        )
    loose = [n for n, p in module.named_parameters() if id(p) not in fsdp_params]
    if loose and dims.dp > 1:
        raise ValueError(
            f"the model applied fully_shard itself but left parameters {loose} outside it, which would then be "
            "neither sharded nor averaged over the data-parallel ranks: fully_shard their modules too (or the "
            "module holding them), or leave all of ZeRO to the strategy"
        )
    return True


# ---- 1. tensor parallelism -------------------------------------------------------------------------------


def _apply_tensor_parallel(
    module: nn.Module, gpts: list[GPT], plan: ParallelPlan, tp_mesh: DeviceMesh
) -> tuple[list[str], RegionCheck | None]:
    from megascale.core.parallel.tp.apply import apply_tensor_parallel
    from megascale.core.parallel.tp.user_model import tied_parameter_sites

    chunks = plan.tp_comm_chunks if plan.overlap_tp_comm else 1
    already = {id(p) for p in module.parameters() if is_dtensor(p)}
    ties = tied_parameter_sites(module)
    region_check = None
    for gpt in gpts:
        apply_tensor_parallel(gpt, tp_mesh, sequence_parallel=plan.sequence_parallel, overlap=plan.overlap_tp_comm,
                              overlap_chunks=plan.tp_comm_chunks)  # fmt: skip
    if any(getattr(m, "tensor_parallel_plan", None) is not None for m in module.modules()):
        from megascale.core.parallel.tp.region_check import install_region_check
        from megascale.core.parallel.tp.user_model import (
            apply_tensor_parallel_plan,
            check_tensor_parallel_plan,
            check_tied_parameters,
            find_tensor_parallel_plans,
        )

        plans = find_tensor_parallel_plans(module)
        styles: dict[str, object] = {}  # every plan's styles by name under module: ties across plans
        for name, m, tp_plan in plans:
            matched = check_tensor_parallel_plan(m, tp_plan, plan.tp, sequence_parallel=plan.sequence_parallel,
                                                 name=name)  # fmt: skip
            styles.update({f"{name}.{n}" if name else n: style for n, (_, style) in matched.items()})
        check_tied_parameters(module, styles, where=type(module).__name__)
        for name, m, tp_plan in plans:
            apply_tensor_parallel_plan(
                m,
                tp_plan,
                tp_mesh,
                sequence_parallel=plan.sequence_parallel,
                overlap_chunks=chunks,
                name=name,
                check_regions=False,
            )
        # one watch over the whole module: parameters outside the plans (a head of the LightningModule's own)
        # used on the plans' sequence shards are found too
        region_check = install_region_check(module, [(n, m) for n, m, _ in plans], tp=plan.tp,
                                            sequence_parallel=plan.sequence_parallel, defer=plan.pp > 1)  # fmt: skip
    _check_ties_kept(module, ties)
    if not any(is_dtensor(p) for p in module.parameters()):
        raise ValueError(
            f"tp={plan.tp} found nothing to split: the model has no megascale GPT, no module declaring a "
            "tensor_parallel_plan, and configure_model() split nothing over self.device_mesh['tp']. Give your model "
            "a tensor_parallel_plan (module-name patterns -> 'colwise'/'rowwise'/...), or use tp=1"
        )
    if not already:
        return [], region_check
    names = sorted({n.rpartition(".")[0] for n, p in module.named_parameters() if id(p) in already})
    return [
        f"tensor parallelism of {names} was applied by the model itself (DTensor): sequence_parallel, "
        "overlap_tp_comm and tp_comm_chunks do not apply to those layers; declare a tensor_parallel_plan "
        "instead to get them"
    ], region_check


def _parameter_at(root: nn.Module, name: str, attr: str) -> nn.Parameter | None:
    try:
        return root.get_submodule(name)._parameters.get(attr) if name else root._parameters.get(attr)
    except AttributeError:  # the module was replaced by one of another shape
        return None


def _check_ties_kept(module: nn.Module, ties: dict[int, list[tuple[str, nn.Module, str]]]) -> None:
    """Every weight tied before tensor parallelism is still one parameter (the plans' checks refuse what
    would untie one; this catches any other way, e.g. a model splitting a tied layer itself)."""
    for sites in ties.values():
        # by name in the tree as it is now: tensor parallelism may replace modules (a GPT's layers)
        held = {id(p) for p in (_parameter_at(module, n, attr) for n, _, attr in sites) if p is not None}
        if len(held) > 1:
            names = [f"{n}.{attr}" if n else attr for n, _, attr in sites]
            raise ValueError(
                f"tensor parallelism untied {names}: they were one parameter before the split and are now "
                "separate copies, whose values would drift apart from the second step. Split every use of a tied "
                "weight the same way (an embedding 'rowwise' with its LM head 'colwise'/'colwise_rep'), or untie "
                "them"
            )


# ---- 1b. context parallelism -----------------------------------------------------------------------------


def _apply_context_parallel(module: nn.Module, gpts: list[GPT], cp_mesh: DeviceMesh) -> None:
    from megascale.core.parallel.cp import apply_context_parallel
    from megascale.core.parallel.cp.user_model import apply_context_parallel_plan, context_parallel_plans

    plans = [(n, m, p) for n, m, p in context_parallel_plans(module) if not isinstance(m, GPT)]
    if not gpts and not plans:
        raise ValueError(
            f"cp={cp_mesh.size()}: context parallelism splits the sequence inside attention, and "
            f"{type(module).__name__} holds no megascale GPT and declares no context_parallel_plan (which modules "
            "take the tokens, attend and compute the loss: docs/guides/core.md, 'Context parallelism'); use cp=1"
        )
    for gpt in gpts:
        apply_context_parallel(gpt, cp_mesh)
    for _, m, plan in plans:
        apply_context_parallel_plan(m, plan, cp_mesh)


# ---- 1c. expert parallelism ------------------------------------------------------------------------------


def _check_own_moe_layers(module: nn.Module, gpts: list[GPT], dims: ParallelDims) -> None:
    """A model of one's own using megascale's MoE layers: what its layouts cannot do yet, by name."""
    from megascale.core.model.moe import MoE

    inside = {id(m) for gpt in gpts for m in gpt.modules()}
    own = [n for n, m in module.named_modules() if isinstance(m, MoE) and id(m) not in inside]
    if own and (dims.tp > 1 or dims.cp > 1):
        raise ValueError(
            f"MoE layers {own} of a model of your own with tp={dims.tp}, cp={dims.cp}: routing whole sequences "
            "on every tp/cp rank is wired for megascale GPTs only so far; use tp=1 and cp=1 (ep, pp, dp and "
            "ZeRO work), or a megascale GPT with GPTConfig.moe"
        )


def _apply_expert_parallel(
    module: nn.Module, gpts: list[GPT], mesh: DeviceMesh, plan: ParallelPlan
) -> tuple[list[nn.Parameter], DeviceMesh, list[WaitTimed]]:
    from megascale.core.parallel.ep.apply import apply_expert_parallel, expert_mesh, expert_params

    emesh = expert_mesh(mesh, plan.ep)
    dispatchers: list[WaitTimed] = list(apply_expert_parallel(module, emesh["ep"], plan.ep_comm_chunks))
    return expert_params(module), emesh, dispatchers


def _expert_replicas(
    dense: ZeroRuntime, experts: list[nn.Parameter], edp_mesh: DeviceMesh, plan: ParallelPlan,
    trees: list[UnitTree], root: nn.Module,
) -> ZeroRuntime:  # fmt: skip
    from megascale.core.parallel.ep.apply import ExpertReplicas

    if plan.zero_stage >= 2:  # the experts are FSDP2 units of their own (shard_experts)
        return ExpertReplicas(dense, None, None)
    if edp_mesh.size() == 1:  # nobody else holds these experts; at ZeRO-1 nobody creates their state either
        return ExpertReplicas(dense, None, None, alone=experts if plan.zero_stage == 1 else ())
    held = apply_zero_to_params(
        experts, edp_mesh, stage=plan.zero_stage, root=root,
        units=[m for t in trees for m in (t.root, *t.layers())], bucket_size_mb=plan.bucket_size_mb,
        overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
        accumulations=plan.microbatches if plan.pp > 1 else 1,
    )  # fmt: skip
    return ExpertReplicas(dense, held, edp_mesh.get_group())


# ---- 1d. fp8 ---------------------------------------------------------------------------------------------


def _apply_fp8(gpts: list[GPT], plan: ParallelPlan, device: torch.device | str) -> list[str]:
    from megascale.core.fp8 import convert_to_float8  # torchao: imported only when a config asks for fp8

    notes = []
    for gpt in gpts:
        if gpt.config.fp8 is None:
            continue
        if not convert_to_float8(gpt, device=device):
            notes.append(
                f"fp8={gpt.config.fp8!r}: no projection of the blocks has both dimensions multiples of 16 "
                f"(per tensor-parallel shard, tp={plan.tp}), so none runs in fp8"
            )
        elif plan.tp > 1 and plan.overlap_tp_comm:
            notes.append(
                "fp8: the tensor-parallel collectives of the fp8 projections run in one piece, not overlapped "
                "with their GEMMs (overlap_tp_comm applies to the other layers only so far)"
            )
    return notes


def _replica_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The ranks holding the same parameters, over which gradients are averaged and ZeRO shards: "dp", or
    "dp" and "cp" flattened into one dimension (named "dp_cp") under context parallelism."""
    if dims.cp == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


# ---- 2. pipeline -----------------------------------------------------------------------------------------


def _the_pipelined_model(module: nn.Module, user_fsdp: bool) -> tuple[nn.Module, str]:
    from megascale.core.parallel.pp.apply import pipelined_modules

    found = pipelined_modules(module)
    names = {id(m): n for n, m in module.named_modules()}
    if len(found) != 1:
        listed = [f"{names[id(m)] or '<root>'} ({type(m).__name__})" for m in found]
        raise ValueError(
            f"pipeline parallelism needs exactly one model offering pipeline_layers() and pipeline_loss() in "
            f"{type(module).__name__}, found {len(found)}{': ' + ', '.join(listed) if listed else ''}. A megascale "
            "GPT has both; give your model these two methods (docs/guides/lightning.md, 'Your own model'), or "
            "use pp=1"
        )
    model = found[0]
    inside = {id(p) for p in model.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(
            f"pipeline parallelism: parameters {outside} are outside the pipelined model "
            f"{names[id(model)] or '<root>'}, so no pipeline stage would run them in step with its layers: "
            "make them part of one of its layers (e.g. a value head inside the last layers), or use pp=1"
        )
    return model, names[id(model)] or type(model).__name__


# ---- 3. materialisation ----------------------------------------------------------------------------------


def _materialize(module: nn.Module, gpts: list[GPT], device: torch.device | str) -> list[str]:
    for gpt in gpts:  # every rank must materialise the same values: take rank 0's seeds
        gpt.init_seed = _broadcast_int(gpt.init_seed)
    seed = _broadcast_int(torch.initial_seed())
    reset = materialize(module, device, seed=seed)
    if not reset:
        return []
    return [
        f"meta_init: {reset} were initialised by their reset_parameters() (PyTorch's defaults, each drawn from "
        "the run's seed and its name, the same in every layout); init code in __init__ or configure_model does "
        "not run on meta tensors: give the model an init_weights() to initialise it your way"
    ]


def _broadcast_int(value: int) -> int:
    box = [int(value)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


# ---- 5. data parallelism ---------------------------------------------------------------------------------


@torch.no_grad()
def _broadcast_replicas(module: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Every data-parallel replica starts from its dp group's first rank's values, as DDP does (a run that
    forgot to seed every rank alike would otherwise train diverging replicas). Tensors split over dp (a
    model's own fully_shard) are shards, not replicas: left alone."""
    if dp_mesh.size() == 1:
        return
    group = dp_mesh.get_group()
    peers = set(dp_mesh.mesh.flatten().tolist()) - {dist.get_rank()}
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        if is_dtensor(tensor) and peers & set(tensor.device_mesh.mesh.flatten().tolist()):  # type: ignore[attr-defined]
            continue
        dist.broadcast(local(tensor), src=src, group=group)


def _unit_segments(module: nn.Module, module_lists: bool) -> list[list[nn.Module]]:
    """Layers that become ZeRO units, in forward order, as segments (see ``UnitTree``): the first, blocks and
    last layers of every model listing them (a GPT, a user model with ``pipeline_layers()``); with
    ``module_lists`` (ZeRO-2/3) also the entries of any other plain ``nn.ModuleList``/``nn.ModuleDict`` holding
    parameters, the usual home of transformer blocks. Only those exact containers: subclasses (megascale's
    grouped linears among them) may read their entries' parameters without calling them, which a unit must
    not be (its parameters would stay sharded); a user module doing that is refused loudly by FSDP2's
    DTensor parameters, or must list its layers."""
    segments: list[list[nn.Module]] = []
    claimed: set[int] = set()
    for m in module.modules():
        if id(m) in claimed:
            continue
        layers = pipeline_layers_of(m)
        if layers is not None:
            segments += [[layer] for layer in layers.first]
            segments.append(layers.blocks)
            segments += [[layer] for layer in layers.last]
        elif module_lists and type(m) in (nn.ModuleList, nn.ModuleDict) and m is not module:
            entries = [c for c in m.children() if any(True for _ in c.parameters())]
            if not entries:
                continue
            segments.append(entries)
        else:
            continue
        claimed.update(id(sub) for sub in m.modules())
    return [s for s in segments if s]
