"""``parallelize`` without Lightning: pp × ZeRO and tp × pp × dp against one process, on real gloo ranks.

Each layout trains, with a plain training loop that calls the runtime's ZeRO hooks in their documented order,
(a) a megascale GPT and (b) a small model written here that joins by ``pipeline_layers()``/``pipeline_loss()``
only, for three steps of SGD with momentum and global-norm clipping, on the union of the ranks' batches,
against one process stepping the whole model on that union.

Tolerance: float32; layouts differ only in the order of sums (gradients averaged over dp, partial products
over tp, pipeline microbatches summed, the clip norm combined over shards): ~1e-7 relative on gradients. SGD
with momentum is linear in the gradients, so weights differ by lr × that: observed ≤ 4e-8, bound 1e-6.
Losses agree to 1e-6. A dropped or doubled reduction, a stale ZeRO-1 update or a wrong microbatch scale moves
weights by ~lr × |grad| ≈ 1e-3 and losses by ~1e-3.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megascale.core import GPT, GPTConfig
from megascale.core.parallel import ParallelPlan, materialize, parallelize
from tests._dist import run_distributed
from tests._models import Head, LayeredLM, MLPBlock, full_weights
from tests.core._tiny import TINY_GQA_GPT
from tests.core._train_loop import train

WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-6
STEPS = 3
LR = 0.05
MAX_NORM = 0.5  # below the models' gradient norms: every step clips
BATCH = 8  # sequences per step, split over dp
SEQ = 8


class TinyLM(LayeredLM):
    """Embedding, a ModuleList of residual MLP blocks, a head: joins pipelines by listing its layers."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        super().__init__(vocab, width, [MLPBlock(width) for _ in range(layers)], Head(width, vocab))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY_GQA_GPT, "n_layers": 4}))
    return TinyLM()


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_weights(model, exclude="rope")


def _train(model: nn.Module, runtime: Any, dp_rank: int, dp: int, pipelined: bool) -> list[float]:
    losses, _ = train(model, runtime, dp_rank, dp, pipelined=pipelined, steps=STEPS, lr=LR, max_norm=MAX_NORM,
                      size=BATCH, seq=SEQ)  # fmt: skip
    return losses


def _reference(kind: str) -> dict[str, Any]:
    # built on meta and materialised like the layouts (a GPT initialises itself alike either way); the seed
    # is parallelize's: torch.initial_seed(), which _build set
    with torch.device("meta"):
        model = _build(kind)
    materialize(model, "cpu", seed=torch.initial_seed())
    return {"losses": _train(model, None, 0, 1, pipelined=False), "weights": _full_weights(model)}


def _layout_worker(rank: int, world: int, kind: str, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kw in layouts:
        plan = ParallelPlan(**kw)
        mesh = plan.dims(world).build_mesh("cpu")
        with torch.device("meta"):
            model = _build(kind)
        runtime = parallelize(model, plan, mesh, device="cpu")
        losses = _train(model, runtime, mesh["dp"].get_local_rank(), mesh["dp"].size(), pipelined=plan.pp > 1)
        out[repr(kw)] = {"losses": losses, "weights": _full_weights(model)}
        runtime.zero.remove()
    return out


def _compare(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=LOSS_TOL), name
    assert got["weights"].keys() == want["weights"].keys(), name
    worst = max((got["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
    assert worst <= WEIGHT_TOL, f"{name}: weights differ by up to {worst:.2e}"
    assert all(math.isfinite(v) for v in got["losses"])


LAYOUTS_GPT = [
    dict(pp=2, zero_stage=1, num_microbatches=2),
    dict(pp=2, zero_stage=2, num_microbatches=4, schedule="gpipe"),
    dict(tp=2, pp=2),
    dict(tp=2, zero_stage=3, sequence_parallel=True),
    dict(pp=2, zero_stage=0, schedule="interleaved", virtual_stages=2, num_microbatches=2),
]
LAYOUTS_OWN = [
    dict(pp=2, zero_stage=1, num_microbatches=2),
    dict(pp=2, zero_stage=2, num_microbatches=2),
    dict(pp=4, num_microbatches=4),
    dict(zero_stage=3),
]


@pytest.mark.parametrize(("kind", "layouts"), [("gpt", LAYOUTS_GPT), ("own", LAYOUTS_OWN)])
def test_every_layout_trains_like_one_process_without_lightning(
    kind: str, layouts: list[dict[str, Any]]
) -> None:
    want = _reference(kind)
    results = run_distributed(_layout_worker, 4, kind, layouts, timeout=300)
    for rank, result in enumerate(results):
        for name, got in result.items():
            _compare(got, want, f"{kind} {name} rank {rank}")


# ---- refusals, before any collective, and the flags a layout cannot honour -------------------------------

# case -> (plan, message in the error or in the runtime's notes)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "pp, no layers listed": (dict(pp=2, num_microbatches=2), "give your model these two methods"),
    "pp, a head outside": (dict(pp=2, num_microbatches=2),
                           "parameters ['value_head.weight', 'value_head.bias'] are outside the pipelined model"),
    "pp, tied across stages": (dict(pp=2, num_microbatches=2), "is shared by layers 'embed' and 'head'"),
    "wrapped in DDP": (dict(), "is wrapped in DistributedDataParallel"),
    "DTensor on another mesh": (dict(tp=2), "that is not the strategy's"),
    "fully_shard over tp": (dict(tp=2), "sharded by fully_shard on a mesh without the data-parallel ranks"),
    "fully_shard leaving parameters out": (dict(), "left parameters ['b.weight', 'b.bias'] outside it"),
    "fully_shard with pp": (dict(pp=2, num_microbatches=2), "the model applied fully_shard itself, and pp > 1"),
    "full AC, no blocks": (dict(activation_checkpointing="full"), "found nothing to recompute in Sequential"),
    "tp, nothing to split": (dict(tp=2), "tp=2 found nothing to split"),
    "tp by the model's own DTensor code": (dict(tp=2), "sequence_parallel, overlap_tp_comm and tp_comm_chunks do not apply"),
    "fully_shard by the model": (dict(zero_stage=2), "no ZeRO of the strategy's own is added (zero_stage=2"),
}  # fmt: skip


def _case_model(case: str, mesh: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if case in ("pp, no layers listed", "full AC, no blocks", "tp, nothing to split"):
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if case == "pp, a head outside":
        return nn.ModuleDict({"lm": TinyLM(), "value_head": nn.Linear(32, 1)})
    if case == "pp, tied across stages":
        model = TinyLM()
        model.embed.weight = model.head.proj.weight = nn.Parameter(torch.randn(64, 32))
        return model
    if case == "wrapped in DDP":
        return nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    if case == "DTensor on another mesh":
        model = nn.Linear(4, 4)
        own = init_device_mesh("cpu", (dist.get_world_size(),))
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), own, [Shard(0)]))
        return model
    if case == "fully_shard over tp":
        model = nn.Linear(4, 4)
        fully_shard(model, mesh=mesh["tp"])
        return model
    if case == "fully_shard leaving parameters out":
        model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        fully_shard(model["a"], mesh=mesh["data_parallel"])
        return model
    if case == "fully_shard with pp":
        model = TinyLM()
        fully_shard(model, mesh=mesh["dp"])
        return model
    if case == "tp by the model's own DTensor code":
        model = nn.Sequential(nn.Linear(4, 4))
        parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel()})
        return model
    assert case == "fully_shard by the model"
    model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _refusal_worker(rank: int, world: int) -> dict[str, str]:
    import warnings

    meshes: dict[tuple[int, int], Any] = {}
    out = {}
    for case, (kw, _) in CASES.items():
        plan = ParallelPlan(**kw)
        if (plan.tp, plan.pp) not in meshes:
            meshes[plan.tp, plan.pp] = plan.dims(world).build_mesh("cpu")
        mesh = meshes[plan.tp, plan.pp]
        model = _case_model(case, mesh)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runtime = parallelize(model, plan, mesh, device="cpu")
            out[case] = "accepted; notes: " + " | ".join(runtime.notes)
        except ValueError as e:
            out[case] = str(e)
    return out


def test_what_a_layout_cannot_do_is_refused_naming_it() -> None:
    """Each case fails (or, for flags a layout cannot honour and a model's own sharding, warns) with a message
    that names the module or parameter and what to change; all ranks alike, before any collective."""
    results = run_distributed(_refusal_worker, 4, timeout=240)
    for case, (_, message) in CASES.items():
        for rank, result in enumerate(results):
            assert message in result[case], f"{case} (rank {rank}): {result[case]}"


# ---- meta-device init: every layout starts from one process's values -------------------------------------


class InitOwner(nn.Module):
    """A model with an init_weights() of its own that draws random values into every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    @torch.no_grad()
    def init_weights(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p)


def _init_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    import warnings

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plan = ParallelPlan(tp=2)
    mesh = plan.dims(world).build_mesh("cpu")
    with torch.device("meta"):
        model = InitOwner()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallelize(model, plan, mesh, device="cpu")
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()
    }


def test_a_models_own_init_weights_draws_one_processs_values_into_tensor_parallel_shards() -> None:
    """init_weights() sees whole tensors (each rank then keeps its shard), so tp shards are not drawn alike
    on every rank (as a per-rank random draw into DTensor shards on CPU would be), and equal one process."""
    torch.manual_seed(0)
    with torch.device("meta"):
        reference = InitOwner()
    materialize(reference, "cpu", seed=torch.initial_seed())
    for result in run_distributed(_init_worker, 2):
        for name, p in reference.named_parameters():
            assert torch.equal(result[name], p.detach()), name
