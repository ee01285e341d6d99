"""Helpers of `benchmarks/data.py` that are not the comparison itself: measuring process trees, writing the
corpus (tar or Parquet, random or stdlib text), getting a BPE tokenizer, and the main job's side (the CPU
cost of tokenizing one of its batches, its step time).

No torch at the top, like `benchmarks/data.py`: the tree reader's workers import that module to unpickle its
preprocess, and this one with it.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAIN_CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without distributed variables, one thread per process, the repository
    root on PYTHONPATH (the ranks and the tree reader import ``benchmarks.data``), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("TORCHELASTIC")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


# --------------------------------------------------------------------------------------------- processes

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


READER_WORKER = "reader worker (spawn)"
LOADER_WORKER = "DataLoader worker (fork of its rank)"


def _name(pid: int, role: str) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "?"
    for pattern, name in (
        ("megascale.data.reader", "tree reader"),
        ("resource_tracker", "multiprocessing resource tracker"),
        ("spawn_main", READER_WORKER),
        ("--_rank", "rank" if role == "rank" else LOADER_WORKER),
    ):
        if pattern in cmd:
            return name
    return cmd.replace("\0", " ")[:60]


@dataclass
class Proc:
    role: str  # "rank" or "loader"
    name: str
    cpu: float = 0.0
    hwm_kb: int = 0
    pss_kb: int = 0


class Monitor:
    """Samples the process trees under the rank pids: CPU time, peak RSS (VmHWM) and the largest PSS."""

    def __init__(self, ranks: list[int], interval: float) -> None:
        self.ranks, self.interval = ranks, interval
        self.procs: dict[int, Proc] = {}
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

    def sample(self, pss: bool = False) -> dict[int, Proc]:
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
                    proc = self.procs[pid] = Proc(role, _name(pid, role))
                proc.cpu = st[1]
                proc.hwm_kb = _kb(f"/proc/{pid}/status", "VmHWM:") or proc.hwm_kb
                if pss:
                    proc.pss_kb = max(proc.pss_kb, _kb(f"/proc/{pid}/smaps_rollup", "Pss:") or 0)
            return {pid: Proc(**vars(p)) for pid, p in self.procs.items()}


# --------------------------------------------------------------------------------------------- the corpus


def stdlib_texts() -> Iterator[str]:
    """The stdlib's training files (validation files left out, as the shards and the BPE's training do)."""
    import sysconfig

    from megascale.data.stdlib import _held_out, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        if not _held_out(path.relative_to(root).as_posix(), 5.0):
            yield path.read_text(encoding="utf-8", errors="replace")


def _stdlib_chunks(doc_chars: int) -> Iterator[str]:
    """Endless documents of about ``doc_chars`` characters cut from the stdlib at line ends (cycling)."""
    while True:
        for text in stdlib_texts():
            chunk, size = [], 0
            for line in text.splitlines(keepends=True):
                chunk.append(line)
                size += len(line)
                if size >= doc_chars:
                    yield "".join(chunk)
                    chunk, size = [], 0


def documents(text: str, units: int, docs_per_unit: int, doc_chars: int) -> list[list[str]]:
    """``units`` lists of ``docs_per_unit`` documents: "random" (lowercase letters and spaces, the original
    benchmark's) or "stdlib" (Python source, the main job's data: what a BPE trained on the stdlib sees)."""
    if text == "random":
        from tests.data._shards import make_doc

        return [[make_doc(u, d, doc_chars=doc_chars) for d in range(docs_per_unit)] for u in range(units)]
    chunks = _stdlib_chunks(doc_chars)
    return [[next(chunks) for _ in range(docs_per_unit)] for _ in range(units)]


def write_corpus(target: str, fmt: str, docs: list[list[str]], row_groups: int) -> tuple[str, list[str], str]:
    """Write ``docs`` (one list per unit) as tar shards (a unit each) or Parquet files (``row_groups`` units
    each, a ``text`` column); returns the pattern a `Source` reads, the files, and the text key."""
    from tests.data._shards import write_tar

    if fmt == "tar":
        files, n = [], 0
        for i, unit in enumerate(docs):
            files.append(f"{target}/part-{i:06d}.tar")
            write_tar(files[-1], [(f"{n + j:09d}.txt", d.encode()) for j, d in enumerate(unit)])
            n += len(unit)
        return f"{target}/part-{{000000..{len(files) - 1:06d}}}.tar", files, "txt"
    import pyarrow as pa
    import pyarrow.parquet as pq

    if len(docs) % row_groups:
        raise SystemExit(f"--shards {len(docs)} must be a multiple of --row-groups {row_groups}")
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    files, n = [], 0
    for i in range(len(docs) // row_groups):
        files.append(f"{target}/part-{i:06d}.parquet")
        with pq.ParquetWriter(files[-1], schema) as writer:
            for unit in docs[i * row_groups : (i + 1) * row_groups]:  # one write_table, one row group
                writer.write_table(pa.table({"id": range(n, n + len(unit)), "text": unit}, schema=schema))
                n += len(unit)
    return f"{target}/part-*.parquet", files, "text"


# --------------------------------------------------------------------------------------------- tokenizer


def bpe_tokenizer(spec: str, tmp: str, vocab_size: int, max_bytes: int | None) -> tuple[str, float]:
    """The directory of a BPE tokenizer and the seconds spent training it: ``spec`` itself, or, for
    ``"bpe"``, one trained here on the stdlib's training files (``megascale-data tokenizer``'s function)."""
    if spec != "bpe":
        return spec, 0.0
    from megascale.data.bpe import train_stdlib_bpe

    start = time.perf_counter()
    out = train_stdlib_bpe(Path(tmp) / "bpe", vocab_size=vocab_size, max_bytes=max_bytes)
    return str(out), time.perf_counter() - start


# --------------------------------------------------------------------------------------------- main job


def main_job_shape(config: Path = MAIN_CONFIG) -> tuple[int, int]:
    """(seq_len, batch_size) of the main job's training data."""
    import yaml

    train = yaml.safe_load(config.read_text())["data"]["init_args"]["train"]
    return int(train["seq_len"]), int(train["batch_size"])


def tokenize_cost(tokenizer_dir: str, seq_len: int, batch: int, max_docs: int | None) -> list[dict[str, Any]]:
    """CPU seconds to turn the main job's documents (the stdlib's training files, one per document, as
    UTF-8 bytes the way its shards hold them) into one batch of ``batch`` windows of ``seq_len`` + 1 tokens:
    the reader worker's per-sample work (decode, tokenize) and packing, with the byte tokenizer and the BPE.
    """
    from megascale.data.packing import TextPreprocess, pack
    from megascale.data.tokenize import ByteTokenizer, load_tokenizer

    raw = [t.encode() for t in stdlib_texts()][:max_docs]
    rows = []
    for name, tokenizer in (("bytes", ByteTokenizer()), ("BPE", load_tokenizer(tokenizer_dir))):
        preprocess = TextPreprocess(tokenizer)
        start = time.process_time()  # this thread's and process's CPU: the tokenizer's own threads too
        windows = sum(1 for _ in pack((preprocess({"txt": r}) for r in raw), seq_len, tokenizer.eos_id))
        cpu = time.process_time() - start
        rows.append({
            "tokenizer": name, "vocab": tokenizer.vocab_size, "windows": windows,
            "bytes_per_token": sum(map(len, raw)) / (windows * seq_len),
            "ms_per_batch": 1e3 * cpu / windows * batch, "tokens_per_cpu_s": windows * seq_len / cpu,
        })  # fmt: skip
    return rows


def main_job_step(
    steps: int, tokenizer_dir: str, vocab_size: int, tmp: str, timeout: float
) -> dict[str, Any]:
    """Run the main job (examples/configs/main_cpu.yaml: tp2 × pp2 on 4 CPU processes) for ``steps`` steps
    with the BPE overrides its header documents, on stdlib shards built in ``tmp``; only the length, paths,
    logging and callbacks (no checkpoints) are changed. Returns its step times, from the ``train/time``
    SpeedMonitor logs at every step (the first 3 steps left out as warm-up)."""
    import yaml

    from megascale.data import build_stdlib_shards

    shards = build_stdlib_shards(Path(tmp) / "stdlib")
    data = yaml.safe_load(MAIN_CONFIG.read_text())["data"]  # all of it: a second --config replaces lists
    data["init_args"]["train"]["sources"] = [{"urls": shards.train}]
    data["init_args"]["val"]["sources"] = [{"urls": shards.val}]
    data["init_args"]["val_batches"] = 1
    logs = Path(tmp) / "main-logs"
    override = {
        "trainer": {
            "max_steps": steps, "log_every_n_steps": 1, "val_check_interval": 10**6,
            "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(logs), "name": "main"}},
            "callbacks": [{"class_path": "megascale.lightning.SpeedMonitor",
                           "init_args": {"peak_flops": "measure"}}],
        },
        "data": data,
    }  # fmt: skip
    path = Path(tmp) / "main-override.yaml"
    path.write_text(json.dumps(override))  # YAML is a superset of JSON
    command = [
        sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", str(MAIN_CONFIG), "--config", str(path),
        *bpe_overrides(tokenizer_dir, vocab_size),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the main job failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    rows = csv.DictReader((logs / "main" / "version_0" / "metrics.csv").read_text().splitlines())
    times = sorted((int(r["step"]), float(r["train/time"])) for r in rows if r.get("train/time"))
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(times)][3:]
    if not gaps:
        raise RuntimeError(f"the main job logged too few steps for a step time: {times}")
    return {"steps": steps, "step_s": statistics.median(gaps), "step_s_min": min(gaps),
            "step_s_max": max(gaps), "wall_s": wall}  # fmt: skip


def bpe_overrides(tokenizer_dir: str, vocab_size: int) -> list[str]:
    """The command-line overrides that switch the main job to a BPE vocabulary (main_cpu.yaml's header)."""
    return [
        "--data.init_args.train.tokenizer", tokenizer_dir,
        "--data.init_args.val.tokenizer", tokenizer_dir,
        "--model.config.vocab_size", str(vocab_size),
    ]  # fmt: skip
