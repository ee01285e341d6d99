"""``materialize``: a meta-device model gets every tensor initialised, by its own init, the same in any layout.

One process; the tensor-parallel and FSDP-sharded cases (whole-size temporaries cut into shards) run in
tests/core/test_compose.py and tests/lightning/test_own_module.py against one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import materialize
from megascale.core.parallel.materialize import uninitialisable
from tests.core._tiny import TINY_GQA_GPT


class Gain(nn.Module):
    """A layer of the user's own, with no reset_parameters()."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))


class WithInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = Gain(4)
        self.proj = nn.Linear(4, 4)

    @torch.no_grad()
    def init_weights(self) -> None:
        self.gain.gain.fill_(0.5)
        self.proj.weight.fill_(2.0)
        self.proj.bias.zero_()


def _meta(build):
    with torch.device("meta"):
        return build()


def test_a_module_nothing_initialises_is_refused_by_name_before_allocating():
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), Gain(4), nn.ModuleDict({"deep": Gain(2)})))
    assert uninitialisable(model) == ["1 (Gain: gain)", "2.deep (Gain: gain)"]
    with pytest.raises(ValueError, match=r"1 \(Gain: gain\); 2\.deep \(Gain: gain\)") as info:
        materialize(model, "cpu", seed=0)
    assert "init_weights()" in str(info.value) and "meta_init=False" in str(info.value)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated


def test_init_weights_owns_its_subtree_and_reset_parameters_the_rest():
    model = _meta(lambda: nn.ModuleDict({"owned": WithInit(), "plain": nn.Linear(4, 3)}))
    reset = materialize(model, "cpu", seed=7)
    assert reset == ["plain"]
    assert torch.equal(model["owned"].gain.gain, torch.full((4,), 0.5))
    assert torch.equal(model["owned"].proj.weight, torch.full((4, 4), 2.0))
    assert not any(p.is_meta for p in model.parameters())
    # torch's default init, drawn from a generator seeded by (seed, name): the same for the same seed
    again = _meta(lambda: nn.ModuleDict({"owned": WithInit(), "plain": nn.Linear(4, 3)}))
    materialize(again, "cpu", seed=7)
    assert torch.equal(again["plain"].weight, model["plain"].weight)
    other = _meta(lambda: nn.ModuleDict({"owned": WithInit(), "plain": nn.Linear(4, 3)}))
    materialize(other, "cpu", seed=8)
    assert not torch.equal(other["plain"].weight, model["plain"].weight)


def test_values_do_not_depend_on_which_other_layers_a_rank_holds():
    """A pipeline stage holding some layers gets the values the whole model gets for them."""

    def build():
        return nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})

    whole = _meta(build)
    materialize(whole, "cpu", seed=3)
    stage = _meta(build)
    del stage["0"], stage["1"]
    materialize(stage, "cpu", seed=3)
    for key in ("2", "3"):
        assert torch.equal(stage[key].weight, whole[key].weight)
    assert not torch.equal(whole["0"].weight, whole["1"].weight)  # each layer its own draw


def test_tied_weights_stay_tied_and_real_tensors_are_left_alone():
    def build():
        model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
        model["head"].weight = model["embed"].weight
        return model

    model = _meta(build)
    real = nn.Linear(4, 4)
    model["extra"] = real
    before = real.weight.detach().clone()
    materialize(model, "cpu", seed=0)
    assert model["head"].weight is model["embed"].weight
    assert model["extra"] is real and torch.equal(real.weight, before)


def test_a_gpt_initialises_itself_as_a_direct_build_does():
    torch.manual_seed(0)
    direct = GPT(GPTConfig(**TINY_GQA_GPT))
    torch.manual_seed(0)
    meta = _meta(lambda: GPT(GPTConfig(**TINY_GQA_GPT)))
    assert materialize(meta, "cpu", seed=123) == []  # the GPT's own init_weights, not reset_parameters
    for (name, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name


# ---- buffers computed in __init__ (issue 22, item 8) ------------------------------------------------------


class CausalAttention(nn.Module):
    """A layer with reset_parameters() (its Linear's) and a causal mask computed in __init__: on the meta
    device the mask is computed as nothing, and reset_parameters() does not write it."""

    def __init__(self, width: int = 4, seq: int = 6, persistent: bool = True, explicit_device: bool = False):
        super().__init__()
        self.proj = nn.Linear(width, width)
        device = "cpu" if explicit_device else None
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, device=device)), persistent=persistent)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=device), persistent=persistent)

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()


class WritesItsMask(CausalAttention):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.mask.copy_(torch.tril(torch.ones_like(self.mask)))
        self.steps.data.zero_()  # through .data: no version bump, seen by the sentinel


@pytest.mark.parametrize("persistent", [True, False])
def test_a_buffer_computed_in_init_that_no_init_writes_is_refused_by_name(persistent):
    model = _meta(lambda: nn.Sequential(CausalAttention(persistent=persistent)))
    with pytest.raises(ValueError, match="were computed on the meta device in __init__") as info:
        materialize(model, "cpu", seed=0)
    message = str(info.value)
    assert "['0.mask (CausalAttention)', '0.steps (CausalAttention)']" in message
    assert "reset_parameters()/init_weights()" in message and "device='cpu'" in message
    assert "meta_init=False" in message


def test_buffers_written_by_reset_parameters_or_made_for_real_are_accepted():
    model = _meta(lambda: nn.Sequential(WritesItsMask(), CausalAttention(explicit_device=True)))
    assert not model[1].mask.is_meta  # the explicit device wins over the meta device
    materialize(model, "cpu", seed=0)
    for layer in model:
        assert torch.equal(layer.mask, torch.tril(torch.ones(6, 6))) and int(layer.steps) == 0


def test_the_gpts_rope_tables_are_written_by_its_own_init():
    from megascale.core.model.rope import RotaryEmbedding

    model = _meta(lambda: GPT(GPTConfig(**TINY_GQA_GPT)))
    materialize(model, "cpu", seed=0)
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    assert torch.isfinite(rope.cos).all() and rope.cos.abs().max() <= 1
