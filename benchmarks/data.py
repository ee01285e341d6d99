"""Benchmark megascale-data's tree loader against a per-rank DataLoader (webdataset on tar shards, Hugging
Face datasets streaming on Parquet) in every rank of a node.

The setting (MegaScale §3.5): one node, one tensor-parallel group of --ranks ranks (default 4, dp=1), so every
rank needs the same batches. Compared, on the same corpus (--format tar: --shards tar shards, the default;
--format parquet: Parquet files of --row-groups row groups each, a `text` column, --shards row groups in all):
    plain     (tar) each rank runs its own webdataset.WebDataset (nodesplitter=None, shardshuffle=False: every
              rank reads every shard, as the ranks of a TP group must) → preprocess → pack → batch, inside a
              torch DataLoader with --plain-workers worker processes (fork, the default) per rank
    datasets  (Parquet) each rank streams every file with `datasets.load_dataset("parquet", data_files=...,
              split="train", streaming=True)`, tokenizes with a batched map → pack → batch, inside the same
              torch DataLoader with --plain-workers workers per rank (no split_dataset_by_node, as above)
    tree      megascale.data.WebLoader(tree=True, dp_rank=0, dp_size=1): local rank 0 starts the node's one
              reader process (`python -m megascale.data.reader`, no torch) with --tree-workers worker
              processes; every rank copies its batch out of the shared-memory ring
The preprocessing is the same in both loaders of a run, as is the packing (`megascale.data.packing.pack`:
windows of seq_len + 1 tokens, each document followed by end-of-sequence):
    synthetic (default) `WorkPreprocess`: decode UTF-8, byte-tokenize, then burn --work-us microseconds of
              the thread's CPU clock per document, standing in for a heavy tokenizer
    BPE       (--tokenizer DIR, a directory `megascale-data tokenizer` wrote, or --tokenizer bpe to train one
              here with --bpe-vocab ids): the tree tokenizes with WebDataConfig(tokenizer=DIR), its own
              default path (one `encode` per document in the reader workers); the baselines with the same
              `tokenizers` file (datasets: `encode_batch` in the map). TOKENIZERS_PARALLELISM=false: one core
              per loader worker in both. The text is then the stdlib's source (--text), what the BPE is for
              and what the main job reads; random letters would tokenize at an unrepresentative rate

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
    tokens/s   per loader worker: on the wall clock of the timed window, and per CPU-second of the worker
               processes (what one worker makes of a core to itself); the tree's worker makes each token once
               for the node, a baseline's worker once per rank
    wait       seconds a rank spends inside next() per step (a batch already there still costs its copy);
               "steady" = over the last half of the steps, once the batches prefetched during the barrier
               are used up: the mean (over ranks, and the worst rank's) and the longest single wait
Every rank hashes the first tokens of each batch: the ranks of a configuration must agree (identical batches
in the TP group, and, for a baseline, proof that no splitter handed ranks different files).

Part 1 (throughput and cost, no step): baseline vs tree at --work-us (or the BPE), --batches per rank,
--repeats times in turn. Part 2 (data wait): --wait-work-us (or the BPE), and a step of a multiple of the CPU
time one process needs to prepare a batch (measured here first): --wait-easy-ratio (> 1: one worker keeps
up, tree wait ≈ 0), then --wait-step-ratio (< 1: preprocessing needs more than one core; tree with 1 worker
makes the step wait, with 2 workers it should not), and the baseline at that step, which needs --ranks times
the cores for the same batches. Part 3 (with a BPE only): the CPU time to tokenize and pack one batch of the
main job (examples/configs/main_cpu.yaml's seq_len and batch_size, on its own text, the stdlib's training
files) with the byte tokenizer and with the BPE, against the main job's step time when --main-steps runs it
(with the BPE overrides the config's header documents; 4 processes, no checkpoints).

    python benchmarks/data.py                                   # ~1.5 minutes on 2 cores
    python benchmarks/data.py --work-us 0 500 --batches 400     # several preprocessing costs
    python benchmarks/data.py --skip-wait --ranks 8             # part 1 only, 8 ranks (a GPU node)
    python benchmarks/data.py --format parquet --tokenizer bpe --main-steps 12   # Parquet + BPE vs datasets
    python benchmarks/data.py --quick --ranks 2 --format parquet --tokenizer bpe # a smoke run (the test's)
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
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks._data_harness and tests.data._shards by name

from benchmarks._data_harness import (  # noqa: E402
    LOADER_WORKER,
    READER_WORKER,
    Monitor,
    Proc,
    bpe_tokenizer,
    clean_env,
    documents,
    main_job_shape,
    main_job_step,
    tokenize_cost,
    write_corpus,
)

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


def _preprocess(cfg: dict[str, Any]) -> Any:
    """The per-sample work of a configuration: the BPE as the loader's default preprocessing, or the
    synthetic byte tokenizer + burned µs."""
    if cfg["tokenizer"] is None:
        # by module name, not __main__: the tree reader's workers must be able to unpickle it
        from benchmarks.data import WorkPreprocess as Preprocess

        return Preprocess(cfg["work_us"], cfg["text_key"])
    from megascale.data.packing import TextPreprocess
    from megascale.data.tokenize import load_tokenizer

    return TextPreprocess(load_tokenizer(cfg["tokenizer"]), cfg["text_key"])


def _batches(docs: Any, *, seq_len: int, batch: int, eos: int) -> Any:
    """Documents' token ids → packed windows → (batch, seq_len + 1) int64 arrays."""
    from megascale.data.packing import pack

    rows: list[np.ndarray] = []
    for window in pack((d for d in docs if d is not None and len(d)), seq_len, eos):
        rows.append(window)
        if len(rows) == batch:
            yield np.stack(rows).astype(np.int64)
            rows = []


def _pack_batches(samples: Any, *, preprocess: Any, seq_len: int, batch: int, eos: int) -> Any:
    """The plain pipeline's last stage: samples → packed windows → (batch, seq_len + 1) int64 arrays."""
    return _batches(map(preprocess, samples), seq_len=seq_len, batch=batch, eos=eos)


def prep_time_per_batch(cfg: dict[str, Any], units: int = 2) -> float:
    """CPU seconds one process needs to read, preprocess and pack one batch (the first ``units`` units:
    tar shards or Parquet row groups)."""
    from megascale.data.packing import pack
    from megascale.data.sources import Source, iter_samples, list_shards

    preprocess, sequences = _preprocess(cfg), 0
    start = time.process_time()
    for unit in list_shards(Source(cfg["url"], text_key=cfg["text_key"]))[:units]:
        docs = (preprocess(s) for s in iter_samples(unit, text_key=cfg["text_key"]))
        sequences += sum(1 for _ in pack((d for d in docs if d is not None), cfg["seq_len"], cfg["eos"]))
    return (time.process_time() - start) / sequences * cfg["batch"]


# --------------------------------------------------------------------------------------------- a rank


def _say(kind: str, **payload: Any) -> None:
    print(TAG + json.dumps({"kind": kind, **payload}), flush=True)


def _data_loader(dataset: Any, cfg: dict[str, Any]) -> Any:
    """A torch DataLoader over an iterable of ready batches, ``cfg["workers"]`` fork workers per rank."""
    from torch.utils.data import DataLoader

    workers = cfg["workers"]
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=max(1, cfg["prefetch"] // workers) if workers else None,
    )
    for batch in loader:  # the same (inputs, targets) a trainer gets from the tree loader
        yield batch[:, :-1], batch[:, 1:]


def _plain_loader(cfg: dict[str, Any]) -> Any:
    import functools

    import webdataset as wds

    from megascale.data.sources import expand_urls

    stage = functools.partial(
        _pack_batches, preprocess=_preprocess(cfg), seq_len=cfg["seq_len"], batch=cfg["batch"], eos=cfg["eos"]
    )
    dataset = (
        wds.WebDataset(expand_urls(cfg["url"]), shardshuffle=False, nodesplitter=None, empty_check=False)
        .repeat()
        .compose(stage)
    )
    return _data_loader(dataset, cfg)


def _datasets_loader(cfg: dict[str, Any]) -> Any:
    """Hugging Face `datasets` streaming, as its documentation reads Parquet and tokenizes: a batched map
    over the stream (``encode_batch`` for the BPE; the synthetic preprocess per document otherwise), then
    `pack` and batching, all inside the DataLoader's worker. Every rank reads every file (no
    ``split_dataset_by_node``: the ranks of a TP group need the same batches)."""
    import datasets
    from torch.utils.data import IterableDataset

    datasets.disable_progress_bars()
    stream = datasets.load_dataset("parquet", data_files=cfg["files"], split="train", streaming=True)
    stream = stream.select_columns([cfg["text_key"]])
    key = cfg["text_key"]
    if cfg["tokenizer"] is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(cfg["tokenizer"]) / "tokenizer.json"))

        def tokenize(rows: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {"ids": [e.ids for e in tokenizer.encode_batch(rows[key], add_special_tokens=False)]}
    else:
        work = WorkPreprocess(cfg["work_us"], key)

        def tokenize(rows: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {"ids": [work({key: text}) for text in rows[key]]}

    tokens = stream.map(tokenize, batched=True, remove_columns=[key])

    class Batches(IterableDataset):  # defined here: the DataLoader forks its workers, nothing is pickled
        def __iter__(self) -> Any:
            def docs() -> Any:
                while True:  # endless, as the tree's stream is: file order, epoch after epoch
                    for row in tokens:  # in a DataLoader worker, datasets gives it its share of the files
                        yield np.asarray(row["ids"], dtype=np.int32)

            return _batches(docs(), seq_len=cfg["seq_len"], batch=cfg["batch"], eos=cfg["eos"])

    return _data_loader(Batches(), cfg)


def _tree_loader(cfg: dict[str, Any], rank: int) -> Any:
    from megascale.data import Source, WebDataConfig, WebLoader

    # the BPE runs as the loader's own default preprocessing (tokenizer=DIR); the synthetic work as a hook
    synthetic = cfg["tokenizer"] is None
    config = WebDataConfig(
        sources=[Source(cfg["url"], text_key=cfg["text_key"])], seq_len=cfg["seq_len"], batch_size=cfg["batch"],
        tokenizer="bytes" if synthetic else cfg["tokenizer"], preprocess=_preprocess(cfg) if synthetic else None,
        shuffle=False, num_workers=cfg["workers"], prefetch=cfg["prefetch"], timeout=120,
    )  # fmt: skip
    return WebLoader(
        config, dp_rank=0, dp_size=1, tree=True, local_rank=rank, local_world_size=cfg["ranks"], node_rank=0,
        run_id=cfg["run_id"],
    )  # fmt: skip


def _rank_main(rank: int, cfg: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    loader = _tree_loader(cfg, rank) if cfg["loader"] == "tree" else None
    if loader is not None:
        batches = iter(loader)
    elif cfg["loader"] == "datasets":
        batches = _datasets_loader(cfg)
    else:
        batches = _plain_loader(cfg)
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


def _run_config(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks of one configuration, measure them, and return the figures."""
    # one core per loader worker in both loaders: `tokenizers` would otherwise spread the baseline's
    # encode_batch over every core from each rank's worker (the tree's per-document encode is single-threaded);
    # datasets offline, its cache in the run's temporary directory
    env = clean_env(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                    HF_HOME=cfg["hf_home"])  # fmt: skip
    cfg, started = {**cfg, "run_id": uuid.uuid4().hex[:12]}, time.perf_counter()
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

    def total(procs_: dict[int, Proc], role: str | None, attr: str) -> float:
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
        "config_s": time.perf_counter() - started,  # start-up and shutdown included
        "procs": [  # (name, CPU-s of the timed window, peak RSS MB) per process
            (p.name, p.cpu - (warm[pid].cpu if pid in warm else 0.0), p.hwm_kb / 1024)
            for pid, p in end.items()
        ],
    }


# --------------------------------------------------------------------------------------------- reporting


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


_BASELINES = {"plain": "plain", "datasets": "datasets streaming"}


def _label(r: dict[str, Any]) -> str:
    name = _BASELINES.get(r["loader"], r["loader"])
    return f"{name}, {r['workers']} worker{'s' if r['workers'] != 1 else ''}" + (
        " (node)" if r["loader"] == "tree" else " per rank"
    )


def _work(r: dict[str, Any]) -> str:
    return "BPE" if r["tokenizer"] else f"{r['work_us']:g} µs/doc"


def _cost_table(rows: list[dict[str, Any]], ranks: int) -> str:
    out = [
        f"| loader | preprocess | seq/s per rank | CPU-s loader | CPU-s all ({ranks} ranks incl.) | start-up "
        "CPU-s | peak RSS loader MB | peak RSS all MB | PSS loader MB | PSS all MB | same batches on all ranks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {_label(r)} | {_work(r)} | {r['seq_per_s']:.0f} | {r['cpu_loader']:.2f} | "
            f"{r['cpu_all']:.2f} | {r['cpu_startup']:.1f} | {r['rss_loader_mb']:.0f} | {r['rss_all_mb']:.0f} | "
            f"{r['pss_loader_mb']:.0f} | {r['pss_all_mb']:.0f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(out)


def _ratio(tree: dict[str, Any], base: dict[str, Any], key: str) -> str:
    # CPU times tick in 10 ms: a smoke run's window can read 0.00
    return f"{tree[key] / base[key]:.2f}x" if base[key] else "n/a"


def _ratios(base: dict[str, Any], tree: dict[str, Any]) -> str:
    def ratio(key: str) -> str:
        return _ratio(tree, base, key)

    return (
        f"{_work(base)}, tree/{base['loader']}: seq/s {ratio('seq_per_s')} (target ≥ 1.0x); "
        f"CPU-s loader {ratio('cpu_loader')}, all {ratio('cpu_all')} (target ≤ 0.35x); peak RSS loader "
        f"{ratio('rss_loader_mb')}, all {ratio('rss_all_mb')}; PSS loader {ratio('pss_loader_mb')}, all "
        f"{ratio('pss_all_mb')} (target ≤ 0.35x)"
    )


def _throughput(r: dict[str, Any]) -> dict[str, float]:
    """Tokens the loader produced per second of one worker: on the wall clock of the timed window, and per
    CPU-second of its worker processes (what one worker makes of a core to itself). The tree makes the node's
    tokens once; a per-rank loader makes them once per rank."""
    names = {READER_WORKER} if r["workers"] else {"tree reader"}
    if r["loader"] != "tree":
        names = {LOADER_WORKER} if r["workers"] else {"rank"}
    cpu = sum(c for name, c, _ in r["procs"] if name in names)
    copies = 1 if r["loader"] == "tree" else r["ranks"]
    workers = max(1, r["workers"]) * copies
    tokens = r["batches"] * r["batch"] * r["seq_len"] * copies
    wall = r["batches"] * r["batch"] / r["seq_per_s"]
    # CPU times tick in 10 ms: below 0.1 s (a smoke run) the ratio would be noise
    per_cpu = tokens / cpu if cpu >= 0.1 else None
    return {"tokens_per_s_per_worker": tokens / wall / workers, "tokens_per_cpu_s": per_cpu}


def _throughput_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| loader | preprocess | tokens/s per rank | tokens/s per worker (wall) | tokens per worker CPU-s |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        t = r["throughput"]
        out.append(
            f"| {_label(r)} | {_work(r)} | {r['seq_per_s'] * r['seq_len']:,.0f} | "
            f"{t['tokens_per_s_per_worker']:,.0f} | "
            + ("n/a" if t["tokens_per_cpu_s"] is None else f"{t['tokens_per_cpu_s']:,.0f}")
            + " |"
        )
    return "\n".join(out)


def _wait_table(rows: list[dict[str, Any]], prep_ms: float) -> str:
    out = [
        "| loader | preprocess | batch prep, 1 core ms | step ms | wait ms/step, steady (mean / worst rank) "
        "| longest wait ms, steady | seq/s per rank | CPU-s all |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {_label(r)} | {_work(r)} | {prep_ms:.1f} | {r['step_ms']:.1f} | "
            f"{r['wait_steady_ms']:.2f} / {r['wait_steady_max_ms']:.2f} | {r['wait_max_ms']:.1f} | "
            f"{r['seq_per_s']:.0f} | {r['cpu_all']:.2f} |"
        )
    return "\n".join(out)


def _keeps_up(r: dict[str, Any]) -> str:
    # a batch already in the ring still costs its copy (~0.5 ms at 8 × 2048): "keeps up" allows 10% of the step
    verdict = "keeps up" if r["wait_steady_ms"] <= 0.1 * r["step_ms"] else "does NOT keep up"
    return (
        f"{_label(r)} at a {r['step_ms']:.1f} ms step: {verdict} with {r['ranks']} ranks "
        f"(steady wait {r['wait_steady_ms']:.2f} ms/step, {r['wait_steady_ms'] / r['step_ms']:.0%} of the step)"
    )


def _main_table(rows: list[dict[str, Any]], seq_len: int, batch: int, step: dict[str, Any] | None) -> str:
    out = [
        f"| tokenizer | vocabulary | text bytes per token | CPU ms per main-job batch ({batch} × {seq_len}) "
        "| tokens per CPU-s |" + (" share of the main job's step |" if step else ""),
        "|---|---:|---:|---:|---:|" + ("---:|" if step else ""),
    ]
    for r in rows:
        share = f" {r['ms_per_batch'] / (step['step_s'] * 1e3):.3%} |" if step else ""
        out.append(
            f"| {r['tokenizer']} | {r['vocab']} | {r['bytes_per_token']:.2f} | {r['ms_per_batch']:.2f} | "
            f"{r['tokens_per_cpu_s']:,.0f} |{share}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="ranks on the node (one TP group, dp=1)")
    parser.add_argument("--format", choices=["tar", "parquet"], default="tar", help="the corpus's format")
    parser.add_argument("--shards", type=int, default=32, help="units: tar shards or Parquet row groups")
    parser.add_argument("--row-groups", type=int, default=4, help="row groups per Parquet file")
    parser.add_argument("--docs", type=int, default=200, help="documents per unit")
    parser.add_argument("--doc-chars", type=int, default=2000)
    parser.add_argument(
        "--text", choices=["random", "stdlib"], help="documents: random letters (default without "
        "--tokenizer) or the stdlib's source (default with it: the text the BPE was trained for)",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", help="a BPE directory (`megascale-data tokenizer --output DIR`), or 'bpe' to train "
        "one here: both loaders tokenize with it instead of bytes + --work-us",
    )  # fmt: skip
    parser.add_argument("--bpe-vocab", type=int, default=4096, help="vocabulary of --tokenizer bpe")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--prefetch", type=int, default=4, help="batches in flight (ring slots / DataLoader)")
    parser.add_argument("--work-us", type=float, nargs="+", default=[500.0], help="part 1: CPU µs per doc")
    parser.add_argument("--batches", type=int, default=600, help="timed batches per rank, part 1")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches per rank")
    parser.add_argument(
        "--plain-workers", type=int, default=1, help="DataLoader workers per rank (either baseline)"
    )
    parser.add_argument("--tree-workers", type=int, default=1, help="reader workers per node, part 1")
    parser.add_argument("--wait-work-us", type=float, default=4000.0, help="part 2: CPU µs per doc")
    parser.add_argument(
        "--wait-step-ratio", type=float, default=0.75, help="part 2: step / 1-core batch prep"
    )
    parser.add_argument("--wait-steps", type=int, default=120, help="timed steps per rank, part 2")
    parser.add_argument("--wait-easy-ratio", type=float, default=1.5, help="part 2: a step longer than prep")
    parser.add_argument(
        "--repeats", type=int, default=2, help="part 1: the baseline and tree take turns this often"
    )
    parser.add_argument("--skip-wait", action="store_true", help="no part 2")
    parser.add_argument(
        "--main-steps", type=int, default=0, help="part 3: also run the main job with the BPE for this "
        "many steps for its step time (4 processes; 0.5 s a step on 2 idle cores, up to ~10 s on loaded ones)",
    )  # fmt: skip
    parser.add_argument("--main-docs", type=int, help="part 3: tokenize only the first stdlib files")
    parser.add_argument("--sample-s", type=float, default=0.5, help="process sampling interval")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the ranks")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (the tests' smoke run)")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' other output")
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_config", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args._rank is not None:
        _rank_main(args._rank, json.loads(args._config))
        return
    if args.quick:  # seconds of work per configuration; the start-up of the ranks dominates
        args.shards, args.row_groups, args.docs, args.doc_chars = 4, 2, 12, 400
        args.seq_len, args.batch, args.batches, args.warmup, args.repeats = 128, 2, 8, 1, 1
        args.work_us, args.wait_work_us, args.wait_steps, args.sample_s = [50.0], 500.0, 6, 0.2
        args.main_docs = args.main_docs or 20
    baseline = "datasets" if args.format == "parquet" else "plain"
    for module, why in ((baseline == "datasets" and "datasets", "the Parquet baseline (Hugging Face datasets "
                         "streaming)"), (args.tokenizer and "tokenizers", "--tokenizer")):  # fmt: skip
        try:
            if module:
                __import__(module)
        except ImportError:
            raise SystemExit(f"{why} needs `{module}`: pip install {module}") from None
    text = args.text or ("stdlib" if args.tokenizer else "random")
    results: dict[str, Any] = {"settings": vars(args), "load_start": os.getloadavg()}
    print(f"{_load()} at the start", flush=True)

    with tempfile.TemporaryDirectory(prefix="megascale-data-bench-") as tmp:
        tokenizer, eos = None, EOS
        if args.tokenizer:
            from megascale.data.tokenize import load_tokenizer

            tokenizer, trained = bpe_tokenizer(
                args.tokenizer, tmp, args.bpe_vocab, max_bytes=500_000 if args.quick else None
            )
            eos, vocab = load_tokenizer(tokenizer).eos_id, load_tokenizer(tokenizer).vocab_size
            how = f"trained here in {trained:.1f} s" if args.tokenizer == "bpe" else "given"
            print(f"BPE tokenizer {tokenizer}: vocabulary {vocab}, eos id {eos} ({how})")
        t = time.perf_counter()
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        docs = documents(text, args.shards, args.docs, args.doc_chars)
        url, files, text_key = write_corpus(str(corpus), args.format, docs, args.row_groups)
        size = sum(f.stat().st_size for f in corpus.iterdir()) / 2**20
        units = "tar shards" if args.format == "tar" else f"Parquet row groups ({len(files)} files)"
        print(f"{args.shards} {units} × {args.docs} docs × {args.doc_chars} chars of {text} text ({size:.1f} MiB) "
              f"written in {time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs; {args.ranks} ranks, "
              f"tp={args.ranks}, dp=1; batch {args.batch} × {args.seq_len} tokens\n", flush=True)  # fmt: skip
        base = dict(url=url, files=files, text_key=text_key, tokenizer=tokenizer, eos=eos, hf_home=f"{tmp}/hf",
                    ranks=args.ranks, seq_len=args.seq_len, batch=args.batch, prefetch=args.prefetch,
                    warmup=args.warmup)  # fmt: skip

        pairs = []
        for repeat in range(args.repeats):
            for work in [0.0] if tokenizer else args.work_us:
                pair = {}
                for loader, workers in ((baseline, args.plain_workers), ("tree", args.tree_workers)):
                    cfg = dict(base, loader=loader, workers=workers, work_us=work, step_ms=0.0,
                               batches=args.batches)  # fmt: skip
                    pair[loader] = r = _run_config(cfg, args)
                    r["throughput"] = _throughput(r)
                    print(f"  run {repeat + 1}: {_label(cfg)}, {_work(cfg)}: {r['seq_per_s']:.0f} seq/s "
                          f"({r['config_s']:.0f} s); {_load()}", flush=True)  # fmt: skip
                pairs.append(pair)
        results["part1"] = pairs
        rows1 = [r for p in pairs for r in (p[baseline], p["tree"])]
        print(f"\n## Part 1: throughput and cost, no step ({args.batches} timed batches per rank after "
              f"{args.warmup} warm-up)\n")  # fmt: skip
        print(_cost_table(rows1, args.ranks))
        print()
        for p in pairs:
            print(_ratios(p[baseline], p["tree"]))
        print("\nreader throughput (tokens per second of one loader worker; the tree's serves all ranks):\n")
        print(_throughput_table(rows1))
        print("\nper process (timed-window CPU-s, peak RSS MB), first run:")
        for r in (pairs[0][baseline], pairs[0]["tree"]):
            print(
                f"  {_label(r)}: " + "; ".join(f"{n} {c:.2f} s {m:.0f} MB" for n, c, m in sorted(r["procs"]))
            )

        if not args.skip_wait:
            results["part2"] = _part2(args, base, baseline)
        if tokenizer:
            results["part3"] = _part3(args, tokenizer, vocab, tmp)
    results["load_end"] = os.getloadavg()
    print(f"\n{_load()} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")


def _part2(args: argparse.Namespace, base: dict[str, Any], baseline: str) -> dict[str, Any]:
    """The data wait at a simulated step: a multiple of the CPU time one process needs to prepare a batch."""
    work = 0.0 if base["tokenizer"] else args.wait_work_us
    prep = prep_time_per_batch(dict(base, work_us=work))
    what = "with the BPE" if base["tokenizer"] else f"at {work:g} µs/doc"
    print(f"\n## Part 2: data wait; one core needs {prep * 1e3:.1f} ms to prepare a batch {what}; the step is a "
          f"sleep ({args.wait_steps} timed steps per rank)\n", flush=True)  # fmt: skip
    rows = []
    for loader, workers, ratio in (
        ("tree", 1, args.wait_easy_ratio),
        ("tree", 1, args.wait_step_ratio),
        ("tree", 2, args.wait_step_ratio),
        (baseline, args.plain_workers, args.wait_step_ratio),
    ):
        cfg = dict(base, loader=loader, workers=workers, work_us=work, step_ms=ratio * prep * 1e3,
                   batches=args.wait_steps)  # fmt: skip
        rows.append(_run_config(cfg, args))
        print(f"  {_label(cfg)}, step {cfg['step_ms']:.1f} ms: wait {rows[-1]['wait_steady_ms']:.2f} ms/step "
              f"({rows[-1]['config_s']:.0f} s); {_load()}", flush=True)  # fmt: skip
    print()
    print(_wait_table(rows, prep * 1e3))
    print()
    for r in rows:
        print(_keeps_up(r))
    tree2, other = rows[2], rows[3]
    print(f"\nat the short step, tree (2 workers) / {baseline}: seq/s {_ratio(tree2, other, 'seq_per_s')}, "
          f"CPU-s all {_ratio(tree2, other, 'cpu_all')}")  # fmt: skip
    return {"prep_ms": prep * 1e3, "rows": rows, "keeps_up": [_keeps_up(r) for r in rows]}


def _part3(args: argparse.Namespace, tokenizer: str, vocab: int, tmp: str) -> dict[str, Any]:
    """The main job's side: tokenizing one of its batches with the BPE vs bytes, against its step time."""
    seq_len, batch = main_job_shape()
    print(f"\n## Part 3: tokenizing one main-job batch ({batch} × {seq_len} tokens, examples/configs/"
          "main_cpu.yaml) on its own text, the stdlib's training files, in one process\n", flush=True)  # fmt: skip
    rows = tokenize_cost(tokenizer, seq_len, batch, args.main_docs)
    step = None
    if args.main_steps:
        print(f"  running the main job with the BPE for {args.main_steps} steps ...; {_load()}", flush=True)
        step = main_job_step(args.main_steps, tokenizer, vocab, tmp, timeout=max(args.timeout, 1800))
        print(f"  main job (tp2 × pp2, 4 processes, vocabulary {vocab}): {step['step_s']:.2f} s per step (median "
              f"of {args.main_steps - 4}; {step['step_s_min']:.2f}–{step['step_s_max']:.2f}), "
              f"{step['wall_s']:.0f} s in all; {_load()}\n", flush=True)  # fmt: skip
    print(_main_table(rows, seq_len, batch, step))
    bpe = rows[-1]
    need = batch * seq_len / step["step_s"] if step else None
    if need:
        print(f"\nat this step the node's reader must supply {need:,.0f} tokens/s (tp2 × pp2, dp=1: one batch "
              f"per step); one worker tokenizes {bpe['tokens_per_cpu_s']:,.0f} per CPU-second with the BPE")  # fmt: skip
    return {"seq_len": seq_len, "batch": batch, "rows": rows, "main_step": step}


if __name__ == "__main__":
    main()
