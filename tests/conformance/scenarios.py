"""What the conformance matrix runs: layouts × scenarios, and what each cell must give.

A **scenario** is a LightningModule configuration (``model.ConformanceModule`` features), Trainer flags and
callbacks — an ordinary Lightning workflow. A **layout** is a ``MegaScaleStrategy`` configuration and a world
size. Every cell trains the scenario under the layout on gloo ranks and must give what one process gives on
the union batch (Lightning's ``DistributedSampler`` decides which rank sees which samples; one process uses
the same sampler at one replica) — or be refused, with a message naming the feature, declared here in
``REFUSED`` and checked against what the strategy actually says.

Every global batch is ``GLOBAL_BATCH`` sequences (each rank ``GLOBAL_BATCH / dp``), so the union batch of a
step is the same set of samples for every dp; the reference runs once per scenario and seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 4
TRAIN_SEQUENCES, VAL_SEQUENCES = 8, 8  # 2 optimizer steps per epoch


@dataclass(frozen=True)
class Layout:
    """``moe``: the layout splits experts (ep > 1), so its cells train the model with mixture-of-experts
    feed-forwards (megascale's ``MoE`` layer in every block) against one process running that model."""

    name: str
    strategy: dict[str, Any]
    world: int

    @property
    def moe(self) -> bool:
        return self.ep > 1

    @property
    def ep(self) -> int:
        return int(self.strategy.get("ep", 1))

    @property
    def tp(self) -> int:
        return int(self.strategy.get("tp", 1))

    @property
    def pp(self) -> int:
        return int(self.strategy.get("pp", 1))

    @property
    def cp(self) -> int:
        return int(self.strategy.get("cp", 1))

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def zero(self) -> int:  # ZeRO shards over the ranks holding the same parameters: dp × cp
        return int(self.strategy.get("zero_stage", 1)) if self.dp * self.cp > 1 else 0


LAYOUTS = [
    Layout("dp2/zero0", dict(zero_stage=0), 2),
    Layout("dp2/zero1", dict(zero_stage=1), 2),
    Layout("dp2/zero1-params", dict(zero_stage=1, zero1_sharding="parameters"), 2),
    Layout("dp2/zero2", dict(zero_stage=2), 2),
    Layout("dp2/zero3", dict(zero_stage=3), 2),
    Layout("tp2", dict(tp=2), 2),
    Layout("tp2/no-sp", dict(tp=2, sequence_parallel=False), 2),
    Layout("pp2", dict(pp=2), 2),
    Layout("pp2/zb1p", dict(pp=2, schedule="zb1p"), 2),  # zero bubble: backward split in B and W (issue 35)
    Layout("cp2", dict(cp=2), 2),
    Layout("tp2×dp2/zero1", dict(tp=2, zero_stage=1), 4),
    Layout("tp2×pp2", dict(tp=2, pp=2), 4),
    Layout("pp2×dp2/zero2", dict(pp=2, zero_stage=2), 4),
    # expert parallelism: the model's feed-forwards are mixtures of experts, split over the dp ranks
    # (ZeRO-1 by elements is refused with ep > 1: ZeRO-1 here shards by parameters)
    Layout("ep2", dict(ep=2, zero_stage=0), 2),
    Layout("ep2/zero1-params", dict(ep=2, zero_stage=1, zero1_sharding="parameters"), 2),
    Layout("ep2×dp2/zero3", dict(ep=2, zero_stage=3), 4),
    # zero1_sharding left out: the strategy chooses "parameters", what ep needs (as ep2/zero1-params gives it)
    Layout("ep2×pp2", dict(ep=2, pp=2, zero_stage=1), 4),
]
LAYOUT = {layout.name: layout for layout in LAYOUTS}


@dataclass(frozen=True)
class Scenario:
    """One Lightning workflow. ``features``: ``ConformanceModule`` switches; ``trainer``: Trainer flags
    (``max_epochs`` 2 unless given); ``callbacks``: names from ``callbacks.CALLBACKS``; ``validate``: run
    validation (``val_check_interval`` in ``trainer``); ``saves``: a checkpoint at every epoch's end, which
    other layouts resume from (the resume cells)."""

    name: str
    what: str
    features: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: tuple[str, ...] = ()
    validate: bool = False
    saves: bool = False
    resumes: bool = False  # killed at the first epoch's end and resumed from its checkpoint by a new Trainer
    bf16: bool = False
    tp_only: bool = False  # only meaningful where tp > 1 (a tensor_parallel_plan's edge)
    # only meaningful where each rank's training_step sees its whole samples and the model has no experts
    # (pp splits them into microbatches, cp into sequence pieces; an MoE layer's all-to-all pairs ranks)
    whole_samples_only: bool = False
    strategy: dict[str, Any] = field(default_factory=dict)  # MegaScaleStrategy arguments besides the layout's
    one_stage_only: bool = False  # reads a layer that only one pipeline stage holds
    shape_of: str = (
        ""  # the name the model's shape is drawn for (default: this one; a shrunk case: its case's)
    )

    def runs_under(self, layout: Layout) -> bool:
        if self.tp_only and layout.tp == 1:
            return False
        if self.one_stage_only and layout.pp > 1:
            return False
        return not (self.whole_samples_only and (layout.pp > 1 or layout.cp > 1 or layout.moe))


SCENARIOS = [
    Scenario(
        "plain",
        "AdamW, weight decay, clipping by norm; a checkpoint at each epoch's end",
        trainer=dict(gradient_clip_val=0.05),
        saves=True,
    ),
    Scenario(
        "one-file-ckpt",
        "plain, with save_distributed_checkpoint=False: every checkpoint one file in Lightning's form",
        trainer=dict(gradient_clip_val=0.05),
        saves=True,
        strategy=dict(save_distributed_checkpoint=False),
    ),
    Scenario(
        "finetuning",
        "BaseFinetuning: blocks frozen in setup, unfrozen with add_param_group at epoch 1",
        features=dict(eager=True),
        trainer=dict(max_epochs=3),
        callbacks=("finetune",),
    ),
    Scenario(
        "finetuning-groups-resumed",
        "BaseFinetuning with AdamW's groups (matrices decayed, vectors not), killed at the first epoch's end and "
        "resumed (generated case gen-110: under pp2 the first stage holds no trainable vector, an empty group "
        "torch's loader failed on)",
        features=dict(eager=True, optimizer="groups"),
        trainer=dict(max_epochs=3),
        callbacks=("finetune",),
        resumes=True,
        shape_of="gen-110",  # two blocks, both frozen: the first stage's trainable parameter is the embedding
    ),
    Scenario(
        "finetuning-bf16",
        "BaseFinetuning under bf16-mixed (SGD with momentum): blocks frozen when first run, unfrozen at epoch 1, "
        "their gradients then reduced in fp32 as the others'",
        features=dict(eager=True, sgd=True),
        callbacks=("finetune",),
        bf16=True,
    ),
    Scenario(
        "finetuning-validation",
        "BaseFinetuning with validation every batch: the blocks unfrozen after a validation join the optimizer "
        "as the parameters it steps, not as the copies the validation gathered",
        features=dict(eager=True, optimizer="groups"),
        trainer=dict(val_check_interval=1),
        validate=True,
        callbacks=("finetune",),
    ),
    Scenario(
        "finetuning-frozen-embedding",
        "BaseFinetuning with the embedding frozen too: a first pipeline stage has nothing to optimize until "
        "epoch 1, and its configure_optimizers raises on that stage only",
        features=dict(eager=True, frozen=("embed.",)),
        callbacks=("finetune",),
    ),
    Scenario(
        "add-param-group",
        "parameters frozen from the start join the optimizer mid-epoch (step 3)",
        features=dict(frozen=("head.norm",)),
        trainer=dict(max_epochs=3),
        callbacks=("add_group",),
    ),
    Scenario(
        "frozen",
        "requires_grad=False from the start (two parts of the model drawn from the seed)",
        features=dict(frozen="drawn"),
    ),
    Scenario(
        "freeze-mid-run",
        "a block frozen at step 2 while it stays in the optimizer: it must not move",
        trainer=dict(max_epochs=3),
        callbacks=("freeze_mid",),
    ),
    Scenario(
        "unused",
        "LayerDrop (a block skipped on some steps) and a parameter no forward reads",
        features=dict(layerdrop=True, unused=True),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "layerdrop-zeroed",
        "LayerDrop with gradients zeroed, not freed (optimizer_zero_grad with set_to_none=False): a skipped "
        "block's zero gradients are stepped",
        features=dict(layerdrop=True, zero_to_zeros=True),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "layerdrop-accumulate",
        "accumulate_grad_batches=2 with LayerDrop by batch: a block skipped in one micro-batch runs in the other",
        features=dict(layerdrop="batch"),
        trainer=dict(accumulate_grad_batches=2, max_epochs=3),
    ),
    Scenario(
        "manual",
        "manual optimization: two optimizers stepped in one training_step",
        features=dict(manual=True),
    ),
    Scenario(
        "manual-accumulate",
        "manual optimization accumulating two batches by hand before each step",
        features=dict(manual="accumulate"),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "manual-closure",
        "manual optimization accumulating two batches by hand, the second's backward in optimizer.step(closure=...)",
        features=dict(manual="closure"),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "manual-split",
        "manual optimization, two optimizers over every layer: its matrices in AdamW, its vectors in SGD",
        features=dict(manual="split"),
    ),
    Scenario(
        "manual-toggle",
        "Lightning's GAN example: toggle_optimizer/untoggle_optimizer around each of two optimizers, a model "
        "listing no layers",
        features=dict(manual="toggle", flat=True),
    ),
    Scenario(
        "manual-flat",
        "manual optimization, one optimizer, of a model listing no layers (blocks in an nn.Sequential)",
        features=dict(manual="single", flat=True),
    ),
    Scenario(
        "manual-flat-read-grads",
        "the same, its gradients read in training_step between manual_backward and the step, in "
        "on_before_optimizer_step and after the batch: the LightningModule's own parameters included",
        features=dict(manual="single", flat=True, read_grads=True),
        callbacks=("read_grads", "read_grads_after"),
    ),
    Scenario(
        "manual-flat-two",
        "the same model, two optimizers stepped in one training_step (a GAN's loop)",
        features=dict(manual=True, flat=True),
    ),
    Scenario(
        "detach",
        "every other batch the head reads its input detached: the loss reaches the head alone, the blocks and "
        "embedding get no gradient (None) and AdamW leaves them be",
        features=dict(detach=True),
        trainer=dict(gradient_clip_val=0.05),
    ),
    Scenario(
        "manual-three",
        "three optimizers by hand (the blocks', the embedding's, the head's), each stepped after its own "
        "forward and backward, each forward reading what the steps before it wrote",
        features=dict(manual=True, three=True),
    ),
    Scenario(
        "manual-overlap",
        "two optimizers stepped by hand after one backward (a Muon + AdamW loop), sharing one parameter (the "
        "last vector), each stepping it with its own state",
        features=dict(manual="split", overlap=True),
    ),
    Scenario(
        "manual-one-owner",
        "two optimizers by hand, the second over the head's norm alone (the embedding and head frozen): under "
        "ZeRO-1 by parameters one rank owns all of it, and the checkpoint holds that rank's states (gen-445)",
        features=dict(manual="toggle", tie=True, frozen=("embed.", "blocks.0.attn_norm")),
        trainer=dict(val_check_interval=1),
        validate=True,
        shape_of="gen-445",  # no biases: the norm's weight is the second optimizer's one parameter
    ),
    Scenario(
        "skip-steps",
        "optimizer_step overridden to run the closure and skip the step on odd batches",
        features=dict(skip_odd_steps=True),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "schedulers",
        "a per-step warm-up and a per-epoch decay on one optimizer",
        features=dict(schedulers=True),
        trainer=dict(max_epochs=3),
    ),
    Scenario(
        "accumulate", "accumulate_grad_batches=2", trainer=dict(accumulate_grad_batches=2, max_epochs=3)
    ),
    Scenario(
        "clip-value",
        "gradient_clip_val by value",
        trainer=dict(gradient_clip_val=0.02, gradient_clip_algorithm="value"),
    ),
    Scenario(
        "grad-norm",
        "megascale.lightning.grad_norm logged in on_before_optimizer_step; clip_gradients in the module",
        features=dict(log_grad_norm="megascale", clip_in_module=True),
    ),
    Scenario(
        "lightning-grad-norm",
        "Lightning's own grad_norm logged in on_before_optimizer_step",
        features=dict(log_grad_norm="lightning"),
    ),
    Scenario(
        "swa",
        "StochasticWeightAveraging from epoch 1",
        features=dict(eager=True),
        trainer=dict(max_epochs=3),
        callbacks=("swa",),
    ),
    Scenario("ema", "an EMA callback reading every weight after each step", callbacks=("ema",)),
    Scenario(
        "read-grads",
        "a callback reading float(p.grad.norm()) of every parameter in on_before_optimizer_step, logged",
        callbacks=("read_grads",),
    ),
    Scenario(
        "read-grads-after",
        "the same callback reading them after the step, in on_train_batch_end",
        callbacks=("read_grads_after",),
    ),
    Scenario(
        "skip-last-read-after",
        "one epoch whose last batch skips its step, gradients read after each batch (generated case gen-871, "
        "resumed at the epoch's end: no batch followed to warn)",
        features=dict(skip_odd_steps=True),
        trainer=dict(max_epochs=1),
        callbacks=("read_grads_after",),
    ),
    Scenario(
        "read-grads-backward",
        "the same callback reading them in on_after_backward",
        callbacks=("read_grads_backward",),
    ),
    Scenario(
        "manual-read-grads-after",
        "manual optimization, one optimizer, a callback reading float(p.grad.norm()) after each batch "
        "(generated case gen-36: it read ZeRO-2/3 and tp shards)",
        features=dict(manual="single"),
        callbacks=("read_grads_after",),
    ),
    Scenario(
        "accumulate-ema",
        "accumulate_grad_batches=2 and an EMA of every weight after each batch (generated case gen-4: under "
        "ZeRO-2 it met gathered tensors between micro-batches and shards after steps)",
        trainer=dict(accumulate_grad_batches=2, max_epochs=3),
        callbacks=("ema",),
    ),
    Scenario(
        "manual-read-grads",
        "manual optimization reading float(p.grad.norm()) of every parameter between manual_backward and the "
        "step, logged, then clipping by norm with self.clip_gradients",
        features=dict(manual="single", read_grads=True),
    ),
    Scenario(
        "log-tensors",
        "self.log/log_dict of tensors from a layer's gradient and weight (p.grad.norm() synced, p.norm() and p.max() not)",
        features=dict(log_tensors=True),
        one_stage_only=True,  # a layer of the first block, which one pipeline stage holds
    ),
    Scenario("tied", "embedding tied to the output layer", features=dict(tie=True)),
    Scenario(
        "tied-resumed",
        "the same, killed at the first epoch's end and resumed (under pp the last stage's copy is saved and loaded "
        "under the embedding's name)",
        features=dict(tie=True),
        resumes=True,
    ),
    Scenario("buffers", "a causal-mask buffer computed in __init__", features=dict(mask_buffer=True)),
    Scenario(
        "buffers-on-device",
        "the same buffer created with an explicit device (what the refusal of 'buffers' advises)",
        features=dict(mask_buffer="cpu"),
    ),
    Scenario("bf16", "bf16-mixed (SGD with momentum)", features=dict(sgd=True), bf16=True),
    Scenario(
        "bf16-validation",
        "bf16-mixed with validation every batch: the weights read after it are the fp32 ones the optimizer "
        "steps, not the bf16 copies a validation gathered",
        features=dict(sgd=True),
        trainer=dict(val_check_interval=1),
        validate=True,
        bf16=True,
        shape_of="gen-483",  # where rounding the weights to bf16 moves them beyond the tolerance
    ),
    Scenario(
        "bf16-accumulate-unused",
        "bf16-mixed, accumulating 2 batches, with LayerDrop and a parameter no forward reads: gradients kept "
        "in fp32 between micro-batches reduced beside fresh bf16 ones",
        features=dict(sgd=True, layerdrop=True, unused=True),
        trainer=dict(accumulate_grad_batches=2),
        bf16=True,
    ),
    Scenario(
        "validation",
        "validation every batch mid-epoch (val_check_interval=1)",
        trainer=dict(val_check_interval=1),
        validate=True,
    ),
    Scenario(
        "log-reductions",
        "self.log with reduce_fx max, min and mean over the ranks' samples (sync_dist), an epoch mean, and a "
        "value every rank holds alike unsynced",
        features=dict(log_reductions=True),
    ),
    Scenario(
        "log-sum",
        'totals logged with sync_dist=True, reduce_fx="sum" (each sample counted once), validation too',
        features=dict(log_sum=True),
        trainer=dict(val_check_interval=1),
        validate=True,
    ),
    Scenario(
        "conditional-layer",
        "a layer run only when the batch holds some tokens (if sel.any(): loss += extra(h[sel])): ranks differ",
        features=dict(conditional=True),
    ),
    Scenario(
        "conditional-block",
        "the first and last blocks of the layer list run only on samples whose first token is small, and are "
        "skipped where a rank's batch holds none (if keep.any(): ...); a ZeRO unit per layer",
        features=dict(conditional_block=True),
        strategy=dict(bucket_size_mb=1e-6),  # MiB: a unit per layer
        whole_samples_only=True,
    ),
    Scenario(
        "log-l2",
        "an L2 penalty over self.parameters() computed in training_step, logged with sync_dist=True",
        features=dict(log_l2=True),
    ),
    Scenario(
        "torch-clip",
        "the module clips with torch.nn.utils.clip_grad_norm_ itself and logs the norm",
        features=dict(torch_clip=True),
    ),
    Scenario(
        "model-parallel-module",
        "configure_model applies torch TP and fully_shard itself "
        "(a module written for ModelParallelStrategy)",
        features=dict(own_parallelize=True),
    ),
    Scenario("pos-embed", "learned position embeddings", features=dict(pos_embed=True)),
    Scenario(
        "documents",
        "packed documents: batches (inputs, targets, position_ids), the model's own attention masked to each "
        "document",
        features=dict(documents=True),
    ),
    Scenario(
        "documents-unpassed",
        "packed documents, but the attention's context-parallel branch does not pass position_ids on",
        features=dict(documents=True, documents_unpassed=True),
    ),
    Scenario(
        "layer-scale",
        "a learned gain held by each block, marked 'sequence_parallel' in the plan",
        features=dict(layer_scale=True),
    ),
    Scenario(
        "unmarked-norms",
        "a tensor_parallel_plan that leaves the norms (and block gains) out, as "
        "Hugging Face's base_model_tp_plan does",
        features=dict(unmarked_norms=True, layer_scale=True),
        tp_only=True,
    ),
    Scenario(
        "torch-sp-norms",
        "torch's own SequenceParallel(use_local_output=True) style on the norms",
        features=dict(torch_sp_norms=True),
        tp_only=True,
    ),
    Scenario(
        "fused-colwise",
        "'colwise' on fused projections (qkv and gate‖up in one Linear)",
        features=dict(fused=True),
        tp_only=True,
    ),
    Scenario(
        "tied-unplanned",
        "an output layer tied to the split embedding but left out of the plan",
        features=dict(tie_unplanned=True),
        tp_only=True,
    ),
]
SCENARIO = {s.name: s for s in SCENARIOS}


def scenario(name: str) -> Scenario:
    """A matrix scenario by name, or a generated case (``gen-<seed>``, ``generate.py``)."""
    if name in SCENARIO:
        return SCENARIO[name]
    from tests.conformance import generate

    return generate.case(name).scenario()


def draw_shape(seed: int, scenario: str) -> dict[str, Any]:
    """A small random transformer: depth, width, heads, kv heads, biases (every layout can split it), and
    which parameters the "frozen" scenario freezes."""
    rng = random.Random(f"{seed}/{scenario}")
    heads = rng.choice([2, 4])
    frozen = rng.sample(["embed.", "blocks.0.attn_norm", "blocks.0.mlp.", "blocks.1.attn.", "head.norm"], 2)
    return dict(vocab=VOCAB, seq=SEQ, layers=rng.choice([2, 3, 4]), width=rng.choice([16, 32]), heads=heads,
                kv_heads=rng.choice(sorted({2, heads})), bias=rng.random() < 0.5, frozen=frozen)  # fmt: skip


# ---- what is refused, by name -------------------------------------------------------------------------
# {scenario: [(predicate on the layout, words the refusal must contain)]}; every other cell must be exact.
def _sharded(layout: Layout) -> bool:
    return layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.zero >= 2


def _dtensor_grads(layout: Layout) -> bool:
    return layout.tp > 1 or layout.ep > 1 or layout.zero >= 2


def _split_or_experts(layout: Layout) -> bool:  # DTensors beside plain tensors, or of several meshes
    return layout.tp > 1 or layout.ep > 1


def _pipelined(layout: Layout) -> bool:
    return layout.pp > 1


def _sequence_parallel(layout: Layout) -> bool:
    return layout.tp > 1 and layout.strategy.get("sequence_parallel", True)


def _no_sequence_parallel(layout: Layout) -> bool:
    return layout.tp > 1 and not layout.strategy.get("sequence_parallel", True)


def _context_parallel(layout: Layout) -> bool:
    return layout.cp > 1


def _expert_parallel(layout: Layout) -> bool:
    return layout.ep > 1


def _always(layout: Layout) -> bool:
    return True


REFUSED: dict[str, list[tuple[Any, str]]] = {
    "swa": [(_sharded, "StochasticWeightAveraging cannot run under MegaScaleStrategy")],
    "manual": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-accumulate": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-closure": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-split": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-three": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-overlap": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-one-owner": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-read-grads": [(_pipelined, "manual optimization (automatic_optimization=False) cannot run")],
    "manual-read-grads-after": [
        (_pipelined, "manual optimization (automatic_optimization=False) cannot run")
    ],
    # a model listing no layers cannot be split into stages: said before manual optimization's own refusal
    "manual-toggle": [
        (_pipelined, "pipeline parallelism needs exactly one model offering pipeline_layers()")
    ],
    "manual-flat": [(_pipelined, "pipeline parallelism needs exactly one model offering pipeline_layers()")],
    "manual-flat-read-grads": [
        (_pipelined, "pipeline parallelism needs exactly one model offering pipeline_layers()")
    ],
    "manual-flat-two": [
        (_pipelined, "pipeline parallelism needs exactly one model offering pipeline_layers()")
    ],
    "lightning-grad-norm": [(_dtensor_grads, "expert-parallel or ZeRO-2/3 shards (DTensors)")],
    "torch-clip": [(_split_or_experts, "expert-parallel or ZeRO-2/3 shards (DTensors)")],
    "conditional-layer": [
        (_pipelined, "belong to no layer of its pipeline_layers()"),
        (_context_parallel, "which context parallelism does not take in the loss module"),
    ],
    "log-l2": [
        (_pipelined, "differs between the pipeline stages"),
        # dense parameters DTensors on the dp mesh, experts on ("edp", "ep"): torch cannot add the two
        (
            lambda layout: layout.ep > 1 and layout.zero >= 2,
            "combined parameters that MegaScaleStrategy holds",
        ),
    ],
    "finetuning-frozen-embedding": [(_pipelined, "configure_optimizers raised on rank 0 (pipeline stage 0)")],
    "documents-unpassed": [(_context_parallel, "called context_parallel.attention without them")],
    "model-parallel-module": [
        (_pipelined, "the model applied fully_shard itself, and pp > 1"),
        (_context_parallel, "applied fully_shard itself on the data-parallel mesh, and cp=2"),
        (_expert_parallel, "applied fully_shard itself on the data-parallel mesh, and ep=2"),
    ],
    "buffers": [(_always, "were computed on the meta device in __init__")],
    "unmarked-norms": [(_sequence_parallel, "on a sequence shard")],
    "torch-sp-norms": [
        (_no_sequence_parallel, "uses torch's SequenceParallel, which takes its input as a sequence")
    ],
    "fused-colwise": [(_always, "is named like a fused projection")],
    "tied-unplanned": [(_always, "are one tied parameter, but the plan splits its uses differently")],
}


# Cells that cannot be exact and are not refused: the strategy must warn with these words (nothing compared).
WARNED: dict[str, list[tuple[Any, str]]] = {
    "lightning-grad-norm": [(lambda layout: layout.pp > 1, "covers this stage only")],
    "torch-clip": [(lambda layout: layout.pp > 1, "covers this stage only")],
    "read-grads": [(lambda layout: layout.pp > 1, "covers this stage only")],
    "read-grads-after": [(lambda layout: layout.pp > 1, "covers this stage only")],
    "read-grads-backward": [(lambda layout: layout.pp > 1, "covers this stage only")],
    "skip-last-read-after": [
        (lambda layout: layout.pp > 1, "covers this stage only"),
        (lambda layout: True, "each rank's own partial sums"),
    ],
}


def _lookup(table: dict[str, list[tuple[Any, str]]], scenario: str, layout: Layout) -> str | None:
    for applies, words in table.get(scenario, []):
        if applies(layout):
            return words
    return None


def expected_refusal(scenario: str, layout: Layout) -> str | None:
    return _lookup(REFUSED, scenario, layout)


def expected_warning(scenario: str, layout: Layout) -> str | None:
    return _lookup(WARNED, scenario, layout)


def expected_refusals(scenario: str, layout: Layout) -> list[str]:
    """The words any of which the refusal of ``scenario`` under ``layout`` must contain (none: not refused);
    a generated case may meet several of its features' refusals, in whichever order the strategy checks."""
    if scenario in SCENARIO:
        return [w] if (w := expected_refusal(scenario, layout)) is not None else []
    from tests.conformance import generate

    return generate.case(scenario).refusals(layout)


def expected_warnings(scenario: str, layout: Layout) -> list[str]:
    if scenario in SCENARIO:
        return [w] if (w := expected_warning(scenario, layout)) is not None else []
    from tests.conformance import generate

    return generate.case(scenario).warnings(layout)


# (saved under, resumed under): tied embeddings resharded between pipeline layouts and others (issue 47)
TIED_RESHARDS = [
    ("pp2", "dp2/zero0"),
    ("dp2/zero1", "pp2"),
    ("pp2", "tp2×pp2"),
    ("tp2×pp2", "dp2/zero3"),
    ("pp2×dp2/zero2", "pp2"),
]


def resume_pairs(layouts: list[Layout] | None = None) -> list[tuple[Layout, Layout]]:
    """(saved under, resumed under) for every unordered pair of layouts, once: the later layout of the
    LAYOUTS order resumes the earlier one's checkpoint (world-2 layouts come first, so a world-4 run resumes
    world-2 checkpoints and the other way round happens among world-2 and world-4 layouts' own pairs)."""
    layouts = layouts or LAYOUTS
    # a checkpoint of the mixture-of-experts model resumes only where that model trains (the ep layouts)
    return [(a, b) for i, a in enumerate(layouts) for b in layouts[i + 1 :] if a.moe == b.moe]
