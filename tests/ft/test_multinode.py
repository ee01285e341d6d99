"""Multi-node runs on one machine: each "node" is a ``megascale-ft launch --nnodes ...`` process (an agent with
its own torchrun); the first also runs the driver. The job is examples/ft_ddp.py (gloo DDP, a checkpoint every
2 of 8 steps). Rendezvous is torchrun's c10d, at the store the driver hosts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ft._launch import COLLECTIVE, HANG, HEARTBEAT, launch_job
from tests.lightning._launch import ROOT, clean_env, free_port

SCRIPT = str(ROOT / "examples" / "ft_ddp.py")
TOKEN = "multinode-test-token-0123456789"


def _start(
    tmp: Path, name: str, port: int, *train_args: str, driver: bool, nnodes: str = "2", self_check: bool = False,
    env: dict[str, str] | None = None, extra: tuple[str, ...] = (), tls: tuple[str, str] | None = None,
) -> subprocess.Popen:  # fmt: skip
    """One node's launcher (``driver``: it also runs the driver, on ``port``)."""
    command = [
        sys.executable, "-m", "megascale.ft.cli", "launch", f"--nnodes={nnodes}", "--nproc-per-node=2",
        f"--heartbeat-interval={HEARTBEAT}", f"--hang-timeout={HANG}", f"--collective-timeout={COLLECTIVE}",
        "--max-restarts=3", "--node-timeout=4", *extra, *([] if self_check else ["--no-self-check"]),
        f"--node-rank={name}", f"--run-dir={tmp / ('run' if driver else 'run-' + name)}",
    ]  # fmt: skip
    scheme = "http" if tls is None else "https"
    command += [f"--port={port}"] if driver else [f"--driver={scheme}://127.0.0.1:{port}"]
    if tls is not None:  # the driver serves HTTPS; agents and ranks verify its certificate
        command += [f"--tls-cert={tls[0]}", f"--tls-key={tls[1]}"] if driver else [f"--tls-ca={tls[0]}"]
    job = ["--", SCRIPT, str(tmp / "ckpt"), str(tmp / "out.pt"), *train_args]
    return subprocess.Popen(
        [*command, *job], env={**clean_env(), "MEGASCALE_FT_TOKEN": TOKEN, **(env or {})}, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(
    tmp: Path, processes: dict[str, subprocess.Popen]
) -> tuple[dict[str, subprocess.CompletedProcess], dict]:
    """Wait for every launcher; their outputs and the driver's report.json."""
    results = {}
    for name, process in processes.items():
        try:
            out, _ = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, "")
    report_path = tmp / "run" / "report.json"
    assert report_path.exists(), "\n".join(r.stdout[-3000:] for r in results.values())
    return results, json.loads(report_path.read_text())


def _nodes(
    tmp: Path, names: list[str], *train_args: str, env: dict[str, dict[str, str]] | None = None, **options
) -> tuple[dict[str, subprocess.CompletedProcess], dict]:  # fmt: skip
    """One launcher per name (the first runs the driver), all to the end; their outputs and report.json."""
    port, processes = free_port(), {}
    for i, name in enumerate(names):
        processes[name] = _start(
            tmp, name, port, *train_args, driver=i == 0, env=(env or {}).get(name), **options
        )
        time.sleep(0.3)  # the driver's node first
    return _finish(tmp, processes)


def _output(results: dict[str, subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- node {n} ---\n{r.stdout[-4000:]}" for n, r in results.items())


def _assert_equal(path: Path, reference: dict[str, torch.Tensor], exact: bool = True) -> None:
    final = torch.load(path, weights_only=True)
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        if exact:
            assert torch.equal(final[name], value), f"{name} differs"
        else:  # other dp sizes sum the same gradients in another order: float32 rounding, nothing more
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same 4 ranks on one machine under the one-node launcher, no fault."""
    tmp = tmp_path_factory.mktemp("one-node")
    result, report = launch_job(tmp, SCRIPT, ranks=4, launcher_args=("--repeat-limit=2",))
    assert report["ok"] and len(report["attempts"]) == 1, result.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=True)


@pytest.mark.slow  # a lost node (the next test) is the harder case of the same restart
def test_a_node_whose_processes_die_is_named_and_both_nodes_restart_to_bitwise_equal_weights(
    uninterrupted, tmp_path
):
    results, report = _nodes(tmp_path, ["0", "1"], "--fault", "kill-node@4:1")
    output = _output(results)
    assert report["ok"] and all(r.returncode == 0 for r in results.values()), output
    first, second = report["attempts"]
    fault = first["fault"]
    assert fault["node"] == "1" and fault["kind"] == "dead" and fault["rank"] in (0, 1, 2, 3), fault
    assert fault["latency"] <= 2 * HEARTBEAT + 1, f"detected after {fault['latency']:.2f} s"
    assert sorted(first["nodes"]) == sorted(second["nodes"]) == ["0", "1"]  # both nodes restarted
    assert second["fault"] is None
    assert "dead on node 1" in results["0"].stdout
    _assert_equal(tmp_path / "out.pt", uninterrupted)


def test_a_whole_node_lost_is_named_and_its_replacement_joins_the_restart(uninterrupted, tmp_path):
    """Node 1's agent and everything below it are SIGKILLed at step 4 (the machine is gone): node 0's ranks
    fail on the broken connections, and the driver blames node 1, whose agent fell silent. A new launcher for
    node 1 (a scheduler restarting it) joins, and the run ends bitwise equal."""
    port = free_port()
    fault = ("--fault", "kill-agent@4:1")
    processes = {"0": _start(tmp_path, "0", port, *fault, driver=True, extra=("--node-timeout=120",))}
    first = _start(tmp_path, "1", port, *fault, driver=False)
    first.communicate(timeout=240)
    assert first.returncode == -9  # killed with its tree
    processes["1"] = _start(tmp_path, "1", port, *fault, driver=False)
    results, report = _finish(tmp_path, processes)
    output = _output(results)
    assert report["ok"] and all(r.returncode == 0 for r in results.values()), output
    failed, resumed = report["attempts"]
    assert (failed["fault"]["kind"], failed["fault"]["node"]) == ("node-lost", "1"), failed["fault"]
    assert "agent silent" in failed["fault"]["message"]
    assert sorted(resumed["nodes"]) == ["0", "1"] and resumed["fault"] is None
    _assert_equal(tmp_path / "out.pt", uninterrupted)


def test_a_node_failing_its_self_check_is_evicted_and_a_spare_takes_its_place(uninterrupted, tmp_path):
    results, report = _nodes(
        tmp_path, ["0", "1", "spare"], self_check=True,
        env={"1": {"MEGASCALE_FT_SELFCHECK_INJECT": "matmul:1"}},
    )  # fmt: skip
    output = _output(results)
    assert report["ok"], output
    assert list(report["evicted"]) == ["1"] and "FAIL matmul" in report["evicted"]["1"], report["evicted"]
    (attempt,) = report["attempts"]
    assert sorted(attempt["nodes"]) == ["0", "spare"] and attempt["fault"] is None
    assert not attempt["self_check"]["1"]["ok"] and attempt["self_check"]["spare"]["ok"]
    assert results["1"].returncode == 3 and "evicted" in results["1"].stdout
    assert results["0"].returncode == 0 and results["spare"].returncode == 0
    assert "node 1 evicted: self-checks failed" in results["0"].stdout
    _assert_equal(tmp_path / "out.pt", uninterrupted)


def _one_process(steps: int, size: int) -> dict[str, torch.Tensor]:
    """examples/ft_ddp.py's model trained in this process on each step's whole global batch, once."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ft_ddp
    finally:
        sys.path.pop(0)
    model = ft_ddp._model().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = ft_ddp.global_batch(step, size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.slow  # CI tier: eviction with a spare (above)
def test_without_a_spare_the_run_goes_on_at_half_the_nodes_and_every_batch_is_trained_once(tmp_path):
    """Node 1 is behind the same fault twice (its processes die at step 4 in every attempt): evicted. No spare
    comes within --node-timeout, and --nnodes 1:2 allows one node: the last attempt runs at dp=2 from the
    checkpoint the 4 ranks wrote. Each step's global batch is shared by whatever ranks there are, so the
    final weights match one process that saw every batch once; a repeated or skipped step would not."""
    results, report = _nodes(tmp_path, ["0", "1"], "--fault", "kill-node@4:1", "--always", "--global-batch", "16",
                             nnodes="1:2")  # fmt: skip
    output = _output(results)
    assert report["ok"], output
    assert [sorted(a["nodes"]) for a in report["attempts"]] == [["0", "1"], ["0", "1"], ["0"]], report[
        "attempts"
    ]
    assert [a["fault"]["node"] for a in report["attempts"][:2]] == ["1", "1"]
    assert "behind 2 faults of kind 'dead'" in report["evicted"]["1"]
    assert results["1"].returncode == 3
    assert "attempt 2 runs on 1 of 2 nodes" in results["0"].stdout
    _assert_equal(tmp_path / "out.pt", _one_process(8, 16), exact=False)


@pytest.mark.slow  # CI tier: the frozen rank's stacks on one node, tests/ft/test_faults.py
def test_a_frozen_rank_on_another_node_is_named_from_every_rank_s_stacks(tmp_path):
    """Rank 3 (on whichever node holds it) stops with SIGSTOP at step 4: the driver asks each node's agent for
    its ranks' stacks before the trees are killed; the frozen rank is the one that stands out. Over TLS, as
    heartbeats and agent reports travel between machines."""
    from tests.ft.test_heartbeat import _self_signed

    results, report = _nodes(tmp_path, ["0", "1"], "--fault", "sigstop@4:3", tls=_self_signed(tmp_path))
    output = _output(results)
    assert report["ok"], output
    fault = report["attempts"][0]["fault"]
    assert (fault["kind"], fault["rank"]) == ("hung", 3) and fault["node"] in ("0", "1"), fault
    stacks = fault["stacks"]
    assert list(stacks["suspects"]) == ["3"] and "ft_ddp.py" in stacks["suspects"]["3"], stacks
    assert len(stacks["files"]) == 4 and all(Path(f).is_file() for f in stacks["files"].values())
    assert Path(stacks["map"]).is_file()  # the hang map, beside the stacks the agents sent
    assert "rank 3 differs, in" in results["0"].stdout
    assert "heartbeats on https://127.0.0.1" in results["0"].stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--nnodes=2"], {}, "needs the token on every node"),
        (["--nnodes=3:2"], {"MEGASCALE_FT_TOKEN": TOKEN}, "min_nodes (3) <= nnodes (2)"),
        (["--nnodes=two"], {"MEGASCALE_FT_TOKEN": TOKEN}, "--nnodes takes N or MIN:MAX"),
        (["--nnodes=2", "--host=10.1.2.3"], {"MEGASCALE_FT_TOKEN": TOKEN}, "TLS certificate"),
        ([], {"MEGASCALE_FT_TOKEN": TOKEN, "MEGASCALE_FT_NNODES": "3:2"}, "min_nodes (3) <= nnodes (2)"),
    ],
    ids=["no-token", "min-above-max", "not-a-number", "off-loopback-without-tls", "from-the-environment"],
)
def test_a_multi_node_launch_with_bad_settings_stops_at_once_and_says_what_to_change(args, env, message):
    clean = {k: v for k, v in clean_env().items() if k != "MEGASCALE_FT_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "megascale.ft.cli", "launch", *args, "--", SCRIPT, "ckpt", "out.pt"],
        env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
