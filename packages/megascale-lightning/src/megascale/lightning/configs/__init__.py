"""Example LightningCLI configs shipped inside megascale-lightning (YAML files next to this module).

    megascale configs                               # list them with their paths
    megascale fit --config tiny_cpu.yaml            # run one by name (a local file of that name wins)

    from megascale.lightning import configs
    configs.names()                                 # ['gpt_1b_8gpu.yaml', 'tiny_cpu.yaml', 'tp2_dp2_cpu.yaml']
    configs.path("tiny_cpu.yaml")                   # its path on disk, to read or copy and edit

tiny_cpu.yaml runs anywhere (one CPU process). tp2_dp2_cpu.yaml and gpt_1b_8gpu.yaml use MegaScaleStrategy.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["names", "path"]

_DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped config file names, sorted."""
    return sorted(p.name for p in _DIR.glob("*.yaml"))


def path(name: str) -> Path:
    """The path of the shipped config ``name`` (e.g. "tiny_cpu.yaml"; the ".yaml" may be left out)."""
    if not name.endswith(".yaml"):
        name += ".yaml"
    candidate = _DIR / name
    if not candidate.is_file():
        raise FileNotFoundError(f"no shipped config {name!r}; shipped: {names()}")
    return candidate
