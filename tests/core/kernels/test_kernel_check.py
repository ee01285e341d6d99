"""A backend is checked against the torch reference before its first use on a device: one that disagrees
(forward or backward) or fails is skipped with a warning naming the difference, or refused when forced.

Injected on the CPU into the real ``rms_norm`` kernel (available there, ahead of the others): a backend that
forgets the weight, one whose forward is right and backward wrong, one that raises, and a correct one; the
real Triton backends (in Triton's CPU interpreter) and SDPA must pass their checks, also when the first call
comes under inference mode, autocast or TF32, and ``describe(checks=True)`` reports what each check found.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from megascale.core.kernels import KernelUnavailableError, attention, kernels, registry, rms_norm
from megascale.core.kernels.registry import Backend, Probe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.delenv(registry.CHECK_ENV_VAR, raising=False)
    registry.reset()
    yield
    registry.reset()


@pytest.fixture
def inject(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Put a backend first in rms_norm's list, available on the CPU (restored after the test)."""

    def put(name: str, fn: Any) -> None:
        monkeypatch.setattr(rms_norm, "backends", [Backend(name, fn), *rms_norm.backends])
        registry.reset()

    return put


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _no_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _reference(x, torch.ones_like(weight), eps)


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _reference(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_reference(xr, wr, ctx.eps), (xr, wr), grad)
        return gx, 2 * gw, None  # the weight's gradient doubled


def _wrong_backward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _WrongBackward.apply(x, weight, eps)


def _raises(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise RuntimeError("no kernel image for this device")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(3, 64, generator=gen), 1 + torch.randn(64, generator=gen)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_no_weight, r"'wrong'.*its output differs from the torch reference by up to"),
        (_wrong_backward, r"'wrong'.*its gradient of input 1 differs from the torch reference"),
        (_raises, r"'wrong'.*it raised RuntimeError: no kernel image"),
    ],
    ids=["wrong forward", "wrong backward", "raises"],
)
def test_a_wrong_backend_is_skipped_with_a_warning_and_the_reference_runs(
    inject: Any, fn: Any, message: str
) -> None:
    inject("wrong", fn)
    x, w = _inputs()
    with pytest.warns(RuntimeWarning, match=message):
        got = rms_norm(x, w, 1e-6)
    assert torch.equal(got, _reference(x, w, 1e-6))
    assert rms_norm.select(CPU).name != "wrong"


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_wrong_backend_that_is_forced_is_refused_naming_the_difference(
    inject: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    inject("wrong", _no_weight)
    if how == "environment":
        monkeypatch.setenv(registry.ENV_VAR, "rms_norm=wrong")
    with pytest.raises(
        KernelUnavailableError,
        match=r"'wrong' \(asked by (backend= argument|MEGASCALE_KERNELS='rms_norm=wrong')\).*failed its check"
        r".*output differs from the torch reference by up to \d.*tolerance 1e-05.*MEGASCALE_KERNEL_CHECK=0",
    ):
        rms_norm(*_inputs(), 1e-6, backend="wrong" if how == "argument" else None)


def test_a_failed_check_warns_and_logs_once(inject: Any, caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    def wrong(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return _no_weight(x, weight, eps)

    caplog.set_level(logging.INFO, logger="megascale.core.kernels")
    inject("wrong", wrong)
    x, w = _inputs()
    with pytest.warns(RuntimeWarning, match=r"'rms_norm'.*'wrong'.*by up to .*tolerance 1e-05 \+ 0.0001"):
        rms_norm(x, w, 1e-6)
    failures = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.getMessage().startswith("megascale kernel rms_norm, backend wrong")
    ]
    assert len(failures) == 1 and "failed its check: its output differs" in failures[0], failures
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the verdict is cached
        for _ in range(3):
            assert torch.equal(rms_norm(x, w, 1e-6), _reference(x, w, 1e-6))
    assert calls == 1, "the failing backend was run again after its check"


def test_describe_reports_what_the_checks_found(inject: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    inject("wrong", _no_weight)
    with pytest.warns(RuntimeWarning):
        report = registry.describe(CPU, checks=True)
    assert report["rms_norm"].startswith(
        "torch (wrong failed its check against the torch reference: its output"
    )
    assert report["attention"].startswith("sdpa (checked against the torch reference on a cpu probe")
    assert "largest difference" in report["attention"]
    assert registry.describe(CPU)["rms_norm"] == "torch"  # the plain form is unchanged

    inject("correct", _reference)
    assert registry.describe(CPU, checks=True)["rms_norm"].startswith(
        "correct (checked against the torch reference on a cpu probe, forward and backward: largest difference"
    )
    registry.reset()
    monkeypatch.setenv(registry.CHECK_ENV_VAR, "0")
    assert (
        registry.describe(CPU, checks=True)["rms_norm"] == "correct (not checked: MEGASCALE_KERNEL_CHECK=0)"
    )


def test_a_correct_backend_passes_once_and_is_used(inject: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"kernel": 0, "probe": 0}

    def correct(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls["kernel"] += 1
        return _reference(x, weight, eps)

    probe = rms_norm.probe
    assert probe is not None

    def counting(*args: Any) -> Any:
        calls["probe"] += 1
        return probe.make(*args)

    monkeypatch.setattr(rms_norm, "probe", Probe(counting, probe.tolerance))
    inject("correct", correct)
    x, w = _inputs()
    for _ in range(3):
        assert torch.equal(rms_norm(x, w, 1e-6), _reference(x, w, 1e-6))
    assert calls["probe"] == 1, "the check ran more than once"
    assert calls["kernel"] == 1 + 3, "the checked backend was not the one used"
    assert rms_norm._verdicts[("correct", "cpu")].passed


def test_the_check_can_be_turned_off(inject: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.CHECK_ENV_VAR, "0")
    inject("wrong", _no_weight)
    x, w = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rms_norm.select(CPU).name == "wrong"
        assert torch.equal(
            rms_norm(x, w, 1e-6, backend="wrong"), _no_weight(x, w, 1e-6)
        )  # forced: not refused
    assert not rms_norm._verdicts


@pytest.mark.parametrize("context", ["inference_mode", "no_grad", "autocast", "tf32"])
def test_the_callers_context_does_not_fail_a_correct_backend(context: str) -> None:
    """The first call of a model often comes from evaluation (inference mode, no grad) or mixed precision: the
    probe must still check the kernel (SDPA, attention's CPU choice), not the context, and leave it as it was."""
    q = torch.randn(1, 8, 2, 8)
    precision = torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.simplefilter("error")
            if context == "inference_mode":
                stack.enter_context(torch.inference_mode())
            elif context == "no_grad":
                stack.enter_context(torch.no_grad())
            elif context == "autocast":
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            else:
                torch.set_float32_matmul_precision("medium")
            out = attention(q, q, q)
            assert attention.select(CPU).name == "sdpa"
            # the context is restored
            assert torch.is_inference_mode_enabled() == (context == "inference_mode")
            assert torch.is_grad_enabled() == (context not in ("inference_mode", "no_grad"))
            assert torch.is_autocast_enabled("cpu") == (context == "autocast")
            assert torch.get_float32_matmul_precision() == ("medium" if context == "tf32" else precision)
        assert out.is_inference() == (context == "inference_mode")
    finally:
        torch.set_float32_matmul_precision(precision)


def test_the_probe_runs_in_full_fp32_precision(inject: Any) -> None:
    seen = []

    def correct(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        seen.append(torch.get_float32_matmul_precision())
        return _reference(x, weight, eps)

    precision = torch.get_float32_matmul_precision()
    inject("correct", correct)
    try:
        torch.set_float32_matmul_precision("medium")
        rms_norm(*_inputs(), 1e-6)
        assert seen == ["highest", "medium"]  # the check, then the call itself
    finally:
        torch.set_float32_matmul_precision(precision)


def test_every_real_backend_passes_its_check_on_the_cpu() -> None:
    """The Triton backends run in the interpreter here (tests/conftest.py); SDPA is attention's CPU choice."""
    pytest.importorskip("triton")
    checked = 0
    for name, kernel in kernels().items():
        assert kernel.probe is not None, f"kernel {name!r} has no probe"
        for backend in kernel.backends:
            if backend.name == registry.REFERENCE or backend.forced_reason(CPU) is not None:
                continue  # apex, flash: CUDA only
            verdict = kernel.verdict(backend, CPU)
            assert verdict.passed, f"{name}/{backend.name}: {verdict.detail}"
            checked += 1
    assert checked >= 7  # six Triton kernels and SDPA


def test_a_first_call_inside_activation_checkpointing_is_checked_apart_from_it() -> None:
    """The probe's own autograd must not run inside the caller's checkpointed forward (its saved-tensor hooks
    and recomputation state are the caller's): it runs on a thread of its own."""
    import warnings

    from torch import nn
    from torch.distributed._composable import checkpoint

    from megascale.core.kernels import attention

    class Core(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v)

    core = checkpoint(Core())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed check would warn
        core(q, k, v).square().sum().backward()
    assert attention.select(CPU).name == "sdpa"
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("sms", [108, 132, 144, 500])  # A100, H100/H200 SXM, GH200, a future GPU
def test_gpu_probes_run_every_block_loop_of_the_kernels(sms: int) -> None:
    """On a GPU the probes reach the code paths real shapes take (issue 24): the cross-entropy's vocabulary
    loop over several full 8192-column blocks and a partial one past the valid columns, and the norms'
    backward programs each summing several rows, the last fewer."""
    import math

    from megascale.core.kernels.cross_entropy import probe_sizes as ce_sizes
    from megascale.core.kernels.rms_norm import probe_sizes as norm_sizes

    block_v = 8192  # kernels/triton/cross_entropy.py's _MAX_BLOCK_V
    rows, width, vocab = ce_sizes("cuda")
    assert vocab > 2 * block_v and vocab % block_v and width > vocab
    rows, width = norm_sizes("cuda")
    per_program = math.ceil(rows / (2 * sms))  # kernels/triton/_launch.py's reduction_programs
    assert per_program >= 2 and rows % per_program, (rows, per_program)
    assert width & (width - 1), "a width short of its power-of-two block (masked columns)"
    assert ce_sizes("cpu")[2] < 100 and norm_sizes("cpu") == (4, 64)  # the interpreter keeps small probes
