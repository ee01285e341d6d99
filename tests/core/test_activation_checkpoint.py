"""Activation checkpointing: same numbers, fewer saved activations, the chosen modules recomputed."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from megascale.core import GPT, GPTConfig, apply_activation_checkpointing, apply_tensor_parallel, kernels
from tests._dist import run_distributed

CFG = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, dropout=0.1)


def _run(model: GPT, tokens: torch.Tensor, monkeypatch) -> tuple[float, dict, int, int]:
    """Loss, gradients, bytes saved for backward, and how often the attention kernel ran."""
    calls = 0
    attention = kernels.attention

    def counting_attention(*args, **kwargs):
        nonlocal calls
        calls += 1
        return attention(*args, **kwargs)

    # counted at the kernel: recomputation calls the module's forward without its hooks
    monkeypatch.setattr(kernels, "attention", counting_attention)
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    torch.manual_seed(5)  # dropout masks: checkpointing must replay them exactly
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, tokens)
    loss.backward()
    monkeypatch.setattr(kernels, "attention", attention)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, saved, calls


@pytest.mark.parametrize("parallel_block", [True, False])
def test_checkpointing_keeps_numbers_and_saves_memory(parallel_block, monkeypatch):
    torch.manual_seed(0)
    base = GPT(GPTConfig(**CFG, parallel_block=parallel_block))
    tokens = torch.randint(0, 100, (2, 24))
    runs = {}
    for mode in ("none", "selective", "full"):
        runs[mode] = _run(apply_activation_checkpointing(copy.deepcopy(base), mode), tokens, monkeypatch)
    loss, grads, saved, calls = runs["none"]
    for mode in ("selective", "full"):
        assert runs[mode][0] == loss
        for name, g in grads.items():
            assert torch.equal(runs[mode][1][name], g), (mode, name)
    assert calls == 2
    assert runs["selective"][3] == 4 and runs["full"][3] == 4  # each attention core ran again in backward
    assert runs["full"][2] < runs["selective"][2] < saved


def test_parameter_names_do_not_change():
    model = GPT(GPTConfig(**CFG))
    names = list(model.state_dict())
    assert list(apply_activation_checkpointing(model, "full").state_dict()) == names


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="'none', 'full' or 'selective'"):
        apply_activation_checkpointing(GPT(GPTConfig(**CFG)), "everything")  # type: ignore[arg-type]


def _tp_with_checkpointing(rank: int, world_size: int) -> float:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    cfg = GPTConfig(**{**CFG, "dropout": 0.0})
    base = apply_tensor_parallel(GPT(cfg), mesh, sequence_parallel=True, overlap=True)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    checkpointed = apply_activation_checkpointing(copy.deepcopy(base), "full")
    base(tokens, tokens).backward()
    checkpointed(tokens, tokens).backward()
    return max(
        (a.grad.to_local() - b.grad.to_local()).abs().max().item()
        for a, b in zip(base.parameters(), checkpointed.parameters())
    )


def test_checkpointing_composes_with_tensor_parallel():
    # recomputation re-runs the TP collectives; the gradients must be unchanged
    assert all(err == 0.0 for err in run_distributed(_tp_with_checkpointing, 2))
