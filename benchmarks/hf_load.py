"""Benchmark loading a Hugging Face checkpoint into a split GPT: per-rank slices vs every rank reading it whole.

A Llama-shaped GPT (default d_model 1024, 8 layers, GQA 16/8 heads, SwiGLU 2816, vocabulary 32000, untied:
160M parameters, 610 MiB in fp32) is written as a Hugging Face directory (``save_hf``), then loaded on
--world gloo ranks in the layout given (default tp2 × pp2), each method in fresh processes:

    slices     what megascale does: the GPT built on the meta device, ``GPT.weights_source = HFWeights(DIR)``,
               ``parallelize`` (tensor/pipeline split, then ``init_weights`` reads each rank's slices)
    baseline   what a user would otherwise write: every rank loads the whole checkpoint
               (``gpt_from_hf(DIR)``: its whole state dict, as a model), then ``parallelize`` splits it

Per rank: bytes handed out by the safetensors files (a wrapper of ``safe_open`` counts every tensor and slice
read), the peak resident memory of the load above the process's resident memory before it (VmHWM after resetting
it, file pages mapped by safetensors included), and the wall time. Both methods must give the same loss of one
batch (checked). Ranks run one torch thread each.

    python benchmarks/hf_load.py                         # ~1 minute on 2 cores (RESULTS.md)
    python benchmarks/hf_load.py --tp 2 --pp 1 --world 2 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.core import GPT, GPTConfig
from megascale.core.hf import HFWeights, gpt_from_hf, save_hf
from megascale.core.parallel import ParallelPlan, parallelize

METHODS = ("slices", "baseline")


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, d_model=args.width, n_layers=args.layers, n_heads=16, n_kv_heads=8,
                     ffn_hidden=args.ffn, max_seq_len=256, parallel_block=False, norm="rmsnorm",
                     activation="swiglu", tie_embeddings=False)  # fmt: skip


def _status_mib(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**10  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    # "5" resets the peak resident set size (Linux >= 4.0), so the peak measured is the load's, not that of
    # the imports before it
    Path("/proc/self/clear_refs").write_text("5")


class _CountingFile:
    """A safetensors file whose every tensor and slice handed out is counted (``read[0]``, bytes)."""

    def __init__(self, inner: Any, read: list[int]) -> None:
        self._inner, self._read = inner, read

    def keys(self) -> Any:
        return self._inner.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        out = self._inner.get_tensor(name)
        self._read[0] += out.numel() * out.element_size()
        return out

    def get_slice(self, name: str) -> Any:
        inner, read = self._inner.get_slice(name), self._read

        class Slice:
            get_shape, get_dtype = inner.get_shape, inner.get_dtype

            def __getitem__(self, index: Any) -> torch.Tensor:
                out = inner[index]
                read[0] += out.numel() * out.element_size()
                return out

        return Slice()


def _rank(rank: int, world: int, args: argparse.Namespace, method: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    plan = ParallelPlan(tp=args.tp, pp=args.pp)
    mesh = plan.dims(world).build_mesh("cpu")
    # what both methods import on first use (pipelining, DTensor, FSDP: ~120 MiB) is imported before measuring
    import megascale.core.hf.load
    import megascale.core.parallel.pp.apply
    import megascale.core.parallel.tp.apply  # noqa: F401

    read = [0]
    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _CountingFile(real(*a, **k), read)  # type: ignore[assignment]
    dist.barrier()
    _reset_peak_rss()
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    if method == "slices":
        with torch.device("meta"):
            model = GPT(_config(args))
        model.weights_source = HFWeights(args.dir)
    else:
        model = gpt_from_hf(args.dir)
    runtime = parallelize(model, plan, mesh, device="cpu")
    seconds = time.perf_counter() - start
    peak = _status_mib("VmHWM") - before
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()) * 4
    tokens = torch.randint(0, args.vocab, (2 * args.pp, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = float(model(tokens[:, :-1], tokens[:, 1:]))
    runtime.zero.remove()
    Path(f"{out}.{rank}").write_text(
        json.dumps({"read": read[0], "peak_mib": peak, "seconds": seconds, "held": held, "loss": loss})
    )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tmp", default=None, help="where the checkpoint is written (default: $TMPDIR)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(dir=args.tmp) as work:
        args.dir = str(Path(work) / "hf")
        torch.manual_seed(0)
        model = GPT(_config(args))
        files = save_hf(model, None, args.dir, "llama")
        size = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
        params = model.num_parameters()
        del model
        print(f"# checkpoint: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB of safetensors (fp32); "
              f"layout tp={args.tp} × pp={args.pp} × dp={args.world // (args.tp * args.pp)} on {args.world} "
              "gloo ranks")  # fmt: skip
        results: dict[str, list[dict[str, float]]] = {}
        for method in METHODS:
            out = str(Path(work) / f"result-{method}")
            store = str(Path(work) / f"store-{method}")
            mp.start_processes(_rank, args=(args.world, args, method, store, out), nprocs=args.world,
                               start_method="spawn", join=True)  # fmt: skip
            results[method] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.world)]
        print(f"{'method':<10} {'rank':>4} {'read MiB':>9} {'of ckpt':>8} {'holds MiB':>9} {'peak RSS +MiB':>13} "
              f"{'seconds':>8} {'loss':>9}")  # fmt: skip
        for method, ranks in results.items():
            for r, res in enumerate(ranks):
                print(f"{method:<10} {r:>4} {res['read'] / 2**20:>9.1f} {res['read'] / size:>8.2f} "
                      f"{res['held'] / 2**20:>9.1f} {res['peak_mib']:>13.0f} {res['seconds']:>8.2f} "
                      f"{res['loss']:>9.5f}")  # fmt: skip
        ours, theirs = results["slices"], results["baseline"]
        losses = {round(r["loss"], 4) for m in results.values() for r in m}
        assert len(losses) == 1, f"the methods load different weights: losses {losses}"
        worst = max(range(args.world), key=lambda r: ours[r]["peak_mib"])
        print(
            f"\nslices vs baseline, per rank: bytes read {max(r['read'] for r in ours) / size:.2f}x vs "
            f"{max(r['read'] for r in theirs) / size:.2f}x the checkpoint (ratio "
            f"{max(r['read'] for r in ours) / max(r['read'] for r in theirs):.2f}); peak RSS of the load "
            f"{max(r['peak_mib'] for r in ours):.0f} MiB vs {max(r['peak_mib'] for r in theirs):.0f} MiB (ratio "
            f"{max(r['peak_mib'] for r in ours) / max(r['peak_mib'] for r in theirs):.2f}, worst rank {worst}); "
            f"time {max(r['seconds'] for r in ours):.2f} s vs {max(r['seconds'] for r in theirs):.2f} s"
        )


if __name__ == "__main__":
    main()
