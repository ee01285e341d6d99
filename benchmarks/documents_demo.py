"""The demo's validation loss with and without document masks, side by side (issue 34).

Trains the demo (``examples/configs/main_cpu.yaml``: tp2 × pp2 on 4 CPU processes, the Python standard library
as WebDataset shards, one file one document) twice from the same seed: with ``document_mask: true`` (its
setting: attention kept inside each file, positions restarting at each) and with it off for training and
validation (Megatron's pretraining packing). Each run validates as it trains; the table puts the two
validation losses of every validation step side by side, with the training steps' time. The checkpoints and
the sample of the demo are left out (nothing is resumed), so both runs start from nothing.

    python benchmarks/documents_demo.py                 # 200 steps each, ~8 minutes on 2 cores
    python benchmarks/documents_demo.py --steps 50      # a quick look
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"
STDLIB = ROOT / ".cache" / "megascale" / "stdlib"


def _config(masked: bool, steps: int, run_dir: Path) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    trainer = config["trainer"]
    trainer["max_steps"] = steps
    trainer["logger"]["init_args"]["save_dir"] = str(run_dir)
    trainer["callbacks"] = [c for c in trainer["callbacks"] if c["class_path"].endswith("SpeedMonitor")]
    for split in ("train", "val"):
        stream = config["data"]["init_args"][split]
        stream["document_mask"] = masked
        for source in stream["sources"]:
            source["urls"] = str(STDLIB / Path(source["urls"]).name)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _val_losses(run_dir: Path) -> dict[int, float]:
    (metrics,) = run_dir.glob("logs/version_*/metrics.csv")
    with metrics.open() as f:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if not any(STDLIB.glob("train-*.tar")):
        subprocess.run(
            [sys.executable, "-m", "megascale.data.cli", "stdlib", "--output", str(STDLIB)], check=True
        )
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    results: dict[bool, tuple[dict[int, float], float]] = {}
    with tempfile.TemporaryDirectory(prefix="documents-demo-") as tmp:
        for masked in (True, False):
            run_dir = Path(tmp) / ("masked" if masked else "causal")
            run_dir.mkdir()
            config = _config(masked, args.steps, run_dir)
            start = time.perf_counter()
            cli = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", str(config)]
            subprocess.run(cli, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            results[masked] = (_val_losses(run_dir), time.perf_counter() - start)
    (masked_losses, masked_s), (causal_losses, causal_s) = results[True], results[False]
    print(f"demo (examples/configs/main_cpu.yaml), {args.steps} steps, tp2 x pp2 on 4 CPU processes")
    print("| step | val loss, document masks | val loss, causal packing | difference |")
    print("|---|---|---|---|")
    for step in sorted(masked_losses.keys() & causal_losses.keys()):
        a, b = masked_losses[step], causal_losses[step]
        print(f"| {step} | {a:.4f} | {b:.4f} | {a - b:+.4f} |")
    print(f"| wall time | {masked_s:.0f} s | {causal_s:.0f} s | {masked_s / causal_s:.2f}x |")


if __name__ == "__main__":
    main()
