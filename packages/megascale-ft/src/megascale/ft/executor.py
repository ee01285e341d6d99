"""The rank's side of fault tolerance (MegaScale calls a training process an executor).

Under ``megascale-ft launch`` the launcher passes, through the environment, where its heartbeat server is,
the token, the attempt number and the timeouts; `Executor.from_env` reads them. Outside the launcher the
executor is inert (no thread, no network), so the same training script runs both ways::

    with Executor.from_env() as executor:          # reports "error" with the exception if the body raises
        for step in range(start, steps):
            with executor.timer.step(step):
                loss = train_step(...)
            executor.step_done(step, loss.item())  # a NaN/inf loss is reported, then raises
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
import traceback
from datetime import timedelta
from types import TracebackType

from megascale.ft.config import Timeouts
from megascale.ft.heartbeat import Heartbeat, HeartbeatSender
from megascale.ft.timing import StepTimer

__all__ = ["ENV", "Executor", "NonFiniteLossError"]

# What the launcher tells its ranks (and nothing else: parallel layout comes from torchrun's own variables).
ENV = {
    "url": "MEGASCALE_FT_URL",
    "token": "MEGASCALE_FT_TOKEN",
    "attempt": "MEGASCALE_FT_ATTEMPT",
    "heartbeat_interval": "MEGASCALE_FT_HEARTBEAT_INTERVAL",
    "hang_timeout": "MEGASCALE_FT_HANG_TIMEOUT",
    "cafile": "MEGASCALE_FT_CAFILE",
    "collective_timeout": "MEGASCALE_FT_COLLECTIVE_TIMEOUT",
    "node": "MEGASCALE_FT_NODE",  # the node agent's name (multi-node launches): faults name the node
}


class NonFiniteLossError(FloatingPointError):
    """The loss was NaN or infinite; the driver has been told and restarts from the last good checkpoint."""


def _device_memory() -> int:
    """Bytes on the device (CUDA allocated) or, on CPU, this process's peak resident set."""
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Executor:
    """Heartbeats, anomaly reports and step timings of one rank.

    Args:
        rank: global rank.
        url: the driver's heartbeat server, or None for an inert executor.
        token: the shared secret.
        timeouts: the job's `Timeouts` (its ``collective_timeout`` is what to give ``init_process_group``).
        attempt: 0 for the first start, n after the n-th restart.
        cafile: the certificate an ``https`` driver is verified against (the launcher's TLS setting).
    """

    def __init__(
        self,
        rank: int = 0,
        url: str | None = None,
        token: str = "",
        timeouts: Timeouts | None = None,
        attempt: int = 0,
        cafile: str | None = None,
    ) -> None:
        self.rank, self.url, self.attempt = rank, url, attempt
        self.timeouts = timeouts or Timeouts()
        self.timer = StepTimer(rank=rank)
        self._lock = threading.Lock()
        self._beat = Heartbeat(rank=rank, attempt=attempt, node=os.environ.get(ENV["node"]) or None)
        self._sender = None
        if url is not None:
            self._sender = HeartbeatSender(
                url, token, self.timeouts.heartbeat_interval, self._snapshot, cafile=cafile
            )

    @classmethod
    def from_env(cls) -> Executor:
        """The executor the launcher configured, or an inert one when not launched by ``megascale-ft``."""
        rank = int(os.environ.get("RANK", "0"))
        url = os.environ.get(ENV["url"])
        if not url:
            return cls(rank=rank)
        defaults = Timeouts()
        hang_timeout = float(os.environ.get(ENV["hang_timeout"], defaults.hang_timeout))
        timeouts = Timeouts(
            heartbeat_interval=float(os.environ.get(ENV["heartbeat_interval"], defaults.heartbeat_interval)),
            hang_timeout=hang_timeout,
            collective_timeout=float(os.environ.get(ENV["collective_timeout"], defaults.collective_timeout)),
            startup_timeout=max(
                defaults.startup_timeout, hang_timeout
            ),  # the driver's concern, not the rank's
        )
        token = os.environ.get(ENV["token"], "")
        from megascale.ft.stacks import arm_stack_dump

        arm_stack_dump(rank)  # the driver asks for every rank's stacks before it kills a hung job
        return cls(rank, url, token, timeouts, int(os.environ.get(ENV["attempt"], "0")),
                   cafile=os.environ.get(ENV["cafile"]))  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self._sender is not None

    @property
    def collective_timeout(self) -> timedelta:
        """Give this to ``init_process_group(timeout=...)``: it sits above the driver's hang timeout."""
        return timedelta(seconds=self.timeouts.collective_timeout)

    def _snapshot(self) -> Heartbeat:
        with self._lock:
            beat = Heartbeat(**{**self._beat.__dict__, "events": self.timer.drain()})
        beat.device_memory = _device_memory()
        return beat

    def start(self) -> Executor:
        """Send the first heartbeat and keep sending in the background."""
        if self._sender is not None:
            self._sender.send_now()
            self._sender.start()
        return self

    def step_done(self, step: int, loss: float | None = None) -> None:
        """Record a finished step. A non-finite ``loss`` is reported to the driver at once, then raises
        `NonFiniteLossError` (continuing would only spread NaNs into the weights and the next checkpoint)."""
        with self._lock:
            self._beat.step = step
            self._beat.loss = None if loss is None or not math.isfinite(loss) else float(loss)
            self._beat.last_step_time = self.timer.last_step_time
        if loss is not None and not math.isfinite(loss):
            message = f"loss is {loss} at step {step}"
            self._report("nan", message)
            raise NonFiniteLossError(
                f"rank {self.rank}: {message}; the driver restarts from the last good checkpoint"
            )

    def set_coords(self, coords: dict[str, int]) -> None:
        """This rank's parallel coordinates (``{"dp": .., "pp": .., "tp": ..}``), sent with the heartbeats:
        the driver's timeline groups its rows by them."""
        with self._lock:
            self._beat.coords = {str(k): int(v) for k, v in coords.items()}

    def touch(self) -> None:
        """Show progress outside training steps (call it per validation batch, or while loading): without
        it, work longer than the hang timeout between two steps looks like a hang to the driver."""
        with self._lock:
            self._beat.progress += 1

    def _report(self, status: str, message: str) -> None:
        with self._lock:
            self._beat.status, self._beat.message = status, message
        if self._sender is not None:
            self._sender.send_now()

    def report_exception(self, error: BaseException) -> None:
        """Tell the driver this rank failed, and why (the last line of the traceback and its location)."""
        if isinstance(error, NonFiniteLossError):
            return  # already reported as "nan"
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        self._report("error", f"{type(error).__name__}: {error}{where}")

    def finishing(self) -> None:
        """The last training step is done: what follows (the final checkpoint's commit, a sample, teardown)
        may take longer than the hang timeout without progress; the driver allows it ``startup_timeout``."""
        self._report("finishing", "")

    def finish(self) -> None:
        """Report a clean end and stop the heartbeats."""
        self._report("finished", "")
        self.close()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.stop()

    def __enter__(self) -> Executor:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is None:
            self.finish()
            return
        if not isinstance(error, KeyboardInterrupt | SystemExit):
            self.report_exception(error)
        self.close()
