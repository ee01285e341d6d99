"""Parallelisms applied to a built model, one folder per dimension, composed in one order by ``parallelize``.

- ``tp/``, ``pp/``, ``cp/``, ``ep/``, ``zero/``: one dimension each, with its apply/check entry points;
- ``plan.py`` (``ParallelPlan``: every rule of a layout) and ``compose.py`` (``parallelize``: the order) on top;
- beside them what every dimension shares: the mesh, activation checkpointing, materialisation, gradient
  clipping, RNG, replica checks, compile, wait timers.

plan = ParallelPlan(tp=2, pp=2, zero_stage=1)                       # every rule checked here
mesh = plan.dims(world_size).build_mesh("cuda")                      # ("dp", "pp", "cp", "tp")
runtime = parallelize(model, plan, mesh, device="cuda")              # compose.py: the order
"""

from megascale.core.parallel.activation_checkpoint import (
    ActivationCheckpointMode,
    apply_activation_checkpointing,
)
from megascale.core.parallel.compose import CheckpointLayout, ParallelRuntime, parallelize
from megascale.core.parallel.grad_clip import all_reduce_over_shards, clip_grad_norm_, grad_norm
from megascale.core.parallel.materialize import materialize
from megascale.core.parallel.mesh import ParallelDims
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.parallel.tp.apply import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayerNorm,
    TensorParallelRMSNorm,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    local,
)
from megascale.core.parallel.tp.comm import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)
from megascale.core.parallel.tp.cross_entropy import vocab_parallel_cross_entropy
from megascale.core.parallel.tp.overlap import column_parallel_matmul, row_parallel_matmul
from megascale.core.parallel.zero import (
    BucketedGradReduce,
    OptimizerStateSharding,
    UnitTree,
    ZeroRuntime,
    apply_zero,
)

__all__ = [
    "ActivationCheckpointMode",
    "BucketedGradReduce",
    "CheckpointLayout",
    "ColumnParallelLinear",
    "OptimizerStateSharding",
    "ParallelDims",
    "ParallelPlan",
    "ParallelRuntime",
    "RowParallelLinear",
    "ScheduleDecoupled1F1B",
    "ScheduleTimeline",
    "TensorParallelLayerNorm",
    "TensorParallelRMSNorm",
    "TimelineEvent",
    "UnitTree",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "ZeroRuntime",
    "all_reduce_over_shards",
    "apply_activation_checkpointing",
    "apply_tensor_parallel",
    "apply_tensor_parallel_plan",
    "apply_zero",
    "clip_grad_norm_",
    "column_parallel_matmul",
    "copy_to_tp_region",
    "directional_p2p_groups",
    "gather_from_sp_region",
    "grad_norm",
    "local",
    "materialize",
    "parallelize",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "row_parallel_matmul",
    "vocab_parallel_cross_entropy",
]


# Pipeline schedules are exported lazily: torch.distributed.pipelining imports much of torch (triton
# included where installed), which code that never builds a pipeline should not pay for.
_LAZY = {
    "apply_tensor_parallel_plan": "megascale.core.parallel.tp.user_model",
    "ScheduleDecoupled1F1B": "megascale.core.parallel.pp.schedules",
    "ScheduleTimeline": "megascale.core.parallel.pp.schedules",
    "TimelineEvent": "megascale.core.parallel.pp.schedules",
    "directional_p2p_groups": "megascale.core.parallel.pp.schedules",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
