"""Pipeline parallelism for a GPT: cut its ordered layers into stages, keep each rank's, run the microbatches.

A GPT's layers in order are: embedding, blocks 0..L-1, head (final norm + logits). ``split_blocks`` gives each
of the P·V stages a run of consecutive blocks (the first stage also holds the embedding, the last the head and
the loss); rank r of the pipeline group holds stages r, r+P, r+2P, ... (V > 1: the interleaved schedule's
"virtual stages"). ``apply_pipeline``:

1. prunes the GPT to this rank's layers — on the meta device, before anything is allocated, so no rank ever
   materialises the whole model (``GPT.init_weights`` then gives the kept parameters exactly the values the
   unsharded model has, because every parameter's init depends only on the seed and its name);
2. makes one ``StageModule`` per stage: a view over the GPT's own submodules (shared, not copied), so every
   parameter keeps its name in the whole model and checkpoints reshard between pipeline layouts;
3. returns a ``Pipeline``: ``PipelineStage``s (torch.distributed.pipelining) and a schedule over them —
   "gpipe", "1f1b" (megascale's decoupled 1F1B when available), "interleaved" (V ≥ 2).

``Pipeline.attach`` makes the GPT's forward run the pipeline, so code that calls ``model(tokens, targets)``
(a LightningModule's training_step) drives it unchanged: in training that call runs forward and backward of
every microbatch and returns the loss (the last stage's mean, broadcast to every stage), already
backpropagated; under ``no_grad`` it runs forward only (validation); without targets it returns the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from megascale.core.model.gpt import GPT, LMHead, TokenEmbedding

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "StageModule",
    "apply_pipeline",
    "build_pipeline",
    "check_pipeline",
    "split_blocks",
    "stages_of_rank",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def split_blocks(n_blocks: int, n_stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """Block indices of each stage: ``split`` (blocks per stage) if given, else as even as possible, with the
    remainder going to the middle stages first (the first and last also carry the embedding and the head)."""
    if split is not None:
        if len(split) != n_stages or any(n < 0 for n in split) or sum(split) != n_blocks:
            raise ValueError(
                f"pipeline_split={list(split)} must give {n_stages} non-negative block counts (one per stage) "
                f"summing to the model's {n_blocks} blocks"
            )
        counts = list(split)
    else:
        if n_stages > n_blocks:
            raise ValueError(
                f"{n_stages} pipeline stages but the model has only {n_blocks} blocks: each stage needs at "
                "least one; lower pp (or virtual_stages), or give more layers"
            )
        base, extra = divmod(n_blocks, n_stages)
        counts = [base] * n_stages
        middle_first = sorted(
            range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(2 * s - n_stages + 1))
        )
        for s in middle_first[:extra]:
            counts[s] += 1
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: pp_rank, pp_rank + pp, ... (looped placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


class StageModule(nn.Module):
    """One pipeline stage of a GPT: its run of blocks, with the embedding on the first stage and the head on
    the last. Holds the GPT's own submodules, so parameters are shared, not copied."""

    def __init__(self, gpt: GPT, blocks: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.embed: TokenEmbedding | None = gpt.embed if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[str(i)] for i in blocks})
        self.head: LMHead | None = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(x)


def _prune(gpt: GPT, keep: set[int], first: bool, last: bool) -> None:
    for key in [k for k in gpt.blocks if int(k) not in keep]:
        del gpt.blocks[key]
    if not first:
        gpt.embed = None
    if not last:
        gpt.head = None


class Pipeline:
    """This rank's stages and the schedules that run them; ``attach`` makes a GPT's forward use them."""

    def __init__(
        self,
        stage_modules: list[StageModule],
        stage_ids: list[int],
        num_stages: int,
        group: dist.ProcessGroup,
        *,
        schedule: ScheduleName,
        num_microbatches: int,
        loss_fn: nn.Module,
        device: torch.device,
    ) -> None:
        self.stage_modules, self.stage_ids, self.num_stages = stage_modules, stage_ids, num_stages
        self.group, self.num_microbatches, self.schedule_name = group, num_microbatches, schedule
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.last_rank = dist.get_global_rank(group, (num_stages - 1) % dist.get_world_size(group))
        self.device = device
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

    def _schedule(self, purpose: Literal["train", "eval", "logits"], shape: tuple[int, ...]) -> Any:
        key = (purpose, shape)
        if key not in self._schedules:
            stages: list[Any] = [
                PipelineStage(m, s, self.num_stages, self.device, group=self.group)
                for m, s in zip(self.stage_modules, self.stage_ids)
            ]
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
                self._schedules[key] = ScheduleInterleaved1F1B(stages, n, **kwargs)
            elif name == "looped":
                self._schedules[key] = ScheduleLoopedBFS(stages, n, **kwargs)
            elif name == "1f1b":
                self._schedules[key] = _one_f_one_b()(stages[0], n, **kwargs)
            else:
                self._schedules[key] = ScheduleGPipe(stages[0], n, **kwargs)
        return self._schedules[key]

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # training only backpropagates through this; evaluation divides the scale back out of its losses
        return self._loss_fn(output, target) * (self.loss_scale / self.num_microbatches)

    def _check_batch(self, tokens: torch.Tensor) -> None:
        if tokens.shape[0] % self.num_microbatches:
            raise ValueError(
                f"a batch of {tokens.shape[0]} sequences cannot be split into num_microbatches="
                f"{self.num_microbatches} equal microbatches: make the per-rank batch size a multiple of it"
            )

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, *, backward: bool) -> torch.Tensor:
        """Mean loss over the batch on every rank of the pipeline; with ``backward`` the gradients of every
        microbatch are accumulated into this rank's parameters (scaled by 1/num_microbatches)."""
        if backward:
            self._check_batch(tokens)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        schedule = self._schedule("train" if backward else "eval", tuple(tokens.shape))
        if backward:
            schedule.step(*args, **kwargs)
        else:
            schedule.eval(*args, **kwargs)
        scale = self.loss_scale / self.num_microbatches  # what _scaled_loss multiplied by
        loss = torch.stack([x.detach().float() for x in losses]).mean() / scale if self.has_last else None
        if loss is None:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)  # every stage logs the same loss
        return loss

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of ``tokens`` (forward only), on every rank of the pipeline."""
        out = self._schedule("logits", tuple(tokens.shape)).eval(*((tokens,) if self.has_first else ()))
        if self.has_last:
            assert isinstance(out, torch.Tensor)
            meta = torch.tensor(out.shape[-1], device=self.device)
        else:
            meta = torch.zeros((), dtype=torch.long, device=self.device)
        dist.broadcast(meta, src=self.last_rank, group=self.group)
        if not self.has_last:
            out = torch.empty(*tokens.shape, int(meta), dtype=torch.float32, device=self.device)
        logits = out.float().contiguous()
        dist.broadcast(logits, src=self.last_rank, group=self.group)
        return logits

    def attach(self, gpt: GPT) -> None:
        """Make ``gpt(tokens, targets)`` run this pipeline (see the module docstring)."""

        def forward(tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
            if targets is None:
                return self.logits(tokens)
            return self.loss(tokens, targets, backward=torch.is_grad_enabled() and gpt.training)

        gpt.forward = forward  # type: ignore[method-assign]


def _one_f_one_b() -> type:
    """megascale's decoupled 1F1B when present, torch's otherwise (same interface and results)."""
    try:
        from megascale.core.parallel.pipeline_schedules import ScheduleDecoupled1F1B

        return ScheduleDecoupled1F1B
    except ImportError:
        from torch.distributed.pipelining import Schedule1F1B

        return Schedule1F1B


def check_pipeline(
    n_blocks: int,
    pp: int,
    *,
    schedule: str,
    virtual_stages: int,
    num_microbatches: int,
    split: Sequence[int] | None = None,
) -> None:
    """Raise ValueError, with what to change, for a pipeline layout that cannot run (no collective used)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} must be one of {SCHEDULES}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages} must be >= 1")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' (got {schedule!r}): only the "
            "interleaved schedule runs several stages per rank"
        )
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError("schedule='interleaved' needs virtual_stages >= 2 (stages per rank)")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if pp > 1 and schedule in ("1f1b", "interleaved") and num_microbatches < pp:
        raise ValueError(
            f"the {schedule} schedule needs at least as many microbatches as pipeline ranks: "
            f"num_microbatches={num_microbatches} < pp={pp}"
        )
    if schedule == "interleaved" and num_microbatches % pp:
        raise ValueError(
            f"the interleaved schedule runs microbatches in rounds of pp: num_microbatches={num_microbatches} "
            f"is not a multiple of pp={pp}; use {pp * max(1, round(num_microbatches / pp))}"
        )
    split_blocks(n_blocks, pp * virtual_stages, split)


def apply_pipeline(
    gpt: GPT,
    pp_mesh: Any,
    *,
    schedule: ScheduleName = "1f1b",
    num_microbatches: int,
    virtual_stages: int = 1,
    split: Sequence[int] | None = None,
) -> list[StageModule]:
    """Prune ``gpt`` to this rank's stages (in place) and return one ``StageModule`` per stage it holds.

    The schedule is built by ``build_pipeline`` once the stage modules are materialised and wrapped
    (activation checkpointing, ZeRO): torch's PipelineStage must see the final modules.
    """
    pp = pp_mesh.size()
    if gpt.config.tie_embeddings and pp > 1:
        raise ValueError(
            "tie_embeddings=True with pp > 1: the embedding (first stage) and the output projection (last "
            "stage) would live on different ranks; untie them (tie_embeddings=False) or use pp=1"
        )
    check_pipeline(
        gpt.config.n_layers, pp, schedule=schedule, virtual_stages=virtual_stages,
        num_microbatches=num_microbatches, split=split,
    )  # fmt: skip
    num_stages = pp * virtual_stages
    blocks = split_blocks(gpt.config.n_layers, num_stages, split)
    mine = stages_of_rank(pp_mesh.get_local_rank(), pp, virtual_stages)
    _prune(gpt, {b for s in mine for b in blocks[s]}, first=0 in mine, last=num_stages - 1 in mine)
    return [StageModule(gpt, blocks[s], first=s == 0, last=s == num_stages - 1) for s in mine]


def build_pipeline(
    gpt: GPT,
    stage_modules: list[StageModule],
    pp_mesh: Any,
    *,
    schedule: ScheduleName,
    num_microbatches: int,
    virtual_stages: int,
    device: torch.device | str,
) -> Pipeline:
    """The schedule over this rank's (materialised, wrapped) stage modules, attached to ``gpt``."""
    pp = pp_mesh.size()
    pipeline = Pipeline(
        stage_modules,
        stages_of_rank(pp_mesh.get_local_rank(), pp, virtual_stages),
        pp * virtual_stages,
        pp_mesh.get_group(),
        schedule=schedule,
        num_microbatches=num_microbatches,
        loss_fn=gpt.loss_fn,
        device=torch.device(device),
    )
    pipeline.attach(gpt)
    return pipeline
