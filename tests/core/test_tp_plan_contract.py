"""What a ``tensor_parallel_plan`` must never do silently (issue 22, items 4-7), on real gloo ranks (tp2).

Each case is exact against the unsplit model or refused by name:
- item 4: a trainable plain parameter used on a sequence shard or on this rank's heads that no style sums over
  tp (a norm left out of the plan, per-head q/k norms, a LayerScale gain held by a block) is refused in the
  first forward, naming it and the style that fixes it; with that style the model computes the unsplit one's
  loss and gradients;
- item 5: torch's own ``SequenceParallel`` style on the norms trains like one process under ZeRO-0, ZeRO-1 (both
  shardings), 2 and 3 at tp2 × dp2 (its Partial gradients are made whole before ZeRO reduces them; ZeRO-1
  diverged before);
- item 6: plain 'colwise' on a layer named like a fused projection is refused, 'colwise_unfused' opts in;
- item 7: a weight tied between a split and a whole use is refused; tied embedding/LM head both split by
  vocabulary rows stay tied and exact; a learned position embedding is refused by name under sequence
  parallelism (not a raw shape error) and exact with the 'position_embedding' style.

Tolerance: float32, only the order of sums differs (partial products over tp): ~1e-7 relative; gradients
O(1e-2..1), so 1e-5 absolute (as test_tp_plan.py). A gradient missing its sum over tp is off by ~1e-2.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.parallel.tp.user_model import apply_tensor_parallel_plan, check_tensor_parallel_plan
from tests._dist import run_distributed

TOL = 1e-5
VOCAB, WIDTH, HEADS, HEAD_DIM, SEQ = 64, 32, 4, 8, 8


class Attention(nn.Module):
    def __init__(self, qk_norm: bool, fused: bool) -> None:
        super().__init__()
        if fused:
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        else:
            self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)
        self.q_norm = nn.LayerNorm(HEAD_DIM) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            q = self.q_norm(q)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, gain: bool, qk_norm: bool, fused: bool) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention(qk_norm, fused)
        self.norm2, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 64), nn.Linear(64, WIDTH)
        # LayerScale: a gain held by the block itself, applied to its branches' outputs
        self.gain = nn.Parameter(torch.full((WIDTH,), 0.5)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.norm1(x))
        x = x + (a if self.gain is None else self.gain * a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, pos: str | None = None, gain: bool = False, qk_norm: bool = False, fused: bool = False,
                 tie: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos_kind = pos
        if pos == "embedding":
            self.pos = nn.Embedding(SEQ, WIDTH)
        elif pos == "parameter":
            self.pos_table = nn.Parameter(torch.randn(1, SEQ, WIDTH) * 0.1)
        self.blocks = nn.ModuleList(Block(gain, qk_norm, fused) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.proj.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos_kind == "embedding":
            x = x + self.pos(torch.arange(tokens.shape[1]))  # (T, D), broadcast over the batch
        elif self.pos_kind == "parameter":
            x = x + self.pos_table[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.proj(self.norm(x)).flatten(0, 1), targets.flatten())


def plan(*, drop: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    """A correct plan for ``LM`` (SP on), less the patterns in ``drop``, plus ``extra``."""
    full: dict[str, Any] = {
        "embed": "rowwise",
        "blocks.*.norm1": "sequence_parallel",
        "blocks.*.norm2": "sequence_parallel",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "norm": "sequence_parallel",
        "proj": "colwise_rep",
    }
    return {k: v for k, v in full.items() if k not in drop} | extra


# case -> (LM options, plan, sequence_parallel, expected: "exact" or a message the error contains)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool, str]] = {
    "item 4: a norm left out of the plan (SP)": (
        {}, plan(drop=("blocks.*.norm2",)), True,
        "parameter(s) ['blocks.0.norm2.bias', 'blocks.0.norm2.weight'] are used in blocks.0.norm2 on a sequence "
        "shard",
    ),
    "item 4: the final norm left out (SP): its fix named": (
        {}, plan(drop=("norm",)), True, "Fix: in the tensor_parallel_plan of <root>, mark 'norm' as "
        "'sequence_parallel'",
    ),
    "item 4: per-head q norm left out (no SP)": (
        dict(qk_norm=True), plan(), False,
        "['blocks.0.attn.q_norm.bias', 'blocks.0.attn.q_norm.weight'] are used in blocks.0.attn.q_norm on this "
        "rank's share of the features",
    ),
    "item 4: per-head q norm marked": (
        dict(qk_norm=True), plan(**{"blocks.*.attn.q_norm": "replicated_with_grad_allreduce"}), False, "exact",
    ),
    "item 4: a LayerScale gain held by the block (SP)": (
        dict(gain=True), plan(), True, "['blocks.0.gain'] are used in blocks.0 on a sequence shard",
    ),
    "item 4: the block marked 'sequence_parallel' sums its gain": (
        dict(gain=True), plan(**{"blocks.*": "sequence_parallel"}), True, "exact",
    ),
    "item 4: opted out with 'replicated_unsummed'": (
        {}, plan(**{"blocks.*.norm2": "replicated_unsummed"}), True, "accepted",
    ),
    "item 7: a learned position embedding left out (SP)": (
        dict(pos="embedding"), plan(), True, "mark it 'position_embedding'",
    ),
    "item 7: a learned position embedding marked": (
        dict(pos="embedding"), plan(pos="position_embedding"), True, "exact",
    ),
    "item 7: a position table held as a parameter (SP)": (
        dict(pos="parameter"), plan(), True, "combines a sequence shard (2, 4, 32)",
    ),
    "item 7: tied embedding and LM head, both split by rows": (dict(tie=True), plan(), True, "exact"),
    "item 6: a fused qkv marked 'colwise_unfused' is accepted": (
        dict(fused=True), plan(drop=("blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v"),
                               **{"blocks.*.attn.qkv": "colwise_unfused"}), True, "accepted",
    ),
}  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model: nn.Module, steps: int = 2) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for _ in range(steps):  # the second step shows a weight untied or a gradient not whole after step 1
        loss = model(*_batch())
        loss.backward()
        losses.append(float(loss))
        grads.append({n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _cases_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for name in names:
        options, the_plan, sp, _ = CASES[name]
        torch.manual_seed(0)
        reference = LM(**options)
        model = copy.deepcopy(reference)
        try:
            apply_tensor_parallel_plan(model, the_plan, mesh, sequence_parallel=sp)
            got = _train(model)
        except ValueError as e:
            out[name] = str(e)
            continue
        out[name] = {"got": got, "want": _train(reference)}
    return out


def test_each_case_is_exact_or_refused_by_name() -> None:
    results = run_distributed(_cases_worker, 2, list(CASES))
    for rank, result in enumerate(results):
        for name, (_, _, _, expected) in CASES.items():
            got = result[name]
            if expected in ("exact", "accepted"):
                assert not isinstance(got, str), f"{name}, rank {rank}: refused: {got}"
                if expected == "accepted":
                    continue
                (got_losses, got_grads), (want_losses, want_grads) = got["got"], got["want"]
                assert got_losses == pytest.approx(want_losses, abs=TOL), f"{name}, rank {rank}"
                for step, (g, w) in enumerate(zip(got_grads, want_grads)):
                    assert g.keys() == w.keys(), name
                    worst = max((g[k] - w[k]).abs().max().item() for k in w)
                    assert worst <= TOL, f"{name}, rank {rank}, step {step}: gradients off by {worst:.2e}"
            else:
                assert isinstance(got, str), f"{name}, rank {rank}: not refused"
                assert expected in got, f"{name}, rank {rank}: {got}"


# ---- refused before any collective (meta-device models, no process group) ------------------------------


def _meta_lm(**options: Any) -> LM:
    with torch.device("meta"):
        return LM(**options)


@pytest.mark.parametrize(
    ("options", "the_plan", "sp", "message"),
    [
        (
            dict(fused=True),
            plan(drop=("blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v"), **{"blocks.*.attn.qkv": "colwise"}),
            True,
            "blocks.0.attn.qkv is named like a fused projection ('qkv'",
        ),
        (dict(tie=True), plan(drop=("embed",)), False,
         "embed.weight and proj.weight are one tied parameter, but the plan splits its uses differently "
         "(embed.weight: left whole (not in the plan), proj.weight: split by rows, Shard(0))"),
        (dict(tie=True), plan(drop=("proj",)), True, "embed.weight and proj.weight are one tied parameter"),
        (dict(tie=True), plan(proj="rowwise"), True, "proj.weight: split by columns, Shard(1)"),
        (dict(pos="embedding"), plan(norm="position_embedding"), True, "'position_embedding' takes an nn.Embedding"),
    ],
)  # fmt: skip
def test_plans_that_would_be_silently_wrong_are_refused_before_any_collective(options, the_plan, sp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tensor_parallel_plan(_meta_lm(**options), the_plan, 2, sequence_parallel=sp)


# ---- item 5: torch's SequenceParallel under every ZeRO stage that reduces local tensors -------------------

ZERO_LAYOUTS = [
    dict(tp=2, zero_stage=0),
    dict(tp=2, zero_stage=1, zero1_sharding="elements"),
    dict(tp=2, zero_stage=1, zero1_sharding="parameters"),
    dict(tp=2, zero_stage=2),
    dict(tp=2, zero_stage=3),
]


class TorchNormsLM(LM):
    """The norms split by torch's own SequenceParallel (replicated weights whose gradients come Partial)."""

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import SequenceParallel

        norms = ("blocks.*.norm1", "blocks.*.norm2", "norm")
        return plan(drop=norms) | {n: SequenceParallel(use_local_output=True) for n in norms}


def _torch_norms_worker(rank: int, world: int) -> dict[str, Any]:
    from megascale.core.parallel import ParallelPlan, parallelize
    from tests.core.test_compose import _full_weights, _train

    out = {}
    for kw in ZERO_LAYOUTS:
        the_plan = ParallelPlan(**kw)
        mesh = the_plan.dims(world).build_mesh("cpu")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TorchNormsLM()
        runtime = parallelize(model, the_plan, mesh, device="cpu")
        losses = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size(), pipelined=False)
        out[repr(kw)] = {"losses": losses, "weights": _full_weights(model)}
        runtime.zero.remove()
    return out


def test_torch_sequence_parallel_norms_train_like_one_process_under_every_zero_stage() -> None:
    from megascale.core.parallel import materialize
    from tests.core.test_compose import _compare, _full_weights, _train

    torch.manual_seed(0)
    with torch.device("meta"):
        reference = TorchNormsLM()
    materialize(reference, "cpu", seed=torch.initial_seed())
    want = {"losses": _train(reference, None, 0, 1, pipelined=False), "weights": _full_weights(reference)}
    for rank, result in enumerate(run_distributed(_torch_norms_worker, 4, timeout=300)):
        for name, got in result.items():
            _compare(got, want, f"torch SequenceParallel norms, {name}, rank {rank}")


# ---- across plans: what parallelize checks over the whole module ------------------------------------------


class PlannedLM(LM):
    def tensor_parallel_plan(self) -> dict[str, Any]:
        return plan()

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # under sequence parallelism: this rank's sequence shard


class WithValueHead(nn.Module):
    """A plan model and a value head outside it; ``tie``: an output layer outside the plan tied to its
    vocabulary-parallel embedding."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.lm = PlannedLM()
        self.value = nn.Linear(WIDTH, 1)
        if tie:
            self.extra = nn.Linear(WIDTH, VOCAB, bias=False)
            self.extra.weight = self.lm.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.value(self.lm.hidden(tokens)).pow(2).mean()


def _whole_module_worker(rank: int, world: int) -> dict[str, str]:
    from megascale.core.parallel import ParallelPlan, parallelize

    out = {}
    for case in ("tied outside the plan", "a head outside the plan on sequence shards"):
        the_plan = ParallelPlan(tp=2)
        torch.manual_seed(0)
        model = WithValueHead(tie=case.startswith("tied"))
        try:
            runtime = parallelize(model, the_plan, the_plan.dims(world).build_mesh("cpu"), device="cpu")
            model(_batch()[0]).backward()
            runtime.zero.remove()
            out[case] = "accepted"
        except ValueError as e:
            out[case] = str(e)
    return out


def test_parallelize_checks_ties_and_parameters_outside_the_plans_too() -> None:
    for result in run_distributed(_whole_module_worker, 2):
        tied = result["tied outside the plan"]
        assert "lm.embed.weight and extra.weight are one tied parameter" in tied, tied
        assert "extra.weight: left whole (not in the plan)" in tied
        head = result["a head outside the plan on sequence shards"]
        assert "['value.bias', 'value.weight'] are used in value on a sequence shard" in head, head
        assert "no module above 'value' declares a tensor_parallel_plan: declare one that marks it as" in head
