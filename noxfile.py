"""Sessions for the megascale monorepo.

    nox                 what CI runs (session ``ci``): lint, each package's tests with that package installed
                        alone (the à-la-carte proof; the conformance matrix with megascale-lightning's), the
                        tests that need several packages and the type check (all installed together), docs,
                        in two lanes side by side (``LANES``). The CI tier: tests marked ``slow`` are left
                        out (see below). ``nox -s lint core lightning data ft integration docs`` runs the
                        same one after another
    nox -s slow         the slow tier, all packages installed together: what repeats a feature the CI tier
                        proves, under more layouts or faults, or runs an example end to end for minutes
    nox -s tests        every package installed together, both tiers
    nox -s core         megascale-core alone (likewise lightning, data, ft), CI tier
    nox -s integration  all packages together, the tests that need several (megascale-ft on MegaScaleStrategy)
    nox -s conformance  Lightning's contract: every scenario x layout against one process (``-- --seeds 50``
                        draws 50 model shapes per cell instead of 1)
    nox -s conformance_fuzz  generated cases (``-- --cases N --seed S``), failures shrunk to their fewest features
    nox -s typecheck    mypy alone (CI runs it in the integration session, whose environment has everything)
    nox -s demo         the main job: a real training run on the embedded default data
    nox -s chaos        the chaos soak: the main job's model under megascale-ft with random faults, 30 minutes
    nox -s benchmarks   print each benchmark's figures (slow; not part of CI)
    nox -s lock         resolve .ci/constraints.txt anew: the newest releases the packages allow today
    nox -s latest       the CI tier with the newest releases the packages allow (not the lock), all packages
                        together; says which versions differ from the lock. Not part of CI's gate

Every session installs through .ci/constraints.txt, the lock: one version of every package CI installs, so a
release upstream cannot turn main red between two commits. It is written by ``nox -s lock`` from
.ci/pins.txt (torch pinned to the CPU build that lies on disk here: without it pip would resolve a multi-GB
CUDA build) and the requirements below; refreshing it is a commit of its own. The packages themselves
declare ranges; ``nox -s latest`` tests what those ranges give a user today.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import nox

# Installs skip byte-compiling (--no-compile, below); Python then compiles what a test imports on first import
# and caches it, unless PYTHONDONTWRITEBYTECODE is set (it is on some CI images): then every rank process of
# every test compiled torch and Lightning from source again (importing Lightning: 34 s instead of 14 s here).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

SESSIONS = ["lint", "core", "lightning", "data", "ft", "integration", "docs"]
# CI's tier: a test marked slow repeats what another proves (more layouts, more faults) or runs minutes of an
# example; `nox -s slow` runs them. CI must stay under 40 minutes on 2 cores.
CI_TIER = ["-m", "not slow"]
# CI runs SESSIONS in two lanes at once: one suite leaves the 2 cores ~40% idle (one rank importing while its
# peer waits, heartbeat and restart waits of megascale-ft), which the other lane uses. Balanced by the
# sessions' lengths run alone (lightning 12 min, integration 11, core 7, ft 7, data 4).
LANES = (["lightning", "ft", "docs"], ["lint", "core", "data", "integration"])
assert sorted(s for lane in LANES for s in lane) == sorted(SESSIONS)
nox.options.sessions = ["ci"]
nox.options.error_on_missing_interpreters = True

# CI's machine has a few GB of disk to spare: the seven environments of one run (torch in each, triton in two,
# transformers and datasets in the integration one) took 8.3 GB and a run failed with "No space left on device".
# Under `ci` every session deletes its environment when it ends, so at most one per lane exists at a time
# (~4 GB at the peak: integration beside ft); `nox -s NAME` keeps it for reuse (`-r`).
DISCARD_VENVS = "MEGASCALE_NOX_DISCARD_VENVS"

CONSTRAINTS = ".ci/constraints.txt"  # the lock (nox -s lock)
PINS = ".ci/pins.txt"  # what the lock and `latest` hold fixed by hand (torch's CPU build)
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3"]
PACKAGES = {
    "core": "packages/megascale-core[triton]",
    "lightning": "packages/megascale-lightning[plots]",
    "data": "packages/megascale-data[s3,lightning,parquet,zstd,webdataset]",
    "ft": "packages/megascale-ft[lightning,s3,plots]",
}
# What a package's tests need beyond the package itself (test tools, servers), never another megascale package.
EXTRA_TEST_DEPS = {
    # transformers: the reference the Hugging Face conversions are tested against (Qwen3 needs >= 4.51)
    # torchao: the fp8 option's float8 GEMMs (tests/core/test_fp8.py runs them on the CPU)
    "core": ["transformers>=4.51", "safetensors>=0.4", "torchao>=0.18"],
    "lightning": ["transformers>=4.51", "safetensors>=0.4"],
    "data": ["moto[server]>=5", "tokenizers>=0.19"],
    "ft": ["moto[server]>=5"],
}
# What tests/integration and the benchmarks need beyond the packages: the Parquet + BPE data benchmark's
# baseline (Hugging Face datasets streaming) and its tokenizer, and the Hugging Face example (a tiny model
# written by transformers, read through safetensors).
BENCH_DEPS = ["datasets>=2.19", "tokenizers>=0.19", "transformers>=4.51", "safetensors>=0.4"]
DOCS_DEPS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]
LINT_DEPS = ["ruff>=0.6"]
TYPECHECK_DEPS = ["mypy>=1.10"]
# nox itself (the README's test command installs it through the lock) and uv (`nox -s lock` resolves with it)
TOOL_DEPS = ["nox", "uv"]


def _discarded_under_ci(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """The session, deleting its environment when it ends if DISCARD_VENVS is set (by `ci`)."""

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        try:
            func(session)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if os.environ.get(DISCARD_VENVS) == "1" and location and Path(location, "pyvenv.cfg").is_file():
                shutil.rmtree(location, ignore_errors=True)

    return run


def _install(session: nox.Session, *requirements: str, constraints: str = CONSTRAINTS) -> None:
    # --no-compile: byte-compiling all of torch, transformers and Lightning at install time took most of each
    # session's set-up (42 s of torch's 54 s here); Python compiles what a test imports, when it imports it.
    session.install("--no-compile", "-c", constraints, "torch")  # first, so nothing can pull a CUDA build
    if requirements:
        session.install("--no-compile", "-c", constraints, *requirements)


def _pytest(session: nox.Session, *args: str, locked: bool = True) -> None:
    # No pytest-xdist: on 2 cores the suites compute as much as they wait (every rank process imports torch and
    # Lightning); two test files at once made the fault tests slower (ft: 18 min against 11) and flaky.
    # MEGASCALE_LOCK: tests/test_packaging.py checks that the environment holds the lock's versions
    env = {"PYTHONHASHSEED": "0", **({"MEGASCALE_LOCK": str(Path(CONSTRAINTS).resolve())} if locked else {})}
    session.run("python", "-m", "pytest", *args, *session.posargs, env=env)


def _mypy(session: nox.Session) -> None:
    packages = ["megascale.core", "megascale.lightning", "megascale.data", "megascale.ft"]
    session.run("mypy", *(arg for name in packages for arg in ("-p", name)))


def _package_session(name: str) -> None:
    @nox.session(name=name)
    @_discarded_under_ci
    def run(session: nox.Session) -> None:
        # megascale-lightning depends on megascale-core (same version), which is not on an index: install
        # it from the tree first, exactly as its requirement pins it.
        local_deps = ["packages/megascale-core"] if name == "lightning" else []
        _install(session, *local_deps, PACKAGES[name], *TEST_DEPS, *EXTRA_TEST_DEPS[name])
        # the conformance matrix needs exactly megascale-lightning's environment: run it here, one install less
        paths = [f"tests/{name}", *(["tests/conformance"] if name == "lightning" else [])]
        _pytest(session, *CI_TIER, *paths, "tests/test_packaging.py")

    run.__doc__ = f"megascale-{name} installed alone with its declared dependencies; its tests."


for _name in PACKAGES:
    _package_session(_name)


@nox.session
def tests(session: nox.Session) -> None:
    """All packages together, all tests."""
    deps = [dep for name in PACKAGES for dep in EXTRA_TEST_DEPS[name]]
    _install(session, "packages/megascale-core", *PACKAGES.values(), *TEST_DEPS, *deps, *BENCH_DEPS)
    _pytest(session, "tests")


@nox.session
def slow(session: nox.Session) -> None:
    """The slow tier (tests marked slow), every package installed together."""
    deps = [dep for name in PACKAGES for dep in EXTRA_TEST_DEPS[name]]
    _install(session, "packages/megascale-core", *PACKAGES.values(), *TEST_DEPS, *deps, *BENCH_DEPS)
    _pytest(session, "-m", "slow", "tests")


@nox.session
@_discarded_under_ci
def integration(session: nox.Session) -> None:
    """All four packages installed together: the type check, and the tests that need several packages
    (tests/integration), CI tier."""
    _install(session, "packages/megascale-core", *PACKAGES.values(), *TEST_DEPS, *BENCH_DEPS, *TYPECHECK_DEPS)
    _mypy(session)
    _pytest(session, *CI_TIER, "tests/integration")


@nox.session(venv_backend="none")
def ci(session: nox.Session) -> None:
    """What CI runs: every session of SESSIONS, in the two LANES side by side (each lane a nox of its own, its
    lines prefixed with its first session's name); fails if any session failed."""
    free = shutil.disk_usage(".").free / 2**30
    session.log(f"{free:.1f} GiB free on this disk; each lane deletes its environments as it goes")
    # no pip cache either: every wheel is installed once per environment and never again
    env = {**os.environ, DISCARD_VENVS: "1", "PIP_NO_CACHE_DIR": "1"}
    lanes = []
    for lane in LANES:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nox", "-s", *lane, "--", *session.posargs],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
        )  # fmt: skip
        failures: list[str] = []
        echo = threading.Thread(target=_echo, args=(proc, f"[{'+'.join(lane)}] ", failures))
        echo.start()
        lanes.append((lane, proc, echo, failures))
    failed = []
    for lane, proc, echo, failures in lanes:
        proc.wait()
        echo.join()
        if proc.returncode:
            failed.append("+".join(lane))
            # the lanes' lines interleave and a CI log is often read from its end: what failed, said again last
            session.log(f"[{'+'.join(lane)}] what failed:")
            for line in failures or ["(no test failed: see the lane's session output above)"]:
                session.log(f"    {line}")
    if failed:
        session.error(f"failed: {', '.join(failed)} (each lane's own summary is above)")


# pytest's one-line outcomes and nox's session verdicts: what `ci` repeats at the end when a lane failed
_FAILURE_LINE = re.compile(
    r"^(FAILED |ERROR |nox > Session \S+ (failed|aborted|interrupted))|^=+ .*(failed|error)"
)


def _echo(proc: subprocess.Popen, prefix: str, failures: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
        if _FAILURE_LINE.search(line):
            failures.append(line.rstrip()[:400])


def _locked_requirements() -> list[str]:
    """Everything any session installs: what `nox -s lock` resolves (local packages as ./ paths)."""
    extras = [dep for deps in EXTRA_TEST_DEPS.values() for dep in deps]
    local = [f"./{spec}" for spec in ["packages/megascale-core", *PACKAGES.values()]]
    tools = [*TEST_DEPS, *BENCH_DEPS, *DOCS_DEPS, *LINT_DEPS, *TYPECHECK_DEPS, *TOOL_DEPS]
    return [*local, *extras, *tools]


@nox.session
def lock(session: nox.Session) -> None:
    """Resolve .ci/constraints.txt anew (uv pip compile): the newest releases every package CI installs
    may have beside .ci/pins.txt, for every Python the packages support (markers where they differ). Run it
    deliberately, commit the result alone, after `nox -s latest` passed with the same versions."""
    session.install("-c", CONSTRAINTS, "uv")
    requirements = Path(session.create_tmp(), "requirements.in")
    requirements.write_text("\n".join(_locked_requirements()) + "\n")
    local = [arg for name in PACKAGES for arg in ("--no-emit-package", f"megascale-{name}")]
    session.run(
        "uv", "pip", "compile", "--universal", "--python-version", "3.10", "--upgrade", "--quiet",
        "--custom-compile-command", "nox -s lock", "-c", PINS, *local, str(requirements), "-o", CONSTRAINTS,
    )  # fmt: skip
    lines = Path(CONSTRAINTS).read_text().splitlines()
    header = [
        "# CI's lock: every package any nox session installs, one version each (per Python where markers say).",
        f"# Written by `nox -s lock` from {PINS} and noxfile.py's requirement lists; do not edit by hand.",
    ]
    body = [line.replace(f"-r {requirements}", "-r noxfile.py") for line in lines]
    Path(CONSTRAINTS).write_text("\n".join([*header, *body]) + "\n")
    session.log(f"{CONSTRAINTS}: {sum(1 for line in body if '==' in line)} packages")


def _lock_differences(session: nox.Session) -> list[str]:
    """'name: locked X, installed Y' for each package of the session's environment the lock pins otherwise."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    listing = session.run("python", "-m", "pip", "list", "--format=json", silent=True, log=False)
    installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(str(listing))}
    locked: dict[str, str] = {}
    for line in Path(CONSTRAINTS).read_text().splitlines():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # comments and "# via" annotations
        if req.marker is None or req.marker.evaluate():  # nox's interpreter is the session's (python=None)
            locked[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    return [
        f"{name}: locked {locked[name]}, installed {version}"
        for name, version in sorted(installed.items())
        if name in locked and locked[name] != version.split("+")[0]
    ]


@nox.session
def latest(session: nox.Session) -> None:
    """The CI tier, every package installed together at the newest releases the packages' declared ranges
    allow (only .ci/pins.txt held: torch's CPU build), not the lock: what `pip install megascale-*` gives a user
    today. Says first which versions differ from the lock. Not part of CI's gate: run it before `nox -s lock`,
    and whenever a release upstream may matter (a new torch, Lightning or transformers)."""
    deps = [dep for name in PACKAGES for dep in EXTRA_TEST_DEPS[name]]
    _install(
        session,
        "packages/megascale-core",
        *PACKAGES.values(),
        *TEST_DEPS,
        *deps,
        *BENCH_DEPS,
        constraints=PINS,
    )
    differences = _lock_differences(session)
    session.log(f"{len(differences)} installed versions differ from {CONSTRAINTS}:")
    for line in differences:
        session.log(f"    {line}")
    _pytest(session, *CI_TIER, "tests", locked=False)


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance matrix (tests/conformance): megascale-lightning and megascale-core installed alone, every
    Lightning scenario under every layout against one process; docs/guides/guarantees.md is its table."""
    _install(session, "packages/megascale-core", PACKAGES["lightning"], *TEST_DEPS)
    _pytest(session, "tests/conformance")  # every cell, both tiers


@nox.session
def conformance_fuzz(session: nox.Session) -> None:
    """Generated conformance cases (tests/conformance/generate.py) beyond CI's sample, failures shrunk to their
    fewest features: ``nox -s conformance_fuzz -- --cases 200 --seed 1000`` (``--layouts all``: every layout)."""
    _install(session, "packages/megascale-core", PACKAGES["lightning"], *TEST_DEPS)
    session.run("python", "-m", "tests.conformance.fuzz", *session.posargs)


@nox.session
@_discarded_under_ci
def lint(session: nox.Session) -> None:
    """ruff over packages, tests, benchmarks and examples; no import circles, and layers import downward only."""
    session.install("-c", CONSTRAINTS, *LINT_DEPS)
    paths = ["packages", "tests", "benchmarks", "examples", "noxfile.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.run("python", "tools/import_cycles.py", "--layers")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the public packages."""
    _install(session, "packages/megascale-core", *PACKAGES.values(), *TYPECHECK_DEPS)
    _mypy(session)


@nox.session
@_discarded_under_ci
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings are errors."""
    session.install("-c", CONSTRAINTS, *DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: pretrain a small GPT with tp2 x pp2 on 4 CPU processes on the embedded data (the Python
    standard library as WebDataset shards), with two-stage checkpoints under megascale-ft's launcher.
    Extra arguments go to the CLI, e.g. ``nox -s demo -- --trainer.max_steps 50``."""
    _install(session, "packages/megascale-core", *PACKAGES.values())
    session.run("megascale-data", "stdlib", "--output", ".cache/megascale/stdlib")
    session.run(
        "megascale-ft", "launch", "--nproc-per-node", "4", "--max-restarts", "3", "--run-dir", "runs/main_cpu",
        "--", "-m", "megascale.lightning.cli", "fit", "--config", "examples/configs/main_cpu.yaml",
        *session.posargs,
    )  # fmt: skip


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos soak (issue 25, benchmarks/chaos.py): the main job's model on 2 loopback nodes x 2 ranks
    under megascale-ft's launcher, random faults of every kind for 30 minutes, checked against an
    uninterrupted run of the same steps (run alongside). CI runs a short version (tests/integration/
    test_chaos.py). Arguments replace the defaults, e.g. ``nox -s chaos -- --minutes 5 --faults kill-rank,slow``."""
    _install(session, "packages/megascale-core", *PACKAGES.values())
    default = ["--minutes", "30", "--steps", "1400", "--alongside", "--hang-timeout", "10"]
    session.run("python", "benchmarks/chaos.py", *(session.posargs or default))


@nox.session
def benchmarks(session: nox.Session) -> None:
    """Run every benchmark, or those named (``nox -s benchmarks -- kernel_bench data``); figures go to the terminal,
    to be recorded in benchmarks/RESULTS.md with the command, date and machine."""
    _install(session, "packages/megascale-core", *PACKAGES.values(), *BENCH_DEPS)
    # _-prefixed modules are a benchmark's helpers, not benchmarks
    names = session.posargs or sorted(p.stem for p in Path("benchmarks").glob("[!_]*.py"))
    for name in names:
        session.run("python", f"benchmarks/{name.removesuffix('.py')}.py")
