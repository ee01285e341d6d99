"""Expert parallelism: a mixture of experts' experts split over the "ep" ranks, tokens moved by all-to-all.

The "ep" ranks are data-parallel ranks (Megatron's and torchtitan's layout): every rank keeps the whole dense
model and its own batch, and 1/ep of each MoE layer's experts. The data-parallel dimension is seen as
("edp", "ep"): dense parameters are averaged over all of dp, experts over "edp" (the ranks holding the same
experts).

- ``dispatch``: ``AllToAllDispatcher``, which sends each routed token to its experts' rank and the outputs back
  (uneven splits: dropless).
- ``apply``: ``apply_expert_parallel`` for a megascale GPT; ``check_expert_parallel`` for a plan.
"""

from megascale.core.parallel.ep.apply import apply_expert_parallel, check_expert_parallel, expert_mesh
from megascale.core.parallel.ep.dispatch import AllToAllDispatcher

__all__ = ["AllToAllDispatcher", "apply_expert_parallel", "check_expert_parallel", "expert_mesh"]
