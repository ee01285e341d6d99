"""An optimizer's checkpoint state dict holds the states the optimizer holds, none made up (gen-445: under ZeRO-1
by parameters, a rank owning none of an optimizer's parameters wrote zero states that DCP kept instead of the
owner's; the matrix row ``manual-one-owner`` runs it under every layout)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from megascale.lightning.optimizer_state_dict import optimizer_state_dict


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_torch_makes_up_states_that_it_leaves_in_the_optimizer() -> None:
    """Why the wrapper exists: what it must undo (if torch stops doing this, the wrapper can go)."""
    model, optimizer = _model_and_optimizer()
    saved = get_optimizer_state_dict(model, optimizer)
    assert len(saved["state"]) == 4 and len(optimizer.state) == 4


def test_an_optimizer_holding_no_state_gives_none_and_keeps_none() -> None:
    model, optimizer = _model_and_optimizer()
    for options in (StateDictOptions(), StateDictOptions(flatten_optimizer_state_dict=True)):
        saved = optimizer_state_dict(model, optimizer, options)
        assert not [k for k in saved if k.startswith("state.")] and not saved.get("state")
        assert not optimizer.state
        assert saved.get("param_groups") or any(k.startswith("param_groups.") for k in saved)


def test_a_template_has_every_state_and_the_optimizer_keeps_none() -> None:
    model, optimizer = _model_and_optimizer()
    template = optimizer_state_dict(model, optimizer, StateDictOptions(), keep="every")
    assert sorted(template["state"]) == sorted(n for n, _ in model.named_parameters())
    assert not optimizer.state


def test_the_states_held_are_given_whole_and_no_other() -> None:
    model, optimizer = _model_and_optimizer()
    model[1](torch.randn(5, 4)).sum().backward()  # the first layer gets no gradient: never stepped
    optimizer.step()
    nested = optimizer_state_dict(model, optimizer, StateDictOptions())
    assert sorted(nested["state"]) == ["1.bias", "1.weight"]
    torch.testing.assert_close(
        nested["state"]["1.weight"]["exp_avg"], optimizer.state[model[1].weight]["exp_avg"]
    )
    flat = optimizer_state_dict(model, optimizer, StateDictOptions(flatten_optimizer_state_dict=True))
    assert sorted({k.split(".")[1] for k in flat if k.startswith("state.")}) == ["1"]
    assert {k for k in flat if k.startswith("param_groups.0.")}  # every parameter's settings stay
    assert len(optimizer.state) == 2


def test_a_checkpoint_of_a_parameter_never_stepped_resumes_without_its_state(tmp_path) -> None:
    """Saved, the never-stepped parameter has no state; resumed into a fresh optimizer it gets none either
    (torch's set_optimizer_state_dict alone fails on such a dict, and the template used to ask the
    checkpoint for it), and the next steps equal those of the run that kept going."""
    from megascale.lightning import checkpoint_io

    model, optimizer = _model_and_optimizer()
    model[1](torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    checkpoint_io.save(tmp_path / "ckpt", model, [optimizer], {}, is_global_zero=True, barrier=lambda: None)
    again, fresh = _model_and_optimizer()
    checkpoint_io.load(tmp_path / "ckpt", again, [fresh])
    assert set(fresh.state) == {again[1].weight, again[1].bias}
    for m, opt in ((model, optimizer), (again, fresh)):
        torch.manual_seed(1)
        m(torch.randn(5, 3)).sum().backward()
        opt.step()
    for p, q in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_param_group_without_parameters_resumes_with_its_own_settings(tmp_path) -> None:
    """A pipeline stage holds none of a group's parameters (gen-110 under pp2): torch's
    set_optimizer_state_dict read that group's settings from its first parameter (IndexError); the group now
    keeps its own and the others load."""
    from megascale.lightning import checkpoint_io

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        groups = [{"params": list(model.parameters())}, {"params": [], "lr": 0.5}]
        return model, torch.optim.AdamW(groups, lr=0.1)

    model, optimizer = make()
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.05  # as a scheduler would have set it
    checkpoint_io.save(tmp_path / "ckpt", model, [optimizer], {}, is_global_zero=True, barrier=lambda: None)
    again, fresh = make()
    checkpoint_io.load(tmp_path / "ckpt", again, [fresh])
    assert [g["lr"] for g in fresh.param_groups] == [0.05, 0.5]
    assert [len(g["params"]) for g in fresh.param_groups] == [4, 0]
    for p, q in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(fresh.state[q]["exp_avg"], optimizer.state[p]["exp_avg"], rtol=0, atol=0)
