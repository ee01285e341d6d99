"""The docs that describe the code must not fall behind it.

- docs/reference/configuration.md names (in backticks) every argument a user can write in a `megascale` YAML
  or give `megascale-ft launch`: MegaScaleStrategy, GPTModule, GPTConfig, WebDataModule, WebDataConfig,
  Source, TokenDataModule, FaultTolerance, SpeedMonitor, RunSummary, the CLI's trainer defaults and the
  launcher's options.
- docs/techniques.md refers only to files that exist and to tests that exist in the files it names.
- every section of benchmarks/RESULTS.md says which command, when and on what machine its figures came from.

Adding an argument without documenting it fails here, naming the argument and the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"
TECHNIQUES = ROOT / "docs" / "techniques.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _code_spans(path: Path) -> set[str]:
    return set(_CODE_SPAN.findall(path.read_text(encoding="utf-8")))


def _init_parameters(cls: type) -> list[str]:
    """Named parameters of ``cls.__init__`` (no self, *args or **kwargs)."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in skip]


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _launch_options() -> list[str]:
    """The long option strings (and the command's metavar) of ``megascale-ft launch``."""
    from megascale.ft.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = []
    for action in sub.choices["launch"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names.append(max(action.option_strings, key=len) if action.option_strings else str(action.metavar))
    return names


def _trainer_defaults() -> list[str]:
    from megascale.lightning.cli import TRAINER_DEFAULTS

    return list(TRAINER_DEFAULTS)


# what a user configures: class name -> (module exporting it, how its arguments are read)
CLASSES: dict[str, tuple[str, Callable[[type], list[str]]]] = {
    "MegaScaleStrategy": ("megascale.lightning", _init_parameters),
    "GPTModule": ("megascale.lightning", _init_parameters),
    "GPTConfig": ("megascale.core", _fields),
    "WebDataModule": ("megascale.data", _init_parameters),
    "WebDataConfig": ("megascale.data", _fields),
    "Source": ("megascale.data", _fields),
    "TokenDataModule": ("megascale.lightning", _init_parameters),
    "FaultTolerance": ("megascale.ft", _init_parameters),
    "SpeedMonitor": ("megascale.lightning", _init_parameters),
    "RunSummary": ("megascale.lightning", _init_parameters),
}
OTHERS: dict[str, Callable[[], list[str]]] = {
    "TRAINER_DEFAULTS": _trainer_defaults,
    "megascale-ft launch": _launch_options,
}


def _arguments(what: str) -> list[str]:
    if what in OTHERS:
        return OTHERS[what]()
    module, read = CLASSES[what]
    return read(getattr(importlib.import_module(module), what))


@pytest.mark.parametrize("what", [*CLASSES, *OTHERS])
def test_configuration_reference_names_every_argument(what: str) -> None:
    names = _arguments(what)
    assert names, f"found no arguments of {what}: the test no longer reads them right"
    documented = _code_spans(CONFIGURATION)
    missing = [n for n in names if n not in documented]
    assert not missing, (
        f"docs/reference/configuration.md does not document these arguments of {what} "
        f"(write each as `name` with its type, default and meaning): {missing}"
    )


def test_configuration_reference_has_a_section_per_class() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("#")]
    for name in ("trainer.strategy", "model.config", "WebDataModule", "TokenDataModule", "trainer.callbacks",
                 "FaultTolerance", "SpeedMonitor", "RunSummary", "megascale-ft launch"):  # fmt: skip
        assert any(name in h for h in headings), f"no heading of {CONFIGURATION.name} mentions {name}"


# --- techniques.md ------------------------------------------------------------------------------------------

_PATH = re.compile(r"^(?:packages|tests|benchmarks|examples|docs)/[\w./-]*$")


def _references() -> tuple[list[str], list[tuple[str, str]]]:
    """Backticked repository paths, and (path, test name) pairs of `path::name`, in docs/techniques.md."""
    paths, tests = [], []
    for span in sorted(_code_spans(TECHNIQUES)):
        path, _, name = span.partition("::")
        if not _PATH.match(path):
            continue
        paths.append(path)
        if name:
            tests.append((path, name))
    return paths, tests


def test_techniques_page_refers_to_enough_code() -> None:
    paths, tests = _references()
    assert len(paths) >= 30 and len(tests) >= 20, (len(paths), len(tests))


def test_every_path_in_the_techniques_page_exists() -> None:
    paths, _ = _references()
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/techniques.md names paths that do not exist: {missing}"


def test_every_test_in_the_techniques_page_exists() -> None:
    _, tests = _references()
    missing = []
    for path, name in tests:
        function = name.split("::")[-1].split("[")[0]  # a parametrised id names the same function
        source = (ROOT / path).read_text(encoding="utf-8") if (ROOT / path).is_file() else ""
        if not re.search(rf"^\s*(?:async\s+)?def {re.escape(function)}\(", source, re.MULTILINE):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/techniques.md names tests that do not exist: {missing}"


# --- benchmarks/RESULTS.md ----------------------------------------------------------------------------------


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_every_benchmark_section_gives_command_date_and_machine() -> None:
    sections = _sections(RESULTS.read_text(encoding="utf-8"))
    assert sections
    for title, body in sections.items():
        assert re.search(r"\*\*Commands?\*\*", body), f"RESULTS.md section {title!r} gives no command"
        dates = re.findall(r"\*\*Date / machine\*\*: (\d{4}-\d{2}-\d{2}), (.+)", body)
        assert dates, f"RESULTS.md section {title!r} gives no '**Date / machine**: YYYY-MM-DD, machine'"
        for _, machine in dates:
            assert "CPU" in machine or "GPU" in machine, f"{title!r}: which machine? {machine!r}"
        script = re.match(r"`(benchmarks/\w+\.py)`", title)
        assert script and (ROOT / script.group(1)).is_file(), f"{title!r} names no existing benchmark script"
