"""``tensor_parallel_plan`` styles against the unsplit model, on real gloo ranks (tp2), and the plan checks.

The model is written here: a vocabulary-parallel embedding, pre-norm blocks with their own attention (q/k/v/o
``nn.Linear``, grouped-query heads, per-head q/k norms that see only this rank's heads:
"replicated_with_grad_allreduce") and MLP, a final norm and an LM head whose logits are gathered
("colwise_rep"), and a value head reading the hidden states through "sequence_gather". Loss = LM loss +
value loss. Every rank builds the same model (same seed); the split copy must give the unsplit one's loss and
every parameter's gradient (DTensor gradients gathered whole, replicated ones as they are, which also shows
they are equal on every rank), with sequence parallelism on and off and 1 or 3 overlap chunks, then again
after one SGD step, and with activation checkpointing on every block.

Tolerance: float32, only the order of sums differs (partial products over tp, chunked GEMMs): ~1e-7 relative;
gradients are O(1e-2..1), so 1e-5 absolute. A missing gradient sum over tp halves a norm's gradient (off by
~1e-2); a wrong gather/scatter backward scales a gradient by tp.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.parallel.tp.user_model import (
    TP_STYLES,
    apply_tensor_parallel_plan,
    check_tensor_parallel_plan,
)
from tests._dist import run_distributed
from tests._models import Head

TOL = 1e-5
VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.k = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)
        self.q_norm = nn.LayerNorm(HEAD_DIM)  # per head (Qwen3-style): sees this rank's heads only
        self.k_norm = nn.LayerNorm(HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        B, T = q.shape[:2]  # from the projections: under sequence parallelism x is a shard
        q = self.q_norm(q.view(B, T, -1, HEAD_DIM)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, -1, HEAD_DIM)).transpose(1, 2)
        v = v.view(B, T, -1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ValueLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = Head(WIDTH, VOCAB, bias=False)
        self.value_head = nn.Linear(WIDTH, 1)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        lm = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        value = self.value_head(x).squeeze(-1)
        return lm + (value - targets.float() / VOCAB).pow(2).mean()


PLAN: dict[str, Any] = {
    "embed": "rowwise",
    "blocks.*.norm1": "sequence_parallel",
    "blocks.*.norm2": "sequence_parallel",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.attn.q_norm": "replicated_with_grad_allreduce",
    "blocks.*.attn.k_norm": "replicated_with_grad_allreduce",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "head.norm": "sequence_parallel",
    "head.proj": "colwise_rep",
    "value_head": "sequence_gather",
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _parity_worker(
    rank: int, world: int, sequence_parallel: bool, chunks: int, torch_mlp: bool, ac: bool
) -> dict:
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    reference = ValueLM()
    model = copy.deepcopy(reference)
    plan = dict(PLAN)
    if torch_mlp:  # torch's own styles for the MLP, megascale's for the rest
        plan.update({"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()})
    mesh = init_device_mesh("cpu", (world,))
    apply_tensor_parallel_plan(model, plan, mesh, sequence_parallel=sequence_parallel, overlap_chunks=chunks)
    if ac:
        for block in [*model.blocks, *reference.blocks]:
            checkpoint(block)
    tokens, targets = _batch()
    out: dict[str, Any] = {"losses": [], "grads": []}
    for m in (reference, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses, grads = [], []
        for _ in range(2):
            loss = m(tokens, targets)
            loss.backward()
            losses.append(float(loss))
            grads.append(_grads(m))
            opt.step()
            opt.zero_grad()
        out["losses"].append(losses)
        out["grads"].append(grads)
    return out


@pytest.mark.parametrize(
    ("sequence_parallel", "chunks", "torch_mlp", "ac"),
    [(True, 1, False, False), (True, 3, False, True), (False, 3, False, False), (False, 1, True, False)],
)
def test_a_planned_model_computes_the_unsplit_models_loss_and_gradients(
    sequence_parallel, chunks, torch_mlp, ac
):
    for rank, result in enumerate(
        run_distributed(_parity_worker, 2, sequence_parallel, chunks, torch_mlp, ac)
    ):
        (want_losses, got_losses), (want_grads, got_grads) = result["losses"], result["grads"]
        assert got_losses == pytest.approx(want_losses, abs=TOL), f"rank {rank}"
        for step, (want, got) in enumerate(zip(want_grads, got_grads)):
            assert want.keys() == got.keys()
            for name in want:
                worst = (got[name] - want[name]).abs().max().item()
                assert worst <= TOL, f"rank {rank} step {step}: gradient of {name} off by {worst:.2e}"


def _guard_worker(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = ValueLM()
    apply_tensor_parallel_plan(model, PLAN, init_device_mesh("cpu", (world,)), sequence_parallel=True)
    model(*_batch())  # records the sequence length entering the region: 16
    try:
        model.blocks[0].attn.q(torch.randn(2, 16, WIDTH))  # the whole sequence, not this rank's 8 positions
    except RuntimeError as e:
        return str(e)
    return "accepted"


def test_an_input_that_is_not_a_sequence_shard_is_refused_by_the_layer_that_would_gather_it():
    for message in run_distributed(_guard_worker, 2):
        assert (
            message.startswith("blocks.0.attn.q: its input has 16 positions") and "sequence shard" in message
        )


def _meta_model() -> ValueLM:
    with torch.device("meta"):
        return ValueLM()


@pytest.mark.parametrize(
    ("change", "sequence_parallel", "message"),
    [
        ({"blocks.*.attn.z": "colwise"}, False, "pattern 'blocks.*.attn.z' matches no submodule"),
        ({"blocks.*.up": "diagonal"}, False, "blocks.0.up: unknown style 'diagonal'"),
        ({"embed": "colwise"}, False, "embed is a Embedding; 'colwise' splits an nn.Linear (an nn.Embedding"),
        (
            {"blocks.*.norm1": "rowwise"},
            False,
            "blocks.0.norm1 is a LayerNorm; 'rowwise' splits an nn.Linear",
        ),
        ({"embed": "sequence_parallel"}, True, "nothing in the plan splits the sequence"),
        (
            {"blocks.0.up": "colwise", "blocks.*.up": "rowwise"},
            False,
            "blocks.0.up is matched by two patterns",
        ),
    ],
)
def test_a_plan_that_cannot_apply_is_refused_naming_the_module_before_any_collective(
    change, sequence_parallel, message
):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tensor_parallel_plan(
            _meta_model(), {**PLAN, **change}, 2, sequence_parallel=sequence_parallel, name="lm"
        )


def test_sizes_that_tp_does_not_divide_are_refused_with_what_fits():
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.k has out_features=16, not divisible by tp=3"):
        check_tensor_parallel_plan(_meta_model(), {"blocks.*.attn.k": "colwise"}, 3, sequence_parallel=False)
    model = _meta_model()
    model.embed = nn.Embedding(63, WIDTH, device="meta")
    with pytest.raises(
        ValueError,
        match=r"num_embeddings=63, not divisible by tp=2 \(tp can be one of \[1, 3, 7, 9, 21, 63\]",
    ):
        check_tensor_parallel_plan(model, PLAN, 2, sequence_parallel=True)
    assert "sequence_gather" in TP_STYLES


def _twice_worker(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    model = ValueLM()
    mesh = init_device_mesh("cpu", (world,))
    apply_tensor_parallel_plan(model, PLAN, mesh, sequence_parallel=True)
    try:
        apply_tensor_parallel_plan(model, PLAN, mesh, sequence_parallel=True)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_plan_applied_twice_is_refused():
    for message in run_distributed(_twice_worker, 2):
        assert "embed already holds split (DTensor) parameters" in message
