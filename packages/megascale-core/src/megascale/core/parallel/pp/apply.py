"""Pipeline parallelism for any model that lists its layers: cut them into stages, keep each rank's, run the
microbatches.

A model joins by two methods (``megascale.core.model.layers``): ``pipeline_layers()`` — its layers in order,
``first`` (embedding), ``blocks``, ``last`` (norm, head) — and ``pipeline_loss(output, target)``. A megascale
GPT has both. ``split_blocks`` gives each of the P·V stages a run of consecutive blocks (the first stage also
holds the first layers, the last stage the last layers and the loss); rank r of the pipeline group holds stages
r, r+P, r+2P, ... (V > 1: the interleaved schedule's "virtual stages"). ``apply_pipeline``:

1. checks that every parameter of the model lives in one of its layers, and that no parameter is shared by
   layers of different stages (tied embeddings), naming any that do not;
2. prunes the model to this rank's layers — on the meta device, before anything is allocated, so no rank ever
   materialises the whole model — removing the others from their parents (a ``ModuleDict`` entry is deleted, a
   ``ModuleList`` entry replaced by an empty ``PrunedLayer`` so the kept ones keep their indices, an attribute
   set to None): every kept parameter keeps its name, so checkpoints reshard between pipeline layouts;
3. returns one ``StageModule`` per stage it holds: a view over the model's own layers (shared, not copied).

``build_pipeline`` then builds the ``PipelineStage``s (torch.distributed.pipelining) and a schedule — "gpipe",
"1f1b" (megascale's decoupled 1F1B), "interleaved" (V ≥ 2; torch's, receives prefetched) — over the finished
stage modules, and makes the model's calls run it: ``model(inputs, targets)`` runs forward and backward of every microbatch in training and
returns the loss (the last stage's mean, broadcast to every stage), already backpropagated; under ``no_grad``
forward only (validation); ``model(inputs)`` returns the outputs, broadcast from the last stage. The model's
class is swapped for a subclass whose ``forward`` does that (as ``fully_shard`` swaps classes): code that calls
``model(x, y)`` (a LightningModule's training_step) drives the pipeline unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining._utils import _make_tensor_from_meta, to_local_if_dtensor
from torch.distributed.pipelining.stage import _RecvInfo

from megascale.core.model.layers import PipelineLayers, pipeline_layers_of
from megascale.core.parallel.plan import SCHEDULES, ParallelPlan, split_blocks
from megascale.core.parallel.pp.foreign import ForeignParameters
from megascale.core.parallel.pp.interleaved import (
    ScheduleDecoupledInterleaved1F1B,
    stream_p2p_groups,
    stream_tag,
)
from megascale.core.parallel.pp.split_backward import gradients_off_the_input_path, with_accumulate_hooks
from megascale.core.parallel.pp.tied import TiedCopies, tied_across_stages
from megascale.core.parallel.pp.unreached import UnreachedStages
from megascale.core.parallel.rng import ModelParallelRNG
from megascale.core.parallel.wait_timer import WaitTimer, untimed
from megascale.core.parallel.zero.fsdp import fsdp_param_groups

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PrunedLayer",
    "StageModule",
    "apply_pipeline",
    "build_pipeline",
    "pipelined_modules",
    "split_blocks",
    "stages_of_rank",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb1p"]


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: pp_rank, pp_rank + pp, ... (looped placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


class StageModule(nn.Module):
    """One pipeline stage: its layers, called in turn. Holds the model's own layer modules, so parameters are
    shared, not copied; ``segments`` are its (first, blocks, last) layers, for ZeRO units.

    A mixture of experts' balancing losses of the stage's layers ride on its output into backward, weighted as
    the schedule weighs a microbatch's loss (``loss_weight``); ``balancing_sum`` adds up their values over the
    step's microbatches, for the reported loss."""

    loss_weight: float = 1.0

    def __init__(
        self, first: Sequence[nn.Module], blocks: Sequence[nn.Module], last: Sequence[nn.Module]
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([*first, *blocks, *last])
        self.segments = [list(first), list(blocks), list(last)]
        self.balancing_sum: torch.Tensor | float = 0.0
        self._blocks = range(len(first), len(first) + len(blocks))
        #: the model's tensors tied across the first and last stage, by their names (``tied.py``)
        self.tied: list[str] = []
        #: the model's parameters other stages hold, watched for uses in the first step (``foreign.py``)
        self.foreign: ForeignParameters | None = None
        # packed documents: the step's position_ids split as its microbatches are, and the microbatch's own
        # (every pipeline rank holds the whole batch; the stage is told which microbatch it computes)
        self.position_chunks: tuple[torch.Tensor, ...] | None = None
        self.positions: torch.Tensor | None = None

    def select_microbatch(self, index: int) -> None:
        self.positions = None if self.position_chunks is None else self.position_chunks[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.positions
        with self.foreign.watch() if self.foreign is not None else nullcontext():
            for i, layer in enumerate(self.layers):
                # blocks of a model taking position_ids (blocks_take_position_ids) get them as a second input
                x = layer(x) if positions is None or i not in self._blocks else layer(x, positions)
        if self.training and torch.is_grad_enabled():
            from megascale.core.model.moe import attach_balancing_losses

            x, value = attach_balancing_losses(x, self, self.loss_weight)
            if value is not None:  # a tensor: no device sync per microbatch
                self.balancing_sum = self.balancing_sum + value.float()
        return x


class PrunedLayer(nn.Module):
    """Stands where a layer held by another pipeline rank was, in an ``nn.ModuleList`` (or anywhere, carrying
    the layer's tensors tied to this rank's layers, under their names: ``tied.py``)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this layer lives on another pipeline rank: run the model through its pipeline")

    def reset_parameters(self) -> None:
        """Nothing: what it carries takes its values from the stage holding the layer (``TiedCopies``)."""


def pipelined_modules(root: nn.Module) -> list[nn.Module]:
    """The modules in ``root``'s tree that can be pipelined (``pipeline_layers`` and ``pipeline_loss``),
    outermost first (one inside another is not listed)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside:
            continue
        if callable(getattr(module, "pipeline_layers", None)) and callable(
            getattr(module, "pipeline_loss", None)
        ):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _parents(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    out: dict[int, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            out.setdefault(id(child), (parent, name))
    return out


def _remove(
    model: nn.Module, layer: nn.Module, parents: dict[int, tuple[nn.Module, str]], keep: set[int]
) -> None:
    """Remove ``layer`` from the model; the tensors in ``keep`` (tied to this rank's layers) stay where they
    were, in a ``PrunedLayer`` standing in for it."""
    parent, name = parents[id(layer)]
    stub = _carrying(layer, keep)
    if isinstance(parent, nn.ModuleDict):
        if stub is None:
            del parent[name]
        else:
            parent[name] = stub
    elif isinstance(parent, nn.ModuleList):
        parent[int(name)] = stub or PrunedLayer()
    else:
        setattr(parent, name, stub)


def _carrying(layer: nn.Module, keep: set[int]) -> PrunedLayer | None:
    """A ``PrunedLayer`` holding ``layer``'s tensors in ``keep`` under their names in it, or None."""
    kept = [(n, p) for n, p in layer.named_parameters(remove_duplicate=False) if id(p) in keep]
    if not kept:
        return None
    stub = PrunedLayer()
    for name, p in kept:
        *path, leaf = name.split(".")
        holder: nn.Module = stub
        for part in path:
            if not hasattr(holder, part):
                holder.add_module(part, PrunedLayer())
            holder = getattr(holder, part)
        holder.register_parameter(leaf, p)
    return stub


def _check_layers(
    model: nn.Module, layers: PipelineLayers, stage_of: dict[int, int], num_stages: int, name: str
) -> dict[str, tuple[str, str]]:
    """Every parameter in a layer; none shared by layers of different stages but the first and the last
    (tied embeddings): {name: (its first-stage layer, its last-stage layer)} of those."""
    owner: dict[int, list[tuple[int, str]]] = {}
    module_names = {id(m): n for n, m in model.named_modules()}
    for layer in layers.all():
        for p in layer.parameters():
            where = module_names.get(id(layer), type(layer).__name__)
            owner.setdefault(id(p), []).append((stage_of[id(layer)], where))
    first_names = {id(p): n for n, p in model.named_parameters()}  # a shared tensor: its first name
    tied = tied_across_stages(owner, first_names, num_stages, name)
    loose = [n for n, p in model.named_parameters() if id(p) not in owner]
    if loose:
        raise ValueError(
            f"pipeline parallelism: parameters {loose} of {name} belong to no layer of its pipeline_layers(), so "
            "no stage would hold them: list every layer (first / blocks / last), or move these parameters into one"
        )
    return tied


class Pipeline:
    """This rank's stages and the schedules that run them; ``attach`` makes a model's calls use them."""

    def __init__(
        self,
        stage_modules: list[StageModule],
        stage_ids: list[int],
        num_stages: int,
        group: dist.ProcessGroup,
        *,
        schedule: ScheduleName,
        num_microbatches: int,
        loss_fn: Any,
        device: torch.device,
    ) -> None:
        self.stage_modules, self.stage_ids, self.num_stages = stage_modules, stage_ids, num_stages
        self.group, self.num_microbatches, self.schedule_name = group, num_microbatches, schedule
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.last_rank = dist.get_global_rank(group, (num_stages - 1) % dist.get_world_size(group))
        self.device = device
        # P2P streams (direction, receiving stage) on their own groups where the backend orders P2P per
        # communicator and ignores tags (NCCL); on gloo the tags keep them apart (interleaved.py)
        self._stream_groups = (
            stream_p2p_groups(group, num_stages)
            if len(stage_ids) > 1 and "gloo" not in str(dist.get_backend(group))
            else {}
        )
        #: the run's dropout streams (set by ``parallelize``), kept out of the stages' shape inference
        self.rng: ModelParallelRNG | None = None
        #: False inside ``ParallelRuntime.no_sync`` (gradient accumulation over steps): the stages reduce no
        #: ZeRO-2/3 gradients (ZeRO-0/1 follow their own no_sync).
        self.sync_gradients = True
        #: how the schedules' blocking receives and sends are timed (``wait_timer.py``)
        self.wait_timer: WaitTimer = untimed
        # The schedule's backward runs on loss × loss_scale / num_microbatches. loss_scale: 1/steps under
        # gradient accumulation, as a trainer divides its loss. The 1/num_microbatches is ours, not torch's
        # scale_grads, which divides the whole .grad after the step — gradients accumulated by earlier
        # steps included. The reported loss is unscaled.
        self.loss_scale = 1.0
        self._loss_fn = loss_fn
        # torch's PipelineStage fixes its buffers' shapes at its first step, so each (purpose, batch shape)
        # gets stages and a schedule of its own, built on first use: training, evaluation (loss, no
        # backward) and logits (no loss) batches of other shapes — a last short batch, a generation prompt.
        self._schedules: dict[tuple[str, tuple[int, ...]], Any] = {}
        #: stages the loss did not reach in a training step get no gradients, as on one process
        self.unreached = UnreachedStages(stage_modules, stage_ids, num_stages, device)
        #: weights tied across the first and last stage (set by ``parallelize``; ``tied.py``)
        self.tied: TiedCopies | None = None
        #: uses of parameters other stages hold, refused after the first step (set by ``parallelize``)
        self.foreign: ForeignParameters | None = None

    @contextmanager
    def random_streams_untouched(self) -> Iterator[None]:
        """Whatever is drawn inside leaves the default generator and the tensor-parallel stream as they were."""
        rng = self.rng
        saved = rng.state_dict() if rng is not None else None
        with torch.random.fork_rng(devices=[self.device] if self.device.type != "cpu" else []):
            yield
        if rng is not None and saved is not None:
            rng.load_state_dict(saved)

    def stream_group(self, direction: str, receiving_stage: int) -> dist.ProcessGroup | None:
        """The process group of a P2P stream, or None for the pipeline's own (see ``_LeanStage._stream``)."""
        return self._stream_groups.get((direction, receiving_stage))

    def _schedule(self, purpose: Literal["train", "eval", "logits"], shape: tuple[int, ...]) -> Any:
        key = (purpose, shape)
        if key not in self._schedules:
            stages: list[Any] = []
            for m, s in zip(self.stage_modules, self.stage_ids):
                stage = _LeanStage(m, s, self.num_stages, self.device, group=self.group)
                stage.pipeline = self
                stages.append(stage)
            kwargs: dict[str, Any] = {
                "loss_fn": None if purpose == "logits" else self._scaled_loss,
                "scale_grads": False,
            }
            name: str
            if purpose == "train":
                n, name = self.num_microbatches, self.schedule_name
            else:  # forward only: any batch size, as many microbatches as divide it (up to the configured)
                n = max(d for d in range(1, self.num_microbatches + 1) if shape[0] % d == 0)
                name = "looped" if len(stages) > 1 else "gpipe"
            if name == "interleaved":
                if self._stream_groups:  # off gloo: one set of per-stream groups, shared by every schedule
                    kwargs["p2p_groups"] = self._stream_groups
                self._schedules[key] = ScheduleDecoupledInterleaved1F1B(stages, n, **kwargs)
            elif name == "zb1p":  # torch's: input gradients (B), then weight gradients (W) filling the bubble
                for stage in stages:  # W reads the saved inputs: a pooled buffer would be reused before it
                    stage.pool_receives = False
                self._schedules[key] = ScheduleInterleavedZeroBubble(stages, n, **kwargs)
            elif name == "looped":
                self._schedules[key] = ScheduleLoopedBFS(stages, n, **kwargs)
            elif name == "1f1b":
                self._schedules[key] = _one_f_one_b()(stages[0], n, **kwargs)
            else:
                self._schedules[key] = ScheduleGPipe(stages[0], n, **kwargs)
            self._schedules[key].wait_timer = self.wait_timer  # torch's own schedules ignore it
        return self._schedules[key]

    def set_wait_timer(self, timer: WaitTimer) -> None:
        """Time the decoupled schedules' waits on receives and sends with ``timer`` (and, a ``Timers``, each
        microbatch's forward and backward)."""
        self.wait_timer = timer
        for schedule in self._schedules.values():
            schedule.wait_timer = timer

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # training only backpropagates through this; evaluation divides the scale back out of its losses
        return self._loss_fn(output, target) * (self.loss_scale / self.num_microbatches)

    def _check_batch(self, tokens: torch.Tensor) -> None:
        if tokens.shape[0] % self.num_microbatches:
            raise ValueError(
                f"a batch of {tokens.shape[0]} sequences cannot be split into num_microbatches="
                f"{self.num_microbatches} equal microbatches: make the per-rank batch size a multiple of it"
            )

    @contextmanager
    def _positions(self, position_ids: torch.Tensor | None, schedule: Any) -> Iterator[None]:
        """The stages' position_ids for this step, split into the schedule's microbatches (packed documents)."""
        chunks = None if position_ids is None else position_ids.tensor_split(schedule._n_microbatches)
        for stage in self.stage_modules:
            stage.position_chunks, stage.positions = chunks, None
        try:
            yield
        finally:
            for stage in self.stage_modules:
                stage.position_chunks, stage.positions = None, None

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        backward: bool,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean loss over the batch on every rank of the pipeline; with ``backward`` the gradients of every
        microbatch are accumulated into this rank's parameters (scaled by 1/num_microbatches).
        ``position_ids``: packed documents (the whole batch's, on every rank; see ``GPT.forward``)."""
        if backward:
            self._check_batch(tokens)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        schedule = self._schedule("train" if backward else "eval", tuple(tokens.shape))
        scale = self.loss_scale / self.num_microbatches  # what _scaled_loss multiplies by
        for stage in self.stage_modules:  # a mixture of experts' balancing losses, weighted alike
            stage.loss_weight, stage.balancing_sum = scale, 0.0
        # return_outputs=False: the last stage keeps no microbatch's output (the logits) once its loss is taken
        with self._positions(position_ids, schedule):
            if backward:
                if self.tied is not None:
                    self.tied.begin_backward()
                self.unreached.begin()
                schedule.step(*args, return_outputs=False, **kwargs)
                self.unreached.end()
                if self.foreign is not None:  # one training step watched: what it found waits for verdict()
                    self.foreign.stop_watching()
            else:
                with torch.no_grad():  # evaluation in train or eval mode alike: no microbatch keeps its graph
                    schedule.eval(*args, return_outputs=False, **kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).mean() / scale if self.has_last else None
        if loss is None:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        balancing = sum(stage.balancing_sum for stage in self.stage_modules) / self.num_microbatches
        if balancing:  # every stage's balancing losses join the reported loss (what one process returns)
            loss = loss + balancing
        # every stage logs the same loss (the last stage's, plus each stage's balancing losses); the last stage
        # waits here for the first stages' last backward
        with self.wait_timer("pipeline-loss"):
            dist.all_reduce(loss, group=self.group)
        return loss

    @torch.no_grad()
    def outputs(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model's outputs for ``inputs`` (forward only; float32), on every rank of the pipeline."""
        schedule = self._schedule("logits", tuple(inputs.shape))
        with self._positions(position_ids, schedule):
            out = schedule.eval(*((inputs,) if self.has_first else ()))
        shape = torch.zeros(8, dtype=torch.long, device=self.device)  # (ndim, sizes...) of the output
        if self.has_last:
            assert isinstance(out, torch.Tensor) and out.dim() < 8
            shape[0] = out.dim()
            shape[1 : 1 + out.dim()] = torch.tensor(out.shape)
        dist.broadcast(shape, src=self.last_rank, group=self.group)
        if not self.has_last:
            out = torch.empty(shape[1 : 1 + int(shape[0])].tolist(), dtype=torch.float32, device=self.device)
        result = out.float().contiguous()
        dist.broadcast(result, src=self.last_rank, group=self.group)
        return result

    def attach(self, model: nn.Module) -> None:
        """Make ``model(inputs, targets)`` and ``model(inputs)`` run this pipeline (see the module docstring)."""
        model.__class__ = _pipelined_class(type(model))
        model._megascale_pipeline = self  # type: ignore[assignment]


@contextmanager
def _unused_not_reduced(module: nn.Module) -> Iterator[None]:
    """torch infers the shapes of a stage's input gradients with a backward through it (``autograd.grad``: no
    parameter gets a gradient), which fires FSDP's post-backward: ZeRO-2/3 here reduce-scatter unused
    parameters (zero/used_params.py), which would give every parameter a zero gradient there. Not inside."""
    groups = fsdp_param_groups(module)
    before = [group.reduce_scatter_unused_params for group in groups]
    for group in groups:
        group.reduce_scatter_unused_params = False
    try:
        yield
    finally:
        for group, value in zip(groups, before):
            group.reduce_scatter_unused_params = value


class _LeanStage(PipelineStage):
    """torch's ``PipelineStage``, holding outputs no longer than needed and reducing ZeRO-2/3 gradients during
    the last microbatch's backward.

    Outputs: torch's stage caches every forward's output until that microbatch's backward (``fwd_cache``), and
    without a backward (evaluation) until the next step: the last stage would keep all M microbatches' logits
    alive. Here, without a backward, the cache entry goes as soon as the output is sent (its send holds the
    tensor until delivered) or, on the last stage, as soon as the forward returns (the schedule takes the loss
    from the returned output); with one, the last stage caches only the inputs (its backward starts from the
    loss, whose graph holds what it needs of the logits).

    Gradients: torch runs every microbatch's backward with FSDP's gradient sync off and reduce-scatters every
    unit after the last one (``perform_reduce_grad``), one after another, overlapping nothing. Here the last
    microbatch's backward runs with sync on, so FSDP reduce-scatters each unit as backward finishes it, while
    the earlier units' gradients are computed; ``perform_reduce_grad`` then finds nothing left to reduce. Under
    the runtime's ``no_sync`` (gradient accumulation over pipeline steps) nothing is reduced: the gradients
    stay unsharded sums until the step that syncs.

    Receive buffers: torch's stage allocates an activation and a gradient receive buffer for every microbatch
    and keeps them all, though a schedule has only a few microbatches between posting a receive and finishing
    that microbatch's backward. In training, here each direction's buffers are pooled (``_RecvPool``): a
    microbatch borrows a set when its receive is posted and returns it after its backward, so a stage holds as
    many as it has microbatches in flight (1F1B: min(P - s + 1, M) activations and 2 gradients on stage s;
    GPipe: M activations, 1 gradient; ``plan.schedule.receive_buffers`` counts them). Every element of a
    buffer is overwritten by its receive, so results are unchanged bit for bit. (torch still allocates one
    per microbatch when it sets the stage up, in the first step; all but one set are dropped right away.)
    ``pool_receives = False`` keeps torch's per-microbatch buffers.
    """

    pipeline: Pipeline
    #: pool the training schedule's receive buffers (see above); False: torch's one per microbatch
    pool_receives: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pools: dict[str, _RecvPool] = {}  # "F" activations, "B" gradients: while training
        self._reduced_in_backward = False  # FSDP reduced during the step's last (whole) backward

    def _syncs(self) -> bool:
        return self.pipeline.sync_gradients

    # torch infers the stages' shapes by running a real forward (and backward) of the first microbatch, once
    # per process: its dropout must not draw from the run's random streams, or a run restarted from a
    # checkpoint (which infers again, mid-run) would draw other masks than the uninterrupted one; nor may its
    # routers count that microbatch's tokens twice (loss-free balancing steers by the counts).
    def _prepare_forward_infra(
        self, num_microbatches: int, args: Any, kwargs: Any = None, has_backward: bool = False
    ) -> Any:
        from megascale.core.model.moe import routing_statistics_untouched

        balancing = self.submod.balancing_sum if isinstance(self.submod, StageModule) else 0.0
        with self.pipeline.random_streams_untouched(), routing_statistics_untouched(self.submod):
            out = super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward=has_backward)
        if isinstance(self.submod, StageModule):
            self.submod.balancing_sum = balancing
        self._pools = {}  # (re)built: torch has just allocated one buffer per microbatch again
        if has_backward and self.pool_receives and not self.is_first:
            self._pools["F"] = _RecvPool(self.args_recv_info, self.device)
        return out

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.pipeline.random_streams_untouched(), _unused_not_reduced(self.submod):
            out = super()._prepare_backward_infra(*args, **kwargs)
        if self.pool_receives and not self.is_last:
            self._pools["B"] = _RecvPool(self.grad_recv_info, self.device)
        return out

    def receive_buffers(self) -> list[torch.Tensor]:
        """Every receive buffer this stage holds: in a microbatch's receive info, lent, or pooled."""
        infos = [
            i for per_mb in (*self.args_recv_info.values(), *self.grad_recv_info.values()) for i in per_mb
        ]
        held = {id(i.buffer): i.buffer for i in infos if isinstance(i.buffer, torch.Tensor)}
        for pool in self._pools.values():
            held.update((id(t), t) for t in pool.buffers())
        return list(held.values())

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if backward_type == "input":  # zb1p's B half (split_backward.py)
            gradients_off_the_input_path(self.submod, bwd_kwargs)
        if not (last_backward and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        sync = self._syncs()
        self.submod.set_is_last_backward(sync)
        self.submod.set_reshard_after_backward(sync)
        self.submod.set_requires_gradient_sync(sync)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        self._reduced_in_backward = sync
        return grads, None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        reduced, self._reduced_in_backward = self._reduced_in_backward, False
        if not isinstance(self.submod, FSDPModule) or (not reduced and self._syncs()):
            # a split backward (zb1p: B, then W, with FSDP's sync off): torch's end of backward reduces
            super().perform_reduce_grad(grad_scale_factor)
            return
        # The last full backward ran with FSDP's gradient sync on (backward_maybe_with_nosync), so autograd
        # already ran FSDP's end of backward: every unit reduced and finalised. torch's own would call every
        # unit's post_backward again, a no-op only while FSDP skips parameters without a gradient; ZeRO-2/3
        # here reduce-scatter those too (zero/used_params.py), so it would reduce-scatter zeros a second time.
        # (A split backward, B then W, would need torch's call here: this stage runs full backwards only.)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:  # (a split backward, not run here, would still need them until its weight half)
            sending = self.bwd_cache.get(bwd_chunk_id, ())  # the input gradients, sent after this
            for pool in self._pools.values():
                pool.give_back(bwd_chunk_id, sending)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """zb1p's W half; the first stage's is a whole backward, whose hooks autograd runs (split_backward.py)."""
        run = super().backward_weight_one_chunk
        if self.stage_index == 0:
            run(bwd_chunk_id, last_backward)
            return
        params = [p for p in self.submod.parameters() if p.requires_grad]
        with_accumulate_hooks(params, lambda: run(bwd_chunk_id, last_backward))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        cast(StageModule, self.submod).select_microbatch(fwd_chunk_id)  # its packed documents' positions
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last:
            if not self.has_backward:
                self.fwd_cache.pop(fwd_chunk_id, None)
            else:  # its backward starts from the loss: the output (logits) need not wait for it here
                _, inputs = self.fwd_cache[fwd_chunk_id]
                self.fwd_cache[fwd_chunk_id] = ((), inputs)
        return output

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_last:
            return []  # sends nothing; its cache entry may be gone already
        ops = self._stream(super().get_fwd_send_ops(fwd_chunk_id), "F", self.stage_index + 1)
        if not self.has_backward:
            self.fwd_cache.pop(fwd_chunk_id, None)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if "F" in self._pools:
            self._pools["F"].lend(fwd_chunk_id)
        return self._stream(super().get_fwd_recv_ops(fwd_chunk_id), "F", self.stage_index)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward:  # torch sends zeros for an input the loss did not reach (None): noted
            self.pipeline.unreached.sent(self.stage_index, self.bwd_cache.get(bwd_chunk_id, ()))
        return self._stream(super().get_bwd_send_ops(bwd_chunk_id), "B", self.stage_index - 1)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if "B" in self._pools:
            self._pools["B"].lend(bwd_chunk_id)
        return self._stream(super().get_bwd_recv_ops(bwd_chunk_id), "B", self.stage_index)

    def _stream(self, ops: list[dist.P2POp], direction: str, receiving_stage: int) -> list[dist.P2POp]:
        """The ops on their stream's tag (and, off gloo, group): schedules that post receives early
        (``interleaved.py``) must not let one stream's data match another's receive."""
        tag = stream_tag(direction, receiving_stage)
        group = self.pipeline.stream_group(direction, receiving_stage)
        return [
            dist.P2POp(op.op, op.tensor, group=group or op.group, tag=tag, group_peer=op.group_peer)
            for op in ops
        ]


class _RecvPool:
    """One direction's receive buffers of a stage (see ``_LeanStage``), shared by the microbatches.

    Built from torch's receive infos (one per microbatch, each with its own buffers): keeps the first
    microbatch's buffers as the first free set and takes the others' away. ``lend`` gives a microbatch a free
    set (a new one if none is free) when its receive is posted; ``give_back`` returns it after its backward.
    """

    def __init__(self, infos: dict[int, tuple[_RecvInfo, ...]], device: torch.device) -> None:
        self._infos, self._device = infos, device
        first = infos[min(infos)]
        self._metas = [i.tensor_meta if i.buffer is not None else None for i in first]
        self._free = [[i.buffer for i in first]]
        self._lent: dict[int, list[torch.Tensor | None]] = {}
        self.most_lent = 0  # the most sets lent at once
        for per_mb in infos.values():
            for i in per_mb:
                i.buffer = None  # (a stage that receives has no root arguments)

    def lend(self, mb: int) -> None:
        infos = self._infos[mb]
        if mb in self._lent or any(i.buffer is not None for i in infos):
            return  # holds a set already (lent, or handed over by a stage on this rank)
        if self._free:
            buffers = self._free.pop()
        else:
            buffers = [None if m is None else _make_tensor_from_meta(m, self._device) for m in self._metas]
        for i, b in zip(infos, buffers):
            i.buffer = b
        self._lent[mb] = buffers
        self.most_lent = max(self.most_lent, len(self._lent))

    def give_back(self, mb: int, sending: Sequence[torch.Tensor | None]) -> None:
        buffers = self._lent.pop(mb, None)
        if buffers is None:
            return
        for i in self._infos[mb]:
            i.buffer = None
        # autograd may hand the received gradient on as the input gradient (a stage that passes it through):
        # then the buffer is still being sent, and is dropped rather than reused
        sent = {to_local_if_dtensor(t).untyped_storage().data_ptr() for t in sending if t is not None}
        if any(b is not None and b.untyped_storage().data_ptr() in sent for b in buffers):
            return
        for b in buffers:
            if b is not None:
                b.grad = None  # (stage_backward clears it too): no gradient may add to the next user's
        self._free.append(buffers)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers this pool holds, free or lent."""
        sets = [*self._free, *self._lent.values()]
        return [b for buffers in sets for b in buffers if b is not None]


class _RunsPipeline:
    """The forward of a pipelined model (mixed into its class by ``Pipeline.attach``)."""

    _megascale_pipeline: Pipeline
    training: bool

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is not None and not getattr(self, "blocks_take_position_ids", False):
            raise ValueError(  # the strategy refuses this at start-up; a guard for direct use
                f"packed documents (position_ids) under pipeline parallelism need a model whose blocks take them "
                f"as their second input (megascale's GPT: blocks_take_position_ids); {type(self).__name__}'s "
                "are called with the hidden states alone. Use pp=1, or batches without position_ids"
            )
        if targets is None:
            return self._megascale_pipeline.outputs(inputs, position_ids)
        backward = torch.is_grad_enabled() and self.training
        return self._megascale_pipeline.loss(inputs, targets, backward=backward, position_ids=position_ids)


_PIPELINED: dict[type, type] = {}


def _pipelined_class(cls: type) -> type:
    if issubclass(cls, _RunsPipeline):
        return cls
    if cls not in _PIPELINED:
        _PIPELINED[cls] = type(
            f"Pipelined{cls.__name__}", (_RunsPipeline, cls), {"__module__": cls.__module__}
        )
    return _PIPELINED[cls]


def _one_f_one_b() -> type:
    from megascale.core.parallel.pp.schedules import ScheduleDecoupled1F1B

    return ScheduleDecoupled1F1B


def apply_pipeline(
    model: nn.Module,
    pp_mesh: Any,
    plan: ParallelPlan,
    *,
    name: str = "the model",
    sum_tied_gradients: bool = False,
) -> list[StageModule]:
    """Prune ``model`` to this rank's stages (in place) and return one ``StageModule`` per stage it holds.

    ``model`` offers ``pipeline_layers()`` and ``pipeline_loss()``; ``name`` is how errors call it. Weights
    tied across the first and last stage are refused unless ``sum_tied_gradients`` (the caller sums their
    gradients each step: ``tied.py``); each stage module's ``tied`` names them. The schedule
    is built by ``build_pipeline`` once the stage modules are materialised and wrapped (activation
    checkpointing, ZeRO): torch's PipelineStage must see the final modules.
    """
    layers = pipeline_layers_of(model)
    if layers is None or not callable(getattr(model, "pipeline_loss", None)):
        raise ValueError(
            f"pipeline parallelism needs {name} ({type(model).__name__}) to list its layers and compute its "
            "loss: give it pipeline_layers() (megascale.core.model.PipelineLayers) and pipeline_loss(output, "
            "target) (see docs/guides/lightning.md, 'Your own model')"
        )
    pp, v = pp_mesh.size(), plan.virtual_stages
    plan.check_pipeline(len(layers.blocks))
    num_stages = pp * v
    blocks = split_blocks(len(layers.blocks), num_stages, plan.pipeline_split)
    stage_of = {id(m): 0 for m in layers.first} | {id(m): num_stages - 1 for m in layers.last}
    for s, indices in enumerate(blocks):
        stage_of.update({id(layers.blocks[i]): s for i in indices})
    tied = _check_layers(model, layers, stage_of, num_stages, name)
    if tied and not sum_tied_gradients:
        first = sorted(tied)[0]
        raise ValueError(
            f"pipeline parallelism: parameter {first!r} of {name} is shared by layers {tied[first][0]!r} and "
            f"{tied[first][1]!r}, which different pipeline stages hold (tied weights): untie them (e.g. "
            "GPTConfig(tie_embeddings=False)) or use pp=1"
        )
    mine = stages_of_rank(pp_mesh.get_local_rank(), pp, v)
    stages = [
        StageModule(
            layers.first if s == 0 else [],
            [layers.blocks[i] for i in blocks[s]],
            layers.last if s == num_stages - 1 else [],
        )
        for s in mine
    ]
    # the last stage keeps a copy of what it shares with the first, under the first stage's names
    keep = {id(p) for n, p in model.named_parameters() if n in tied} if num_stages - 1 in mine else set()
    names = {id(p): n for n, p in model.named_parameters()}
    before = {
        id(p): (names[id(p)], stage_of[id(layer)], p) for layer in layers.all() for p in layer.parameters()
    }
    parents = _parents(model)
    for layer in layers.all():
        if stage_of[id(layer)] not in mine:
            _remove(model, layer, parents, keep)
    foreign = ForeignParameters(before, {id(p) for p in model.parameters()}, mine)
    for stage in stages:
        stage.tied = sorted(tied)
        stage.foreign = foreign
    return stages


def build_pipeline(
    model: nn.Module,
    stage_modules: list[StageModule],
    pp_mesh: Any,
    plan: ParallelPlan,
    *,
    device: torch.device | str,
) -> Pipeline:
    """The schedule over this rank's (materialised, wrapped) stage modules, attached to ``model``."""
    pp = pp_mesh.size()
    pipeline = Pipeline(
        stage_modules,
        stages_of_rank(pp_mesh.get_local_rank(), pp, plan.virtual_stages),
        pp * plan.virtual_stages,
        pp_mesh.get_group(),
        schedule=plan.schedule,
        num_microbatches=plan.microbatches,
        loss_fn=model.pipeline_loss,
        device=torch.device(device),
    )
    pipeline.attach(model)
    return pipeline
