"""Kernel registry: one entry per kernel, several interchangeable backends, one choice per device type.

A backend is a function with the kernel's signature plus a check that says why it cannot run here (or None).
The choice is made once per (kernel, device type, forced name), logged with the reasons the faster backends
were skipped, and can be forced three ways, strongest first: a ``backend=`` argument (what
``GPTConfig.kernels`` passes), the environment variable ``MEGASCALE_KERNELS``
("rms_norm=triton,attention=sdpa", or a bare name such as "torch" applied to every kernel that has it), or
nothing (fastest available). The ``torch`` backend of every kernel is the reference the others are tested
against, and it always runs.

Two checks per backend, because "can run" and "should be picked" differ on some devices:
``unavailable(device)`` says why automatic selection skips the backend; ``unavailable_if_forced(device)``
(default: the same check) says why even a forced request must fail. A backend that works on a device but is
no choice there, such as a Triton kernel on the CPU (correct only through the slow interpreter, meant for
tests), gives a looser second check: automatic selection passes it by, ``backend="triton"`` still gets it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Backend",
    "Check",
    "Kernel",
    "KernelUnavailableError",
    "describe",
    "get_kernel",
    "kernels",
    "reset",
]

log = logging.getLogger("megascale.core.kernels")

ENV_VAR = "MEGASCALE_KERNELS"
REFERENCE = "torch"


class KernelUnavailableError(RuntimeError):
    """A backend was forced that cannot run on this machine or for these inputs."""


Check = Callable[[torch.device], str | None]
"""Why a backend cannot be used on a device, or None when it can."""


def _always(_device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., Any]
    unavailable: Check = _always
    """Why automatic selection skips this backend on ``device`` (None when it may pick it)."""
    unavailable_if_forced: Check | None = None
    """Why this backend cannot run on ``device`` even when forced; None: the same check as ``unavailable``."""

    def forced_reason(self, device: torch.device) -> str | None:
        check = self.unavailable if self.unavailable_if_forced is None else self.unavailable_if_forced
        return check(device)


@dataclass
class Kernel:
    """A named operation with backends in order of preference; call it like the function it stands for."""

    name: str
    backends: list[Backend] = field(default_factory=list)
    _chosen: dict[tuple[str, str | None], Backend] = field(default_factory=dict, repr=False)

    def register(
        self, name: str, unavailable: Check = _always, *, unavailable_if_forced: Check | None = None
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator adding a backend; backends registered first are preferred. See the module docstring for
        the two checks."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if any(b.name == name for b in self.backends):
                raise ValueError(f"kernel {self.name!r} already has a backend {name!r}")
            self.backends.append(Backend(name, fn, unavailable, unavailable_if_forced))
            return fn

        return add

    def backend_names(self) -> list[str]:
        return [b.name for b in self.backends]

    def select(self, device: torch.device | str, backend: str | None = None) -> Backend:
        """The backend that runs on ``device``: the forced one, else the first available. Cached."""
        device = torch.device(device)
        forced, source = (backend, "backend= argument") if backend else _forced_by_env(self)
        key = (device.type, forced)
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen
        if forced is not None:
            by_name = {b.name: b for b in self.backends}
            if forced not in by_name:
                raise KernelUnavailableError(
                    f"kernel {self.name!r} has no backend {forced!r} (asked by {source}); "
                    f"choose one of {self.backend_names()}"
                )
            chosen = by_name[forced]
            reason = chosen.forced_reason(device)
            if reason is not None:
                raise KernelUnavailableError(
                    f"kernel {self.name!r}: backend {forced!r} (asked by {source}) cannot run on "
                    f"{device.type}: {reason}. Remove the request or choose one of {self.backend_names()}."
                )
            log.info("megascale kernel %s on %s: %s (forced by %s)", self.name, device.type, forced, source)
        else:
            skipped = []
            for candidate in self.backends:
                reason = candidate.unavailable(device)
                if reason is None:
                    chosen = candidate
                    break
                skipped.append(f"{candidate.name}: {reason}")
            assert chosen is not None, f"kernel {self.name!r} has no backend that runs on {device.type}"
            log.info(
                "megascale kernel %s on %s: %s%s",
                self.name,
                device.type,
                chosen.name,
                f" (skipped {'; '.join(skipped)})" if skipped else "",
            )
        self._chosen[key] = chosen
        return chosen

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        return self.select(device, backend).fn(*args, **kwargs)


_KERNELS: dict[str, Kernel] = {}


def get_kernel(name: str) -> Kernel:
    """The kernel called ``name``, created empty on first use."""
    if name not in _KERNELS:
        _KERNELS[name] = Kernel(name)
    return _KERNELS[name]


def kernels() -> dict[str, Kernel]:
    return dict(_KERNELS)


def reset() -> None:
    """Forget every cached choice (after changing ``MEGASCALE_KERNELS``, or in tests)."""
    for k in _KERNELS.values():
        k._chosen.clear()


def describe(device: torch.device | str = "cpu") -> dict[str, str]:
    """Which backend each kernel runs on ``device``, e.g. {"attention": "sdpa", ...}."""
    out = {}
    for name, k in sorted(_KERNELS.items()):
        try:
            out[name] = k.select(device).name
        except KernelUnavailableError as exc:
            out[name] = f"error: {exc}"
    return out


def _forced_by_env(kernel: Kernel) -> tuple[str | None, str]:
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None, ""
    source = f"{ENV_VAR}={spec!r}"
    for item in spec.split(","):
        item = item.strip()
        if "=" in item:
            name, _, choice = item.partition("=")
            if name.strip() == kernel.name:
                return choice.strip(), source
        elif item in kernel.backend_names():
            return item, source  # a bare backend name applies to every kernel that has it
    return None, source
