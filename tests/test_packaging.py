"""The monorepo's packaging promises: one PEP 420 namespace, four distributions, à-la-carte dependencies.

Run in every per-package nox session, so it checks whichever megascale distributions are installed there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["core", "lightning", "data", "ft"]


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(f"megascale-{name}")
    except metadata.PackageNotFoundError:
        return None


def _pyproject(name: str) -> dict:
    return tomllib.loads((ROOT / f"packages/megascale-{name}/pyproject.toml").read_text())


def test_no_source_tree_has_a_namespace_init():
    offenders = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/src/megascale/__init__.py"))
    assert not offenders, f"megascale is a PEP 420 namespace; remove {offenders}"


@pytest.mark.parametrize("name", NAMES)
def test_installed_distribution_ships_only_its_subpackage(name):
    dist = _installed(name)
    if dist is None:
        pytest.skip(f"megascale-{name} is not installed in this environment")
    if json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
        pytest.skip(f"megascale-{name} is an editable install: its wheel's contents are checked under nox")
    files = [str(f) for f in dist.files or []]
    assert "megascale/__init__.py" not in files, f"megascale-{name} ships megascale/__init__.py"
    shipped = {f.split("/")[1] for f in files if f.startswith("megascale/")}
    assert shipped == {name}, f"megascale-{name} ships {shipped}"
    assert f"megascale/{name}/py.typed" in files


@pytest.mark.parametrize("name", NAMES)
def test_versions_agree(name):
    version = _pyproject(name)["project"]["version"]
    assert version == _pyproject("core")["project"]["version"]
    dist = _installed(name)
    if dist is not None:
        assert dist.version == version
        module = __import__(f"megascale.{name}", fromlist=["__version__"])
        assert module.__version__ == version


def test_megascale_is_a_namespace():
    import megascale

    assert getattr(megascale, "__file__", None) is None


def test_lightning_pins_core_to_its_own_version():
    project = _pyproject("lightning")["project"]
    assert f"megascale-core=={project['version']}" in project["dependencies"]


@pytest.mark.parametrize("name", ["data", "ft"])
def test_data_and_ft_do_not_need_core(name):
    deps = " ".join(_pyproject(name)["project"]["dependencies"])
    assert "megascale-core" not in deps
    if _installed(name) is None:
        pytest.skip(f"megascale-{name} is not installed in this environment")
    code = f"import sys, megascale.{name}; assert 'megascale.core' not in sys.modules, 'imports core'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_declares_torch_and_what_torch_needs_only():
    # numpy: torch.distributed.pipelining sends stage shapes with send/recv_object_list, which needs it and
    # torch does not declare it. Anything else here would break the "core -> torch" promise.
    deps = _pyproject("core")["project"]["dependencies"]
    assert [d.split(">")[0].split("=")[0].split("<")[0] for d in deps] == ["torch", "numpy"]
