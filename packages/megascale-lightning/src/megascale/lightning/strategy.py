"""MegaScaleStrategy: tensor × pipeline × ZeRO data parallelism inside Lightning's Trainer.

The strategy is thin. ``setup_environment`` validates the layout (before any process group exists), starts
the process group and builds one DeviceMesh ("dp", "pp", "tp"; see ``megascale.core.parallel.mesh``).
``setup`` parallelises every ``megascale.core.GPT`` inside the LightningModule by calling the ``apply_*``
functions of megascale-core, always in this order:

1. tensor (+ sequence) parallelism on the "tp" mesh — first, because it decides what each parameter is;
2. pipeline split on the "pp" mesh (pp > 1): each rank keeps only its stages' layers — still on the meta
   device, so no rank ever materialises the whole model;
3. materialisation (``to_empty`` + ``init_weights``: the same weights as a single process, in every layout);
4. activation checkpointing — wraps the already-split blocks, so recomputation replays their collectives;
5. ZeRO on the "dp" mesh — last, because it shards whatever parameters the steps above produced:
   stage 0/1 megascale's bucketed gradient all-reduce (+ optimizer-state sharding for 1),
   stage 2/3 FSDP2 (``megascale.core.parallel.fsdp``; with pp > 1 each pipeline stage is an FSDP root);
6. the pipeline schedule over the finished stage modules, attached to the GPT.

With pp > 1 one Lightning ``training_step`` is one global batch: the GPT's forward runs the schedule over
``num_microbatches`` microbatches, backward included (so ``backward`` here does nothing more), and returns the
last stage's loss, broadcast so every rank logs it.

A LightningModule without a GPT can use the strategy too: its ``configure_model`` applies its own tensor
parallel plan with ``self.device_mesh["tp"]`` (e.g. DTensor's ``parallelize_module``); the strategy then
applies ZeRO to the whole module.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
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
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from megascale.core import GPT, GPTConfig
from megascale.core._dtensor import is_dtensor, local
from megascale.core.parallel import apply_activation_checkpointing, apply_tensor_parallel
from megascale.core.parallel.data_parallel import BucketedGradReduce
from megascale.core.parallel.fsdp import FSDPUnits, apply_fsdp
from megascale.core.parallel.mesh import ParallelDims
from megascale.core.parallel.pipeline import (
    Pipeline,
    StageModule,
    apply_pipeline,
    build_pipeline,
    check_pipeline,
)
from megascale.core.parallel.zero import OptimizerStateSharding
from megascale.lightning import checkpoint_io
from megascale.lightning.precision import to_megascale_precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MegaScaleStrategy"]


class MegaScaleStrategy(ParallelStrategy):
    """Tensor, pipeline and ZeRO data parallelism for ``megascale.core.GPT`` models (and your own).

    ``dp`` is inferred: world size / (tp · pp).

    Args:
        tp: tensor-parallel size (ranks splitting every layer; keep it within a node).
        pp: pipeline-parallel size (ranks each holding a run of layers).
        num_microbatches: microbatches per step with pp > 1 (default pp); each rank's batch is split into them.
        schedule: pipeline schedule: "1f1b" (megascale's decoupled 1F1B), "interleaved" (needs
            virtual_stages ≥ 2) or "gpipe".
        virtual_stages: stages per pipeline rank (interleaved schedule): the bubble shrinks by this factor.
        pipeline_split: blocks per stage (pp · virtual_stages numbers); default: as even as possible.
        zero_stage: 0 replicate everything (DDP-like); 1 shard optimizer state; 2 also gradients;
            3 also parameters. Stages 2/3 run on FSDP2; stage 3 is refused with pp > 1 (it would gather the
            parameters again for every microbatch).
        sequence_parallel: with tp > 1, run norms, dropout and residuals on sequence shards.
        overlap_tp_comm: split the TP all-gathers/reduce-scatters into chunks overlapped with the GEMMs.
        tp_comm_chunks: how many chunks.
        overlap_grad_reduce: launch the data-parallel gradient reduction of each bucket during backward
            (False: one reduction after the whole backward).
        overlap_param_gather: ZeRO-1: gather updated parameters during the next forward; ZeRO-2/3: prefetch
            the next unit's parameters while the current one computes (and the first before forward).
        bucket_size_mb: size of the gradient-reduction buckets / FSDP units.
        activation_checkpointing: "none", "full" (recompute each block) or "selective" (attention core).
        meta_init: build models on the meta device and materialise them after they are split, so no rank
            ever holds a whole model (models whose modules lack ``reset_parameters``/``init_weights`` need
            False).
        process_group_backend: "nccl", "gloo", ... (default: by device).
        timeout: collective timeout.
    """

    strategy_name = "megascale"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        num_microbatches: int | None = None,
        schedule: Literal["1f1b", "interleaved", "gpipe"] = "1f1b",
        virtual_stages: int = 1,
        pipeline_split: list[int] | None = None,
        zero_stage: int = 1,
        sequence_parallel: bool = True,
        overlap_tp_comm: bool = True,
        tp_comm_chunks: int = 4,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        bucket_size_mb: float = 25.0,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        meta_init: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
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
        for name, value in (("tp", tp), ("pp", pp), ("tp_comm_chunks", tp_comm_chunks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MegaScaleStrategy({name}={value!r}): must be a positive integer")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"MegaScaleStrategy(zero_stage={zero_stage!r}): ZeRO stages are 0 (replicate), 1 (shard "
                "optimizer state), 2 (+ gradients) and 3 (+ parameters)"
            )
        if zero_stage == 3 and pp > 1:
            raise ValueError(
                f"MegaScaleStrategy(zero_stage=3, pp={pp}): ZeRO-3 would gather every stage's parameters again "
                "for each microbatch; use zero_stage=2 (gradients and optimizer state sharded) with pipelines"
            )
        self.num_microbatches = pp if num_microbatches is None else num_microbatches
        self.schedule, self.virtual_stages, self.pipeline_split = schedule, virtual_stages, pipeline_split
        if pp > 1 or virtual_stages > 1:
            # what can be checked without the model (block counts are checked in validate_layout)
            check_pipeline(
                max(pp * virtual_stages, sum(pipeline_split or [])), pp, schedule=schedule,
                virtual_stages=virtual_stages, num_microbatches=self.num_microbatches,
            )  # fmt: skip
        if activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} must be 'none', 'full' or 'selective'"
            )
        if bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be >= 0")
        self.tp, self.pp, self.zero_stage = tp, pp, zero_stage
        self.sequence_parallel, self.overlap_tp_comm, self.tp_comm_chunks = (
            sequence_parallel,
            overlap_tp_comm,
            tp_comm_chunks,
        )
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.bucket_size_mb = bucket_size_mb
        self.activation_checkpointing = activation_checkpointing
        self.meta_init = meta_init
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._grad_reduce: BucketedGradReduce | None = None
        self._fsdp_units: list[FSDPUnits] = []
        self._pipeline: Pipeline | None = None
        self._step_done = True  # the last optimizer step consumed the gradients: zero them before the next
        self._set_aside: list[tuple[Tensor, Tensor]] = []
        self._zero1: dict[int, OptimizerStateSharding] = {}
        self._sync_grads = True

    # ---- layout -------------------------------------------------------------------------------------

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("the parallel layout is known once the strategy's environment is set up")
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ("dp", "pp", "tp") DeviceMesh (also ``LightningModule.device_mesh``)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the strategy's environment is set up")
        return self._mesh

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
        """Data parallel rank and size: ranks of one TP group (and pipeline) read the same samples."""
        mesh = self.device_mesh["dp"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def validate_layout(self, world_size: int, module: LightningModule | None = None) -> ParallelDims:
        """Check tp/pp/zero against the world size and the model; no collective is used."""
        dims = ParallelDims.infer(world_size, tp=self.tp, pp=self.pp)
        config = getattr(module, "config", None) if module is not None else None
        if isinstance(config, GPTConfig):
            config.check_tensor_parallel(self.tp)
            if self.pp > 1:
                if config.tie_embeddings:
                    raise ValueError(
                        "tie_embeddings=True with pp > 1: the embedding (first stage) and the output projection "
                        "(last stage) would live on different ranks; set tie_embeddings=False or pp=1"
                    )
                check_pipeline(
                    config.n_layers, self.pp, schedule=self.schedule, virtual_stages=self.virtual_stages,
                    num_microbatches=self.num_microbatches, split=self.pipeline_split,
                )  # fmt: skip
        return dims

    @property
    def gradient_norm_group(self) -> dist.ProcessGroup | None:
        """The group over which ranks hold different parameters (pipeline stages): a global gradient norm
        sums its parts over it. None without pipeline parallelism."""
        return self.device_mesh["pp"].get_group() if self.dims.pp > 1 else None

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
        self._set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._mesh = self._dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh
        rank_zero_info(
            f"MegaScaleStrategy: dp={self._dims.dp} × pp={self._dims.pp} × tp={self._dims.tp} "
            f"(world {self._dims.world_size}), ZeRO stage {self.zero_stage}"
        )

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

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
        self.accelerator.setup(trainer)
        self.precision_plugin = to_megascale_precision(self.precision_plugin)
        self.precision_plugin.before_optimizer_step = self._before_optimizer_step  # type: ignore[attr-defined]
        self.precision_plugin.grad_norm_group = self.gradient_norm_group  # type: ignore[attr-defined]
        # trainer.validate/predict after fit set the strategy up again: the model is split already
        if not getattr(self.model, "_megascale_parallelized", False):
            self._parallelize(self.model)
            setattr(self.model, "_megascale_parallelized", True)  # noqa: B010  (nn.Module's __setattr__ typing)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.zero_stage == 1 and self.dims.dp > 1:
                dp_group = self.device_mesh["dp"].get_group()
                # the units whose forwards wait for their updated parameters: each GPT and its layers
                # (a LightningModule's own forward is not what its training_step calls)
                units = [m for gpt in self._gpts() for m in (gpt, *gpt.layers())]
                self._zero1 = {
                    id(opt): OptimizerStateSharding(
                        opt,
                        self.model,
                        dp_group,
                        overlap_param_gather=self.overlap_param_gather and bool(units),
                        bucket_size_mb=self.bucket_size_mb,
                        units=units,
                    )
                    for opt in self.optimizers
                }
        self.setup_precision_plugin()

    def _gpts(self) -> list[GPT]:
        assert self.model is not None
        return [m for m in self.model.modules() if isinstance(m, GPT)]

    def _parallelize(self, module: nn.Module) -> None:
        dims, mesh = self.dims, self.device_mesh
        gpts = self._gpts()
        if dims.tp > 1:  # 1. tensor parallelism
            for gpt in gpts:
                apply_tensor_parallel(
                    gpt,
                    mesh["tp"],
                    sequence_parallel=self.sequence_parallel,
                    overlap=self.overlap_tp_comm,
                    overlap_chunks=self.tp_comm_chunks,
                )
            if not any(is_dtensor(p) for p in module.parameters()):
                raise ValueError(
                    f"MegaScaleStrategy(tp={dims.tp}) found no tensor-parallel parameters: the LightningModule has "
                    "no megascale GPT and its configure_model() applied no tensor-parallel plan. Split your model "
                    "over self.device_mesh['tp'] in configure_model(), or use tp=1."
                )
        stage_modules: list[StageModule] = []
        if dims.pp > 1:  # 2. pipeline split, before anything is allocated
            if len(gpts) != 1:
                raise ValueError(
                    f"MegaScaleStrategy(pp={dims.pp}) needs exactly one megascale GPT in the LightningModule "
                    f"(found {len(gpts)}): pipeline parallelism cuts that model's layers into stages"
                )
            stage_modules = apply_pipeline(
                gpts[0], mesh["pp"], schedule=self.schedule, num_microbatches=self.num_microbatches,
                virtual_stages=self.virtual_stages, split=self.pipeline_split,
            )  # fmt: skip
        self._materialize(module, gpts)  # 3.
        if self.activation_checkpointing != "none":  # 4.
            for gpt in gpts:
                apply_activation_checkpointing(gpt, self.activation_checkpointing)
        self._broadcast_replicas(module)
        self._apply_zero(module, gpts, stage_modules)  # 5.
        if stage_modules:  # 6.
            self._pipeline = build_pipeline(
                gpts[0], stage_modules, mesh["pp"], schedule=self.schedule,
                num_microbatches=self.num_microbatches, virtual_stages=self.virtual_stages,
                device=self.root_device,
            )  # fmt: skip

    def _materialize(self, module: nn.Module, gpts: list[GPT]) -> None:
        device = self.root_device
        if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
            for gpt in gpts:
                # every rank must materialise the same values: take rank 0's seed
                gpt.init_seed = self.broadcast(gpt.init_seed)
            module.to_empty(device=device)
            in_gpt = {id(m) for gpt in gpts for m in gpt.modules()}
            with torch.no_grad():
                for gpt in gpts:
                    gpt.init_weights()
                for m in module.modules():
                    reset = getattr(m, "reset_parameters", None)
                    if id(m) not in in_gpt and callable(reset):
                        reset()
        module.to(device)

    def _broadcast_replicas(self, module: nn.Module) -> None:
        """Make every data-parallel replica start from rank 0's weights, as DDP does (a run that forgot to
        seed every rank alike would otherwise train diverging replicas)."""
        if self.dims.dp == 1:
            return
        group = self.device_mesh["dp"].get_group()
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(local(tensor), src=src, group=group)

    def _apply_zero(self, module: nn.Module, gpts: list[GPT], stage_modules: list[StageModule]) -> None:
        dims = self.dims
        if dims.dp == 1:
            return
        dp_mesh = self.device_mesh["dp"]
        if self.zero_stage >= 2:
            bf16 = getattr(self.precision_plugin, "precision", "") == "bf16-mixed"
            # with a pipeline the schedule calls the stage modules: they are the FSDP roots
            roots: list[GPT | StageModule] = list(stage_modules) if stage_modules else list(gpts)
            for root in roots:
                self._fsdp_units.append(
                    apply_fsdp(
                        root,
                        dp_mesh,
                        stage=self.zero_stage,
                        param_dtype=torch.bfloat16 if bf16 else None,
                        bucket_size_mb=self.bucket_size_mb,
                        overlap_grad_reduce=self.overlap_grad_reduce,
                        prefetch=self.overlap_param_gather,
                    )
                )
            if not gpts:
                from torch.distributed.fsdp import fully_shard

                fully_shard(module, mesh=dp_mesh, reshard_after_forward=self.zero_stage == 3)
        else:
            params = [p for p in module.parameters() if p.requires_grad]
            self._grad_reduce = BucketedGradReduce(
                params,
                dp_mesh.get_group(),
                bucket_size_mb=self.bucket_size_mb,
                overlap=self.overlap_grad_reduce,
                # a pipeline step accumulates every gradient once per microbatch
                accumulations=self.num_microbatches if stage_modules else 1,
            )

    # ---- training step ------------------------------------------------------------------------------

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batches: ZeRO-0/1 accumulate locally and reduce once at the last
        micro-batch; ZeRO-2/3 reduce-scatter every micro-batch (their gradients stay sharded)."""
        if self._grad_reduce is None:
            yield
            return
        self._sync_grads = False
        try:
            with self._grad_reduce.no_sync():
                yield
        finally:
            self._sync_grads = True

    # With a pipeline, training_step runs every microbatch's backward (inside the schedule). Lightning's
    # automatic optimization zero-grads *between* training_step and backward, which would wipe those
    # gradients, and would not have cleared the previous step's before the schedule accumulated onto them.
    # So: zero before the first schedule of a step, set the gradients aside across Lightning's zero_grad,
    # and give them back in backward (where Lightning's own backward has nothing left to do).

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        assert self.model is not None and self.lightning_module is not None
        # Lightning divides the loss by accumulate_grad_batches before its backward; ours runs in the schedule
        self._pipeline.loss_scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        if self._step_done:
            for p in self.model.parameters():
                p.grad = None
            self._step_done = False
        output = super().training_step(*args, **kwargs)
        self._set_aside = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        for param, _ in self._set_aside:
            param.grad = None
        return output

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        for param, grad in self._set_aside:
            param.grad = grad
        self._set_aside = []
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._grad_reduce is not None and self._sync_grads:
            self._grad_reduce.finish()

    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        sharding = self._zero1.get(id(optimizer))
        if sharding is not None:
            sharding.drop_unowned_grads()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._step_done = True
        sharding = self._zero1.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if sharding is not None:
            sharding.broadcast_updated()
        if self.zero_stage == 3 and self.overlap_param_gather:
            for units in self._fsdp_units:
                units.prefetch_first_unit()
        return result

    def _wait_for_params(self) -> None:
        for sharding in self._zero1.values():
            sharding.wait()

    @override
    def on_validation_start(self) -> None:
        self._wait_for_params()

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

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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

    def _prepare_optimizer_state(self, optimizer: Optimizer) -> None:
        sharding = self._zero1.get(id(optimizer))
        if sharding is not None:
            sharding.init_owned_state()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("MegaScaleStrategy.save_checkpoint does not take storage_options")
        self._wait_for_params()
        path = Path(self.broadcast(str(filepath)))
        checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        assert self.model is not None
        checkpoint_io.save(
            path,
            self.model,
            self.optimizers,
            checkpoint,
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
            before_optimizer_state=self._prepare_optimizer_state,
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._wait_for_params()
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        return checkpoint_io.load(
            path,
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            before_optimizer_state=self._prepare_optimizer_state,
            holds_all_states=lambda optimizer: id(optimizer) not in self._zero1,
        )

    def sharded_state_dict(self) -> dict[str, Any]:
        """Model and optimizer states for a checkpointer of your own (e.g. megascale-ft's ``FaultTolerance``).

        ``{"state_dict": ..., "optimizer_<i>": ...}`` as ``torch.distributed.checkpoint`` state dicts: keyed
        by parameter name, tensors as this rank's shards (DTensors), as `save_checkpoint` writes them, so any
        layout works (a ZeRO-1 rank holds the optimizer states it owns). Save it with DCP, or load into it in
        place with DCP and then call `load_sharded_state_dict`. Waits for ZeRO-1 parameter gathers in flight
        first, so the parameters are this step's.
        """
        self._wait_for_params()
        assert self.model is not None
        return checkpoint_io.states(self.model, self.optimizers, self._prepare_optimizer_state)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Set the model and optimizer states from a `sharded_state_dict` whose tensors were loaded in place."""
        self._wait_for_params()
        assert self.model is not None and self.lightning_module is not None
        checkpoint_io.apply_states(
            self.model,
            self.optimizers,
            state,
            strict=self.lightning_module.strict_loading,
            holds_all_states=lambda optimizer: id(optimizer) not in self._zero1,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            checkpoint_io.remove(filepath)

    # ---- teardown -----------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        self._wait_for_params()
        if self._grad_reduce is not None:
            self._grad_reduce.remove()
            self._grad_reduce = None
        for sharding in self._zero1.values():
            sharding.remove()
        self._zero1 = {}
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="megascale tensor × pipeline × ZeRO")


if MegaScaleStrategy.strategy_name not in StrategyRegistry:
    MegaScaleStrategy.register_strategies(StrategyRegistry)
