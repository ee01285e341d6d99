"""Warm restarts (`megascale.ft.warm`): a node's next ranks wait, started and with torch imported, so a restart
starts no process; only the faulted node checks itself again. The multi-node runs are examples/ft_ddp.py under
two ``megascale-ft launch --nnodes 2`` processes on this machine (tests/ft/test_multinode.py's harness)."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megascale.ft.warm import WarmGroup, rank_env, script_imports, split_command
from tests.ft._launch import launch_job
from tests.ft.test_multinode import SCRIPT, _assert_equal, _nodes, _output
from tests.lightning._launch import clean_env

# a generous bound for a loaded 2-core CI machine: imports alone take 20+ s there when other suites run
READY_TIMEOUT_S = 240.0
# longer than tests/ft/_launch.py's: at a load average of 20 on 2 cores, 4 ranks importing torch at once
# missed the 8 s collective timeout in init_process_group (seen while writing this test); nothing here
# depends on how fast a hang is noticed
PATIENT = ("--hang-timeout=10", "--collective-timeout=60")


# --- the pieces -----------------------------------------------------------------------------------------------
def test_the_script_s_top_level_imports_are_what_a_spare_imports_ahead(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""\
        from __future__ import annotations
        import os, torch.distributed as dist
        from torch import nn
        from megascale.ft import Executor, TwoStageCheckpointer
        from . import sibling
        from .helpers import thing
        from pkg import *

        def main():
            import lightning  # inside a function: only when it runs
        """)
    )
    assert script_imports(str(script)) == [
        "os", "torch.distributed", "torch", "torch.nn", "megascale.ft", "megascale.ft.Executor",
        "megascale.ft.TwoStageCheckpointer", "pkg",
    ]  # fmt: skip
    (tmp_path / "broken.py").write_text("import (")
    assert script_imports(str(tmp_path / "broken.py")) == []  # the run itself says what is wrong


def test_the_ranks_a_node_gets_are_torchrun_s_variables_for_its_place() -> None:
    env = rank_env(node_rank=1, nnodes=2, nproc=2, local_rank=1, master="[::1]:2950", run_id="job-3")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    }  # fmt: skip
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("::1", "2950")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every rank a client: none hosts a store
    assert split_command(["python", "-m", "pkg.train", "--x"]) == (None, "pkg.train", ["--x"])
    assert split_command(["train.py", "--x"]) == ("train.py", None, ["--x"])


JOB = """\
import os, sys, json
warm = "torch" in sys.modules  # before this script imported anything
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {"warm": warm, "pid": os.getpid(), "ppid": os.getppid(), "sum": t.item(), "argv": sys.argv[1:],
       "threads": torch.get_num_threads()}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
sys.exit(int(os.environ.get("EXIT_CODE", "0")) if os.environ["RANK"] == "1" else 0)
"""


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _store() -> tuple[socket.socket, dist.TCPStore]:
    """A TCP store like the driver's: its socket bound to loopback only, then handed to torch."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.fileno(), use_libuv=True, timeout=timedelta(seconds=60))  # fmt: skip
    return sock, store


def _ranks(store: dist.TCPStore) -> list[dict[str, str]]:
    master = f"127.0.0.1:{store.port}"
    return [rank_env(node_rank=0, nnodes=1, nproc=2, local_rank=r, master=master, run_id="t") for r in (0, 1)]


def _group(tmp_path: Path, env: dict[str, str] | None = None) -> WarmGroup:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    group = WarmGroup(
        [sys.executable, str(script), str(tmp_path)], 2, {**clean_env(), **(env or {})}, name="t"
    )
    assert group.ready.wait(READY_TIMEOUT_S), "the warm group never became ready"
    return group


def test_a_warm_group_checks_itself_then_its_waiting_ranks_form_a_real_process_group(tmp_path) -> None:
    """Two workers forked after the imports: they pass the self-checks (run in forked checkers, not in them),
    then get their ranks and join a gloo group at a TCP store as clients, and the all-reduce is exact."""
    group = _group(tmp_path)
    try:
        workers = group.workers
        assert len(workers) == 2 and "torch._dynamo" in group.info["imported"], group.info
        ident = group.check(tmp_path / "check.json", 60.0, str(tmp_path / "storage"))
        _wait(lambda: group.result(ident) is not None, 120, "the self-checks")
        result = group.result(ident)
        assert result is not None and result["ok"], result
        assert "passed: 8 checks on 2 ranks" in result["summary"]
        assert group.workers == workers and group.alive()  # the checkers were others, and are gone
        sock, store = _store()
        group.run({**clean_env(), "EXIT_CODE": "0"}, _ranks(store))
        assert group.process.wait(timeout=120) == 0
        sock.close()
    finally:
        group.close()
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["pid"] for o in outs] == workers  # the ranks are the processes that waited: no process start
    assert all(o["warm"] and o["ppid"] == group.pid and o["sum"] == 3.0 for o in outs), outs
    assert all(o["argv"] == [str(tmp_path)] and o["threads"] == 1 for o in outs), outs


def test_a_warm_group_reports_a_failing_check_and_a_failing_rank(tmp_path) -> None:
    group = _group(tmp_path, {"MEGASCALE_FT_SELFCHECK_INJECT": "matmul:1"})
    try:
        ident = group.check(tmp_path / "check.json", 60.0, None)
        _wait(lambda: group.result(ident) is not None, 120, "the self-checks")
        result = group.result(ident)
        assert result is not None and not result["ok"] and "FAIL matmul" in result["summary"], result
        sock, store = _store()
        group.run({**clean_env(), "EXIT_CODE": "7"}, _ranks(store))  # rank 1 exits with 7: the verdict is 1
        assert group.process.wait(timeout=120) == 1
        sock.close()
    finally:
        group.close()


def test_a_discarded_warm_group_leaves_no_process(tmp_path) -> None:
    group = _group(tmp_path)
    pids = [group.pid, *group.workers]
    group.close()
    _wait(
        lambda: not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids),
        30,
        "the group to end",
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


IN_PLACE_JOB = """\
import os, sys, json, threading
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
threading.Thread(target=lambda: None).start()  # a thread of the run's own: ended, so no reason to refuse
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    raise RuntimeError("injected")
dist.all_reduce(t)  # the failed rank's peer fails here: its group is destroyed, the connection closed
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "sum": t.item(), "port": os.environ["MASTER_PORT"]}, f)
dist.destroy_process_group()
"""


def test_in_place_a_failed_run_s_ranks_settle_and_run_the_next_attempt_in_the_same_processes(
    tmp_path,
) -> None:
    """Rank 1 raises after a first all-reduce while rank 0 waits in the second: rank 1's worker destroys its
    process group, so rank 0 fails at once (not at the collective timeout), and both settle. The group
    reports `ended` with the same two workers, stays alive, and runs the next attempt (a fresh store) in
    them: the all-reduces of that run are exact and its ranks are the processes forked before the failure."""
    script = tmp_path / "job.py"
    script.write_text(IN_PLACE_JOB)
    group = WarmGroup([sys.executable, str(script), str(tmp_path)], 2, clean_env(), name="t", in_place=True)
    try:
        assert group.ready.wait(READY_TIMEOUT_S), "the warm group never became ready"
        workers = group.workers
        sock, store = _store()
        started = time.monotonic()
        group.run({**clean_env(), "FAIL_RANK": "1"}, _ranks(store))
        _wait(lambda: group.ended is not None or not group.alive(), 60, "the failed run to end")
        # well under the 60-s collective timeout: rank 0 learnt of the failure from the closed connection
        assert group.ended is not None and time.monotonic() - started < 30, group.ended
        assert group.ended["workers"] == workers and group.alive(), group.ended
        assert not list(tmp_path.glob("rank*.json"))
        # both stores live to the end: a store handed a listening fd closes that fd number when it goes,
        # which another store's socket may have taken by then
        sock2, store2 = _store()
        group.run(clean_env(), _ranks(store2))
        assert group.process.wait(timeout=120) == 0 and group.runs == 2
        sock.close()
        sock2.close()
    finally:
        group.close()
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["pid"] for o in outs] == workers and all(o["sum"] == 6.0 for o in outs), outs
    assert {o["port"] for o in outs} == {str(store2.port)}


LEAKY_JOB = """\
import os, threading, time
import torch.distributed as dist

dist.init_process_group("gloo")
threading.Thread(target=time.sleep, args=(600,), daemon=True, name="left-behind").start()
raise RuntimeError("injected")
"""


def test_in_place_a_run_that_leaves_a_thread_running_is_not_restarted_in_place(tmp_path, monkeypatch) -> None:
    """A thread of the failed run still running after the settle time: the process is not one to run the next
    attempt in (that thread could still act on the old run), so the group exits with the failure as without
    in place, and says why."""
    script = tmp_path / "job.py"
    script.write_text(LEAKY_JOB)
    group = WarmGroup([sys.executable, str(script)], 2, clean_env(), name="t", in_place=True)
    try:
        assert group.ready.wait(READY_TIMEOUT_S), "the warm group never became ready"
        sock, store = _store()
        group.run(clean_env(), _ranks(store))
        assert group.process.wait(timeout=120) == 1 and group.ended is None
        sock.close()
    finally:
        group.close()


# --- 2 nodes x 2 ranks ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same 4 ranks on one machine under the one-node launcher, no fault."""
    tmp = tmp_path_factory.mktemp("one-node")
    result, report = launch_job(tmp, SCRIPT, ranks=4, launcher_args=("--repeat-limit=2", *PATIENT))
    assert report["ok"] and len(report["attempts"]) == 1, result.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=True)


def test_a_node_whose_processes_die_restarts_from_warm_spares_to_bitwise_equal_weights(
    uninterrupted, tmp_path
):
    """Node 1's attempt (its warm group's supervisor and ranks) is SIGKILLed at step 4. The restart runs in the
    spares that waited on both nodes since before the fault: the ranks of attempt 1 are exactly the workers
    those groups had forked, ready before the fault was noticed. Node 0's self-check from before the fault
    counts; node 1 checks again. The final weights equal an uninterrupted run's bit for bit."""
    results, report = _nodes(tmp_path, ["0", "1"], "--fault", "kill-node@4:1", self_check=True, extra=PATIENT)
    output = _output(results)
    assert report["ok"] and all(r.returncode == 0 for r in results.values()), output
    failed, resumed = report["attempts"]
    assert failed["fault"]["node"] == "1" and failed["fault"]["kind"] == "dead", failed["fault"]
    assert failed["warm"] and resumed["warm"], output
    groups = resumed["warm_groups"]
    workers = sorted(p for g in groups.values() for p in g["workers"])
    assert sorted(resumed["ranks"].values()) == workers, (resumed["ranks"], groups)  # no process started
    noticed = failed["fault"]["detected"]
    assert all(g["ready_at"] < noticed for g in groups.values()), (groups, noticed)
    assert resumed["self_check"]["1"]["ahead"] is False and resumed["self_check"]["0"]["ahead"] is True
    phases = resumed["phases"]
    assert all(v is not None for v in phases.values()), phases
    # A cold start (torchrun, rendezvous, 4 ranks importing torch) takes 5.1 s on this machine when quiet and
    # a minute at load 25; a warm one 0.3 s at load 12 (benchmarks/recovery.py). 4 s: room for a loaded CI
    # machine, yet a restart that started processes would not fit on a quiet one.
    assert phases["start"] < 4.0, phases
    _assert_equal(tmp_path / "out.pt", uninterrupted)


def _same_processes(failed: dict, resumed: dict, ranks: list[int]) -> bool:
    return all(resumed["ranks"][str(r)] == failed["ranks"][str(r)] for r in ranks)


def _in_place_run(tmp_path: Path, fault: str) -> tuple[str, dict, dict]:
    """A 2 x 2 run under --restart-in-place hit by ``fault`` once: its output, the failed and resumed attempts."""
    extra = (*PATIENT, "--restart-in-place")
    results, report = _nodes(tmp_path, ["0", "1"], "--fault", fault, self_check=True, extra=extra)
    output = _output(results)
    assert report["ok"] and all(r.returncode == 0 for r in results.values()), output
    failed, resumed = report["attempts"]
    return output, failed, resumed


def test_in_place_an_exception_restarts_every_rank_in_its_own_process_to_bitwise_equal_weights(
    uninterrupted, tmp_path
):
    """--restart-in-place, rank 1 raises at step 4: no process is gone, so every rank settles and attempt 1
    runs in the very processes of attempt 0 (same pids on both nodes, the groups' second run), resumes from
    the checkpoint and ends bitwise equal to an uninterrupted run."""
    output, failed, resumed = _in_place_run(tmp_path, "exception@4:1")
    assert failed["fault"]["kind"] == "exception" and failed["fault"]["rank"] == 1, failed["fault"]
    assert "injected failure at step 4" in failed["fault"]["message"], failed["fault"]
    assert _same_processes(failed, resumed, [0, 1, 2, 3]), (failed["ranks"], resumed["ranks"])
    groups = resumed["warm_groups"]
    assert all(g["in_place"] and g["runs"] == 2 for g in groups.values()), groups
    assert "; the next attempt runs in them" in output
    _assert_equal(tmp_path / "out.pt", uninterrupted)


def test_in_place_a_dead_rank_s_node_restarts_from_a_spare_and_the_other_node_in_place(
    uninterrupted, tmp_path
):
    """--restart-in-place, rank 3 (node 1) is SIGKILLed at step 4: node 0's ranks lose their peer, fail and
    settle, so they run attempt 1 in place; node 1's group lost a process and is replaced by its warm spare.
    The fault is still named (rank 3 dead on node 1) and the weights end bitwise equal."""
    _, failed, resumed = _in_place_run(tmp_path, "sigkill@4:3")
    assert failed["fault"]["kind"] == "dead" and failed["fault"]["rank"] == 3, failed["fault"]
    assert _same_processes(failed, resumed, [0, 1]), (failed["ranks"], resumed["ranks"])
    assert not any(resumed["ranks"][str(r)] == failed["ranks"][str(r)] for r in (2, 3)), resumed["ranks"]
    groups = resumed["warm_groups"]  # node names are "0" and "1"; which holds ranks 2-3 is who joined last
    faulted = failed["fault"]["node"]
    assert not groups[faulted]["in_place"] and all(g["in_place"] for n, g in groups.items() if n != faulted)
    _assert_equal(tmp_path / "out.pt", uninterrupted)


@pytest.mark.slow  # the torchrun path, as before warm spares: CI runs the warm one above
def test_a_node_without_warm_spares_makes_every_attempt_a_torchrun_again(uninterrupted, tmp_path):
    """Node 1 runs with --no-warm: the driver cannot run an attempt in warm groups on it, so both nodes start
    torchrun in a c10d rendezvous, as without warm spares, and the restart is still bitwise equal."""
    results, report = _nodes(
        tmp_path,
        ["0", "1"],
        "--fault",
        "kill-node@4:1",
        self_check=True,
        env={"1": {"MEGASCALE_FT_NO_WARM": "1"}},
        extra=PATIENT,
    )
    output = _output(results)
    assert report["ok"] and all(r.returncode == 0 for r in results.values()), output
    failed, resumed = report["attempts"]
    assert failed["fault"]["node"] == "1" and not failed["warm"] and not resumed["warm"], output
    assert "torch.distributed.run" in results["1"].stdout
    _assert_equal(tmp_path / "out.pt", uninterrupted)
