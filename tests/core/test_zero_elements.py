"""ZeRO-1 with zero1_sharding="elements" (reduce-scatter, each rank steps 1/dp of every bucket, all-gather) on
real gloo ranks, through ``apply_zero``'s runtime as a plain training loop calls it.

Against one process stepping the unsharded model on the union of all ranks' batches, for 4 steps with torch
AdamW (foreach and for-loop) and megascale LAMB (whose trust ratio needs norms summed over the pieces of a
parameter), at dp=2, dp=4 and dp=2 × tp=2 (DTensor parameters cut into 1-D pieces). Every step clips by the
global norm, which is only right if the scattered gradients' shares are added over dp (``grad_sum_group``).
Also: bytes per step equal DDP's (stage 0's) to the bucket padding; the optimizer state is 1/dp of the whole
to a few elements (no largest-parameter bound); the next forward waits for the all-gathers through its
pre-hooks alone (nothing waits without them); a parameter given new storage between steps still gets the
gathered values; the state gathered whole for a checkpoint equals the
reference optimizer's, also where a parameter was not stepped since the last gather (its state still whole
beside others' pieces); a non-elementwise optimizer is refused by name.

Tolerance as in test_zero.py (same model, steps and reasoning: sums in another order, amplified by AdamW where
a gradient element is near zero): 5e-5 for AdamW, 2e-6 for LAMB. A skipped, doubled or stale update, or a
norm summed over the wrong ranks, moves a weight by ~lr = 1e-2.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megascale.core import GPT, GPTConfig, apply_tensor_parallel
from megascale.core.comm_meter import CollectiveMeter
from megascale.core.parallel import UnitTree, apply_zero, clip_grad_norm_
from tests._dist import run_distributed
from tests.core._zero_steps import BUCKET_MB, CONFIG, LR, MAX_NORM, STEPS, full, union
from tests.core._zero_steps import batch as _batch
from tests.core._zero_steps import optimizer as _optimizer

ATOL = {"adamw-foreach": 5e-5, "adamw-loop": 5e-5, "lamb": 2e-6}


def _local_numel(t: torch.Tensor) -> int:
    from megascale.core._dtensor import local

    return local(t).numel()


def _run(kind: str, overlap: bool, dp_mesh: Any, tp_mesh: Any) -> dict[str, Any]:
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**CONFIG))
    model = copy.deepcopy(ref)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    zero = apply_zero(
        [UnitTree(model, [model.layers()])], dp_mesh, stage=1, bucket_size_mb=BUCKET_MB,
        overlap_param_gather=overlap,
    )  # fmt: skip
    opt = _optimizer(kind, model.parameters())
    zero.attach_optimizers([opt])
    ref_opt = _optimizer(kind, ref.parameters())
    meter = CollectiveMeter()

    def step(i: int) -> None:
        with meter:
            model(*_batch(i, dp_rank)).backward()
            zero.after_backward()
            clip_grad_norm_(model.parameters(), MAX_NORM, sum_group=zero.grad_sum_group())
            opt.step()  # a plain loop: the step hooks swap the pieces in and out
            zero.after_optimizer_step(opt)
        opt.zero_grad()
        ref(*union(i, dp)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()

    for i in range(STEPS):
        meter.records.clear()
        step(i)
    buckets = zero.reduce.buckets  # type: ignore[attr-defined]
    sent = {k: meter.payload_bytes(k) for k in ("reduce_scatter", "all_gather", "all_reduce", "broadcast")}
    out: dict[str, Any] = {
        "kind": kind, "overlap": overlap, "dp": dp, "sent": sent,
        "padding_bytes": 4 * sum(b.padded(dp) - b.numel for b in buckets),
        "grad_bytes": 4 * sum(b.numel for b in buckets), "buckets": len(buckets),
        "params": len(list(model.parameters())),
        "cut": sum(1 for b in buckets for p in b.params if 0 < _piece(zero, opt, p) < _local_numel(p)),
    }  # fmt: skip
    sharding = zero.steps[id(opt)]  # type: ignore[attr-defined]
    out["pending_before_forward"] = len(sharding._pending)
    test = _batch(99, 0)[0]

    def logits_error() -> float:
        with torch.no_grad():
            ours, full = model(test), ref(test)
        if tp_mesh is not None:
            width = ours.shape[-1]
            full = full[..., tp_mesh.get_local_rank() * width : (tp_mesh.get_local_rank() + 1) * width]
        return (ours - full).abs().max().item()

    out["logits"] = logits_error()  # the pre-hooks alone bring the gathered values in
    zero.wait_for_params()
    out["weights"] = max(
        (full(p) - r.detach()).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
    )
    state_numel = [
        sum(v.numel() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for s in opt.state.values()
    ]
    out["state_elements"] = sum(state_numel)
    out["full_state_elements"] = 2 * sum(_local_numel(p) for p in model.parameters())  # two moments
    out["largest_param_state"] = 2 * max(_local_numel(p) for p in model.parameters())
    # Whole state for a checkpoint: equal to the reference optimizer's, on every rank.
    zero.prepare_optimizer_state(opt)
    out["state_error"] = max(
        (full(opt.state[p][key]) - ref_opt.state[r][key]).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters())
        for key in ("exp_avg", "exp_avg_sq")
    )
    # ... and one more step from whole state (cut into pieces again) still matches.
    step(STEPS)
    zero.wait_for_params()
    out["weights_after_gather"] = max(
        (full(p) - r.detach()).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
    )
    # A parameter given new storage between steps (p.data = ...) is taken back into its bucket's flat buffer,
    # which the all-gather writes: it still gets the other ranks' pieces.
    moved = next(model.parameters())
    target = moved._local_tensor if hasattr(moved, "_local_tensor") else moved
    target.data = target.data.clone()
    step(STEPS + 1)
    zero.wait_for_params()
    out["weights_after_new_storage"] = max(
        (full(p) - r.detach()).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
    )
    # Without the pre-hooks nothing waits for the gathers (which write into the parameters in place).
    for handle in sharding._handles[:-2]:
        handle.remove()
    step(STEPS + 2)
    logits_error()
    out["pending_without_hooks"] = len(sharding._pending)
    zero.wait_for_params()
    out["logits_after_wait"] = logits_error()
    return out


def _piece(zero: Any, opt: Any, p: torch.Tensor) -> int:
    start, stop = zero.steps[id(opt)]._range[id(p)]
    return stop - start


def _worker(rank: int, world_size: int, plan: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for layout, kind, overlap in plan:
        if layout == "dp":
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
            result = _run(kind, overlap, mesh["dp"], None)
        else:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
            result = _run(kind, overlap, mesh["dp"], mesh["tp"])
            result["tp_rank"] = mesh["tp"].get_local_rank()
        result["layout"] = layout
        out.append(result)
    return out


def _check(results: list[list[dict[str, Any]]]) -> None:
    for i in range(len(results[0])):
        runs = [per_rank[i] for per_rank in results]
        first = runs[0]
        where = f"{first['layout']} {first['kind']} overlap={first['overlap']}"
        for rank, r in enumerate(runs):
            at, atol, dp = f"{where}, rank {rank}", ATOL[r["kind"]], r["dp"]
            for key in ("weights", "logits", "state_error", "weights_after_gather", "weights_after_new_storage",
                        "logits_after_wait"):  # fmt: skip
                assert r[key] <= atol, (at, key, r[key])
            sent = r["sent"]
            if r["layout"] == "dp":  # (under TP the meter also sees the tensor-parallel collectives)
                # DDP's bytes: one reduce-scatter and one all-gather of every bucket (padded); besides, only
                # the clip norm's scalar and LAMB's trust-ratio norms (two floats per parameter).
                assert sent["all_reduce"] <= 8 * (2 * r["params"] + 1) and sent["broadcast"] == 0, (at, sent)
                assert sent["reduce_scatter"] == r["grad_bytes"] + r["padding_bytes"], (at, sent)
                assert sent["all_gather"] == sent["reduce_scatter"], (at, sent)
            assert r["padding_bytes"] < 4 * dp * r["buckets"], at
            assert r["cut"] > 0, f"{at}: no parameter is cut between ranks: the test does not test pieces"
            # State 1/dp to the bucket padding, far below the largest-parameter bound of whole ownership.
            even = r["full_state_elements"] / dp
            assert abs(r["state_elements"] - even) <= 2 * dp * r["buckets"], (at, r["state_elements"], even)
            if r["overlap"]:
                assert r["pending_before_forward"] == r["buckets"], at
                assert r["pending_without_hooks"] == r["buckets"], at
            else:
                assert r["pending_before_forward"] == 0, at
                assert r["pending_without_hooks"] == 0, at
        groups: dict[int, list[dict[str, Any]]] = {}
        for r in runs:
            groups.setdefault(r.get("tp_rank", 0), []).append(r)
        for members in groups.values():  # the pieces of one dp group are the whole state, once
            assert sum(r["state_elements"] for r in members) == members[0]["full_state_elements"], where


def test_zero1_elements_dp2() -> None:
    plan = [("dp", "adamw-foreach", True), ("dp", "adamw-loop", False), ("dp", "lamb", True)]
    _check(run_distributed(_worker, 2, plan))


def test_zero1_elements_dp4_and_dp2_tp2() -> None:
    plan = [("dp", "adamw-foreach", True), ("dp", "lamb", True), ("dp_tp", "adamw-foreach", True),
            ("dp_tp", "lamb", False)]  # fmt: skip
    _check(run_distributed(_worker, 4, plan))


def _refuses(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    model = GPT(GPTConfig(**CONFIG))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    zero = apply_zero([UnitTree(model, [model.layers()])], mesh["dp"], stage=1)
    opt = torch.optim.Adafactor(model.parameters(), lr=LR)
    with pytest.raises(
        ValueError, match=r"Adafactor may look at whole parameters.*zero1_sharding='parameters'"
    ):
        zero.attach_optimizers([opt])
    zero = apply_zero([UnitTree(model, [model.layers()])], mesh["dp"], stage=1, zero1_sharding="parameters")
    zero.attach_optimizers([opt])  # whole parameters by owner: any optimizer
    dist.barrier()
    return "ok"


def test_a_non_elementwise_optimizer_is_refused_by_name() -> None:
    assert run_distributed(_refuses, 2) == ["ok", "ok"]


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, skip_b: bool = False) -> torch.Tensor:
        h = self.a(x).tanh()
        return (h if skip_b else self.b(h)).square().mean()


def _state_gathered_twice(rank: int, world_size: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = _TwoLayers()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    zero = apply_zero([UnitTree(model, [[model.a, model.b]])], mesh["dp"], stage=1)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, ref))
    zero.attach_optimizers([opt])
    data = torch.randn(3, world_size, 4, 6, generator=torch.Generator().manual_seed(1))
    errors = {}
    # b is left out of the middle step (layer drop, an unused branch): its state stays whole from the first
    # gather while a's is kept in pieces again; the second gather must take each as it is
    for i, skip_b in enumerate((False, True, False)):
        model(data[i, rank], skip_b).backward()
        zero.after_backward()
        opt.step()
        zero.after_optimizer_step(opt)
        opt.zero_grad()
        ref(data[i].flatten(0, 1), skip_b).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        zero.prepare_optimizer_state(opt)
        errors[f"state after step {i}"] = max(
            (opt.state[p][key] - ref_opt.state[r][key]).abs().max().item()
            for p, r in zip(model.parameters(), ref.parameters())
            for key in ("exp_avg", "exp_avg_sq")
        )
    zero.wait_for_params()
    errors["weights"] = max((p - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
    return errors


def test_state_not_stepped_since_the_last_gather_is_gathered_as_it_is() -> None:
    for errors in run_distributed(_state_gathered_twice, 2):
        assert max(errors.values()) < 1e-6, errors
