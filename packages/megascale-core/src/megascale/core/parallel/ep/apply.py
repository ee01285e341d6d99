"""apply_expert_parallel: MoE layers (a megascale GPT's, or a model's own) keep 1/ep of their experts per rank.

Each MoE layer's expert stacks (``GroupedExperts``: gate, up, down, experts first) become DTensors split over
"ep" on their first dimension (Shard(0)), so initialisation, Hugging Face loading and checkpoints see whole
tensors, each rank holding its experts' rows; the layer gets an ``AllToAllDispatcher``. The router, attention
and everything else stay whole on every rank, each computing its own batch as under data parallelism.

Gradients: a rank's experts receive the gradient of every ep rank's tokens (the all-to-all's backward), a sum
over ep batches where a dense parameter has its own batch's; the dispatcher divides it by ep and
``ExpertReplicas`` (ZeRO-0/1) or the experts' FSDP2 units (ZeRO-2/3, ``shard_experts``) average it over "edp",
the ranks holding the same experts, so that it is the mean over all dp batches like every other gradient (one
process on the union batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from megascale.core.model.moe import MoE, moe_layers
from megascale.core.parallel.ep.dispatch import AllToAllDispatcher
from megascale.core.parallel.zero import ZeroRuntime

if TYPE_CHECKING:
    from megascale.core.config import GPTConfig
    from megascale.core.parallel.wait_timer import WaitTimer

__all__ = ["ExpertReplicas", "apply_expert_parallel", "check_expert_parallel", "expert_mesh", "expert_params"]


class ExpertLayout(Protocol):
    """What ``check_expert_parallel`` reads of a layout (a ``ParallelPlan`` has it; ep/ does not import plan)."""

    @property
    def ep(self) -> int: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def zero1_sharding(self) -> str | None: ...


def check_expert_parallel(config: GPTConfig, plan: ExpertLayout) -> None:
    """Raise ValueError for what a GPT of ``config`` cannot do under ``plan`` (a ``ParallelPlan``) because of its
    mixture of experts or of ``plan.ep``, naming what to change."""
    moe = config.moe
    if moe is None:
        if plan.ep > 1:
            raise ValueError(
                f"ep={plan.ep}: expert parallelism splits a mixture of experts, and this GPT has none; set "
                "GPTConfig.moe (MoEConfig) or use ep=1"
            )
        return
    if moe.num_experts % plan.ep:
        fits = [n for n in range(1, moe.num_experts + 1) if moe.num_experts % n == 0]
        raise ValueError(
            f"num_experts={moe.num_experts} cannot be split over ep={plan.ep} ranks: each needs the same number "
            f"of experts; choose ep among {fits}"
        )
    if plan.ep > 1 and plan.zero_stage == 1 and plan.zero1_sharding != "parameters":
        raise ValueError(
            f"ep={plan.ep} with zero_stage=1 needs zero1_sharding='parameters' (each parameter's optimizer state "
            "on one owner): with 'elements' the experts' gradient pieces, scattered over other ranks than the "
            "dense ones', would be counted wrongly by the global gradient norm; or use zero_stage 0, 2 or 3"
        )


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """``mesh`` (("dp", "pp", "cp", "tp")) with "dp" seen as ("edp", "ep"): consecutive dp ranks share their
    experts' tokens, every ep-th one holds the same experts."""
    dp = mesh["dp"].size()
    if dp % ep:
        raise ValueError(
            f"ep={ep} must divide the data-parallel size dp={dp}: the expert-parallel ranks are data-parallel "
            f"ranks; choose ep among {[n for n in range(1, dp + 1) if dp % n == 0]}"
        )
    return mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep"))


def apply_expert_parallel(
    module: nn.Module, ep_mesh: DeviceMesh, chunks: int = 2
) -> list[AllToAllDispatcher]:
    """Split every MoE layer under ``module`` (a megascale GPT's, or a model of your own using
    ``megascale.core.model.moe.MoE``) over ``ep_mesh`` (1-D, "ep"), in place; on the meta device too.
    ``chunks``: see ``AllToAllDispatcher``. Returns the layers' dispatchers."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    named = [(n, m) for n, m in module.named_modules() if isinstance(m, MoE)]
    if not named:
        raise ValueError(
            f"ep={ep}: expert parallelism splits mixtures of experts, and {type(module).__name__} holds none (a "
            "megascale GPT with GPTConfig.moe, or megascale.core.model.moe.MoE layers in a model of your own); "
            "use ep=1"
        )
    for name, layer in named:
        experts = layer.router.moe.num_experts
        if experts % ep:
            fits = [n for n in range(1, experts + 1) if experts % n == 0]
            raise ValueError(
                f"MoE layer {name or type(module).__name__}: num_experts={experts} cannot be split over ep={ep} "
                f"ranks; choose ep among {fits}"
            )
    dispatchers = []
    for _, layer in named:
        stacks = layer.experts
        for name, param in list(stacks.named_parameters(recurse=False)):
            dt = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            setattr(stacks, name, nn.Parameter(dt, requires_grad=param.requires_grad))
        dispatcher = AllToAllDispatcher(ep_mesh.get_group(), layer.router.moe.num_experts, chunks)
        layer.dispatcher = dispatcher
        dispatchers.append(dispatcher)
    return dispatchers


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    """The expert stacks under ``module`` (split over "ep" once ``apply_expert_parallel`` ran)."""
    return [p for layer in moe_layers(module) for p in layer.experts.parameters()]


def shard_experts(
    module: nn.Module, edp_mesh: DeviceMesh, *, stage: int, param_dtype: torch.dtype | None
) -> None:
    """ZeRO-2/3 of the experts: each MoE layer's experts one FSDP2 unit over "edp" (the ranks holding the same
    experts; FSDP2 composes it with their "ep" split as with tensor parallelism), made before the dense
    parameters' units, which then leave them out; their gradients are averaged over edp as they are
    reduce-scattered."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in moe_layers(module):
        fully_shard(layer.experts, mesh=edp_mesh, reshard_after_forward=stage == 3, mp_policy=policy)


@torch.no_grad()
def broadcast_expert_replicas(params: list[nn.Parameter], edp_mesh: DeviceMesh) -> None:
    """Every rank holding the same experts starts from the first one's values (as dense replicas do)."""
    from megascale.core._dtensor import local

    if edp_mesh.size() == 1:
        return
    group = edp_mesh.get_group()
    for p in params:
        dist.broadcast(local(p), src=dist.get_global_rank(group, 0), group=group)


class ExpertReplicas(ZeroRuntime):
    """The dense parameters' ZeRO (``dense``) beside the experts': where several ranks hold the same experts,
    their gradients averaged over them (and, at ZeRO-1, their optimizer state sharded over them) by
    ``experts``. Every hook of ``ZeroRuntime`` reaches both."""

    checkpoint_partial = True  # ep ranks hold different experts

    def __init__(
        self, dense: ZeroRuntime, experts: ZeroRuntime | None, edp_group: dist.ProcessGroup | None,
        alone: Sequence[nn.Parameter] = (),
    ) -> None:  # fmt: skip
        """``alone``: expert parameters no ZeRO runtime takes (no other rank holds them: edp = 1) while the
        dense ones' optimizer state is sharded; checkpoint loading creates their state here."""
        self.dense, self.experts = dense, experts
        self.stage = dense.stage
        self.edp_group = edp_group
        self._alone = {id(p) for p in alone}

    def _each(self) -> list[ZeroRuntime]:
        return [self.dense] if self.experts is None else [self.dense, self.experts]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with ExitStack() as stack:
            for runtime in self._each():
                stack.enter_context(runtime.no_sync())
            yield

    def before_backward(self, loss: Tensor) -> Tensor:
        for runtime in self._each():
            loss = runtime.before_backward(loss)
        return loss

    def after_backward(self) -> None:
        for runtime in self._each():
            runtime.after_backward()

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        for runtime in self._each():
            runtime.attach_optimizers(optimizers)

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        for runtime in self._each():
            runtime.before_optimizer_step(optimizer)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        for runtime in self._each():
            runtime.after_optimizer_step(optimizer)

    def wait_for_params(self) -> None:
        for runtime in self._each():
            runtime.wait_for_params()

    def prepare_optimizer_state(self, optimizer: Optimizer) -> None:
        for runtime in self._each():
            runtime.prepare_optimizer_state(optimizer)
        if self._alone:  # a loading template must hold their state too: nothing else creates it
            from megascale.core.parallel.zero.optimizer_state import init_optimizer_state, optimizer_params

            init_optimizer_state(optimizer, [p for p in optimizer_params(optimizer) if id(p) in self._alone])

    def holds_all_optimizer_states(self, optimizer: Optimizer) -> bool:
        return all(runtime.holds_all_optimizer_states(optimizer) for runtime in self._each())

    def grad_sum_group(self) -> dist.ProcessGroup | None:
        return self.dense.grad_sum_group()  # None: check_expert_parallel refuses ZeRO-1 by elements

    def set_whole_gradients(self, whole: bool) -> None:
        for runtime in self._each():
            runtime.set_whole_gradients(whole)

    def replica_group(self) -> dist.ProcessGroup | None:
        # the ranks holding this rank's whole state: the same experts and (ZeRO-0) the same dense parameters
        return self.edp_group if self.dense.replica_group() is not None else None

    def set_wait_timer(self, timer: WaitTimer) -> None:
        for runtime in self._each():
            runtime.set_wait_timer(timer)

    def remove(self) -> None:
        for runtime in self._each():
            runtime.remove()
