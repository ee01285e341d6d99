"""Typed settings of fault tolerance: the timeout hierarchy and where the driver listens.

Dataclasses with plain fields, so jsonargparse (the ``megascale-ft launch`` CLI, LightningCLI) can fill them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

__all__ = ["DriverAddress", "TLSConfig", "Timeouts"]


@dataclass(frozen=True)
class Timeouts:
    """How fast a fault is noticed, as one validated hierarchy.

    Args:
        heartbeat_interval: seconds between two heartbeats of a rank.
        hang_timeout: a rank is hung when no heartbeat arrived, or its step did not advance, for this long.
        collective_timeout: the ranks' ``torch.distributed`` timeout. Longer than ``hang_timeout``, so the
            driver names the rank that stopped before the collectives fail on every healthy rank (which
            would blame them all).
        startup_timeout: the time a rank has from its start to its first finished step (importing torch,
            loading a checkpoint, compiling) before it counts as hung.

    The hierarchy ``heartbeat_interval`` × 2 ≤ ``hang_timeout`` < ``collective_timeout`` is checked: one lost
    heartbeat must not make a rank look hung.
    """

    heartbeat_interval: float = 5.0
    hang_timeout: float = 60.0
    collective_timeout: float = 300.0
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0 s, got {self.heartbeat_interval}")
        if self.hang_timeout < 2 * self.heartbeat_interval:
            raise ValueError(
                f"hang_timeout ({self.hang_timeout} s) must be at least twice heartbeat_interval "
                f"({self.heartbeat_interval} s), so one late heartbeat does not look like a hang: raise "
                "hang_timeout or send heartbeats more often"
            )
        if self.collective_timeout <= self.hang_timeout:
            raise ValueError(
                f"collective_timeout ({self.collective_timeout} s) must be longer than hang_timeout "
                f"({self.hang_timeout} s): otherwise the collectives of every healthy rank time out before "
                "the driver finds the rank that hangs"
            )
        if self.startup_timeout < self.hang_timeout:
            raise ValueError(
                f"startup_timeout ({self.startup_timeout} s) must be at least hang_timeout ({self.hang_timeout} s)"
            )


@dataclass(frozen=True)
class TLSConfig:
    """The driver's TLS certificate and key (PEM files), for heartbeats that cross the network; ranks verify
    the certificate against ``cafile`` (default: the certificate itself, for a self-signed one)."""

    certfile: str
    keyfile: str
    cafile: str | None = None

    @property
    def verify_with(self) -> str:
        return self.cafile or self.certfile


@dataclass(frozen=True)
class DriverAddress:
    """Where the driver's heartbeat server listens.

    Args:
        host: address to bind, loopback by default. Bind a cluster-internal interface for multi-node jobs;
            ``0.0.0.0`` is refused unless ``allow_any`` (every interface, reachable from outside).
        port: TCP port; 0 picks a free one.
        allow_any: permit binding every interface.
    """

    host: str = "127.0.0.1"
    port: int = 0
    allow_any: bool = field(default=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        try:
            unspecified = ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            unspecified = self.host == ""
        if unspecified and not self.allow_any:
            raise ValueError(
                f"refusing to bind the heartbeat server to every interface ({self.host!r}): give the "
                "address of the interface the ranks reach the driver on, or set allow_any=True"
            )
