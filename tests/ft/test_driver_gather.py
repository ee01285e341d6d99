"""The driver's choice of nodes before an attempt, without processes: agents' reports are fed to it directly."""

from __future__ import annotations

import threading
import time

from megascale.ft.driver import ClusterConfig, ClusterDriver


def _report(node: str, check: dict | None = None, attempt: int = -1) -> dict:
    return {"node": node, "host": "127.0.0.1", "pid": hash(node) % 10_000, "self_check": check,
            "checked_attempt": attempt}  # fmt: skip


def test_a_node_whose_check_fails_last_is_still_evicted(tmp_path) -> None:
    """Nodes 0 and the spare pass their checks before node 1's (slower) check fails: the attempt does not start
    on the first two healthy nodes while node 1 is still checking, so node 1 is evicted and named, whatever
    the order in which the checks end (before, a late failure left ``evicted`` empty)."""
    driver = ClusterDriver(ClusterConfig(nnodes=2, token="t" * 32, node_timeout=30, run_dir=str(tmp_path)))
    for node in ("0", "1", "spare"):  # arrival order: node 1 before the spare
        driver._on_agent(_report(node))
    chosen: dict = {}
    gather = threading.Thread(target=lambda: chosen.update(members=driver._gather(0, chosen)))
    gather.start()
    time.sleep(0.5)
    for node in ("0", "spare"):
        driver._on_agent(_report(node, {"ok": True, "summary": "PASS"}, attempt=0))
    time.sleep(1.0)  # several polls with two healthy nodes: the attempt must still wait for node 1
    assert gather.is_alive(), f"started on {chosen.get('members')} while node 1 was still checking"
    driver._on_agent(_report("1", {"ok": False, "summary": "FAIL matmul on rank 2"}, attempt=0))
    gather.join(timeout=10)
    assert chosen["members"] == ["0", "spare"]
    assert list(driver.evicted) == ["1"] and "FAIL matmul" in driver.evicted["1"]
    assert not chosen["self_check"]["1"]["ok"] and chosen["self_check"]["spare"]["ok"]
