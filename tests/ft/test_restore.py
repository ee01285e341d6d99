"""Restore by broadcast (`TwoStageCheckpointer.load(..., replicas=group)`): one reader per group of
replicas, the others receive; bytes read from storage; fallback past a broken latest; reader failures."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megascale.ft.checkpoint import CheckpointError, TwoStageCheckpointer
from megascale.ft.manifest import SafeFsspecReader
from tests._dist import run_distributed


# --- helpers ----------------------------------------------------------------------------------------------
def _state(seed: int) -> dict[str, Any]:
    """A model, its optimizer after one step, and tensors of dtypes a reduction would not handle."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "mask": torch.rand(5) > 0.5,
        "half": torch.randn(3, 3).to(torch.bfloat16),
        "meta": {"seed": seed},
    }


def _values(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state as raw bytes, keyed by path, plus the non-tensor leaves."""
    out: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if hasattr(value, "load_state_dict"):
            value = value.state_dict()
        if isinstance(value, torch.Tensor):
            out[path] = (value.dtype, value.shape, value.detach().reshape(-1).view(torch.uint8).clone())
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}")
        else:
            out[path] = value

    walk(state, "")
    return out


def _assert_same(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert expected.keys() == got.keys()
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, tuple):
            assert want[:2] == have[:2] and torch.equal(want[2], have[2]), key
        else:
            assert want == have, key


def _stats(ckpt: TwoStageCheckpointer) -> dict[str, Any]:
    assert ckpt.last_load is not None
    return dataclasses.asdict(ckpt.last_load)


def _sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


# --- plain DDP: the world is one group of replicas --------------------------------------------------------
def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ckpt = TwoStageCheckpointer(root)
    ckpt.save(1, _state(seed=1))
    ckpt.wait()
    expected = _values(_state(seed=1))

    fresh = _state(seed=10 + rank)  # different on every rank: rank 1 must receive, not keep, its values
    assert ckpt.load(fresh, replicas=dist.group.WORLD) == 1
    _assert_same(expected, _values(fresh))
    broadcast = _stats(ckpt)

    fresh = _state(seed=10 + rank)
    assert ckpt.load(fresh) == 1  # every rank reads
    _assert_same(expected, _values(fresh))
    every = _stats(ckpt)
    ckpt.close()
    return {"broadcast": broadcast, "every": every}


def test_ddp_one_rank_reads_and_broadcasts(tmp_path: Path) -> None:
    results = run_distributed(_ddp_worker, 2, str(tmp_path), timeout=60)
    sizes = _sizes(tmp_path / "step-000000001")
    data = sum(n for name, n in sizes.items() if name.endswith(".distcp"))
    checked = sum(n for name, n in sizes.items() if name != "manifest.json")
    reader, replica = (r["broadcast"] for r in results)
    assert reader["reader"] and not replica["reader"]
    assert (reader["tensor_bytes"], replica["tensor_bytes"]) == (data, 0)
    assert reader["metadata_bytes"] == sizes["extra.json"] + sizes[".metadata"]
    assert replica["metadata_bytes"] == sizes["extra.json"]  # no .metadata, no tensor data
    # the integrity check is shared: each rank hashes its share of the files, together all of them once
    assert reader["checksum_bytes"] > 0 and replica["checksum_bytes"] > 0
    assert reader["checksum_bytes"] + replica["checksum_bytes"] == checked
    assert reader["broadcast_bytes"] == replica["broadcast_bytes"] > 0
    # Without replicas every rank reads all the data: twice the bytes on 2 ranks.
    assert [r["every"]["tensor_bytes"] for r in results] == [data, data]
    assert all(r["every"]["reader"] and r["every"]["broadcast_bytes"] == 0 for r in results)


# --- dp × tp: each DP group has its own reader --------------------------------------------------------------
def _dp_tp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate() or (0, 0)
    placements = [Replicate(), Shard(0)]
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    saved = {"w": distribute_tensor(full, mesh, placements), f"rng_tp{tp}": torch.tensor([tp + 100])}
    ckpt = TwoStageCheckpointer(root)
    ckpt.save(1, saved)
    ckpt.wait()

    def garbage() -> dict[str, Any]:  # different on every rank
        local = torch.full((4, 8), -1.0 - rank)
        w = DTensor.from_local(local, mesh, placements, run_check=False)
        return {"w": w, f"rng_tp{tp}": torch.tensor([-rank])}

    fresh = garbage()
    assert ckpt.load(fresh, replicas=mesh["dp"].get_group()) == 1
    assert torch.equal(fresh["w"].to_local(), full[4 * tp : 4 * tp + 4])
    assert fresh[f"rng_tp{tp}"].item() == tp + 100
    stats = _stats(ckpt)

    # The world is not a group of replicas here: tp ranks hold different shards. Refused on every rank.
    fresh = garbage()
    with pytest.raises(CheckpointError, match=r"holds other tensors than its reader") as refused:
        ckpt.load(fresh, replicas=dist.group.WORLD)
    assert fresh["w"].to_local().eq(-1.0 - rank).all()  # nothing was copied over it
    ckpt.close()
    return {"dp": dp, "stats": stats, "refused": str(refused.value)}


def test_dp_tp_each_dp_group_reads_its_shard_once(tmp_path: Path) -> None:
    results = run_distributed(_dp_tp_worker, 4, str(tmp_path), timeout=90)
    sizes = _sizes(tmp_path / "step-000000001")
    data = sum(n for name, n in sizes.items() if name.endswith(".distcp"))
    readers = [r["stats"] for r in results if r["dp"] == 0]
    replicas = [r["stats"] for r in results if r["dp"] == 1]
    assert all(s["reader"] and s["tensor_bytes"] > 0 for s in readers)
    assert sum(s["tensor_bytes"] for s in readers) == data  # the two tp shards, each read once
    assert all(not s["reader"] and s["tensor_bytes"] == 0 and s["broadcast_bytes"] > 0 for s in replicas)
    assert all("rank 1 holds other tensors than its reader, rank 0" in r["refused"] for r in results)


# --- per-rank entries (RNG states) next to replicated ones ---------------------------------------------------
def _per_rank_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ckpt = TwoStageCheckpointer(root)
    rng = f"rng_rank{rank}"
    ckpt.save(1, {"w": torch.full((64,), 7.0), rng: torch.tensor([rank + 100])})
    ckpt.wait()
    state = {"w": torch.zeros(64), rng: torch.tensor([-1])}
    with pytest.raises(CheckpointError, match=r"rank 1 holds other tensors than its reader"):
        ckpt.load(state, replicas=dist.group.WORLD)  # the rng keys differ: not replicas
    assert ckpt.load(state, replicas=dist.group.WORLD, per_rank=[rng]) == 1
    ckpt.close()
    return {"w": state["w"].unique().tolist(), "rng": state[rng].item(), "stats": _stats(ckpt)}


def test_per_rank_entries_are_read_by_each_rank_the_rest_broadcast(tmp_path: Path) -> None:
    results = run_distributed(_per_rank_worker, 2, str(tmp_path), timeout=60)
    metadata = SafeFsspecReader(str(tmp_path / "step-000000001")).read_metadata()
    stored = {index.fqn: info.length for index, info in metadata.storage_data.items()}
    for rank, r in enumerate(results):
        assert (r["w"], r["rng"]) == ([7.0], rank + 100)
    assert results[0]["stats"]["tensor_bytes"] == stored["w"] + stored["rng_rank0"]
    assert results[1]["stats"]["tensor_bytes"] == stored["rng_rank1"]  # w came by broadcast
    assert results[1]["stats"]["broadcast_bytes"] == 64 * 4


# --- a broken latest checkpoint is skipped ------------------------------------------------------------------
def _fallback_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ckpt = TwoStageCheckpointer(root)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((64,), float(step)), "meta": {"step": step}})
    ckpt.wait()
    if rank == 0:
        (Path(root) / "step-000000002" / "manifest.json").unlink()  # partial: died before its commit
        # DCP writes a replicated tensor once: corrupt the data file that holds it.
        data = max((Path(root) / "step-000000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # corrupt: bit rot in the newest one
        data.write_bytes(bytes(raw))
    dist.barrier()
    state: dict[str, Any] = {"w": torch.zeros(64), "meta": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ckpt.load(state, replicas=dist.group.WORLD)
    ckpt.close()
    return {
        "step": step,
        "w": state["w"].unique().tolist(),
        "meta": state["meta"],
        "warnings": [str(w.message) for w in caught],
    }


def test_corrupt_and_partial_latest_are_skipped_for_the_previous(tmp_path: Path) -> None:
    results = run_distributed(_fallback_worker, 2, str(tmp_path), timeout=60)
    for r in results:
        assert (r["step"], r["w"], r["meta"]) == (1, [1.0], {"step": 1})
    skipped = " | ".join(results[0]["warnings"])  # rank 0 checks and warns; the others follow its verdict
    assert "step-000000003" in skipped and "corrupt (file __" in skipped
    assert "step-000000002" in skipped and "partial" in skipped


# --- failures: raised on every rank, none left waiting ------------------------------------------------------
def _failures_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ckpt = TwoStageCheckpointer(root)
    ckpt.save(1, {"w": torch.full((8,), 7.0)})
    ckpt.wait()
    only0, only1 = dist.new_group([0]), dist.new_group([1])
    errors = []
    # Rank 0 says it shares its state with rank 1, rank 1 says it has no replicas; then a rank passes a
    # group it is not in. Both are refused on every rank before any data is read.
    for replicas in ([dist.group.WORLD, only1], [dist.group.WORLD, only0]):
        state = {"w": torch.zeros(8)}
        with pytest.raises(CheckpointError, match="cannot restore") as refused:
            ckpt.load(state, replicas=replicas[rank])
        assert state["w"].eq(0.0).all()
        errors.append(str(refused.value))

    original = SafeFsspecReader.read_data
    if rank == 0:  # the reader: its storage goes away after the checksums were verified

        def unreadable(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("connection reset by storage (simulated)")

        SafeFsspecReader.read_data = unreadable  # type: ignore[method-assign]
    state = {"w": torch.zeros(8)}
    with pytest.raises(CheckpointError) as failed:
        ckpt.load(state, replicas=dist.group.WORLD)
    errors.append(str(failed.value))
    SafeFsspecReader.read_data = original  # type: ignore[method-assign]

    # Every rank left each failed load at the same point: the next load works.
    assert ckpt.load(state, replicas=dist.group.WORLD) == 1 and state["w"].eq(7.0).all()
    ckpt.close()
    return {"errors": errors}


def test_failures_raise_on_every_rank_and_the_next_load_works(tmp_path: Path) -> None:
    for r in run_distributed(_failures_worker, 2, str(tmp_path), timeout=60):
        mismatched, outsider, reader_failed = r["errors"]
        assert "rank 0's replicas group (first rank: 0) differs from what its members pass" in mismatched
        assert "rank 1 passed a replicas group it does not belong to" in outsider
        assert "rank 0 (reader)" in reader_failed and "simulated" in reader_failed


def test_replicas_need_torch_distributed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"replicas needs torch\.distributed"):
        TwoStageCheckpointer(str(tmp_path)).load({"w": torch.zeros(1)}, replicas=object())  # type: ignore[arg-type]
