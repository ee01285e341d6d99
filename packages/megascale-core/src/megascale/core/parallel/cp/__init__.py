"""Context parallelism: every sequence split over the "cp" ranks, attention exchanging keys/values.

- ``sharding``: two mirrored chunks per rank (balanced causal work), their positions; ``shard_sequence``
  for the data.
- ``balance``: the blocks each rank holds in a step, head and tail or dealt by packed documents' work.
- ``kv_exchange``: the keys/values a rank lacks, all-gathered (full attention) or only the sliding window's
  tails, point to point.
- ``attention``: ``ContextParallel``, what an attention core calls under cp.
- ``loss``: the whole sequence's mean loss from each rank's part.
- ``apply``: ``apply_context_parallel`` for a megascale GPT.
- ``user_model``: a model of your own, by its ``context_parallel_plan``.
- ``block_attention``: attention block by block over runs of positions (nothing quadratic kept);
  ``flex_blocks``: the same as one FlexAttention call (the GPU's path).
"""

from megascale.core.parallel.cp.apply import apply_context_parallel, check_context_parallel
from megascale.core.parallel.cp.attention import ContextParallel
from megascale.core.parallel.cp.kv_exchange import HaloPlan, exchange_halo, gather_kv, halo_plan
from megascale.core.parallel.cp.loss import ContextParallelLoss
from megascale.core.parallel.cp.sharding import positions, shard_sequence, unshard_sequence
from megascale.core.parallel.cp.user_model import apply_context_parallel_plan, check_context_parallel_plan

__all__ = [
    "ContextParallel",
    "ContextParallelLoss",
    "HaloPlan",
    "apply_context_parallel",
    "apply_context_parallel_plan",
    "check_context_parallel",
    "check_context_parallel_plan",
    "exchange_halo",
    "gather_kv",
    "halo_plan",
    "positions",
    "shard_sequence",
    "unshard_sequence",
]
