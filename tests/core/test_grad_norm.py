"""Tests of megascale.core.parallel.grad_clip: the global gradient norm and clipping, on plain tensors against
torch.nn.utils, and on real gloo ranks (tensor parallel, FSDP2, FSDP2 × TP on a 2-D mesh, Partial gradients)
against one unsharded process holding the same weights and batch.

Tolerance: float32; the sharded gradients equal the unsharded ones to ~1e-7 (TP and FSDP only reorder sums,
see test_tensor_parallel.py), and a norm sums them in another order: rtol 1e-5 leaves ~10x margin. The wrong
ways of counting (shards counted locally only, replicated tensors counted once per replica) are run too, and
are checked to miss the reference by far more than the tolerance, so the comparison can tell them apart.
"""

from __future__ import annotations

import copy
import importlib
import math
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megascale.core import GPT, GPTConfig, apply_tensor_parallel
from megascale.core.parallel import all_reduce_over_shards, clip_grad_norm_, grad_norm
from tests._dist import run_distributed
from tests.core._tiny import TINY_GQA_GPT

# The package exports the function grad_norm, which shadows the module of the same name as an attribute.
grad_norm_module = importlib.import_module("megascale.core.parallel.grad_clip")

RTOL = 1e-5
CONFIG = {**TINY_GQA_GPT, "bias": True, "norm": "layernorm"}


# ---- one process, plain tensors: torch.nn.utils is the reference -----------------------------------------


def _plain_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    params = []
    for i, shape in enumerate([(5, 4), (7,), (3, 2, 2), (6,)]):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * (1 + 2 * i)).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
def test_plain_norm_matches_torch(norm_type: float, foreach: bool | None) -> None:
    params = _plain_params()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    ours = grad_norm(params, norm_type, foreach=foreach)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # clipping, and a norm below max_norm (factor clamped to 1)
def test_plain_clip_matches_torch(max_norm: float, foreach: bool | None) -> None:
    ours, ref = _plain_params(), _plain_params()
    norm = clip_grad_norm_(ours, max_norm, foreach=foreach)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=foreach)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm > norm:
        for a, b in zip(ours, _plain_params()):
            assert torch.equal(a.grad, b.grad)


def test_skips_missing_grads_counts_duplicates_once_and_empty_is_zero() -> None:
    params = _plain_params()
    params[1].grad = None
    expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.testing.assert_close(grad_norm([*params, params[0], params[2]]), expected, rtol=1e-6, atol=0)
    empty = grad_norm([torch.nn.Parameter(torch.ones(3))])
    assert empty.item() == 0.0 and empty.dtype == torch.float32
    assert clip_grad_norm_([], 1.0).item() == 0.0
    single = _plain_params()[0]
    torch.testing.assert_close(grad_norm(single), single.grad.norm(), rtol=1e-6, atol=0)


def test_half_precision_grads_give_an_fp32_norm() -> None:
    params = _plain_params(torch.bfloat16)
    expected = torch.nn.utils.get_total_norm([p.grad.float() for p in params])
    ours = grad_norm(params)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    clip_grad_norm_(params, 1.0)
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


@pytest.mark.parametrize("norm_type", [0.0, -1.0, math.nan])
def test_bad_norm_type(norm_type: float) -> None:
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm(_plain_params(), norm_type)


def test_all_reduce_over_shards_checks_its_input() -> None:
    with pytest.raises(ValueError, match="one entry per spec"):
        all_reduce_over_shards(torch.zeros(3), [None, None])
    values = torch.tensor([1.0, 2.0])
    assert all_reduce_over_shards(values, [None, None]) is values  # whole tensors: no communication


# ---- gloo ranks: sharded models against the unsharded one --------------------------------------------------


@contextmanager
def _counting_all_reduces(calls: list[int]):
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counting):
        yield


def _split_over_every_dim(t: torch.Tensor) -> Any:
    """The double-counting mistake: treat a DTensor as split over all of its mesh dims, Replicate ones too."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    return tuple(t.device_mesh.get_group(d) for d in range(t.device_mesh.ndim))


def _build(layout: str, ref: GPT) -> tuple[torch.nn.Module, int]:
    """The sharded copy of ``ref`` and the all-reduces one norm should take (one per split process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(ref)
    world = dist.get_world_size()
    if layout == "tp":
        apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
        return model, 1
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in model.layers():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, 1
    assert layout == "fsdp_tp"
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    apply_tensor_parallel(model, mesh["tp"])
    for block in model.layers():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, 2


def _grads_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


def _layout_report(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**CONFIG))
    model, expected_reductions = _build(layout, ref)
    gen = torch.Generator().manual_seed(5)
    # Every rank the same batch: FSDP2's averaged gradients then equal the one-process gradients.
    tokens = torch.randint(0, 60, (2, 8), generator=gen)
    targets = torch.randint(0, 60, (2, 8), generator=gen)
    ref(tokens, targets).backward()
    model(tokens, targets).backward()
    ref_grads = [p.grad for p in ref.parameters()]
    out: dict[str, Any] = {"expected_reductions": expected_reductions}
    for name, norm_type in (("l2", 2.0), ("inf", math.inf)):
        calls: list[int] = []
        with _counting_all_reduces(calls):
            ours = grad_norm(model.parameters(), norm_type)
        out[name] = dict(
            ours=ours.item(),
            loop=grad_norm(model.parameters(), norm_type, foreach=False).item(),
            ref=torch.nn.utils.get_total_norm(ref_grads, norm_type).item(),
            reductions=len(calls),
        )
        with mock.patch.object(grad_norm_module, "shard_spec", return_value=None):
            out[name]["local_only"] = grad_norm(model.parameters(), norm_type).item()
        with mock.patch.object(grad_norm_module, "shard_spec", _split_over_every_dim):
            out[name]["every_dim"] = grad_norm(model.parameters(), norm_type).item()
    out["replicated_dims"] = any(
        any(pl.is_replicate() for pl in p.placements) for p in model.parameters()
    )  # only then can double counting show
    # Clipping: by a quarter of the norm (scales), and by twice it (leaves the gradients alone).
    for max_norm in (out["l2"]["ref"] / 4, out["l2"]["ref"] * 2):
        holders = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ref.named_parameters()}
        for n, p in ref.named_parameters():
            holders[n].grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(holders.values(), max_norm)
        expected = {n: h.grad for n, h in holders.items()}
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()  # fresh unclipped gradients (backward is deterministic)
        norm = clip_grad_norm_(model.parameters(), max_norm)
        got = _grads_full(model)
        worst = max(((got[n] - expected[n]).abs() - RTOL * expected[n].abs()).max().item() for n in expected)
        out.setdefault("clip", []).append(dict(norm=norm.item(), worst=worst))
    return out


def _partial_and_plain_report() -> dict[str, Any]:
    """A Partial gradient (its parts sum to the gradient) next to a Shard one and a plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(9)
    whole = [
        torch.randn(4, 3, generator=gen),
        torch.randn(8, 2, generator=gen),
        torch.randn(5, generator=gen),
    ]
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))
    parts = [whole[0] * (r + 1) / sum(range(1, world + 1)) for r in range(world)]
    replicated.grad = DTensor.from_local(parts[rank], mesh, [Partial()], run_check=False)
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(whole[1], mesh, [Shard(0)])
    plain = torch.nn.Parameter(torch.zeros(5))
    plain.grad = whole[2].clone()
    params = [replicated, sharded, plain]
    expected = torch.nn.utils.get_total_norm(whole).item()
    ours = grad_norm(params).item()
    clip_grad_norm_(params, expected / 2)
    clipped = [replicated.grad.full_tensor(), sharded.grad.full_tensor(), plain.grad]
    scale = (expected / 2) / (expected + 1e-6)
    worst = max((c - w * scale).abs().max().item() for c, w in zip(clipped, whole))
    return dict(ours=ours, expected=expected, clip_worst=worst)


def _grad_norm_worker(rank: int, world_size: int, layouts: tuple[str, ...]) -> dict[str, Any]:
    out = {layout: _layout_report(layout) for layout in layouts}
    out["partial"] = _partial_and_plain_report()
    return out


def _check(results: list[dict[str, Any]], layouts: tuple[str, ...]) -> None:
    for layout in layouts:
        first = results[0][layout]
        for rank, per_layout in enumerate(results):
            r = per_layout[layout]
            where = f"rank {rank}, {layout}"
            for name in ("l2", "inf"):
                n = r[name]
                assert n["ours"] == pytest.approx(n["ref"], rel=RTOL), (where, name, n)
                assert n["loop"] == pytest.approx(n["ref"], rel=RTOL), (where, name, n)
                assert n["ours"] == first[name]["ours"], f"{where}: norms differ between ranks"
                assert n["reductions"] == r["expected_reductions"], (where, name, n)
                # The comparison can fail: the wrong countings miss the reference by far more than RTOL.
                if name == "l2":  # a max over local shards can happen to be the global max
                    assert abs(n["local_only"] / n["ref"] - 1) > 100 * RTOL, (where, n)
                if r["replicated_dims"]:
                    assert abs(n["every_dim"] / n["ref"] - 1) > 100 * RTOL or name == "inf", (where, n)
            for c in r["clip"]:
                assert c["norm"] == pytest.approx(r["l2"]["ref"], rel=RTOL), where
                assert c["worst"] <= 1e-6, (where, c)
    for rank, r in enumerate(results):
        p = r["partial"]
        assert p["ours"] == pytest.approx(p["expected"], rel=1e-6), (rank, p)
        assert p["clip_worst"] <= 1e-6, (rank, p)


def test_sharded_grad_norm_world2() -> None:
    layouts = ("tp", "fsdp")
    _check(run_distributed(_grad_norm_worker, 2, layouts), layouts)


def test_sharded_grad_norm_world4() -> None:
    layouts = ("fsdp_tp",)
    _check(run_distributed(_grad_norm_worker, 4, layouts), layouts)
