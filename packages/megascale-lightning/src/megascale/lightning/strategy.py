"""MegaScaleStrategy: tensor × pipeline × ZeRO data parallelism inside Lightning's Trainer.

A thin adapter: the layout is a ``megascale.core.parallel.ParallelPlan`` (checked where the arguments are
given), and ``megascale.core.parallel.parallelize`` composes it on the LightningModule (the order, what a
module must offer, what is refused: see ``megascale/core/parallel/compose.py``). This file forwards Lightning's
hooks to the runtime that returns:

- ``setup_environment`` checks the sizes against the world, starts the process group and builds the
  ("dp", "pp", "cp", "tp") DeviceMesh, which the LightningModule sees as ``self.device_mesh`` (also under
  ModelParallelStrategy's names "data_parallel" and "tensor_parallel");
- ``setup`` parallelises the module built by ``configure_model`` (on the meta device unless
  ``meta_init=False``);
- every step runs inside the LightningModule's own forward (Lightning's forward redirection, as for DDP and
  FSDP wrappers), so ZeRO's hooks on it cover every parameter, GPT or not; gradient accumulation, backward,
  clipping and the optimizer step call the ZeRO hooks in order (``megascale.core.parallel.zero``);
- with pp > 1 a training_step is a whole pipeline step, backward included (``pipeline_loop.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from megascale.core import GPTConfig
from megascale.core.parallel.compose import CheckpointLayout, ParallelRuntime, parallelize
from megascale.core.parallel.cp import ContextParallel
from megascale.core.parallel.grad_clip import SumGroup
from megascale.core.parallel.mesh import MESH_DIMS, ParallelDims
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.parallel.replica_check import ReplicaGuard
from megascale.core.parallel.wait_timer import ComputeTimer, Timers, WaitTimer, untimed
from megascale.lightning import checkpoint_io, dtensor_errors, prebuilt_optimizers, preemption
from megascale.lightning.callback_support import check_packed_documents, check_trainer_features
from megascale.lightning.memory_check import layout_memory_warning
from megascale.lightning.module import position_ids_of
from megascale.lightning.pipeline_loop import PipelineLoop
from megascale.lightning.precision import _GlobalNormClipping, to_megascale_precision
from megascale.lightning.raised_together import raised_together
from megascale.lightning.stage_values import check_same_on_every_stage
from megascale.lightning.weight_readers import (
    gradient_readers,
    gradient_readers_after_backward,
    gradient_readers_after_step,
    gradient_readers_before_step,
    manual_gradient_reader,
    weight_readers_between_steps,
)
from megascale.lightning.whole_gradients import Split, gather_whole, split_again

RNG_KEY = "megascale_rng"  # in meta.pt: every rank's dropout streams (tp / pp layouts)

__all__ = ["MegaScaleStrategy"]


class MegaScaleStrategy(ParallelStrategy):
    """Tensor, pipeline, context, expert and ZeRO data parallelism for any LightningModule (``dp`` = world
    size / (tp · pp · cp)).

    A megascale GPT is split as it is; a model of your own joins by what it declares (a
    ``tensor_parallel_plan``, ``pipeline_layers()``/``pipeline_loss()``, ``init_weights()``): see
    docs/guides/lightning.md, "Your own model". What a layout cannot do for a module is an error naming it.

    Args:
        tp: tensor-parallel size (ranks splitting every layer; keep it within a node).
        pp: pipeline-parallel size (ranks each holding a run of layers).
        cp: context-parallel size (ranks each holding two chunks of every sequence: for long sequences;
            megascale GPTs only). The cp ranks of a replica read the same samples and the model keeps its
            chunks; gradients are averaged and ZeRO shards over dp × cp.
        ep: expert-parallel size: a megascale GPT's mixture of experts (``GPTConfig.moe``) keeps 1/ep of its
            experts on each of ``ep`` data-parallel ranks, tokens moved to them by all-to-all; must divide dp.
        ep_comm_chunks: with ep > 1, each MoE layer's rows travel in this many parts, so that one part's
            all-to-all overlaps another's expert computation (1: no overlap).
        num_microbatches: microbatches per step with pp > 1 (default pp); each rank's batch is split into them.
        schedule: pipeline schedule: "1f1b" (megascale's decoupled 1F1B), "interleaved" (needs
            virtual_stages ≥ 2), "gpipe", or "zb1p" (zero bubble: each backward split into input and weight
            gradients, the weights' filling the bubble; ZeRO 0-2, tp, tied embeddings; ep, cp, MoE,
            activation checkpointing and compile refused by name for now).
        virtual_stages: stages per pipeline rank (interleaved and zb1p): the bubble shrinks by this factor.
        pipeline_split: blocks per stage (pp · virtual_stages numbers); default: as even as possible.
        zero_stage: 0 replicate everything (DDP-like); 1 shard optimizer state; 2 also gradients;
            3 also parameters. Stages 2/3 run on FSDP2; stage 3 is refused with pp > 1 (it would gather the
            parameters again for every microbatch). Every parameter of the LightningModule is covered.
        zero1_sharding: ZeRO-1's split of the optimizer state: "elements" (gradients reduce-scattered, each
            rank steps 1/dp of every bucket, new values all-gathered: DDP's bytes; elementwise optimizers such
            as AdamW, and LAMB) or "parameters" (each parameter stepped whole by one rank: 1.5x DDP's bytes,
            any optimizer). None (the default): "parameters" with ep > 1 (which "elements" cannot run), else
            "elements"; the start-up line says which.
        sequence_parallel: with tp > 1, run norms, dropout and residuals on sequence shards.
        overlap_tp_comm: split the TP all-gathers/reduce-scatters into chunks overlapped with the GEMMs.
        tp_comm_chunks: how many chunks.
        overlap_grad_reduce: launch the data-parallel gradient reduction of each bucket during backward
            (False: one reduction after the whole backward).
        overlap_param_gather: ZeRO-1: gather updated parameters during the next forward; ZeRO-2/3: prefetch
            the next unit's parameters while the current one computes (and the first before forward).
        bucket_size_mb: size of the gradient-reduction buckets / FSDP units.
        activation_checkpointing: "none", "full" (recompute each block) or "selective" (attention core).
        checkpoint_modules: what activation checkpointing recomputes instead of the blocks: class names or
            module-name patterns (e.g. ["MyBlock"] or ["model.layers.*"]).
        compile: compile each block the model lists in ``pipeline_layers()`` (a megascale GPT's) with
            ``torch.compile``, in place: parameter names and checkpoints unchanged (torchtitan's per-block
            compile; ``megascale.core.parallel.compile``).
        meta_init: build models on the meta device and materialise them after they are split, so no rank
            ever holds a whole model; each module is then initialised by its ``init_weights()`` or
            ``reset_parameters()`` (a module with neither is refused by name).
        process_group_backend: "nccl", "gloo", ... (default: by device).
        timeout: collective timeout.
        replica_check_steps: at the first this many optimizer steps, compare checksums of the gradients and
            values that data-parallel replicas and tensor-parallel ranks should hold equal, and stop the run
            naming any that differ (``megascale.core.parallel.replica_check``; one small all-gather per check);
            0 turns it off.
        save_distributed_checkpoint: True (the default): each checkpoint is a torch.distributed.checkpoint
            directory, every rank writing its own shards (``checkpoint_io``); any layout resumes it, and
            ``megascale convert`` or ``checkpoint_io.checkpoint_file`` read it as one file. False: one file in
            Lightning's own form, whole tensors gathered onto rank 0 (``one_file_checkpoint``), which
            ``load_from_checkpoint``, ``torch.load`` and DDP read, and any layout resumes: for models that fit
            one process's memory. ``Trainer.fit(ckpt_path=...)`` reads either form whatever this says.
        device_mesh: a ("dp", "pp", "cp", "tp") mesh to train on instead of building one at each fit
            (``ParallelDims.build_mesh``), for several fits in one process: each new mesh creates process
            groups that stay open (sockets, store keys) until the process ends.
    """

    strategy_name = "megascale"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        ep_comm_chunks: int = 2,
        num_microbatches: int | None = None,
        schedule: Literal["1f1b", "interleaved", "gpipe", "zb1p"] = "1f1b",
        virtual_stages: int = 1,
        pipeline_split: list[int] | None = None,
        zero_stage: int = 1,
        zero1_sharding: Literal["elements", "parameters"] | None = None,
        sequence_parallel: bool = True,
        overlap_tp_comm: bool = True,
        tp_comm_chunks: int = 4,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        bucket_size_mb: float = 25.0,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        checkpoint_modules: list[str] | None = None,
        compile: bool = False,
        meta_init: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        replica_check_steps: int = 2,
        save_distributed_checkpoint: bool = True,
        device_mesh: DeviceMesh | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.plan = ParallelPlan(
            tp=tp, pp=pp, cp=cp, ep=ep, ep_comm_chunks=ep_comm_chunks, zero_stage=zero_stage, zero1_sharding=zero1_sharding, num_microbatches=num_microbatches, schedule=schedule,
            virtual_stages=virtual_stages, pipeline_split=tuple(pipeline_split) if pipeline_split else None,
            sequence_parallel=sequence_parallel, overlap_tp_comm=overlap_tp_comm, tp_comm_chunks=tp_comm_chunks,
            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
            bucket_size_mb=bucket_size_mb, activation_checkpointing=activation_checkpointing,
            checkpoint_modules=tuple(checkpoint_modules or ()), compile=compile,
        )  # fmt: skip
        # None: the layout chose ZeRO-1's sharding (the start-up line says so)
        self._zero1_sharding_given = zero1_sharding is not None
        self.meta_init = meta_init
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._replica_guard = ReplicaGuard(replica_check_steps)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._given_mesh = device_mesh
        self._runtime: ParallelRuntime | None = None
        self._pipeline_loop: PipelineLoop | None = None
        self._wait_after_step = False  # ZeRO-1: hooks between steps read weights (see setup)
        # sharded gradients gathered whole for user code that reads them (see _serve_readers): after each step,
        # for on_after_backward, and from manual_backward to the step; split again before the next backward,
        # optimizer step or training_step
        self._whole_after_step = False
        self._whole_after_backward = False
        self._whole_in_manual_step = False
        self._reshard_between_batches = False
        self._after_step_readers: list[str] = []  # gradient readers after each batch (weight_readers.py)
        self._batch_began = self._stepped = self._warned_unstepped = False
        self._gathered: Split = []
        self._names_before_split: prebuilt_optimizers.Names = {}  # for optimizers built before fit
        self._rng_to_restore: dict[str, Any] | None = None  # dropout streams of a resumed checkpoint
        self._wait_timer: WaitTimer | None = None
        self._memory_checked = False  # the planner's memory check runs at the first training batch
        self._context_parallels: list[ContextParallel] | None = None  # the model's, found at the first step
        self._preemption: preemption.PreemptionStop | None = None

    # ---- layout -------------------------------------------------------------------------------------

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def cp(self) -> int:
        return self.plan.cp

    @property
    def ep(self) -> int:
        return self.plan.ep

    @property
    def data_parallel_group(self) -> Any:
        """The ranks of this rank's pipeline stage reading different batches (dp; tp and cp ranks of a replica
        read the same ones), over which per-batch statistics are summed (a mixture of experts' tokens per
        expert); None with one replica."""
        return self._runtime.data_parallel_group if self._runtime is not None else None

    @property
    def zero_stage(self) -> int:
        return self.plan.zero_stage

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("the parallel layout is known once the strategy's environment is set up")
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ("dp", "pp", "cp", "tp") DeviceMesh (also ``LightningModule.device_mesh``)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the strategy's environment is set up")
        return self._mesh

    @property
    def runtime(self) -> ParallelRuntime:
        """What ``parallelize`` set up (ZeRO hooks, pipeline), once the strategy's ``setup`` ran."""
        if self._runtime is None:
            raise RuntimeError("the model is parallelised in the strategy's setup")
        return self._runtime

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Lightning honours self.log(..., sync_dist=True) only for strategies that say they are distributed
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data parallel rank and size: ranks of one TP group (and pipeline, and cp group) read the same
        samples."""
        mesh = self.device_mesh["dp"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def validate_layout(self, world_size: int, module: LightningModule | None = None) -> ParallelDims:
        """Check the plan against the world size and, when the module holds a ``GPTConfig`` as ``config``,
        against that model; no collective is used."""
        dims = self.plan.dims(world_size)
        config = getattr(module, "config", None) if module is not None else None
        if isinstance(config, GPTConfig):
            self.plan.check_gpt_config(config, sum_tied_gradients=True)  # summed in post_backward
        return dims

    @property
    def gradient_norm_group(self) -> SumGroup:
        """The groups over which ranks hold different gradients (pipeline stages, ZeRO-1's scattered pieces):
        a global gradient norm adds its shares over each (``grad_norm``'s ``sum_group``)."""
        if self._runtime is not None:
            return self._runtime.grad_norm_group
        return self.device_mesh["pp"].get_group() if self.dims.pp > 1 else None

    def checkpoint_layout(self) -> CheckpointLayout:
        """Which ranks hold what (for megascale-ft's read-once-and-broadcast restore)."""
        return self.runtime.checkpoint_layout()

    # ---- environment and setup ----------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._dims = self.validate_layout(self.num_nodes * self.num_processes, self.lightning_module)
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._mesh = self._mesh_for(self._dims)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh
        rank_zero_info(f"MegaScaleStrategy: {self._layout_line(self._dims)}")

    def _layout_line(self, dims: ParallelDims) -> str:
        """Every dimension of the layout and what ZeRO does: the start-up line."""
        plan = self.plan
        parts = [f"dp={dims.dp}", f"pp={dims.pp}", f"cp={dims.cp}", f"tp={dims.tp}"]
        if plan.ep > 1:  # experts split over ep of the dp ranks; edp ranks hold the same experts
            parts.append(f"ep={plan.ep} (edp={dims.dp // plan.ep})")
        zero = f"ZeRO stage {self.zero_stage}"
        if self.zero_stage == 1:
            chosen = "" if self._zero1_sharding_given else ", chosen for this layout"
            zero += f" (zero1_sharding={plan.zero1_sharding!r}{chosen})"
        return f"{' × '.join(parts)} (world {dims.world_size}), {zero}"

    def set_world_ranks(self) -> None:
        """This process's rank and the world size, as DDPStrategy sets them (Lightning calls it when the Trainer
        is built, so ``trainer.world_size`` and ``global_rank`` are right before ``fit``)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _mesh_for(self, dims: ParallelDims) -> DeviceMesh:
        given = self._given_mesh
        if given is None:
            return dims.build_mesh(self.root_device.type)
        shape = tuple(given.mesh.shape)
        if given.mesh_dim_names != MESH_DIMS or shape != dims.shape:
            raise ValueError(
                f"device_mesh has dimensions {given.mesh_dim_names} of sizes {shape}; this layout needs "
                f"{MESH_DIMS} of sizes {dims.shape}: build it with "
                f"ParallelDims(dp={dims.dp}, pp={dims.pp}, tp={dims.tp}, cp={dims.cp}).build_mesh(device_type)"
            )
        return given

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):  # meta models are materialised in setup
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        meta = self.meta_init if empty_init is None else empty_init
        with torch.device("meta") if meta else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self._context_parallels = None
        self._batch_began = self._stepped = self._warned_unstepped = False
        self.accelerator.setup(trainer)
        self.precision_plugin = to_megascale_precision(
            self.precision_plugin,
            before_optimizer_step=self._before_optimizer_step,
            grad_norm_group=lambda: self.gradient_norm_group,  # the runtime's, once it exists
        )
        if (
            self._runtime is None
        ):  # trainer.validate/predict after fit set up the strategy again: split already
            bf16 = getattr(self.precision_plugin, "precision", "") == "bf16-mixed"
            self._names_before_split = prebuilt_optimizers.names_of(self.model)
            self._runtime = parallelize(
                self.model, self.plan, self.device_mesh, device=self.root_device,
                param_dtype=torch.bfloat16 if bf16 else None, sum_tied_gradients=True,
            )  # fmt: skip
            if self._runtime.pipeline is not None:
                self._pipeline_loop = PipelineLoop(self._runtime.pipeline, self.model)
        self.barrier()
        self._preemption = preemption.install(trainer)  # SIGTERM: finish the step, save, exit 0
        if trainer.state.fn == TrainerFn.FITTING:
            assert self.lightning_module is not None
            pp_group = self.device_mesh["pp"].get_group() if self.dims.pp > 1 else None
            check_trainer_features(
                trainer, self.lightning_module, self.dims, self.zero_stage, self.plan.ep, pp_group
            )
            raised_together(
                "configure_optimizers", lambda: self.setup_optimizers(trainer), *self._stage_said()
            )
            moved = prebuilt_optimizers.point_at_split_parameters(
                self._stepping_optimizers, self.model, self._names_before_split
            )
            if moved:
                rank_zero_info(
                    f"MegaScaleStrategy: configure_optimizers returned an optimizer built before the model was "
                    f"split; its {len(moved)} parameters now point to the split ones"
                )
            self.runtime.zero.attach_optimizers(self._stepping_optimizers)
            if self._wait_timer is not None:
                self.runtime.set_wait_timer(self._wait_timer)
            self._serve_readers(trainer)
        self._names_before_split = {}  # the parameters from before the split: no longer held
        self.setup_precision_plugin()

    def _stage_said(self) -> tuple[str, str]:
        """Where this rank is, and what a user hook raising on some stages only most likely means."""
        if self.dims.pp == 1:
            return f"rank {self.global_rank}", ""
        stage = self.device_mesh["pp"].get_local_rank()
        return f"rank {self.global_rank} (pipeline stage {stage})", (
            "; under pipeline parallelism configure_optimizers sees only its stage's parameters (a stage "
            "whose parameters are all frozen gets none): give the optimizer every parameter, frozen ones are "
            "not stepped"
        )

    def _serve_readers(self, trainer: Trainer) -> None:
        """User code that reads weights between steps or gradients (EMA callbacks, logged gradient norms, manual
        optimization): ZeRO-1 (``weight_readers.py``); tensor-, expert- and ZeRO-2/3 shards gathered whole
        where that code reads them (``whole_gradients.py``)."""
        split = any(isinstance(p, DTensor) for p in trainer.lightning_module.parameters())
        manual = manual_gradient_reader(trainer)
        # where user code reads them: (when it reads, when they are gathered whole for it, who reads)
        where = [
            ("after the optimizer step (on_train_batch_end/_start)", "after each step, held until the next "
             "training_step", gradient_readers_after_step(trainer)),
            ("in on_after_backward", "after each backward", gradient_readers_after_backward(trainer)),
            ("in on_before_optimizer_step or configure_gradient_clipping", "there",
             gradient_readers_before_step(trainer)),
            ("in a manual training_step", "after each manual_backward, held until the optimizer's step",
             [manual] if manual else []),
        ]  # fmt: skip
        for when, how, readers in where:
            if readers and split:
                rank_zero_info(
                    f"MegaScaleStrategy: {readers} may read gradients {when}, and some are tensor-, expert- or "
                    f"ZeRO-2/3 shards: they are gathered whole {how} (one all-gather per sharded gradient, the "
                    "whole gradients held meanwhile; give a callback or module that reads none "
                    "`reads_gradients = False`)"
                )
        after_step, after_backward, before_step, in_manual = (bool(r) and split for _, _, r in where)
        self._after_step_readers = where[0][2]
        self._whole_after_step, self._whole_after_backward = after_step, after_backward
        self._whole_in_manual_step = in_manual
        plugin = self.precision_plugin
        if before_step and isinstance(plugin, _GlobalNormClipping):
            plugin.gather_for_readers = True
        # ZeRO-2 keeps the parameters it gathered through an accumulation's micro-batches (plain tensors where
        # shards stand after a step): code reading weights between batches would see both kinds
        self._reshard_between_batches = self.runtime.zero.stage == 2 and bool(
            weight_readers_between_steps(trainer)
        )
        if self.runtime.zero.stage != 1:
            return
        readers = weight_readers_between_steps(trainer)
        self._wait_after_step = bool(readers) and self.plan.overlap_param_gather
        if self._wait_after_step:
            rank_zero_info(
                f"MegaScaleStrategy: {readers} may read weights between optimizer steps, so ZeRO-1 waits for "
                "the updated parameters right after each step instead of during the next forward"
            )
        readers = gradient_readers(trainer) + gradient_readers_after_step(trainer)
        self.runtime.zero.set_whole_gradients(bool(readers))
        if readers and self.plan.zero1_sharding == "elements":
            rank_zero_info(
                f"MegaScaleStrategy: {readers} may read gradients, so ZeRO-1 (zero1_sharding='elements') "
                "all-reduces them whole instead of reduce-scattering pieces (1.5x DDP's bytes; give a callback "
                "that reads none `reads_gradients = False`)"
            )

    # ---- steps: inside the LightningModule's forward --------------------------------------------------

    def _redirected(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # The LightningModule's own forward runs around the step, so forward hooks on it fire (ZeRO-1 waits,
        # the FSDP root gathers): Lightning's forward redirection, as for DDP and FSDP wrappers.
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def _expect_documents(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Tell context parallelism whether this batch packs documents: its attention then refuses a call
        without position_ids (a model of one's own that does not pass them on) instead of mixing documents."""
        if self.dims.cp == 1:
            return
        if self._context_parallels is None:
            assert self.model is not None
            found = (getattr(m, "context_parallel", None) for m in self.model.modules())
            self._context_parallels = [c for c in found if isinstance(c, ContextParallel)]
        batch = args[0] if args else kwargs.get("batch")
        expected = position_ids_of(batch) is not None
        for context_parallel in self._context_parallels:
            context_parallel.documents_expected = expected

    def _warn_if_unstepped(self) -> None:
        """Code reading gradients after each batch (``on_train_batch_end``) reads, after a batch that did not
        step (accumulating, or a step skipped: seen when the next batch starts), each rank's partial sums."""
        if (
            self._after_step_readers
            and self._batch_began
            and not self._stepped
            and not self._warned_unstepped
        ):
            self._warned_unstepped = True
            rank_zero_warn(
                f"MegaScaleStrategy: {self._after_step_readers} may read gradients after each batch; a batch "
                "ended without an optimizer step (accumulating, or a step skipped), so they read each rank's own "
                "partial sums (its samples, its shards, as under DDP), not the union batch's. Read them in "
                "on_before_optimizer_step for the step's whole gradients"
            )
        self._batch_began, self._stepped = True, False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_if_unstepped()
        self._expect_documents(args, kwargs)
        if not self._memory_checked:
            self._memory_checked = True
            batch = args[0] if args else kwargs.get("batch")
            if position_ids_of(batch) is not None:  # a dataloader of the user's own brings them
                assert self.model is not None
                check_packed_documents(
                    "a batch with position_ids", self.model, self.dims, self.zero_stage, self.plan.ep
                )
            self._warn_if_over_memory(batch)
        if self._rng_to_restore is not None:
            self._restore_rng(self._rng_to_restore)
            self._rng_to_restore = None
        self._split_gathered()  # before this step's backward adds shards to them
        try:
            with self.precision_plugin.train_step_context():
                if self._pipeline_loop is None:
                    return self._redirected("training_step", *args, **kwargs)
                assert self.lightning_module is not None
                batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
                with self._pipeline_loop.step(
                    self.lightning_module.trainer.accumulate_grad_batches, batch_idx
                ):
                    return self._redirected("training_step", *args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if dtensor_errors.is_dtensor_refusal(error):
                raise dtensor_errors.named(error, "training_step") from error
            raise

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._expect_documents(args, kwargs)
        with self.precision_plugin.val_step_context():
            out = self._redirected("validation_step", *args, **kwargs)
        # readers in on_validation_batch_end see the shards, as after a step
        if self._reshard_between_batches:
            self.runtime.zero.reshard()
        return out

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._expect_documents(args, kwargs)
        with self.precision_plugin.test_step_context():
            return self._redirected("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._expect_documents(args, kwargs)
        with self.precision_plugin.predict_step_context():
            return self._redirected("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batches: every ZeRO stage (and pipeline steps) accumulates locally and
        reduces once, during the last micro-batch's backward."""
        with self.runtime.no_sync():
            yield
        if self._reshard_between_batches:  # readers between batches see the shards, as after every step
            self.runtime.zero.reshard()

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Lightning's backward with the reductions finished before ``on_after_backward`` (as DDP's hooks see
        reduced gradients), whole gradients for the code reading them (``_serve_readers``), and under pp the
        hooks around the backward the schedule ran inside training_step."""
        module = self.lightning_module
        assert module is not None
        self._split_gathered()  # this backward adds shards to them
        if self._pipeline_loop is None:
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward
            closure_loss = self.runtime.zero.before_backward(closure_loss)
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        else:
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline_loop.restore_gradients()  # the schedule ran backward inside training_step
        self.post_backward(closure_loss)
        if self._pipeline_loop is not None:
            self._pipeline_loop.keep_what_zero_grad_left()
        manual = self._whole_in_manual_step and not module.automatic_optimization
        if manual or self._whole_after_backward:
            self._gathered += gather_whole(module.parameters())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward
        if not manual:  # a manual training_step reads them until its optimizer steps
            self._split_gathered()
        return closure_loss

    def _split_gathered(self) -> None:
        split_again(self._gathered)
        self._gathered = []

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.runtime.zero.after_backward()
        self.runtime.sum_tied_gradients()  # embeddings tied across pipeline stages: both copies' gradients

    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        # a closure given to optimizer.step() ran its manual_backward inside the step: the gradients it
        # gathered whole for reading are split again before the update, as optimizer_step does for the others
        self._split_gathered()
        self.runtime.check_first_step()
        self._replica_guard.check_gradients(optimizer, self.model, self.runtime)
        self.runtime.zero.before_optimizer_step(optimizer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._split_gathered()  # gathered after a manual_backward: the update needs its shards
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._stepped = True
        self.runtime.zero.after_optimizer_step(getattr(optimizer, "_optimizer", optimizer))
        if self._whole_after_step and self.model is not None:
            self._gathered += gather_whole(self.model.parameters())
        self._replica_guard.check_values(optimizer, self.model, self.runtime)
        if self._wait_after_step:
            self.runtime.zero.wait_for_params()
        return result

    def _wait_for_params(self) -> None:
        if self._runtime is not None:
            self._runtime.zero.wait_for_params()

    @override
    def on_train_end(self) -> None:
        # a fit whose last batch did not step (no batch follows it to see that): its readers read partial sums
        self._warn_if_unstepped()
        self._batch_began = False

    @override
    def on_validation_start(self) -> None:
        self._wait_for_params()

    def _reshard_after_evaluation(self) -> None:
        """ZeRO-2 keeps what a forward gathered until a backward frees it: after an evaluation, code reading the
        weights (the next batch's callbacks, fit's caller) would see the gathered compute copies (bf16 under
        mixed precision), not the fp32 shards the optimizer steps."""
        if self._runtime is not None:
            self._runtime.zero.reshard()

    @override
    def on_validation_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_test_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._reshard_after_evaluation()

    # ---- collectives ------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    def _data_parallel_group(self, group: Any) -> Any:
        """``group`` where the caller names one, else the data-parallel ranks (those reading different samples):
        the tp, pp and cp ranks of one replica hold the same values, so a sum or a gather over the world would
        count each sample once per such rank."""
        if group is not None or self._mesh is None or self._mesh.size() == 1:
            return group
        return self._mesh["dp"].get_group()

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``self.log(..., sync_dist=True)``'s reduction: over the data-parallel ranks (see
        ``_data_parallel_group``); a DTensor (a value computed from sharded parameters) is made whole first,
        and under pp a value the stages disagree on is refused (``stage_values.py``)."""
        if isinstance(tensor, Tensor):
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            if group is None and self._mesh is not None and self._mesh["pp"].size() > 1:
                module = self.lightning_module
                hook = getattr(module, "_current_fx_name", None) if module is not None else None
                check_same_on_every_stage(tensor, self._mesh["pp"].get_group(), hook)
            # self.log(..., sync_dist=True) inside training_step: where a fast rank waits for a slow one
            with (self._wait_timer or untimed)("metric-sync"):
                return _sync_ddp_if_available(tensor, self._data_parallel_group(group), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """``LightningModule.all_gather``: one entry per data-parallel rank (see ``_data_parallel_group``)."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().all_gather(tensor, self._data_parallel_group(group), sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # every rank's own decision (Lightning compares the sum with the world size)
        total = self.reduce(
            torch.tensor(int(decision), device=self.root_device), group=_group.WORLD, reduce_op="sum"
        )
        return bool(total == self.world_size) if all else bool(total)

    # ---- checkpoints --------------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be split and the optimizers built before states are loaded into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded by load_checkpoint, through DCP

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved through DCP in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # likewise

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    @property
    def _stepping_optimizers(self) -> list[Optimizer]:
        """``self.optimizers`` less Lightning's stand-in for ``configure_optimizers`` returning None, which
        steps nothing and has no state to shard or save."""
        return [o for o in self.optimizers if not isinstance(o, _MockOptimizer)]

    def _holds_all_states(self, optimizer: Optimizer) -> bool:
        return self.runtime.zero.holds_all_optimizer_states(optimizer)

    def _layout(self) -> dict[str, Any]:
        """This run's layout as a checkpoint records it (``checkpoint_io.LAYOUT_KEY``, ``layout_name``)."""
        dims = self.runtime.dims
        return dict(
            dp=dims.dp, pp=dims.pp, cp=dims.cp, tp=dims.tp, ep=self.plan.ep, zero_stage=self.plan.zero_stage,
            zero1_sharding=self.plan.zero1_sharding, sequence_parallel=self.plan.sequence_parallel,
        )  # fmt: skip

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("MegaScaleStrategy.save_checkpoint does not take storage_options")
        self._wait_for_params()
        where = str(self.broadcast(str(filepath)))  # a local path or a URL (one file)
        checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rng = self._rng_states()
        if rng is not None:
            checkpoint[RNG_KEY] = rng
        checkpoint[checkpoint_io.LAYOUT_KEY] = self._layout()
        assert self.model is not None
        if not self.save_distributed_checkpoint:
            self._save_one_file(checkpoint, where)
            return
        checkpoint_io.save(
            _local_directory(where), self.model, self._stepping_optimizers, checkpoint, is_global_zero=self.is_global_zero,
            barrier=self.barrier, before_optimizer_state=self.runtime.zero.prepare_optimizer_state,
        )  # fmt: skip

    def _save_one_file(self, checkpoint: dict[str, Any], path: str) -> None:
        assert self.model is not None
        where = dict(zip(MESH_DIMS, self.device_mesh.get_coordinate() or [0] * len(MESH_DIMS)))
        first_of_stage = where["dp"] == where["cp"] == where["tp"] == 0
        # ZeRO-1 by parameters: each dp rank holds the states of the parameters it owns (also after fit)
        owners = (
            where["cp"] == where["tp"] == 0
            and self.plan.zero_stage == 1
            and self.plan.zero1_sharding == "parameters"
        )
        checkpoint_io.save_one_file(
            path, self.model, self._stepping_optimizers, checkpoint, write=self.checkpoint_io.save_checkpoint,
            sends_model=first_of_stage, sends_optimizers=first_of_stage or owners,
            is_global_zero=self.is_global_zero, barrier=self.barrier,
            before_optimizer_state=self.runtime.zero.prepare_optimizer_state,
        )  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._wait_for_params()
        where = str(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        strict, prepare = self.lightning_module.strict_loading, self.runtime.zero.prepare_optimizer_state
        optimizers = self._stepping_optimizers
        if get_filesystem(where).isfile(
            where
        ):  # one file: save_distributed_checkpoint=False wrote it, or DDP
            saved = self.checkpoint_io.load_checkpoint(where, map_location="cpu", weights_only=True)
            checkpoint = checkpoint_io.load_one_file(
                saved, self.model, optimizers, strict=strict, before_optimizer_state=prepare,
                holds_all_states=self._holds_all_states,
            )  # fmt: skip
        else:
            checkpoint = checkpoint_io.load(
                _local_directory(where), self.model, optimizers, strict=strict, before_optimizer_state=prepare,
                holds_all_states=self._holds_all_states, layout=self._layout(),
            )  # fmt: skip
        checkpoint.pop(checkpoint_io.LAYOUT_KEY, None)
        # restored at the first training step, not now: Lightning creates the data iterator in between, which
        # draws from the default generator (DataLoader's base seed) where the saved run had drawn long before
        self._rng_to_restore = checkpoint.pop(RNG_KEY, None)
        return checkpoint

    def _warn_if_over_memory(self, batch: Any) -> None:
        """The planner's memory prediction for this layout, at the first batch (``memory_check.py``)."""
        precision = getattr(self.precision_plugin, "precision", "32-true")
        message = layout_memory_warning(
            self.lightning_module, self.plan, self.world_size, batch, self.root_device, str(precision)
        )
        if message is not None:
            rank_zero_warn(f"MegaScaleStrategy: {message}")

    def set_wait_timer(self, timer: WaitTimer, compute: ComputeTimer | None = None) -> None:
        """Time the waits for other ranks with ``timer`` (``megascale.core.parallel.wait_timer``): how
        megascale-ft's ``FaultTolerance`` tells a slow rank from its waiting peers; and with ``compute``
        each pipeline microbatch's forward and backward per stage (for its timeline)."""
        self._wait_timer = timer if compute is None else Timers(timer, compute)
        if self._runtime is not None:
            self._runtime.set_wait_timer(self._wait_timer)

    def random_streams_state(self) -> dict[str, Tensor] | None:
        """This rank's model-parallel dropout streams (``megascale.core.parallel.rng``; None with tp = pp = 1),
        for a checkpointer of your own (megascale-ft saves them with each rank's generators)."""
        rng = self.runtime.rng
        return None if rng is None else rng.state_dict()

    def load_random_streams_state(self, state: dict[str, Tensor]) -> None:
        """Continue this rank's dropout streams from ``random_streams_state()`` of the same rank and layout."""
        if self.runtime.rng is not None:
            self.runtime.rng.load_state_dict(state)

    def _rng_states(self) -> dict[str, Any] | None:
        """Every rank's dropout streams (``megascale.core.parallel.rng``), for rank 0 to save with the rest."""
        rng = self.runtime.rng
        if rng is None:
            return None
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, rng.state_dict())
        return {
            "layout": [self.runtime.dims.dp, self.runtime.dims.pp, self.runtime.dims.tp],
            "states": states,
        }

    def _restore_rng(self, saved: dict[str, Any] | None) -> None:
        rng = self.runtime.rng
        if rng is None or saved is None:
            return
        layout = [self.runtime.dims.dp, self.runtime.dims.pp, self.runtime.dims.tp]
        if saved["layout"] != layout:
            rank_zero_warn(
                f"the checkpoint's dropout streams were saved at dp×pp×tp={saved['layout']}, this run is {layout}: "
                "they start afresh from the seed (the weights and optimizer states are resumed as saved)"
            )
            return
        rng.load_state_dict(saved["states"][self.global_rank])

    def sharded_state_dict(self) -> dict[str, Any]:
        """Model and optimizer states for a checkpointer of your own (e.g. megascale-ft's ``FaultTolerance``).

        ``{"state_dict": ..., "optimizer_<i>": ...}`` as ``torch.distributed.checkpoint`` state dicts: keyed
        by parameter name, tensors as this rank's shards (DTensors), as `save_checkpoint` writes them, so any
        layout works (a ZeRO-1 rank holds the optimizer states it owns; `checkpoint_layout` says which ranks
        hold what). Waits for ZeRO-1 parameter gathers in flight first, so the parameters are this step's.
        """
        self._wait_for_params()
        assert self.model is not None
        return checkpoint_io.states(
            self.model, self._stepping_optimizers, self.runtime.zero.prepare_optimizer_state,
            holds_all_states=self._holds_all_states,
        )  # fmt: skip

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Set the model and optimizer states from a `sharded_state_dict` whose tensors were loaded in place."""
        self._wait_for_params()
        assert self.model is not None and self.lightning_module is not None
        checkpoint_io.apply_states(
            self.model, self._stepping_optimizers, state, strict=self.lightning_module.strict_loading,
            holds_all_states=self._holds_all_states,
        )  # fmt: skip

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            checkpoint_io.remove(filepath)

    # ---- teardown -----------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        # torch's DTensor refusal in a hook no wrapper here catches (a callback, on_train_batch_end): Lightning
        # re-raises the error as it is, so the layout's cause and the change go on it as a note
        if dtensor_errors.is_dtensor_refusal(exception):
            exception.add_note(f"MegaScaleStrategy: {dtensor_errors.advice(exception)}")

    @override
    def teardown(self) -> None:
        if self._runtime is not None:
            self._runtime.zero.remove()  # waits for parameters in flight; reduction still works, unoverlapped
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="megascale tensor × pipeline × ZeRO")


def _local_directory(where: str) -> Path:
    """A checkpoint directory's path: local (or mounted); ``file://`` URLs are local paths too."""
    if where.startswith("file://"):
        return Path(where[len("file://") :])
    if "://" in where:
        raise ValueError(
            f"{where}: MegaScaleStrategy writes and reads checkpoint directories on local or mounted paths; for "
            "a URL, save one file instead (MegaScaleStrategy(save_distributed_checkpoint=False), written through "
            "fsspec), or checkpoint to a mounted path"
        )
    return Path(where)


if MegaScaleStrategy.strategy_name not in StrategyRegistry:
    MegaScaleStrategy.register_strategies(StrategyRegistry)
