"""Conformance scenarios drawn from a seed: Lightning features composed, as users compose them (issue 46).

A drawn case is one way of optimizing (automatic AdamW, SGD with momentum or Nesterov, Adam with amsgrad,
AdamW with its own lr and weight decay per parameter group, or one of six manual-optimization loops) and a
subset of the features below, each kept with probability ``KEEP`` where the way of optimizing takes it. Its
name, ``gen-<seed>`` (or ``gen-<seed>-<kept>``, a shrunk case: the hex mask of the drawn features it keeps),
is all a runner process needs to build it again.

Each feature names the hand-written scenario that tests it alone: what that scenario is refused or warned
about under a layout (``scenarios.REFUSED``, ``WARNED``), the case may be too — any of them, whichever the
strategy meets first. Everything else must be exact.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.conformance.scenarios import (
    LAYOUTS,
    Layout,
    Scenario,
    draw_shape,
    expected_refusal,
    expected_warning,
)

KEEP = 0.3
PREFIX = "gen-"


@dataclass(frozen=True)
class Feature:
    """One Lightning feature: its module switches, Trainer flags and callbacks; ``scenario``: the matrix
    scenario that tests it alone; ``takes``: the ways of optimizing it combines with (empty: every way)."""

    name: str
    scenario: str
    features: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    validate: bool = False
    saves: bool = False
    resumes: bool = False
    bf16: bool = False


AUTOMATIC = ("adamw", "sgd", "nesterov", "amsgrad", "groups")
WAYS = {  # how the module optimizes: features, and the matrix scenario testing it
    "adamw": Feature("adamw", "plain"),
    "sgd": Feature("sgd", "bf16", features=dict(sgd=True)),
    "nesterov": Feature("nesterov", "plain", features=dict(optimizer="nesterov")),
    "amsgrad": Feature("amsgrad", "plain", features=dict(optimizer="amsgrad")),
    "groups": Feature("groups", "plain", features=dict(optimizer="groups")),
    "manual-two": Feature("manual-two", "manual", features=dict(manual=True)),
    "manual-single": Feature("manual-single", "manual-read-grads", features=dict(manual="single")),
    "manual-toggle": Feature("manual-toggle", "manual", features=dict(manual="toggle")),
    "manual-accumulate": Feature(
        "manual-accumulate", "manual-accumulate", features=dict(manual="accumulate")
    ),
    "manual-closure": Feature("manual-closure", "manual-closure", features=dict(manual="closure")),
    "manual-split": Feature("manual-split", "manual-split", features=dict(manual="split")),
}
FEATURES = (
    Feature("accumulate-2", "accumulate", trainer=dict(accumulate_grad_batches=2), takes=AUTOMATIC),
    Feature("accumulate-3", "accumulate", trainer=dict(accumulate_grad_batches=3), takes=AUTOMATIC),
    Feature("clip-norm", "plain", trainer=dict(gradient_clip_val=0.05), takes=AUTOMATIC),
    Feature(
        "clip-value",
        "clip-value",
        trainer=dict(gradient_clip_val=0.02, gradient_clip_algorithm="value"),
        takes=AUTOMATIC,
    ),
    Feature("schedulers", "schedulers", features=dict(schedulers=True), takes=("adamw",)),
    Feature("skip-steps", "skip-steps", features=dict(skip_odd_steps=True), takes=AUTOMATIC),
    Feature("zero-grad-to-zeros", "plain", features=dict(zero_to_zeros=True), takes=AUTOMATIC),
    Feature("bf16", "bf16", bf16=True, takes=("sgd",)),
    Feature("frozen", "frozen", features=dict(frozen="drawn")),
    Feature("layerdrop", "unused", features=dict(layerdrop=True)),
    Feature("unused", "unused", features=dict(unused=True)),
    Feature("tied", "tied", features=dict(tie=True)),
    Feature("flat", "manual-flat", features=dict(flat=True)),  # no layer list: blocks in an nn.Sequential
    Feature(
        "log-sum", "log-sum", features=dict(log_sum=True), trainer=dict(val_check_interval=1), validate=True
    ),
    Feature("log-l2", "log-l2", features=dict(log_l2=True), takes=AUTOMATIC),
    Feature("read-grads", "read-grads", callbacks=("read_grads",)),
    Feature("read-grads-after", "read-grads-after", callbacks=("read_grads_after",)),
    Feature("ema", "ema", callbacks=("ema",)),
    Feature("finetuning", "finetuning", features=dict(eager=True), callbacks=("finetune",), takes=AUTOMATIC),
    Feature("saves", "plain", saves=True),
    Feature("three-epochs", "plain", trainer=dict(max_epochs=3)),
    # last: a feature added after the others leaves every earlier draw of a seed as it was
    Feature("log-reductions", "log-reductions", features=dict(log_reductions=True), takes=AUTOMATIC),
    Feature(
        "overlap",
        "manual-overlap",
        features=dict(overlap=True),
        takes=("manual-two", "manual-toggle", "manual-split"),
    ),
    Feature("detach", "detach", features=dict(detach=True)),
    Feature(
        "three-optimizers", "manual-three", features=dict(three=True), takes=("manual-two", "manual-toggle")
    ),
    Feature("resumes", "plain", resumes=True),  # killed at the first epoch's end, resumed by a new Trainer
)
# what cannot go together, on one process too: LR schedulers made before BaseFinetuning adds a param group
EXCLUSIVE = ({"accumulate-2", "accumulate-3"}, {"clip-norm", "clip-value"}, {"schedulers", "finetuning"})
# two optimizers by hand, the blocks' and the rest's: where the model's shape freezes the embedding and the
# head's norm, tying the head to the embedding leaves the rest's optimizer nothing to step (on one process too)
TWO_OPTIMIZERS = ("manual-two", "manual-toggle")
REST_FROZEN = {"embed.", "head.norm"}
# what features warn about together (under every layout): (one of these, and this one, the warning's words):
# a batch that does not step leaves each rank's partial sums where on_train_batch_end reads them
UNSTEPPED = {"accumulate-2", "accumulate-3", "skip-steps", "manual-accumulate", "manual-closure"}
WARNED_TOGETHER = ((UNSTEPPED, "read-grads-after", "each rank's own partial sums"),)


@dataclass(frozen=True)
class Case:
    seed: int
    way: Feature
    drawn: tuple[Feature, ...]  # every feature the seed drew
    kept: int | None = None  # a shrunk case: the mask of ``drawn`` it keeps (None: all)

    @property
    def features(self) -> tuple[Feature, ...]:
        return tuple(f for i, f in enumerate(self.drawn) if self.kept is None or self.kept >> i & 1)

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.seed}" if self.kept is None else f"{PREFIX}{self.seed}-{self.kept:x}"

    def describe(self) -> str:
        return f"{self.name}: {self.way.name} + {', '.join(f.name for f in self.features) or 'nothing else'}"

    def scenario(self) -> Scenario:
        parts = (self.way, *self.features)
        features: dict[str, Any] = {}
        trainer: dict[str, Any] = {}
        for part in parts:
            features.update(part.features)
            trainer.update(part.trainer)
        return Scenario(
            self.name, self.describe(), features=features, trainer=trainer,
            callbacks=tuple(c for part in parts for c in part.callbacks),
            validate=any(p.validate for p in parts), saves=any(p.saves for p in parts),
            resumes=any(p.resumes for p in parts),
            bf16=any(p.bf16 for p in parts), shape_of=f"{PREFIX}{self.seed}",  # shrunk: the same model
        )  # fmt: skip

    def shrunk(self, kept: int) -> Case:
        return Case(self.seed, self.way, self.drawn, kept)

    def _matrix_scenarios(self) -> list[str]:
        return [p.scenario for p in (self.way, *self.features)]

    def refusals(self, layout: Layout) -> list[str]:
        """The words of every refusal the case's features meet under ``layout`` (any may come first)."""
        alone = [w for s in self._matrix_scenarios() if (w := expected_refusal(s, layout)) is not None]
        names = {f.name for f in self.features}
        shape = draw_shape(0, f"{PREFIX}{self.seed}")  # (generated cells: seed 0)
        if {"frozen", "finetuning"} <= names and "embed." in shape["frozen"]:  # the first stage frozen whole
            alone += [w for w in [expected_refusal("finetuning-frozen-embedding", layout)] if w is not None]
        return alone

    def warnings(self, layout: Layout) -> list[str]:
        alone = [w for s in self._matrix_scenarios() if (w := expected_warning(s, layout)) is not None]
        names = {self.way.name, *(f.name for f in self.features)}
        return alone + [words for any_of, this, words in WARNED_TOGETHER if names & any_of and this in names]


def _rest_frozen(way: Feature, drawn: list[Feature], seed: int) -> bool:
    if way.name not in TWO_OPTIMIZERS or all(d.name != "frozen" for d in drawn):
        return False
    return set(draw_shape(0, f"{PREFIX}{seed}")["frozen"]) >= REST_FROZEN  # (generated cells: seed 0)


def _all_frozen(drawn: list[Feature], seed: int) -> bool:
    """BaseFinetuning freezes the blocks: with the shape freezing the embedding and the head's norm, and the
    head tied to the embedding, the loss reaches no trainable parameter (one process fails too)."""
    names = {d.name for d in drawn}
    return {"frozen", "tied"} <= names and set(draw_shape(0, f"{PREFIX}{seed}")["frozen"]) >= REST_FROZEN


def _detach_trains_nothing(way: Feature, drawn: list[Feature], seed: int) -> bool:
    """On a batch whose head reads its input detached, the loss must still reach a trainable parameter (one
    process fails too, "element 0 of tensors does not require grad"): not under toggle_optimizer (the blocks'
    optimizer's turn leaves the head untrainable), nor with the head frozen (its norm and, tied, its
    projection, the embedding)."""
    if way.name == "manual-toggle":
        return True
    return _all_frozen(drawn, seed)


def draw(seed: int) -> Case:
    """The case of ``seed``: a way of optimizing and the features it takes, each kept with probability KEEP."""
    rng = random.Random(f"conformance-case/{seed}")
    way = WAYS[rng.choice(sorted(WAYS))]
    drawn: list[Feature] = []
    for feature in FEATURES:
        if feature.takes and way.name not in feature.takes:
            continue
        if rng.random() >= KEEP:
            continue
        if any(feature.name in group and any(d.name in group for d in drawn) for group in EXCLUSIVE):
            continue
        if feature.name == "tied" and _rest_frozen(way, drawn, seed):
            continue
        if feature.name == "finetuning" and _all_frozen(drawn, seed):
            continue
        if feature.name == "detach" and _detach_trains_nothing(way, drawn, seed):
            continue
        drawn.append(feature)
    return Case(seed, way, tuple(drawn))


def case(name: str) -> Case:
    """The case named ``gen-<seed>`` or ``gen-<seed>-<kept>``."""
    seed, _, kept = name.removeprefix(PREFIX).partition("-")
    drawn = draw(int(seed))
    return drawn if not kept else drawn.shrunk(int(kept, 16))


# layouts added after the generator's seeds were run: drawing among them too would change every seed's draw
NOT_DRAWN = ("pp2/zb1p",)


def layouts_for(case: Case, count: int | None) -> list[Layout]:
    """``count`` layouts drawn for the case (None: every layout), world-2 ones first."""
    if count is None:
        return list(LAYOUTS)
    rng = random.Random(f"conformance-layouts/{case.seed}")
    world2 = [layout for layout in LAYOUTS if layout.world == 2 and layout.name not in NOT_DRAWN]
    return rng.sample(world2, min(count, len(world2)))


def smaller(case: Case) -> Iterable[Case]:
    """The cases one feature smaller, for shrinking a failure to the fewest features that still fail."""
    kept = case.kept if case.kept is not None else (1 << len(case.drawn)) - 1
    for i in range(len(case.drawn)):
        if kept >> i & 1:
            yield case.shrunk(kept & ~(1 << i))
