"""The monorepo's packaging promises: one PEP 420 namespace, four distributions, à-la-carte dependencies.

Run in every per-package nox session, so it checks whichever megascale distributions are installed there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
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


# Python puts a script's own folder first on sys.path, so a module there named like an installed top-level
# package is imported in its place by whatever imports that package: benchmarks/kernels.py was imported by
# transformers 5.25 as the `kernels` package it requires, and failed. The folders: each one holding a script
# (a file run as __main__), and the repository root (pytest's pythonpath = ["."], PYTHONPATH of benchmarks).
SCRIPT_FOLDERS = sorted(
    {ROOT, ROOT / "benchmarks", ROOT / "examples"}
    | {
        path.parent
        for folder in ("benchmarks", "examples", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.MULTILINE)
    }
)


def _module_names(folder: Path) -> set[str]:
    """The top-level names `import NAME` finds in folder: modules and packages (a folder holding Python)."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {
        p.name for p in folder.iterdir() if p.is_dir() and any(p.rglob("*.py")) and p.name.isidentifier()
    }
    return names


def _shadowing(folders: list[Path]) -> list[str]:
    """'folder/name: who installs it' for each module in folders named like an installed or standard one."""
    installed = metadata.packages_distributions()
    standard = set(sys.stdlib_module_names)
    return [
        f"{folder / name}: "
        + (f"{', '.join(installed[name])} installs `{name}`" if name in installed else "a standard module")
        for folder in folders
        for name in sorted(_module_names(folder))
        if name in installed or name in standard
    ]


def test_no_script_folder_shadows_an_installed_or_standard_module():
    clashes = _shadowing(SCRIPT_FOLDERS)
    assert not clashes, (
        "rename these; a script run from their folder imports them in place of the real one: "
        + "; ".join(clashes)
    )


def test_the_shadow_check_sees_a_clash(tmp_path):
    # the check above on a folder that does shadow, so that it cannot pass by seeing nothing
    (tmp_path / "pytest.py").write_text("")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "bench_helpers.py").write_text("")
    assert _shadowing([tmp_path]) == [
        f"{tmp_path}/json: a standard module",
        f"{tmp_path}/pytest: pytest installs `pytest`",
    ]


def test_this_environment_is_the_lock():
    """Under CI's sessions (nox sets MEGASCALE_LOCK), every installed distribution is the lock's version: a
    dependency added without `nox -s lock` is named here, not found later as an upstream release."""
    lock = os.environ.get("MEGASCALE_LOCK")
    if not lock:
        pytest.skip("not under a locked nox session (MEGASCALE_LOCK unset)")
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    locked = {}
    for line in Path(lock).read_text().splitlines():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate():
            locked[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    # pip, setuptools and wheel are the virtualenv's own seed; megascale's packages come from the tree
    seeded = {"pip", "setuptools", "wheel"}
    # this environment's own installs, not copies a package vendors and puts on sys.path (setuptools' _vendor,
    # once something imports setuptools)
    site = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    drift = sorted(
        f"{name} {dist.version} (lock: {locked.get(name, 'absent')})"
        for dist in metadata.distributions(path=site)
        if (name := canonicalize_name(dist.metadata["Name"])) not in seeded
        and not name.startswith("megascale-")
        and locked.get(name) != dist.version.split("+")[0]
    )
    assert not drift, f"installed beside or against {lock}; run `nox -s lock`: " + ", ".join(drift)
