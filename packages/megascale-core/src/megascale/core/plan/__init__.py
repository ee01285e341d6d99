"""megascale plan: predict the memory and speed of tp × pp × dp × ZeRO × micro-batching layouts, and rank them.

    from megascale.core.plan import ClusterSpec, Workload, gpu_spec, search
    ranked = search(Workload(config, seq_len=2048, global_batch=1536), ClusterSpec(gpu_spec("a100"), gpus=1024))
    best = ranked[0]   # .layout (a ParallelPlan + dp + micro-batch), .memory (per GPU), .step (time, breakdown)

Memory (``memory.py``, ``activations.py``) is checked tensor by tensor against CPU runs (``tests/core/plan``);
throughput (``throughput.py``) against Megatron-LM 2021's published table (``published.py``,
``benchmarks/plan_megatron.py``). ``megascale plan`` is the command line (``cli.py``). A Hugging Face config.json (Llama, Qwen2, Qwen3, Mistral)
plans as the GPTConfig it converts to; a module of your own plans its memory from its parameters, its
``tensor_parallel_plan`` and one measured micro-batch (``module.py``: ``module_memory``).
"""

from megascale.core.plan.activations import ActivationModel
from megascale.core.plan.check import memory_warning
from megascale.core.plan.cluster import (
    A100_80GB,
    GPUS,
    H100_SXM,
    H200,
    MATMUL_EFFICIENCY,
    ClusterSpec,
    GPUSpec,
    gpu_spec,
)
from megascale.core.plan.layout import OPTIMIZER_STATES, Kernels, Layout, Runtime, Workload
from megascale.core.plan.memory import MemoryEstimate, RankMemory, predict_memory, rank_memory
from megascale.core.plan.module import RankMemoryOfModule, measure_activations, module_memory
from megascale.core.plan.search import Candidate, Fixed, enumerate_layouts, search
from megascale.core.plan.throughput import StepEstimate, predict_step

__all__ = [
    "A100_80GB",
    "GPUS",
    "H100_SXM",
    "H200",
    "MATMUL_EFFICIENCY",
    "OPTIMIZER_STATES",
    "ActivationModel",
    "Candidate",
    "ClusterSpec",
    "Fixed",
    "GPUSpec",
    "Kernels",
    "Layout",
    "MemoryEstimate",
    "RankMemory",
    "RankMemoryOfModule",
    "Runtime",
    "StepEstimate",
    "Workload",
    "enumerate_layouts",
    "gpu_spec",
    "measure_activations",
    "memory_warning",
    "module_memory",
    "predict_memory",
    "predict_step",
    "rank_memory",
    "search",
]
