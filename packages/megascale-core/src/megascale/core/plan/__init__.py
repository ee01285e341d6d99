"""megascale plan: predict the memory and speed of tp × pp × dp × ZeRO × micro-batching layouts, and rank them.

    from megascale.core.plan import ClusterSpec, Workload, gpu_spec, search
    ranked = search(Workload(config, seq_len=2048, global_batch=1536), ClusterSpec(gpu_spec("a100"), gpus=1024))
    best = ranked[0]   # .layout (a ParallelPlan + dp + micro-batch), .memory (per GPU), .step (time, breakdown)

Memory (``memory.py``, ``activations.py``) is checked tensor by tensor against CPU runs (``tests/core/plan``);
throughput (``throughput.py``, per-kernel rates per GPU kind in ``rates.py``) against Megatron-LM 2021's
published A100 table and steps measured on one H200 (``published.py``, ``benchmarks/plan_megatron.py``), and
bounded by the best MFU measured on each kind. ``megascale plan`` is the command line (``cli.py``). A Hugging Face config.json (Llama, Qwen2, Qwen3, Mistral)
plans as the GPTConfig it converts to; a module of your own plans its memory from its parameters, its
``tensor_parallel_plan`` and one measured micro-batch (``module.py``: ``module_memory``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megascale.core._lazy import lazy_exports

if TYPE_CHECKING:
    from megascale.core.plan.activations import ActivationModel as ActivationModel
    from megascale.core.plan.check import memory_warning as memory_warning
    from megascale.core.plan.cluster import A100_80GB as A100_80GB
    from megascale.core.plan.cluster import GPUS as GPUS
    from megascale.core.plan.cluster import H100_SXM as H100_SXM
    from megascale.core.plan.cluster import H200 as H200
    from megascale.core.plan.cluster import MATMUL_EFFICIENCY as MATMUL_EFFICIENCY
    from megascale.core.plan.cluster import ClusterSpec as ClusterSpec
    from megascale.core.plan.cluster import GPUSpec as GPUSpec
    from megascale.core.plan.cluster import gpu_spec as gpu_spec
    from megascale.core.plan.layout import OPTIMIZER_STATES as OPTIMIZER_STATES
    from megascale.core.plan.layout import Kernels as Kernels
    from megascale.core.plan.layout import Layout as Layout
    from megascale.core.plan.layout import Runtime as Runtime
    from megascale.core.plan.layout import Workload as Workload
    from megascale.core.plan.memory import MemoryEstimate as MemoryEstimate
    from megascale.core.plan.memory import RankMemory as RankMemory
    from megascale.core.plan.memory import predict_memory as predict_memory
    from megascale.core.plan.memory import rank_memory as rank_memory
    from megascale.core.plan.module import RankMemoryOfModule as RankMemoryOfModule
    from megascale.core.plan.module import measure_activations as measure_activations
    from megascale.core.plan.module import module_memory as module_memory
    from megascale.core.plan.rates import KernelRates as KernelRates
    from megascale.core.plan.search import Candidate as Candidate
    from megascale.core.plan.search import Fixed as Fixed
    from megascale.core.plan.search import enumerate_layouts as enumerate_layouts
    from megascale.core.plan.search import search as search
    from megascale.core.plan.throughput import StepEstimate as StepEstimate
    from megascale.core.plan.throughput import predict_step as predict_step

_LAZY = {
    "A100_80GB": "megascale.core.plan.cluster",
    "ActivationModel": "megascale.core.plan.activations",
    "Candidate": "megascale.core.plan.search",
    "ClusterSpec": "megascale.core.plan.cluster",
    "Fixed": "megascale.core.plan.search",
    "GPUS": "megascale.core.plan.cluster",
    "GPUSpec": "megascale.core.plan.cluster",
    "H100_SXM": "megascale.core.plan.cluster",
    "H200": "megascale.core.plan.cluster",
    "KernelRates": "megascale.core.plan.rates",
    "Kernels": "megascale.core.plan.layout",
    "Layout": "megascale.core.plan.layout",
    "MATMUL_EFFICIENCY": "megascale.core.plan.cluster",
    "MemoryEstimate": "megascale.core.plan.memory",
    "OPTIMIZER_STATES": "megascale.core.plan.layout",
    "RankMemory": "megascale.core.plan.memory",
    "RankMemoryOfModule": "megascale.core.plan.module",
    "Runtime": "megascale.core.plan.layout",
    "StepEstimate": "megascale.core.plan.throughput",
    "Workload": "megascale.core.plan.layout",
    "enumerate_layouts": "megascale.core.plan.search",
    "gpu_spec": "megascale.core.plan.cluster",
    "measure_activations": "megascale.core.plan.module",
    "memory_warning": "megascale.core.plan.check",
    "module_memory": "megascale.core.plan.module",
    "predict_memory": "megascale.core.plan.memory",
    "predict_step": "megascale.core.plan.throughput",
    "rank_memory": "megascale.core.plan.memory",
    "search": "megascale.core.plan.search",
}
__all__ = list(_LAZY)
lazy_exports(__name__, _LAZY)
