"""TwoStageCheckpointer: round trips (1 and 2 ranks, local and S3), stage-1 timing, commit, fallback,
pruning, and refusal of pickled payloads."""

from __future__ import annotations

import copy
import json
import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec import register_implementation
from fsspec.implementations.local import LocalFileSystem

from megascale.ft.checkpoint import CheckpointError, TwoStageCheckpointer
from megascale.ft.manifest import Manifest, SafeFsspecReader, hash_file, list_files, write_manifest
from tests._dist import run_distributed

# DCP says so on every single-process save/load; that is the intended mode here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --- helpers ----------------------------------------------------------------------------------------------
def _trained(seed: int, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and an AdamW with state after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(seed: int, lr: float = 1e-2) -> dict[str, Any]:
    model, opt = _trained(seed, lr)
    torch.manual_seed(seed + 100)
    return {
        "model": model,
        "optim": opt,
        "rng": torch.get_rng_state(),
        "progress": {"step": seed, "tokens": 123_456_789, "loss": 0.1 + seed, "tags": ("a", None, True)},
    }


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a state holds, as plain values, for comparison."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        sd = value.state_dict() if hasattr(value, "load_state_dict") else value
        out[key] = sd
    return out


def _assert_bitwise_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{path}.{i}")
    else:
        assert type(a) is type(b) and a == b, path


def _recommit(directory: Path, step: int) -> None:
    """Rewrite the manifest so its checksums match tampered files (what an attacker could do)."""
    fs = LocalFileSystem()
    files = {n: hash_file(fs, f"{directory}/{n}") for n in list_files(fs, str(directory))}
    write_manifest(fs, str(directory), Manifest(step=step, world_size=1, files=files))


class _Payload:
    """Unpickling this creates ``marker`` (a stand-in for arbitrary code execution)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


# --- round trips ------------------------------------------------------------------------------------------
def test_round_trip_single_process(tmp_path: Path) -> None:
    saved = _state(seed=1)
    expected = _flat(saved)
    with TwoStageCheckpointer(str(tmp_path)) as ckpt:
        ckpt.save(7, saved)
        ckpt.wait()
        assert ckpt.latest() == 7
        fresh = _state(seed=2, lr=0.5)  # different values everywhere, same structure
        assert ckpt.load(fresh) == 7
    _assert_bitwise_equal(expected, _flat(fresh))
    assert sorted(p.name for p in (tmp_path / "step-000000007").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "extra.json",
        "manifest.json",
    ]


def _round_trip_worker(rank: int, world_size: int, root: str, storage_options: dict | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)

    def make(seed: int, lr: float) -> dict[str, Any]:
        state = _state(seed, lr)
        state["sharded"] = distribute_tensor(full * seed, mesh, [Shard(0)])
        state[f"rng_rank{rank}"] = torch.tensor([rank * 1000 + seed])  # per-rank value: per-rank key
        return state

    saved = make(1, 1e-2)
    expected = _flat(saved)
    ckpt = TwoStageCheckpointer(root, storage_options=storage_options)
    ckpt.save(3, saved)
    ckpt.wait()
    fresh = make(2, 0.5)
    step = ckpt.load(fresh)
    ckpt.close()
    got = _flat(fresh)
    assert isinstance(got["sharded"], torch.distributed.tensor.DTensor)
    got["sharded"], expected["sharded"] = got["sharded"].to_local(), expected["sharded"].to_local()
    _assert_bitwise_equal(expected, got)
    return {"step": step, "world": dist.get_world_size()}


def test_round_trip_two_ranks_then_reshard_to_one(tmp_path: Path) -> None:
    results = run_distributed(_round_trip_worker, 2, str(tmp_path), None)
    assert results == [{"step": 3, "world": 2}] * 2
    manifest = json.loads((tmp_path / "step-000000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= manifest["files"].keys()
    # Load the 2-rank checkpoint in one process: the DTensor shards come back as one full tensor.
    state = {"sharded": torch.zeros(8, 3), "rng_rank1": torch.zeros(1, dtype=torch.long)}
    assert TwoStageCheckpointer(str(tmp_path)).load(state) == 3
    assert torch.equal(state["sharded"], torch.arange(24, dtype=torch.float32).reshape(8, 3))
    assert state["rng_rank1"].item() == 1001


def test_round_trip_on_s3(s3_server: Any, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    saved = _state(seed=1)
    expected = _flat(saved)
    with TwoStageCheckpointer(root, keep_last=1, storage_options=s3_server.storage_options) as ckpt:
        ckpt.save(1, saved)
        ckpt.save(2, saved)
        ckpt.wait()
        fresh = _state(seed=2, lr=0.5)
        assert ckpt.load(fresh) == 2
    _assert_bitwise_equal(expected, _flat(fresh))
    listed = sorted(p.rsplit("/", 1)[-1] for p in s3_server.fs().ls(root))
    assert listed == ["step-000000002"]  # keep_last=1 pruned step 1


def test_round_trip_on_s3_two_ranks(s3_server: Any, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    assert (
        run_distributed(_round_trip_worker, 2, root, s3_server.storage_options)
        == [{"step": 3, "world": 2}] * 2
    )


# --- partial states: each rank holds its own part (pipeline stages, ZeRO-1 owners) -----------------------------
def _partial_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    def part(value: float) -> dict[str, Any]:  # this rank's layer and setting, plus one both hold
        return {"w": {f"layer{rank}": torch.full((64,), value), f"lr{rank}": value, "shared": torch.ones(2)}}

    ckpt = TwoStageCheckpointer(root)
    ckpt.save(1, part(float(rank + 1)))
    ckpt.wait()
    with pytest.raises(CheckpointError, match=rf"holds tensors under w\.layer{1 - rank} but the state"):
        ckpt.load(part(0.0))  # not partial: the other rank's entries are an error
    fresh = part(0.0)
    assert ckpt.load(fresh, partial=True) == 1
    assert ckpt.last_load is not None
    read = ckpt.last_load.tensor_bytes
    lacking = {"w": {**part(0.0)["w"], "layer9": torch.zeros(64)}}
    with pytest.raises(CheckpointError, match=rf"rank {rank}: .* has no entries \['w\.layer9'\]"):
        ckpt.load(lacking, partial=True)  # an entry the checkpoint lacks stays an error, on every rank
    ckpt.close()
    return {"loaded": fresh["w"], "read": read}


def test_partial_load_reads_only_this_ranks_entries(tmp_path: Path) -> None:
    results = run_distributed(_partial_worker, 2, str(tmp_path), timeout=90)
    metadata = SafeFsspecReader(str(tmp_path / "step-000000001")).read_metadata()
    stored = {index.fqn: info.length for index, info in metadata.storage_data.items()}
    for rank, result in enumerate(results):
        value = float(rank + 1)
        assert result["loaded"].keys() == {f"layer{rank}", f"lr{rank}", "shared"}  # nothing of the other rank
        assert result["loaded"][f"lr{rank}"] == value
        assert torch.equal(result["loaded"][f"layer{rank}"], torch.full((64,), value))
        assert result["read"] == stored[f"w.layer{rank}"] + stored["w.shared"]  # not the other layer


# --- stage 1 / stage 2 ------------------------------------------------------------------------------------
class _GatedFS(LocalFileSystem):
    """Local files whose DCP data writes block until `gate` opens: stage 2 made observable."""

    protocol = ("gated",)
    gate = threading.Event()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return super()._strip_protocol(path[len("gated://") :] if path.startswith("gated://") else path)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and str(path).endswith(".distcp"):
            assert self.gate.wait(30), "test never opened the gate"
        return super()._open(path, mode, **kwargs)


class _FailingFS(_GatedFS):
    protocol = ("failing",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return LocalFileSystem._strip_protocol(
            path[len("failing://") :] if path.startswith("failing://") else path
        )

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and str(path).endswith(".distcp"):
            raise OSError("disk full (simulated)")
        return LocalFileSystem._open(self, path, mode, **kwargs)


register_implementation("gated", _GatedFS, clobber=True)
register_implementation("failing", _FailingFS, clobber=True)


def test_save_returns_after_the_snapshot_before_the_data_is_persisted(tmp_path: Path) -> None:
    _GatedFS.gate.clear()
    saved = _state(seed=1)
    expected = copy.deepcopy(_flat(saved))  # the values as saved, apart from the live tensors
    ckpt = TwoStageCheckpointer(f"gated://{tmp_path}")
    try:
        ckpt.save(5, saved)  # returns although stage 2 is blocked on the data file write
        assert not (tmp_path / "step-000000005" / "manifest.json").exists()
        # Training goes on and changes the live state: the snapshot must not see it.
        with torch.no_grad():
            for p in saved["model"].parameters():
                p.add_(1.0)
        saved["rng"].zero_()
        saved["progress"]["step"] = 99
    finally:
        _GatedFS.gate.set()
    ckpt.wait()
    assert (tmp_path / "step-000000005" / "manifest.json").exists()
    fresh = _state(seed=2, lr=0.5)
    assert TwoStageCheckpointer(str(tmp_path)).load(fresh) == 5
    _assert_bitwise_equal(expected, _flat(fresh))


def test_background_failure_is_raised_by_wait_and_nothing_is_committed(tmp_path: Path) -> None:
    ckpt = TwoStageCheckpointer(f"failing://{tmp_path}")
    ckpt.save(1, {"x": torch.ones(2)})
    with pytest.raises(
        CheckpointError, match=r"(?s)saving checkpoint step-000000001 under .* failed.*disk full"
    ):
        ckpt.wait()
    ckpt.wait()  # raised once, then cleared
    assert not (tmp_path / "step-000000001" / "manifest.json").exists()
    with pytest.warns(UserWarning, match=r"step-000000001 .*partial"):
        assert TwoStageCheckpointer(str(tmp_path)).latest() is None


def test_unsafe_leaf_is_refused_with_its_key(tmp_path: Path) -> None:
    ckpt = TwoStageCheckpointer(str(tmp_path))
    with pytest.raises(TypeError, match=r"checkpoint state config\.sched\.1 is a builtins\.object"):
        ckpt.save(1, {"config": {"sched": [1, object()]}})
    with pytest.raises(TypeError, match=r"key 1\.5 of type float"):
        ckpt.save(1, {"config": {1.5: "x"}})
    assert not any(tmp_path.iterdir())


# --- commit, fallback, pruning ----------------------------------------------------------------------------
def _save_steps(root: Path, steps: list[int], **kwargs: Any) -> None:
    with TwoStageCheckpointer(str(root), **kwargs) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((4,), float(step)), "meta": {"step": step}})


def _load_w(root: Path, step: int | None = None) -> tuple[int, float, int]:
    state: dict[str, Any] = {"w": torch.zeros(4), "meta": None}
    got = TwoStageCheckpointer(str(root)).load(state, step)
    return got, state["w"][0].item(), state["meta"]["step"]


def test_partial_latest_is_skipped_for_the_previous(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10, 20])
    (tmp_path / "step-000000020" / "manifest.json").unlink()  # as if the save died before its commit
    with pytest.warns(UserWarning, match=r"skipping checkpoint step-000000020 under .*: partial"):
        assert _load_w(tmp_path) == (10, 10.0, 10)
    with pytest.raises(CheckpointError, match=r"step-000000020 under .* is partial \(no manifest"):
        _load_w(tmp_path, 20)


def test_corrupt_latest_is_skipped_for_the_previous(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10, 20])
    data = tmp_path / "step-000000020" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=r"step-000000020 .*corrupt \(file __0_0.distcp does not match"):
        assert _load_w(tmp_path) == (10, 10.0, 10)
    with pytest.raises(CheckpointError, match=r"step-000000020 under .* is corrupt"):
        _load_w(tmp_path, 20)


def test_manifest_of_a_committed_step_and_refusal_of_a_partial_one(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10, 20])
    (tmp_path / "step-000000020" / "manifest.json").unlink()
    ckpt = TwoStageCheckpointer(str(tmp_path))
    manifest = ckpt.manifest(10)
    assert (manifest.step, manifest.world_size) == (10, 1) and "extra.json" in manifest.files
    for step in (20, 30):  # partial, missing
        with pytest.raises(CheckpointError, match=rf"step-0000000{step} under .* partial \(no manifest"):
            ckpt.manifest(step)


def test_keep_last_prunes_old_and_stale_partial_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "step-000000001").mkdir(parents=True)  # stale partial, older than any commit
    (tmp_path / "step-000000099").mkdir()  # partial newer than the newest commit: left alone
    _save_steps(tmp_path, [2, 3, 4, 5, 6], keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000005",
        "step-000000006",
        "step-000000099",
    ]
    with pytest.warns(UserWarning, match="step-000000099"):
        assert _load_w(tmp_path) == (6, 6.0, 6)


def test_no_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no committed, intact checkpoint under"):
        TwoStageCheckpointer(str(tmp_path / "none")).load({"w": torch.zeros(1)})


# --- pickled payloads are refused, never executed -----------------------------------------------------------
def test_pickled_metadata_is_refused_even_with_matching_checksums(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    marker = tmp_path / "pwned"
    directory = tmp_path / "step-000000001"
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _recommit(directory, 1)
    with pytest.raises(
        CheckpointError, match=r"(?s)loading checkpoint step-000000001 .*refusing to load io\.open"
    ):
        _load_w(tmp_path)
    assert not marker.exists()


def test_pickled_byte_item_is_refused_even_with_matching_checksums(tmp_path: Path) -> None:
    """A DCP non-tensor entry (DCP 2.13 torch.save-pickles it) under a key the state holds a tensor for."""
    marker = tmp_path / "pwned"
    directory = tmp_path / "step-000000001"
    dcp.save({"w": _Payload(str(marker))}, checkpoint_id=str(directory), no_dist=True)
    extra = {"step": 1, "state": {"dict": [["w", {"tensor": None}]]}}
    (directory / "extra.json").write_text(json.dumps(extra))
    _recommit(directory, 1)
    state = {"w": torch.zeros(4)}
    with pytest.raises(
        CheckpointError, match=r"(?s)loading checkpoint step-000000001 .*pickled object.*refuses to unpickle"
    ):
        TwoStageCheckpointer(str(tmp_path)).load(state)
    assert not marker.exists()


def test_plain_dcp_would_execute_that_payload(tmp_path: Path) -> None:
    """Why the guards exist: DCP 2.13 itself loads non-tensor entries with torch.load(weights_only=False).

    If this starts failing, a newer torch made DCP's byte loading safe; the guards can then be revisited.
    """
    marker = tmp_path / "pwned"
    dcp.save({"w": _Payload(str(marker))}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": None}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert marker.exists()
    os.remove(marker)
