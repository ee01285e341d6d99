"""megascale-ft: heartbeats, self-checks, two-stage fast checkpoints, broadcast restore, automatic restart.

Works without megascale-core; its Lightning callbacks come with the `lightning` extra. The components land
with the fault-tolerance issue; this package exists now so its à-la-carte install is tested.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megascale-ft")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
