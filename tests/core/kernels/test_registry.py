"""The kernel registry: automatic choice, forcing (argument, environment), unavailable backends, logging."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from megascale.core.kernels import (
    KernelUnavailableError,
    attention,
    cross_entropy,
    get_kernel,
    kernels,
    registry,
)
from megascale.core.kernels.registry import Kernel

LOGGER = "megascale.core.kernels"


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cached choice leaks into or out of a test; no outside MEGASCALE_KERNELS either."""
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.reset()
    yield
    registry.reset()


def _needs_triton() -> None:
    pytest.importorskip("triton")


# --- the two checks of a backend, on a kernel of its own --------------------------------------------------


def _demo_kernel() -> Kernel:
    demo = Kernel("demo")
    demo.register("fast", lambda d: "slow here", unavailable_if_forced=lambda d: None)(lambda x: "fast")
    demo.register("broken", lambda d: "no driver")(lambda x: "broken")
    demo.register("torch")(lambda x: "torch")
    return demo


def test_forceable_backend_is_skipped_automatically_but_runs_when_forced() -> None:
    demo = _demo_kernel()
    x = torch.zeros(1)
    assert demo(x) == "torch"
    assert demo(x, backend="fast") == "fast"


def test_backend_without_a_forced_check_uses_its_availability_check() -> None:
    demo = _demo_kernel()
    with pytest.raises(KernelUnavailableError, match=r"'demo'.*'broken'.*no driver"):
        demo(torch.zeros(1), backend="broken")


def test_a_backend_serving_one_case_is_chosen_for_that_case_only(caplog: pytest.LogCaptureFixture) -> None:
    """Attention's pattern: FlexAttention serves windowed calls; full causal ones keep the next backend."""
    demo = Kernel("demo")
    demo.case_of = lambda x, window=None: "window" if window else None
    demo.cases = ("window",)
    demo.register("windowed", skips=lambda case: None if case == "window" else "serves windows only")(
        lambda x, window=None: "windowed"
    )
    demo.register("torch")(lambda x, window=None: "torch")
    caplog.set_level(logging.INFO, logger=LOGGER)
    x = torch.zeros(1)
    assert demo(x, window=4) == "windowed"
    assert demo(x) == "torch"
    assert demo(x, backend="windowed") == "windowed"  # forced: whatever the case
    assert "megascale kernel demo on cpu: torch (skipped windowed: serves windows only)" in caplog.messages
    assert (
        "megascale kernel demo on cpu (window): windowed (not checked: the kernel declares no probe)"
        in caplog.messages
    )
    demo.observe("cpu", "window", "ran its banded kernel")
    demo.observe("cpu", "window", "ran its banded kernel")  # recorded and logged once
    assert (
        demo.explain("cpu", case="window")
        == "windowed (not checked: the kernel declares no probe; ran its banded kernel)"
    )
    assert caplog.messages.count("megascale kernel demo on cpu (window): ran its banded kernel") == 1


def test_registering_a_backend_twice_is_an_error() -> None:
    demo = _demo_kernel()
    with pytest.raises(ValueError, match="already has a backend 'torch'"):
        demo.register("torch")(lambda x: x)


# --- the real kernels -------------------------------------------------------------------------------------


def test_every_kernel_has_a_torch_reference_registered_last() -> None:
    for name, kernel in kernels().items():
        assert kernel.backend_names()[-1] == "torch", name


def test_preference_order() -> None:
    assert get_kernel("rms_norm").backend_names() == ["apex", "triton", "torch"]
    assert get_kernel("layer_norm").backend_names() == ["apex", "triton", "torch"]
    for name in ("bias_gelu", "swiglu", "rope", "cross_entropy"):
        assert get_kernel(name).backend_names() == ["triton", "torch"], name
    assert attention.backend_names() == ["flash", "flash4", "flex", "sdpa", "torch"]
    assert get_kernel("grouped_mm").backend_names() == ["grouped_mm", "torch"]


def test_cpu_automatic_choice_is_the_reference_with_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chosen = registry.describe("cpu")
    assert chosen.pop("attention") == "sdpa"
    assert chosen.pop("attention (window)") == "sdpa"  # FlexAttention is no automatic choice on the CPU
    assert chosen.pop("attention (documents)") == "sdpa"  # packed documents: SDPA's masked kernel
    assert set(chosen.values()) == {"torch"}, chosen


def test_choice_is_logged_once_with_the_reasons(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    rms_norm = get_kernel("rms_norm")
    x, w = torch.randn(3, 8), torch.ones(8)
    for _ in range(3):
        rms_norm(x, w, 1e-6)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("megascale kernel rms_norm")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("megascale kernel rms_norm on cpu: torch (skipped apex: ")
    assert "apex fused norms run on CUDA only" in lines[0]


def test_forced_by_argument_is_logged_as_forced(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert attention.select("cpu", "torch").name == "torch"
    assert attention.select("cpu").name == "sdpa"  # a forced choice is cached apart from the automatic one
    messages = [r.getMessage() for r in caplog.records]
    assert "megascale kernel attention on cpu: torch (forced by backend= argument)" in messages


def test_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(registry.ENV_VAR, "rms_norm=triton, attention=torch")
    assert get_kernel("rms_norm").select("cpu").name == "triton"
    assert attention.select("cpu").name == "torch"
    assert get_kernel("swiglu").select("cpu").name == "torch"  # not named: automatic
    # the argument beats the environment
    assert get_kernel("rms_norm").select("cpu", "torch").name == "torch"


def test_bare_backend_name_in_environment_applies_to_every_kernel_that_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    assert set(registry.describe("cpu").values()) == {"torch"}
    registry.reset()
    monkeypatch.setenv(registry.ENV_VAR, "sdpa")
    assert attention.select("cpu").name == "sdpa"
    assert get_kernel("rms_norm").select("cpu").name == "torch"


def test_environment_change_needs_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    assert attention.select("cpu").name == "sdpa"
    monkeypatch.setenv(registry.ENV_VAR, "attention=torch")
    assert attention.select("cpu").name == "torch"  # a new forced name is a new cache key
    monkeypatch.setenv(registry.ENV_VAR, "")
    assert attention.select("cpu").name == "sdpa"


@pytest.mark.parametrize(
    ("kernel", "backend", "why"),
    [
        ("attention", "flash", "flash-attn runs on CUDA only"),
        ("rms_norm", "apex", "apex fused norms run on CUDA only"),
        ("layer_norm", "apex", "apex fused norms run on CUDA only"),
    ],
)
def test_forcing_an_unavailable_backend_raises(kernel: str, backend: str, why: str) -> None:
    with pytest.raises(KernelUnavailableError) as info:
        get_kernel(kernel).select("cpu", backend)
    message = str(info.value)
    assert f"kernel {kernel!r}" in message
    assert f"backend {backend!r}" in message
    assert "cannot run on cpu" in message
    assert why in message


def test_forcing_an_unavailable_backend_by_environment_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.ENV_VAR, "attention=flash")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(KernelUnavailableError, match=r"'attention'.*MEGASCALE_KERNELS.*CUDA only"):
        attention(q, q, q)


def test_forcing_an_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(KernelUnavailableError, match=r"no backend 'cudnn'.*\['triton', 'torch'\]"):
        cross_entropy.select("cpu", "cudnn")


def test_triton_on_cpu_without_the_interpreter_cannot_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match=r"'swiglu'.*'triton'.*TRITON_INTERPRET=1"):
        get_kernel("swiglu").select("cpu", "triton")
    assert get_kernel("swiglu").select("cpu").name == "torch"


def test_triton_on_cpu_can_be_forced_with_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate, up = torch.randn(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(
        get_kernel("swiglu")(gate, up, backend="triton"), get_kernel("swiglu")(gate, up, backend="torch")
    )


def test_importing_megascale_core_does_not_import_triton() -> None:
    # torch is imported first: its own import-time warnings (e.g. no NumPy in a bare venv) are not ours.
    code = (
        "import sys, warnings, torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import megascale.core, megascale.core.kernels as k\n"
        "assert not caught, [str(w.message) for w in caught]\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "k.rms_norm.backend_names()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
