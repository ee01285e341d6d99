"""Every shell block and Python snippet in README.md and docs/ runs as written, or says why not.

- A block preceded by ``<!-- not run: REASON -->`` (blank lines between allowed) is skipped; the reason must
  be given. Every other ``bash``/``sh``/``python`` block runs, page by page in the page's order, in a scratch
  directory per page where ``examples/`` is the repository's (so the documented relative paths work) and
  ``.cache/`` is shared by the pages (the stdlib shards are built once). Shell blocks run under
  ``bash -euo pipefail``; Python blocks as scripts (``python block.py``: Lightning's DDP launcher re-runs a
  script, never ``-c``).
- ``pip install`` lines are checked, not executed (the test's environment is the nox ``integration``
  session, where everything is installed): each local path must be one of packages/ and each extra one
  that package declares.
- Training is shrunk by environment variables, the documented command unchanged: the shell's ``megascale``
  (and ``megascale-ft launch ... -- -m megascale.lightning.cli fit``) appends ``$MEGASCALE_DOCS_FIT_ARGS``
  to a fit (per page below: a few steps, or ``--print_config`` where the page only shows how to write a
  command line); ``MEGASCALE_FT_NO_SELF_CHECK=1`` skips megascale-ft's self-checks, which
  tests/ft/test_faults.py runs.

A doc command that stops working fails here, naming the page, the line and the block.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!-- not run: (.*?) -->$")
_PIP = re.compile(r"^(?:python3? -m )?pip install (.+?)(?:\s+#.*)?$")

# a few steps of a fit, checkpointed at its end (what `megascale convert` then reads)
_SHORT_FIT_CHECKPOINTED = """\
trainer:
  max_steps: 3
  val_check_interval: 3
  limit_val_batches: 1
  log_every_n_steps: 1
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {dirpath: CHECKPOINTS, save_last: true}
"""
# page -> environment of its blocks (MEGASCALE_DOCS_FIT: a fit gets _SHORT_FIT_CHECKPOINTED as a 2nd --config)
SHRINK: dict[str, dict[str, str]] = {
    "README.md": {"MEGASCALE_FT_NO_SELF_CHECK": "1"},
    "docs/first-hour.md": {"MEGASCALE_DOCS_FIT": "checkpointed", "MEGASCALE_FT_NO_SELF_CHECK": "1"},
    "docs/guides/huggingface.md": {"MEGASCALE_DOCS_FIT": "checkpointed"},
    "docs/guides/lightning.md": {"MEGASCALE_DOCS_FIT_ARGS": "--print_config"},
    "docs/reference/configuration.md": {"MEGASCALE_DOCS_FIT_ARGS": "--print_config"},
}
_PREAMBLE = """\
megascale() {
  case " $* " in
    *" --print_config"*) command megascale "$@" ;;
    " fit "*) command megascale "$@" $MEGASCALE_DOCS_FIT_ARGS ;;
    *) command megascale "$@" ;;
  esac
}
megascale-ft() {
  case " $* " in
    *" megascale.lightning.cli fit "*) command megascale-ft "$@" $MEGASCALE_DOCS_FIT_ARGS ;;
    *) command megascale-ft "$@" ;;
  esac
}
"""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    not_run: str | None  # the reason, when marked

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The shell and Python blocks of ``page``, each with its not-run reason if it has one."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _NOT_RUN.match(lines[k].strip()) if k >= 0 else None
        if match.group(1) in RUN_LANGS:
            reason = marker.group(1).strip() if marker else None
            out.append(Block(page, i + 1, RUN_LANGS[match.group(1)], "\n".join(lines[i + 1 : end]), reason))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_block_runs_or_gives_its_reason() -> None:
    assert len(ALL) > 30, "found too few blocks: the test no longer reads the pages right"
    unexplained = [b.where() for b in ALL if b.not_run is not None and len(b.not_run) < 10]
    assert not unexplained, f"write why a block is not run (<!-- not run: REASON -->): {unexplained}"


SAME = "same as docs/first-hour.md"


def _commands(block: Block) -> list[str]:
    """The block's lines without comments, continuations joined, whitespace normalised."""
    text = block.text.replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def test_blocks_said_to_be_the_first_hours_are_in_it() -> None:
    """A block not run because docs/first-hour.md runs it: every line of it is a line of that page's blocks."""
    ran = {c for b in blocks(ROOT / "docs" / "first-hour.md") if b.not_run is None for c in _commands(b)}
    proxied = [b for b in ALL if (b.not_run or "").startswith(SAME)]
    assert len(proxied) >= 4
    for block in proxied:
        missing = [c for c in _commands(block) if c not in ran]
        assert not missing, f"{block.where()} says docs/first-hour.md runs it, which lacks: {missing}"


def _extras(package: str) -> set[str]:
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    return set(pyproject["project"].get("optional-dependencies", {}))


def test_install_lines_name_real_packages_and_extras() -> None:
    checked = 0
    for block in (b for b in ALL if b.lang == "shell"):
        for line in block.text.splitlines():
            match = _PIP.match(line.strip().split(" && ")[0])
            if not match:
                continue
            for arg in shlex.split(match.group(1)):
                spec = re.fullmatch(r"(?:\./packages/)?(megascale-\w+)(?:\[([\w,-]+)\])?", arg)
                if spec is None:
                    continue  # a PyPI package (nox, transformers)
                package, extras = spec.group(1), spec.group(2)
                assert arg.startswith("./packages/"), (
                    f"{block.where()}: {arg} is not on PyPI: install it from the clone (./packages/{package})"
                )
                assert (ROOT / "packages" / package).is_dir(), f"{block.where()}: no package {package}"
                missing = set((extras or "").split(",")) - {""} - _extras(package)
                assert not missing, f"{block.where()}: {package} has no extra {missing}"
                checked += 1
    assert checked >= 3


def _runnable_pages() -> list[str]:
    return sorted({str(b.page.relative_to(ROOT)) for b in ALL if b.not_run is None})


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _environment(page: str, work: Path, cache: Path) -> dict[str, str]:
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE"}
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PL_", "TORCHELASTIC_"))
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    shrink = dict(SHRINK.get(page, {}))
    if shrink.pop("MEGASCALE_DOCS_FIT", None) is not None:  # written before each block: _short_fit
        shrink["MEGASCALE_DOCS_FIT_ARGS"] = f"--config {work / '_short_fit.yaml'}"
    env.update(shrink)
    env.setdefault("MEGASCALE_DOCS_FIT_ARGS", "")
    return env


def _short_fit(work: Path, block: Block) -> None:
    """A few steps, checkpointed at the end where the block's config keeps its checkpoints."""
    text = _SHORT_FIT_CHECKPOINTED.replace("CHECKPOINTS", _checkpoint_dir(block))
    (work / "_short_fit.yaml").write_text(text)


def _checkpoint_dir(block: Block) -> str:
    """Where the page's fit keeps its checkpoints: the ModelCheckpoint dirpath its config names."""
    for token in shlex.split(block.text.replace("\\\n", " "), comments=True):
        if token.endswith(".yaml") and (ROOT / token).is_file():
            found = re.search(r"dirpath:\s*(\S+)", (ROOT / token).read_text())
            if found:
                return found.group(1)
    return "checkpoints"


@pytest.mark.parametrize("page", _runnable_pages())
def test_page_runs_as_written(page: str, tmp_path: Path, shared_cache: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (work / ".cache").symlink_to(shared_cache)
    env = _environment(page, work, shared_cache)
    for n, block in enumerate(b for b in blocks(ROOT / page) if b.not_run is None):
        if "MEGASCALE_DOCS_FIT" in SHRINK.get(page, {}):
            _short_fit(work, block)
        if block.lang == "python":
            script = work / f"_block{n}.py"
            script.write_text(block.text + "\n")
            command = [sys.executable, str(script)]
        else:
            lines = [line for line in block.text.splitlines() if not _PIP.match(line.strip())]
            script = work / f"_block{n}.sh"
            script.write_text(_PREAMBLE + "\n".join(lines) + "\n")
            command = ["bash", "-euo", "pipefail", str(script)]
        started = time.monotonic()
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        print(f"{block.where()}: {time.monotonic() - started:.1f} s")  # pytest -s: what each block costs
        assert result.returncode == 0, (
            f"{block.where()} fails (exit {result.returncode}):\n{block.text}\n--- output:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
