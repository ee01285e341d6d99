"""megascale-ft: heartbeats, self-checks, two-stage fast checkpoints, broadcast restore, automatic restart.

Works without megascale-core; its Lightning callback comes with the `lightning` extra, its pictures with
the `plots` extra.
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
    "AgentConfig": "megascale.ft.agent",
    "CheckpointError": "megascale.ft.manifest",
    "ClusterConfig": "megascale.ft.driver",
    "ClusterDriver": "megascale.ft.driver",
    "DriverAddress": "megascale.ft.config",
    "Executor": "megascale.ft.executor",
    "GCSchedule": "megascale.ft.sync_gc",
    "FaultTolerance": "megascale.ft.lightning",
    "LaunchConfig": "megascale.ft.launcher",
    "Launcher": "megascale.ft.launcher",
    "NodeAgent": "megascale.ft.agent",
    "NonFiniteLossError": "megascale.ft.executor",
    "SelfCheckReport": "megascale.ft.selfcheck",
    "StepTimer": "megascale.ft.timing",
    "SynchronizedGC": "megascale.ft.gc_callback",
    "Straggler": "megascale.ft.stragglers",
    "Timeouts": "megascale.ft.config",
    "TwoStageCheckpointer": "megascale.ft.checkpoint",
    "find_stragglers": "megascale.ft.stragglers",
    "plot_step_heatmap": "megascale.ft.timeline",
    "plot_timeline": "megascale.ft.timeline",
    "run_self_checks": "megascale.ft.selfcheck",
    "write_chrome_trace": "megascale.ft.timeline",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from megascale.ft.agent import AgentConfig as AgentConfig
    from megascale.ft.agent import NodeAgent as NodeAgent
    from megascale.ft.checkpoint import TwoStageCheckpointer as TwoStageCheckpointer
    from megascale.ft.config import DriverAddress as DriverAddress
    from megascale.ft.config import Timeouts as Timeouts
    from megascale.ft.driver import ClusterConfig as ClusterConfig
    from megascale.ft.driver import ClusterDriver as ClusterDriver
    from megascale.ft.executor import Executor as Executor
    from megascale.ft.executor import NonFiniteLossError as NonFiniteLossError
    from megascale.ft.gc_callback import SynchronizedGC as SynchronizedGC
    from megascale.ft.launcher import LaunchConfig as LaunchConfig
    from megascale.ft.launcher import Launcher as Launcher
    from megascale.ft.lightning import FaultTolerance as FaultTolerance
    from megascale.ft.manifest import CheckpointError as CheckpointError
    from megascale.ft.selfcheck import SelfCheckReport as SelfCheckReport
    from megascale.ft.selfcheck import run_self_checks as run_self_checks
    from megascale.ft.stragglers import Straggler as Straggler
    from megascale.ft.stragglers import find_stragglers as find_stragglers
    from megascale.ft.sync_gc import GCSchedule as GCSchedule
    from megascale.ft.timeline import plot_step_heatmap as plot_step_heatmap
    from megascale.ft.timeline import plot_timeline as plot_timeline
    from megascale.ft.timeline import write_chrome_trace as write_chrome_trace
    from megascale.ft.timing import StepTimer as StepTimer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megascale.ft' has no attribute {name!r}")
