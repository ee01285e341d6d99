"""Parallelisms applied to a built model, one file each, composed in one order by ``parallelize``.

plan = ParallelPlan(tp=2, pp=2, zero_stage=1)                       # every rule checked here
mesh = plan.dims(world_size).build_mesh("cuda")                      # ("dp", "pp", "cp", "tp")
runtime = parallelize(model, plan, mesh, device="cuda")              # compose.py: the order
"""

from megascale.core.parallel.activation_checkpoint import (
    ActivationCheckpointMode,
    apply_activation_checkpointing,
)
from megascale.core.parallel.compose import CheckpointLayout, ParallelRuntime, parallelize
from megascale.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megascale.core.parallel.grad_clip import all_reduce_over_shards, clip_grad_norm_, grad_norm
from megascale.core.parallel.materialize import materialize
from megascale.core.parallel.mesh import ParallelDims
from megascale.core.parallel.overlap import column_parallel_matmul, row_parallel_matmul
from megascale.core.parallel.plan import ParallelPlan
from megascale.core.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayerNorm,
    TensorParallelRMSNorm,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    local,
)
from megascale.core.parallel.tp_comm import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)
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
    "apply_tensor_parallel_plan": "megascale.core.parallel.tp_plan",
    "ScheduleDecoupled1F1B": "megascale.core.parallel.pipeline_schedules",
    "ScheduleTimeline": "megascale.core.parallel.pipeline_schedules",
    "TimelineEvent": "megascale.core.parallel.pipeline_schedules",
    "directional_p2p_groups": "megascale.core.parallel.pipeline_schedules",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
