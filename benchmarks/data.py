"""Benchmark megascale-data's tree loader against plain webdataset + DataLoader in every rank of a node.

The setting (MegaScale §3.5): one node, one tensor-parallel group of --ranks ranks (default 4, dp=1), so every
rank needs the same batches. Compared, on the same shards:
    plain   each rank runs its own webdataset.WebDataset (nodesplitter=None, shardshuffle=False: every rank
            reads every shard, as the ranks of a TP group must) → preprocess → pack → batch, inside a
            torch DataLoader with --plain-workers worker processes (fork, the default) per rank
    tree    megascale.data.WebLoader(tree=True, dp_rank=0, dp_size=1): local rank 0 starts the node's one
            reader process (`python -m megascale.data.reader`, no torch) with --tree-workers worker
            processes; every rank copies its batch out of the shared-memory ring
Both run the same preprocessing object (`WorkPreprocess`: decode UTF-8, byte-tokenize, then burn --work-us
microseconds of the thread's CPU clock per document, standing in for a heavy tokenizer) and the same packing
(`megascale.data.packing.pack`: windows of seq_len + 1 tokens, each document followed by end-of-sequence).

Each configuration runs in a fresh set of rank processes (OMP_NUM_THREADS=1, torch.set_num_threads(1)) started
by this script: every rank reads --warmup batches, waits for the others, then reads the timed batches (in part
2 with a sleep after each, the simulated training step: a sleep uses no core, like a step that runs on a GPU).
Measured:
    seq/s      packed sequences per rank per second over the timed batches, for the slowest rank (a TP group
               steps at the pace of its slowest member)
    CPU-s      user + system CPU seconds of the timed window (from /proc/<pid>/stat at the start and end
               barriers), summed over processes: "loader" = the ranks' descendants (DataLoader workers, or
               the reader, its workers and multiprocessing's resource tracker); "all" adds the ranks.
               Start-up (imports, spawning, warm-up batches) is shown separately
    peak RSS   VmHWM (/proc/<pid>/status) summed over processes: shared pages (torch's libraries, the ring,
               pages a forked worker shares with its rank) count once per process that maps them. PSS
               (/proc/<pid>/smaps_rollup, the largest value sampled every --sample-s) shares them out instead.
               This script's own sampling (~15 ms of CPU per sample) is not counted
    wait       seconds a rank spends inside next() per step (a batch already there still costs its copy);
               "steady" = over the last half of the steps, once the batches prefetched during the barrier
               are used up: the mean (over ranks, and the worst rank's) and the longest single wait
Every rank hashes the first tokens of each batch: the ranks of a configuration must agree (identical batches
in the TP group, and, for plain, proof that no splitter handed ranks different shards).

Part 1 (throughput and cost, no step): plain vs tree at --work-us, --batches per rank, --repeats times in
turn. Part 2 (data wait): --wait-work-us, and a step of a multiple of the CPU time one process needs to
prepare a batch (measured here first): --wait-easy-ratio (> 1: one worker keeps up, tree wait ≈ 0), then
--wait-step-ratio (< 1: preprocessing needs more than one core; tree with 1 worker makes the step wait, with
2 workers it should not), and plain at that step, which needs --ranks times the cores for the same batches.

    python benchmarks/data.py                                   # ~1.5 minutes on 2 cores
    python benchmarks/data.py --work-us 0 500 --batches 400     # several preprocessing costs
    python benchmarks/data.py --skip-wait --ranks 8             # part 1 only, 8 ranks (a GPU node)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EOS = 256  # the byte tokenizer's end-of-sequence id
TAG = "@@bench "  # prefix of the lines a rank sends to this script (the reader shares rank 0's stdout)


# --------------------------------------------------------------------------------------------- the work


@dataclass(frozen=True)
class WorkPreprocess:
    """Sample → document token ids: decode, byte-tokenize, then ``work_us`` µs of CPU (a tokenizer's cost).

    The extra work is a pure-Python loop on the thread's CPU clock: a fixed CPU cost however busy the machine,
    holding the GIL throughout, as Python-level preprocessing does.

    Module-level and picklable: the tree reader's workers unpickle it as ``benchmarks.data.WorkPreprocess``
    (this module imports no torch at its top, so they stay light).
    """

    work_us: float = 0.0
    text_key: str = "txt"

    def __call__(self, sample: dict[str, Any]) -> np.ndarray | None:
        from megascale.data.packing import TextPreprocess
        from megascale.data.tokenize import ByteTokenizer

        ids = TextPreprocess(ByteTokenizer(), self.text_key)(sample)  # the loader's default preprocessing
        if ids is None:
            return None
        if self.work_us > 0:
            end = time.thread_time() + self.work_us * 1e-6  # this thread's CPU clock: a fixed CPU cost
            while time.thread_time() < end:
                pass
        return ids


def _pack_batches(samples: Any, *, preprocess: WorkPreprocess, seq_len: int, batch: int) -> Any:
    """The plain pipeline's last stage: samples → packed windows → (batch, seq_len + 1) int64 arrays."""
    from megascale.data.packing import pack

    docs = (d for d in map(preprocess, samples) if d is not None and len(d))
    rows: list[np.ndarray] = []
    for window in pack(docs, seq_len, EOS):
        rows.append(window)
        if len(rows) == batch:
            yield np.stack(rows).astype(np.int64)
            rows = []


def prep_time_per_batch(url: str, work_us: float, seq_len: int, batch: int, shards: int = 2) -> float:
    """CPU seconds one process needs to read, preprocess and pack one batch (first ``shards`` shards)."""
    from megascale.data.packing import pack
    from megascale.data.sources import expand_urls, iter_samples

    preprocess, sequences = WorkPreprocess(work_us), 0
    start = time.process_time()
    for shard in expand_urls(url)[:shards]:
        docs = (preprocess(s) for s in iter_samples(shard))
        sequences += sum(1 for _ in pack((d for d in docs if d is not None), seq_len, EOS))
    return (time.process_time() - start) / sequences * batch


# --------------------------------------------------------------------------------------------- a rank


def _say(kind: str, **payload: Any) -> None:
    print(TAG + json.dumps({"kind": kind, **payload}), flush=True)


def _plain_loader(cfg: dict[str, Any], preprocess: WorkPreprocess) -> Any:
    import functools

    import webdataset as wds
    from torch.utils.data import DataLoader

    from megascale.data.sources import expand_urls

    dataset = (
        wds.WebDataset(expand_urls(cfg["url"]), shardshuffle=False, nodesplitter=None, empty_check=False)
        .repeat()
        .compose(
            functools.partial(
                _pack_batches, preprocess=preprocess, seq_len=cfg["seq_len"], batch=cfg["batch"]
            )
        )
    )
    workers = cfg["workers"]
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=max(1, cfg["prefetch"] // workers) if workers else None,
    )
    for batch in loader:  # the same (inputs, targets) a trainer gets from the tree loader
        yield batch[:, :-1], batch[:, 1:]


def _tree_loader(cfg: dict[str, Any], preprocess: WorkPreprocess, rank: int) -> Any:
    from megascale.data import Source, WebDataConfig, WebLoader

    config = WebDataConfig(
        sources=[Source(cfg["url"])], seq_len=cfg["seq_len"], batch_size=cfg["batch"], preprocess=preprocess,
        shuffle=False, num_workers=cfg["workers"], prefetch=cfg["prefetch"], timeout=120,
    )  # fmt: skip
    return WebLoader(
        config, dp_rank=0, dp_size=1, tree=True, local_rank=rank, local_world_size=cfg["ranks"], node_rank=0,
        run_id=cfg["run_id"],
    )  # fmt: skip


def _rank_main(rank: int, cfg: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    # by module name, not __main__: the tree reader's workers must be able to unpickle it
    from benchmarks.data import WorkPreprocess as Preprocess

    preprocess = Preprocess(cfg["work_us"])
    tree = cfg["loader"] == "tree"
    loader = _tree_loader(cfg, preprocess, rank) if tree else None
    batches = iter(loader) if loader is not None else _plain_loader(cfg, preprocess)
    for _ in range(cfg["warmup"]):
        next(batches)
    _say("warm")
    sys.stdin.readline()
    step_s, waits, digest = cfg["step_ms"] / 1e3, [], 0
    start = time.perf_counter()
    for _ in range(cfg["batches"]):
        t = time.perf_counter()
        inputs, targets = next(batches)
        waits.append(time.perf_counter() - t)
        digest = zlib.crc32(inputs[:, :64].numpy().tobytes(), digest)
        digest = zlib.crc32(targets[:, -1].numpy().tobytes(), digest)
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - start
    _say("done", wall=wall, waits=waits, digest=digest, shape=list(inputs.shape))
    sys.stdin.readline()
    if loader is not None:
        loader.close()


# --------------------------------------------------------------------------------------------- measuring

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _kb(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _name(pid: int, role: str) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "?"
    for pattern, name in (
        ("megascale.data.reader", "tree reader"),
        ("resource_tracker", "multiprocessing resource tracker"),
        ("spawn_main", "reader worker (spawn)"),
        ("--_rank", "rank" if role == "rank" else "DataLoader worker (fork of its rank)"),
    ):
        if pattern in cmd:
            return name
    return cmd.replace("\0", " ")[:60]


@dataclass
class _Proc:
    role: str  # "rank" or "loader"
    name: str
    cpu: float = 0.0
    hwm_kb: int = 0
    pss_kb: int = 0


class Monitor:
    """Samples the process trees under the rank pids: CPU time, peak RSS (VmHWM) and the largest PSS."""

    def __init__(self, ranks: list[int], interval: float) -> None:
        self.ranks, self.interval = ranks, interval
        self.procs: dict[int, _Proc] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample(pss=True)

    def sample(self, pss: bool = False) -> dict[int, _Proc]:
        """Update every live process of the trees; returns a copy of what is known (exited: last seen)."""
        with self._lock:
            parent: dict[int, int] = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit() and (st := _stat(int(entry))) is not None:
                    parent[int(entry)] = st[0]
            tree, frontier = set(self.ranks), list(self.ranks)
            while frontier:
                below = [p for p, pp in parent.items() if pp in frontier and p not in tree]
                tree.update(below)
                frontier = below
            for pid in tree:
                st = _stat(pid)
                if st is None:
                    continue
                proc = self.procs.get(pid)
                if proc is None:
                    role = "rank" if pid in self.ranks else "loader"
                    proc = self.procs[pid] = _Proc(role, _name(pid, role))
                proc.cpu = st[1]
                proc.hwm_kb = _kb(f"/proc/{pid}/status", "VmHWM:") or proc.hwm_kb
                if pss:
                    proc.pss_kb = max(proc.pss_kb, _kb(f"/proc/{pid}/smaps_rollup", "Pss:") or 0)
            return {pid: _Proc(**vars(p)) for pid, p in self.procs.items()}


def _run_config(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks of one configuration, measure them, and return the figures."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cfg = {**cfg, "run_id": uuid.uuid4().hex[:12]}
    command = [sys.executable, __file__, "--_config", json.dumps(cfg), "--_rank"]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    procs = [subprocess.Popen([*command, str(r)], **pipes) for r in range(cfg["ranks"])]
    monitor = Monitor([p.pid for p in procs], args.sample_s).start()
    lines: queue.Queue = queue.Queue()

    def pump(rank: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(TAG):
                lines.put((rank, json.loads(line[len(TAG) :])))
            elif args.verbose:
                print(f"[rank {rank}] {line}", end="", file=sys.stderr)
        lines.put((rank, None))

    for r, p in enumerate(procs):
        threading.Thread(target=pump, args=(r, p), daemon=True).start()

    def gather(kind: str) -> list[dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}
        while len(got) < len(procs):
            rank, message = lines.get(timeout=args.timeout)
            if message is None:
                raise RuntimeError(f"rank {rank} exited (code {procs[rank].wait()}) before '{kind}'")
            got[rank] = message
        return [got[r] for r in range(len(procs))]

    def tell() -> None:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()

    try:
        gather("warm")
        warm = monitor.sample(pss=True)
        tell()
        done = gather("done")
        end = monitor.sample(pss=True)
        tell()
        for p in procs:
            p.wait(timeout=60)
    finally:
        monitor.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def total(procs_: dict[int, _Proc], role: str | None, attr: str) -> float:
        return sum(getattr(p, attr) for p in procs_.values() if role is None or p.role == role)

    def window(role: str | None) -> float:
        return sum(
            p.cpu - (warm[pid].cpu if pid in warm else 0.0)
            for pid, p in end.items()
            if role is None or p.role == role
        )

    final = monitor.procs
    steady = [statistics.mean(d["waits"][len(d["waits"]) // 2 :]) for d in done]
    return {
        **cfg,
        "seq_per_s": min(cfg["batches"] * cfg["batch"] / d["wall"] for d in done),
        "identical": len({d["digest"] for d in done}) == 1,
        "waits": [d["waits"] for d in done],
        "wait_steady_ms": 1e3 * statistics.mean(steady),
        "wait_steady_max_ms": 1e3 * max(steady),
        "wait_max_ms": 1e3 * max(w for d in done for w in d["waits"][len(d["waits"]) // 2 :]),
        "cpu_loader": window("loader"),
        "cpu_all": window(None),
        "cpu_startup": total(warm, None, "cpu"),
        "rss_loader_mb": total(final, "loader", "hwm_kb") / 1024,
        "rss_all_mb": total(final, None, "hwm_kb") / 1024,
        "pss_loader_mb": total(final, "loader", "pss_kb") / 1024,
        "pss_all_mb": total(final, None, "pss_kb") / 1024,
        "procs": [  # (name, CPU-s of the timed window, peak RSS MB) per process
            (p.name, p.cpu - (warm[pid].cpu if pid in warm else 0.0), p.hwm_kb / 1024)
            for pid, p in end.items()
        ],
    }


# --------------------------------------------------------------------------------------------- reporting


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _label(r: dict[str, Any]) -> str:
    return f"{r['loader']}, {r['workers']} worker{'s' if r['workers'] != 1 else ''}" + (
        " per rank" if r["loader"] == "plain" else " (node)"
    )


def _cost_table(rows: list[dict[str, Any]], ranks: int) -> str:
    out = [
        f"| loader | work µs/doc | seq/s per rank | CPU-s loader | CPU-s all ({ranks} ranks incl.) | start-up "
        "CPU-s | peak RSS loader MB | peak RSS all MB | PSS loader MB | PSS all MB | same batches on all ranks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {_label(r)} | {r['work_us']:g} | {r['seq_per_s']:.0f} | {r['cpu_loader']:.2f} | "
            f"{r['cpu_all']:.2f} | {r['cpu_startup']:.1f} | {r['rss_loader_mb']:.0f} | {r['rss_all_mb']:.0f} | "
            f"{r['pss_loader_mb']:.0f} | {r['pss_all_mb']:.0f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(out)


def _ratios(plain: dict[str, Any], tree: dict[str, Any]) -> str:
    def ratio(key: str) -> str:
        return f"{tree[key] / plain[key]:.2f}x" if plain[key] else "n/a"

    return (
        f"work {plain['work_us']:g} µs/doc, tree/plain: seq/s {ratio('seq_per_s')} (target ≥ 1.0x); "
        f"CPU-s loader {ratio('cpu_loader')}, all {ratio('cpu_all')} (target ≤ 0.35x); peak RSS loader "
        f"{ratio('rss_loader_mb')}, all {ratio('rss_all_mb')}; PSS loader {ratio('pss_loader_mb')}, all "
        f"{ratio('pss_all_mb')} (target ≤ 0.35x)"
    )


def _wait_table(rows: list[dict[str, Any]], prep_ms: float) -> str:
    out = [
        "| loader | work µs/doc | batch prep, 1 core ms | step ms | wait ms/step, steady (mean / worst rank) "
        "| longest wait ms, steady | seq/s per rank | CPU-s all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {_label(r)} | {r['work_us']:g} | {prep_ms:.1f} | {r['step_ms']:.1f} | "
            f"{r['wait_steady_ms']:.2f} / {r['wait_steady_max_ms']:.2f} | {r['wait_max_ms']:.1f} | "
            f"{r['seq_per_s']:.0f} | {r['cpu_all']:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="ranks on the node (one TP group, dp=1)")
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--docs", type=int, default=200, help="documents per shard")
    parser.add_argument("--doc-chars", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--prefetch", type=int, default=4, help="batches in flight (ring slots / DataLoader)")
    parser.add_argument("--work-us", type=float, nargs="+", default=[500.0], help="part 1: CPU µs per doc")
    parser.add_argument("--batches", type=int, default=600, help="timed batches per rank, part 1")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches per rank")
    parser.add_argument("--plain-workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--tree-workers", type=int, default=1, help="reader workers per node, part 1")
    parser.add_argument("--wait-work-us", type=float, default=4000.0, help="part 2: CPU µs per doc")
    parser.add_argument(
        "--wait-step-ratio", type=float, default=0.75, help="part 2: step / 1-core batch prep"
    )
    parser.add_argument("--wait-steps", type=int, default=120, help="timed steps per rank, part 2")
    parser.add_argument("--wait-easy-ratio", type=float, default=1.5, help="part 2: a step longer than prep")
    parser.add_argument("--repeats", type=int, default=2, help="part 1: plain and tree take turns this often")
    parser.add_argument("--skip-wait", action="store_true", help="part 1 only")
    parser.add_argument("--sample-s", type=float, default=0.5, help="process sampling interval")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the ranks")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' other output")
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._rank is not None:
        _rank_main(args._rank, json.loads(args._config))
        return

    sys.path.insert(0, str(ROOT))
    from tests.data._shards import write_text_shards

    with tempfile.TemporaryDirectory(prefix="megascale-data-bench-") as tmp:
        t = time.perf_counter()
        url, _ = write_text_shards(tmp, args.shards, args.docs, doc_chars=args.doc_chars)
        size = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**20
        print(f"{args.shards} shards × {args.docs} docs × {args.doc_chars} chars ({size:.0f} MiB) written in "
              f"{time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs; {args.ranks} ranks, tp={args.ranks}, "
              f"dp=1; batch {args.batch} × {args.seq_len} tokens\n", flush=True)  # fmt: skip
        base = dict(url=url, ranks=args.ranks, seq_len=args.seq_len, batch=args.batch, prefetch=args.prefetch,
                    warmup=args.warmup)  # fmt: skip

        pairs = []
        for repeat in range(args.repeats):
            for work in args.work_us:
                pair = {}
                for loader, workers in (("plain", args.plain_workers), ("tree", args.tree_workers)):
                    cfg = dict(base, loader=loader, workers=workers, work_us=work, step_ms=0.0,
                               batches=args.batches)  # fmt: skip
                    pair[loader] = _run_config(cfg, args)
                    print(f"  run {repeat + 1}: {_label(cfg)}, work {work:g} µs/doc: "
                          f"{pair[loader]['seq_per_s']:.0f} seq/s; {_load()}", flush=True)  # fmt: skip
                pairs.append(pair)
        print(f"\n## Part 1: throughput and cost, no step ({args.batches} timed batches per rank after "
              f"{args.warmup} warm-up)\n")  # fmt: skip
        print(_cost_table([r for p in pairs for r in (p["plain"], p["tree"])], args.ranks))
        print()
        for p in pairs:
            print(_ratios(p["plain"], p["tree"]))
        print("\nper process (timed-window CPU-s, peak RSS MB), first run:")
        for r in (pairs[0]["plain"], pairs[0]["tree"]):
            print(
                f"  {_label(r)}: " + "; ".join(f"{n} {c:.2f} s {m:.0f} MB" for n, c, m in sorted(r["procs"]))
            )

        if args.skip_wait:
            return
        prep = prep_time_per_batch(url, args.wait_work_us, args.seq_len, args.batch)
        print(f"\n## Part 2: data wait; one core needs {prep * 1e3:.1f} ms to prepare a batch at "
              f"{args.wait_work_us:g} µs/doc; the step is a sleep ({args.wait_steps} timed steps per rank)\n",
              flush=True)  # fmt: skip
        rows = []
        for loader, workers, ratio in (
            ("tree", 1, args.wait_easy_ratio),
            ("tree", 1, args.wait_step_ratio),
            ("tree", 2, args.wait_step_ratio),
            ("plain", args.plain_workers, args.wait_step_ratio),
        ):
            cfg = dict(base, loader=loader, workers=workers, work_us=args.wait_work_us, step_ms=ratio * prep * 1e3,
                       batches=args.wait_steps)  # fmt: skip
            rows.append(_run_config(cfg, args))
            print(f"  {_label(cfg)}, step {cfg['step_ms']:.1f} ms: wait {rows[-1]['wait_steady_ms']:.2f} ms/step; "
                  f"{_load()}", flush=True)  # fmt: skip
        print()
        print(_wait_table(rows, prep * 1e3))
        tree2, plain = rows[2], rows[3]
        print(f"\nat the short step, tree (2 workers) / plain: seq/s {tree2['seq_per_s'] / plain['seq_per_s']:.2f}x, "
              f"CPU-s all {tree2['cpu_all'] / plain['cpu_all']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
