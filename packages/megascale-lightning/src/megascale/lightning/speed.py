# SpeedMonitor: Lightning's ThroughputMonitor with what a pretraining run wants to read, on any device.
#
# Lightning's ThroughputMonitor (pytorch/callbacks/throughput_monitor.py) does the timing and the rolling
# rates (fabric/utilities/throughput.py `Throughput`); this subclass changes three things:
# - MFU everywhere: Lightning takes one device's peak FLOP/s from a table of GPUs and reports no MFU elsewhere
#   (CPUs, unknown GPUs). `peak_flops` gives the peak, or "measure" times a large matmul in the run's compute
#   dtype on the device at setup. On a CPU that measured figure is the only honest peak there is (vendors
#   publish none per process), so MFU there means "model FLOPs / what this process's matmul reaches".
# - Global rates counted once per token: Throughput multiplies a device's samples/items per second by the
#   world size, which counts every sample once per model-parallel device under tp × pp. Global samples,
#   batches and items (tokens) per second here are the device's × the data-parallel size. FLOPs and MFU are
#   per device already (GPTModule.flops_per_batch is per device), so they are left as Lightning computes them.
# - The progress bar shows `tokens/s` (global) and `mfu`, refreshed whenever the rates are logged.
# Defaults: GPTModule's batch_size_fn/length_fn (so items are tokens) and a 10-batch window (Lightning's 100
# means no rate at all in the first 100 steps of a short run).

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from megascale.lightning.data import data_parallel_layout
from megascale.lightning.module import batch_size_fn as gpt_batch_size_fn
from megascale.lightning.module import length_fn as gpt_length_fn

__all__ = ["SpeedMonitor", "compute_dtype", "measure_peak_flops"]


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning ``precision`` setting ("bf16-mixed", "16-true", "32", ...)."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of square matmuls in ``dtype`` on ``device``, timed for about ``seconds`` after a warm-up.

    Large enough to be compute bound (n = 8192 on GPUs, 1024 on CPUs); the best of several timed rounds.
    """
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm-up: kernel selection, allocation
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        sync()
        best = max(best, 3 * 2 * n**3 / (time.perf_counter() - start))
    return best


class SpeedMonitor(ThroughputMonitor):
    """Tokens/s and MFU in the logs and the progress bar, under any strategy and on any device.

    Lightning's ``ThroughputMonitor`` (all its ``train/…`` and ``validate/…`` keys are logged) with MFU where
    Lightning knows no peak (CPUs, unlisted GPUs), global rates that count each token once under tensor and
    pipeline parallelism, and ``tokens/s`` and ``mfu`` in the progress bar. The module must set
    ``flops_per_batch`` per device (GPTModule does).

    Args:
        peak_flops: one device's peak FLOP/s in the run's compute dtype, for MFU: a number (e.g. ``989e12``
            for an H100 SXM in bf16), ``"measure"`` (time a large matmul on the device when the fit starts:
            the achievable peak, which is what MFU on a CPU can mean), or None (Lightning's table of GPU
            peaks; no MFU on a device it does not list).
        window_size: batches the rolling rates average over.
        progress_bar: show ``tokens/s`` and ``mfu`` in the progress bar.
        batch_size_fn: samples in a batch (default: GPTModule batches).
        length_fn: tokens in a batch (default: GPTModule batches), so that items/s are tokens/s.
    """

    def __init__(
        self,
        peak_flops: float | Literal["measure"] | None = None,
        window_size: int = 10,
        progress_bar: bool = True,
        batch_size_fn: Callable[[Any], int] = gpt_batch_size_fn,
        length_fn: Callable[[Any], int] | None = gpt_length_fn,
    ) -> None:
        if isinstance(peak_flops, str) and peak_flops != "measure":
            raise ValueError(f"peak_flops={peak_flops!r}: give FLOP/s as a number, 'measure', or None")
        if isinstance(peak_flops, (int, float)) and peak_flops <= 0:
            raise ValueError(f"peak_flops={peak_flops} must be > 0 FLOP/s")
        if window_size < 2:
            raise ValueError(
                f"window_size={window_size} must be >= 2 (rates are differences over the window)"
            )
        super().__init__(batch_size_fn=batch_size_fn, length_fn=length_fn, window_size=window_size)
        self.peak_flops = peak_flops
        self.progress_bar = progress_bar
        self._dp_size = 1
        self._bar: dict[str, float] = {}
        self._measured: float | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._dp_size = data_parallel_layout(trainer)[0]
        peak = self.peak_flops
        if peak == "measure":
            if self._measured is None:  # once per callback: setup runs again for each later stage
                self._measured = self._measure(trainer)
            peak = self._measured
        if peak is not None:
            self.available_flops = int(peak)
            for throughput in self._throughputs.values():
                throughput.available_flops = int(peak)

    @rank_zero_only
    def _measure(self, trainer: Trainer) -> float:
        # only rank 0 reports rates (ThroughputMonitor's hooks are rank-zero-only): only it needs the peak
        device = trainer.strategy.root_device
        dtype = compute_dtype(trainer.precision)
        peak = measure_peak_flops(device, dtype)
        rank_zero_info(
            f"SpeedMonitor: measured peak {peak / 1e9:.1f} GFLOP/s ({dtype}, {torch.get_num_threads()} threads)"
            f" on {device}; MFU is relative to it"
        )
        return peak

    def _compute(self, trainer: Trainer, iter_num: int | None = None) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        assert stage is not None
        throughput = self._throughputs[stage]
        metrics = throughput.compute()
        sep = throughput.separator
        # count each sample once: a data-parallel replica's rate × the data-parallel size (not × world size)
        for name in ("batches_per_sec", "samples_per_sec", "items_per_sec"):
            per_device = metrics.get(f"device{sep}{name}")
            if per_device is not None and trainer.world_size > 1:
                metrics[name] = per_device * self._dp_size
        prefixed = {f"{stage.value}{sep}{k}": v for k, v in metrics.items()}
        trainer._logger_connector.log_metrics(prefixed, step=iter_num)  # type: ignore[arg-type]
        if stage.value == "train":
            tokens = metrics.get(f"device{sep}items_per_sec")
            if tokens is not None:
                self._bar["tokens/s"] = tokens * self._dp_size
            mfu = metrics.get(f"device{sep}mfu")
            if mfu is not None:
                self._bar["mfu"] = mfu

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        if self.progress_bar:
            for name, value in self._bar.items():
                # rank_zero_only: only rank 0 logs it (as these hooks run on rank 0 only); not sent to loggers
                pl_module.log(name, value, prog_bar=True, logger=False, rank_zero_only=True)
