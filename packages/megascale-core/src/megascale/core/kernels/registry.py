"""Kernel registry: one entry per kernel, several interchangeable backends, one choice per device type.

A backend is a function with the kernel's signature plus a check that says why it cannot run here (or None).
The choice is made once per (kernel, device type, forced name), logged with the reasons the faster backends
were skipped, and can be forced three ways, strongest first: a ``backend=`` argument (what
``GPTConfig.kernels`` passes), the environment variable ``MEGASCALE_KERNELS``
("rms_norm=triton,attention=sdpa", or a bare name such as "torch" applied to every kernel that has it), or
nothing (fastest available). The ``torch`` backend of every kernel is the reference the others are tested
against, and it always runs.

Checked before first use: a backend other than the reference is run once per device type on a small input
(the kernel's ``Probe``: fp32, and on CUDA also bf16) next to the reference, forward and backward; if its
outputs or gradients disagree beyond the probe's tolerance, or it raises, automatic selection skips it with a
warning naming the difference (the next candidate, ultimately the reference, runs), and a forced request fails
with that message (the user asked for it explicitly, so silently running something else would be wrong too). A
Triton, flash or apex kernel that only ever ran in CI's CPU interpreter thus never trains silently wrong on a
user's GPU. The probe runs in plain numerics whatever the caller's context (outside inference mode, autocast
off, full-precision fp32 matmuls, no TF32), so a first call made under ``torch.inference_mode()`` or autocast
checks the kernel, not the context. ``describe(device, checks=True)`` reports each outcome;
``MEGASCALE_KERNEL_CHECK=0`` turns the check off (forced backends included).

Two checks per backend, because "can run" and "should be picked" differ on some devices:
``unavailable(device)`` says why automatic selection skips the backend; ``unavailable_if_forced(device)``
(default: the same check) says why even a forced request must fail. A backend that works on a device but is
no choice there, such as a Triton kernel on the CPU (correct only through the slow interpreter, meant for
tests), gives a looser second check: automatic selection passes it by, ``backend="triton"`` still gets it.

Cases of a call: a kernel may name the case a call falls in (``Kernel.case_of``, e.g. attention's "window" for
a sliding window shorter than the sequence), and a backend may serve only some cases automatically
(``skips(case)`` says why it is passed by, e.g. FlexAttention for full causal attention, where SDPA's fused
causal kernel is faster). The automatic choice is then made, cached and logged per case; a forced backend runs
for every case. ``Kernel.observe`` records what a backend found out about itself at run time (which SDPA kernel
torch dispatched to), logged once and shown by ``explain``/``describe``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Backend",
    "Check",
    "Kernel",
    "KernelUnavailableError",
    "Probe",
    "Verdict",
    "describe",
    "get_kernel",
    "kernels",
    "reset",
]

log = logging.getLogger("megascale.core.kernels")

ENV_VAR = "MEGASCALE_KERNELS"
CHECK_ENV_VAR = "MEGASCALE_KERNEL_CHECK"
REFERENCE = "torch"


class KernelUnavailableError(RuntimeError):
    """A backend was forced that cannot run on this machine or for these inputs."""


Check = Callable[[torch.device], str | None]
"""Why a backend cannot be used on a device, or None when it can."""

CaseCheck = Callable[[str | None], str | None]
"""Why automatic selection passes a backend by for a case of a call (None: the backend serves it)."""


def _always(_device: torch.device) -> str | None:
    return None


def _every_case(_case: str | None) -> str | None:
    return None


def _case_label(case: str | None) -> str:
    return "" if case is None else f" ({case})"


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., Any]
    unavailable: Check = _always
    """Why automatic selection skips this backend on ``device`` (None when it may pick it)."""
    unavailable_if_forced: Check | None = None
    """Why this backend cannot run on ``device`` even when forced; None: the same check as ``unavailable``."""
    skips: CaseCheck = _every_case
    """Why automatic selection passes this backend by for a case of a call (None when it serves the case)."""

    def forced_reason(self, device: torch.device) -> str | None:
        check = self.unavailable if self.unavailable_if_forced is None else self.unavailable_if_forced
        return check(device)


ProbeInputs = tuple[tuple[Any, ...], dict[str, Any], Sequence[int]]
"""(args, kwargs, positions of the args to differentiate)."""


@dataclass(frozen=True)
class Probe:
    """Small inputs on which a backend is checked against the reference, and how close it must come.

    ``make(device, dtype, generator)`` builds the inputs (drawn from ``generator``, a CPU generator, then moved
    to ``device``); ``tolerance`` maps each dtype checked to (rtol, atol): an element passes when
    ``|got - want| <= atol + rtol * |want|``, for the output and for the gradient of every differentiated input.
    """

    make: Callable[[torch.device, torch.dtype, torch.Generator], ProbeInputs]
    tolerance: dict[torch.dtype, tuple[float, float]] = field(
        default_factory=lambda: {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
    )

    def dtypes(self, device: torch.device) -> list[torch.dtype]:
        """fp32 everywhere; on accelerators also the low-precision dtypes training runs in."""
        return [d for d in self.tolerance if d == torch.float32 or device.type != "cpu"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one backend against the reference on one device type."""

    passed: bool
    detail: str


def _checks_enabled() -> bool:
    return os.environ.get(CHECK_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def _plain_numerics(device: torch.device) -> Iterator[None]:
    """Run the probe as a unit test would, whatever the caller's context: autograd on (also outside inference
    mode), autocast off, fp32 matmuls in full precision (TF32 alone would exceed the fp32 tolerance)."""
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            if torch.amp.is_autocast_available(device.type):
                stack.enter_context(torch.autocast(device.type, enabled=False))
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _run(fn: Callable[..., Any], inputs: ProbeInputs, cotangent_seed: int) -> tuple[torch.Tensor, list]:
    args, kwargs, diff = inputs
    args = tuple(
        a.detach().clone().requires_grad_(i in diff) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    )
    out = fn(*args, **kwargs)
    gen = torch.Generator().manual_seed(cotangent_seed)
    cotangent = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    wrt = [args[i] for i in diff]
    grads = list(torch.autograd.grad(out, wrt, cotangent, allow_unused=True)) if wrt else []
    return out.detach(), grads


def _excess(
    got: torch.Tensor | None, want: torch.Tensor | None, rtol: float, atol: float
) -> tuple[float, float]:
    """(largest |got - want| beyond the tolerance, largest |got - want|); inf when one is missing or misshaped."""
    if got is None or want is None:
        return (0.0, 0.0) if got is None and want is None else (float("inf"), float("inf"))
    if got.shape != want.shape:
        return float("inf"), float("inf")
    diff = (got.float() - want.float()).abs()
    if not torch.isfinite(diff).all():
        return float("inf"), float("inf")
    beyond = diff - (atol + rtol * want.float().abs())
    return float(beyond.max()), float(diff.max())


@dataclass
class Kernel:
    """A named operation with backends in order of preference; call it like the function it stands for."""

    name: str
    backends: list[Backend] = field(default_factory=list)
    probe: Probe | None = None
    case_of: Callable[..., str | None] | None = None
    """``case_of(*args, **kwargs)`` names the case a call falls in (None: the plain case); see ``cases``."""
    cases: tuple[str, ...] = ()
    """The named cases ``case_of`` can return, each chosen, cached and described apart from the plain case."""
    _chosen: dict[tuple[str, str | None, str | None], Backend] = field(default_factory=dict, repr=False)
    _verdicts: dict[tuple[str, str], Verdict] = field(default_factory=dict, repr=False)
    _observed: dict[tuple[str, str | None], list[str]] = field(default_factory=dict, repr=False)
    _seen: set[Any] = field(default_factory=set, repr=False)

    def register(
        self,
        name: str,
        unavailable: Check = _always,
        *,
        unavailable_if_forced: Check | None = None,
        skips: CaseCheck = _every_case,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator adding a backend; backends registered first are preferred. See the module docstring for
        the two checks and for ``skips`` (the cases of a call the backend is not chosen for automatically)."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if any(b.name == name for b in self.backends):
                raise ValueError(f"kernel {self.name!r} already has a backend {name!r}")
            self.backends.append(Backend(name, fn, unavailable, unavailable_if_forced, skips))
            return fn

        return add

    def backend_names(self) -> list[str]:
        return [b.name for b in self.backends]

    def _check(self, backend: Backend, device: torch.device) -> Verdict:
        """Run the probe through ``backend`` and the reference and compare (``verdict`` runs this)."""
        assert self.probe is not None
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device.index)  # a new thread starts on the default device
        reference = next(b for b in self.backends if b.name == REFERENCE)
        verdict = None
        largest = []
        start = time.perf_counter()
        with _plain_numerics(device):
            for dtype in self.probe.dtypes(device):
                rtol, atol = self.probe.tolerance[dtype]
                try:  # a probe that cannot be built, or that the reference cannot run, verifies nothing
                    inputs = self.probe.make(device, dtype, torch.Generator().manual_seed(0))
                    want, want_grads = _run(reference.fn, inputs, cotangent_seed=1)
                except Exception as exc:
                    verdict = Verdict(
                        False,
                        f"its probe failed on the torch reference itself ({_exc(exc)}) on {device.type}",
                    )
                    break
                # a kernel that cannot even run the probe is as wrong as one that disagrees
                try:
                    got, got_grads = _run(backend.fn, inputs, cotangent_seed=1)
                except Exception as exc:
                    verdict = Verdict(
                        False, f"it raised {_exc(exc)} on a {device.type} probe in {_name(dtype)}"
                    )
                    break
                names = ["output"] + [f"gradient of input {i}" for i in inputs[2]]
                worst = 0.0
                for what, g, w in zip(names, [got, *got_grads], [want, *want_grads], strict=True):
                    beyond, diff = _excess(g, w, rtol, atol)
                    worst = max(worst, diff)
                    if beyond > 0:
                        verdict = Verdict(
                            False,
                            f"its {what} differs from the torch reference by up to {diff:.3g} in {_name(dtype)} "
                            f"(tolerance {atol:g} + {rtol:g}·|reference|) on a {device.type} probe",
                        )
                        break
                if verdict is not None:
                    break
                largest.append(f"{worst:.3g} in {_name(dtype)} within {atol:g} + {rtol:g}·|reference|")
        if verdict is None:
            verdict = Verdict(
                True,
                f"checked against the torch reference on a {device.type} probe, forward and backward: largest "
                f"difference {', '.join(largest)} ({time.perf_counter() - start:.2f} s)",
            )
        return verdict

    def verdict(self, backend: Backend, device: torch.device) -> Verdict:
        """Check ``backend`` against the reference on the probe (once per device type; see the module docstring).

        ``detail`` says what was found: the largest differences when it passed, the first one beyond the
        tolerance (or the exception) when it failed, or why it was not checked."""
        key = (backend.name, device.type)
        if key in self._verdicts:
            return self._verdicts[key]
        if backend.name == REFERENCE:
            return Verdict(True, "the reference")
        if self.probe is None:
            return Verdict(True, "not checked: the kernel declares no probe")
        if not _checks_enabled():
            return Verdict(True, f"not checked: {CHECK_ENV_VAR}=0")
        # On a thread of its own: the first call may come from anywhere — inside an activation-checkpointed
        # forward (whose saved-tensor hooks and recomputation state would capture the probe's autograd), under
        # inference_mode, no_grad, autocast or a dispatch mode — all thread-local, none seen by a new thread.
        found: list[Verdict] = []
        thread = threading.Thread(
            target=lambda: found.append(self._check(backend, device)), name=f"megascale-check-{self.name}"
        )
        thread.start()
        thread.join()
        verdict = found[0] if found else Verdict(False, f"its check crashed on {device.type} (see the log)")
        self._verdicts[key] = verdict
        log.log(
            logging.INFO if verdict.passed else logging.WARNING,
            "megascale kernel %s, backend %s on %s: %s",
            self.name,
            backend.name,
            device.type,
            verdict.detail if verdict.passed else f"failed its check: {verdict.detail}",
        )
        return verdict

    def first_time(self, key: Any) -> bool:
        """True the first time ``key`` is asked about (until ``reset``): a backend's one-off run-time checks."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def observe(self, device: torch.device | str, case: str | None, note: str) -> None:
        """Record (and log, once) what a backend found out at run time for a case of a call on ``device``, e.g.
        which SDPA kernel torch dispatched to; ``explain`` shows it."""
        device = torch.device(device)
        notes = self._observed.setdefault((device.type, case), [])
        if note not in notes:
            notes.append(note)
            log.info("megascale kernel %s on %s%s: %s", self.name, device.type, _case_label(case), note)

    def observations(self, device: torch.device | str, case: str | None = None) -> list[str]:
        """What was observed at run time on ``device`` for ``case`` (``observe``), oldest first."""
        return list(self._observed.get((torch.device(device).type, case), []))

    def explain(self, device: torch.device | str, backend: str | None = None, case: str | None = None) -> str:
        """The backend that runs on ``device`` (for ``case``) and what its check found, plus the backends that
        failed theirs and what was observed at run time, e.g. "torch (triton failed its check against the torch
        reference: its output differs ...)"."""
        device = torch.device(device)
        chosen = self.select(device, backend, case)
        notes = [] if chosen.name == REFERENCE else [self.verdict(chosen, device).detail]
        notes += self._observed.get((device.type, case), [])
        notes += [
            f"{b.name} failed its check against the torch reference: {v.detail}"
            for b in self.backends
            if (v := self._verdicts.get((b.name, device.type))) is not None and not v.passed
        ]
        return chosen.name + (f" ({'; '.join(notes)})" if notes else "")

    def select(
        self, device: torch.device | str, backend: str | None = None, case: str | None = None
    ) -> Backend:
        """The backend that runs on ``device`` for a call of ``case``: the forced one, else the first available
        that serves the case. Cached."""
        device = torch.device(device)
        forced, source = (backend, "backend= argument") if backend else _forced_by_env(self)
        key = (device.type, forced, None if forced is not None else case)
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
            if reason is None and not (verdict := self.verdict(chosen, device)).passed:
                reason = f"it failed its check against the torch reference: {verdict.detail} ({CHECK_ENV_VAR}=0 skips the check)"
            if reason is not None:
                raise KernelUnavailableError(
                    f"kernel {self.name!r}: backend {forced!r} (asked by {source}) cannot run on "
                    f"{device.type}: {reason}. Remove the request or choose one of {self.backend_names()}."
                )
            log.info("megascale kernel %s on %s: %s (forced by %s)", self.name, device.type, forced, source)
        else:
            skipped = []
            for candidate in self.backends:
                reason = candidate.unavailable(device) or candidate.skips(case)
                if reason is None and not (verdict := self.verdict(candidate, device)).passed:
                    reason = f"failed its check against the torch reference: {verdict.detail}"
                    warnings.warn(
                        f"megascale kernel {self.name!r}: backend {candidate.name!r} is not used on {device.type}: "
                        f"{verdict.detail}. Falling back to the next backend ({CHECK_ENV_VAR}=0 skips the check).",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                if reason is None:
                    chosen = candidate
                    break
                skipped.append(f"{candidate.name}: {reason}")
            assert chosen is not None, f"kernel {self.name!r} has no backend that runs on {device.type}"
            notes = [f"skipped {'; '.join(skipped)}"] if skipped else []
            if chosen.name != REFERENCE:
                notes.append(self.verdict(chosen, device).detail)
            log.info(
                "megascale kernel %s on %s%s: %s%s",
                self.name,
                device.type,
                _case_label(case),
                chosen.name,
                f" ({'; '.join(notes)})" if notes else "",
            )
        self._chosen[key] = chosen
        return chosen

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        case = self.case_of(*args, **kwargs) if self.case_of is not None else None
        return self.select(device, backend, case).fn(*args, **kwargs)


_KERNELS: dict[str, Kernel] = {}


def get_kernel(name: str) -> Kernel:
    """The kernel called ``name``, created empty on first use."""
    if name not in _KERNELS:
        _KERNELS[name] = Kernel(name)
    return _KERNELS[name]


def kernels() -> dict[str, Kernel]:
    return dict(_KERNELS)


def reset() -> None:
    """Forget every cached choice and check (after changing ``MEGASCALE_KERNELS``, or in tests)."""
    for k in _KERNELS.values():
        k._chosen.clear()
        k._verdicts.clear()
        k._observed.clear()
        k._seen.clear()


def describe(device: torch.device | str = "cpu", *, checks: bool = False) -> dict[str, str]:
    """Which backend each kernel runs on ``device``, e.g. {"attention": "sdpa", "attention (window)": "flex",
    ...} (one entry per named case of a kernel); with ``checks``, also what its check against the reference
    found, which faster backends failed theirs and what was observed at run time (``Kernel.explain``)."""
    out = {}
    for name, k in sorted(_KERNELS.items()):
        for case in (None, *k.cases):
            label = name + _case_label(case)
            try:
                out[label] = k.explain(device, case=case) if checks else k.select(device, case=case).name
            except KernelUnavailableError as exc:
                out[label] = f"error: {exc}"
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _exc(exc: BaseException) -> str:
    """The exception on one short line (a Triton compile error can run to pages)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}{'...' if len(first) > 200 else ''}"


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
