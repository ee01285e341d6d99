"""Tensor parallelism: each layer's weights split over the "tp" ranks, with sequence parallelism between them.

- ``apply``: ``apply_tensor_parallel`` for a megascale GPT, and its layers' tensor-parallel forms.
- ``user_model``: a model of your own, by its ``tensor_parallel_plan`` (``apply_tensor_parallel_plan``).
- ``region_check``: the first forward's check that no replicated parameter is left with a partial gradient.
- ``comm``: the collectives between regions (copy/reduce, gather/scatter of sequence shards).
- ``overlap``: column/row-parallel GEMMs with their collectives in chunks, overlapped.
- ``cross_entropy``: the next-token loss over a vocabulary split in columns.
"""

from megascale.core.parallel.tp.apply import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayerNorm,
    TensorParallelRMSNorm,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    apply_tensor_parallel,
)
from megascale.core.parallel.tp.comm import (
    SequenceSplitOverMesh,
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceSplitOverMesh",
    "TensorParallelLayerNorm",
    "TensorParallelRMSNorm",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
]
