"""megascale-ft: heartbeats, self-checks, two-stage fast checkpoints, broadcast restore, automatic restart.

Works without megascale-core; its Lightning callbacks come with the `lightning` extra. The components land
with the fault-tolerance issue; this package exists now so its à-la-carte install is tested.
Names are imported on first use, so `import megascale.ft` stays light (it does not import torch).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("megascale-ft")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "CheckpointError": "megascale.ft.manifest",
    "TwoStageCheckpointer": "megascale.ft.checkpoint",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from megascale.ft.checkpoint import TwoStageCheckpointer as TwoStageCheckpointer
    from megascale.ft.manifest import CheckpointError as CheckpointError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megascale.ft' has no attribute {name!r}")
