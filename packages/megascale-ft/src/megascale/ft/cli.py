"""``megascale-ft``: run a training command with heartbeats, self-checks and automatic restarts.

    megascale-ft launch --nproc-per-node 4 --max-restarts 3 --storage s3://bucket/run1 -- train.py --steps 1000

Across nodes, every node runs ``launch --nnodes N --node-rank K``; the first also runs the driver (give it
``--host``/``--port`` the others reach, with ``--tls-cert/--tls-key``), the others add ``--driver URL``::

    megascale-ft launch --nnodes 2 --nproc-per-node 8 --node-rank 0 --host 10.0.0.1 --port 29400 --tls-cert c.pem --tls-key k.pem -- train.py
    megascale-ft launch --nnodes 2 --nproc-per-node 8 --node-rank 1 --driver https://10.0.0.1:29400 --tls-ca c.pem -- train.py

The token of the heartbeats is random per run unless ``MEGASCALE_FT_TOKEN`` or ``--token-file`` gives one
(never on the command line, where ``ps`` would show it). Every option can also come from the environment,
``MEGASCALE_FT_<OPTION>`` (``MEGASCALE_FT_NNODES=2``, ``MEGASCALE_FT_DRIVER=https://...``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import sys
import threading
from pathlib import Path

from megascale.ft.agent import AgentConfig, NodeAgent
from megascale.ft.cli_errors import report_user_errors
from megascale.ft.config import DriverAddress, Timeouts, TLSConfig
from megascale.ft.driver import ClusterConfig, ClusterDriver
from megascale.ft.launcher import LaunchConfig, Launcher

log = logging.getLogger("megascale.ft")

__all__ = ["main"]


def _driver_options(parser: argparse.ArgumentParser) -> None:
    """What the one-machine launcher and the multi-node driver share."""
    d, t = LaunchConfig(), Timeouts()
    parser.add_argument("--nproc-per-node", type=int, default=d.nproc_per_node)
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts)
    parser.add_argument("--repeat-limit", type=int, default=d.repeat_limit,
                        help="stop after this many consecutive attempts that failed the same way")  # fmt: skip
    parser.add_argument("--heartbeat-interval", type=float, default=t.heartbeat_interval)
    parser.add_argument("--hang-timeout", type=float, default=t.hang_timeout)
    parser.add_argument("--collective-timeout", type=float, default=t.collective_timeout)
    parser.add_argument("--startup-timeout", type=float, default=t.startup_timeout)
    parser.add_argument("--host", default=DriverAddress().host, help="heartbeat server address (loopback)")
    parser.add_argument("--port", type=int, default=0, help="heartbeat server port (0: a free one)")
    parser.add_argument("--token-file", type=Path, help="file holding the heartbeat token")
    parser.add_argument("--tls-cert", help="PEM certificate of the heartbeat server (required off loopback)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="what ranks verify the certificate with (default: the certificate)")
    parser.add_argument("--no-self-check", action="store_true", help="skip the self-checks before attempts")
    parser.add_argument("--self-check-timeout", type=float, default=d.self_check_timeout)
    parser.add_argument("--storage", help="checkpoint storage URL the self-check probes")
    parser.add_argument("--run-dir", default=d.run_dir,
                        help="where report.json, self-check reports, timeline.json/.png and a hang's stacks go "
                        "(default: ./%(default)s)")  # fmt: skip
    parser.add_argument("--straggler-threshold", type=float, default=d.straggler_threshold)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--traceback", action="store_true", help="show the full trace of an error")


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    c = ClusterConfig(token="x" * 16)
    parser.add_argument("--nnodes", default="1", help="nodes per attempt, N or MIN:MAX (fewer: dp shrinks)")
    parser.add_argument("--node-timeout", type=float, default=c.node_timeout,
                        help="seconds to wait for enough healthy nodes (at the start, for spares)")  # fmt: skip
    parser.add_argument("--evict-after", type=int, default=c.evict_after,
                        help="evict a node behind this many faults of the same kind")  # fmt: skip
    parser.add_argument(
        "--rdzv-endpoint", help="HOST:PORT where the driver hosts torchrun's rendezvous store"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale-ft", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser(
        "launch", help="run a training command under torchrun, watch it, restart it on faults",
        description="Run COMMAND (script.py args, or -m module args) on --nproc-per-node ranks under torchrun; "
        "with --nnodes N, as one node of a multi-node run (the first node also runs the driver, unless "
        "--driver names one).",
    )  # fmt: skip
    _driver_options(launch)
    _cluster_options(launch)
    launch.add_argument("--node-rank", help="this node's name in reports (default: the host name)")
    launch.add_argument("--driver", help="URL of the run's driver (the first node's --host/--port, or "
                        "`megascale-ft driver`); without it this node runs the driver")  # fmt: skip
    launch.add_argument("--no-warm", action="store_true",
                        help="multi-node: no warm spares; every attempt is a fresh torchrun (c10d rendezvous)")  # fmt: skip
    launch.add_argument("--warm-spares", type=int, default=AgentConfig.warm_spares,
                        help="multi-node: warm groups (one process per local rank, torch and the script's imports "
                        "loaded, self-checked ahead) waiting on this node while an attempt runs")  # fmt: skip
    launch.add_argument("--restart-in-place", action="store_true",
                        help="multi-node, warm: after a failure that leaves a node's ranks alive (an exception, a "
                             "peer's death), run the next attempt in the same processes (the script runs again "
                             "as __main__: module-level state it changed stays changed)")  # fmt: skip
    launch.add_argument("--warm-import", default="", metavar="MODULE[,MODULE...]",
                        help="modules the warm spares import ahead besides torch and the script's top-level "
                        "imports (never ones that initialise CUDA or start threads: the ranks are forked)")  # fmt: skip
    launch.add_argument("training", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    _env_defaults(launch)
    driver = commands.add_parser(
        "driver", help="drive a multi-node run on its own (every node runs `launch --driver URL`)",
        description="Receive every rank's heartbeats and every node agent's reports; restart, evict, take spares.",
    )  # fmt: skip
    _driver_options(driver)
    _cluster_options(driver)
    _env_defaults(driver)
    return parser


ENV_PREFIX = "MEGASCALE_FT_"


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's default from ``MEGASCALE_FT_<OPTION>`` when set (``--nnodes`` from
    ``MEGASCALE_FT_NNODES``, ``--driver`` from ``MEGASCALE_FT_DRIVER``, ...): a container (Kubernetes) can
    configure a node by its environment alone. The command line still wins."""
    for action in parser._actions:
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None or action.dest in ("help", "training", "command"):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            parser.set_defaults(**{action.dest: value.lower() in ("1", "true", "yes")})
        else:
            parser.set_defaults(**{action.dest: action.type(value) if callable(action.type) else value})


def _tls(args: argparse.Namespace) -> TLSConfig | None:
    if args.tls_cert is None and args.tls_key is None:
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)


def _nnodes(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes takes N or MIN:MAX, got {text!r}") from None


def _config(args: argparse.Namespace, token: str | None) -> LaunchConfig:
    common = dict(
        nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts, repeat_limit=args.repeat_limit,
        timeouts=Timeouts(args.heartbeat_interval, args.hang_timeout, args.collective_timeout,
                          args.startup_timeout),
        address=DriverAddress(args.host, args.port), token=token, self_check=not args.no_self_check,
        self_check_timeout=args.self_check_timeout, storage=args.storage, run_dir=args.run_dir,
        straggler_threshold=args.straggler_threshold, tls=_tls(args),
    )  # fmt: skip
    low, high = _nnodes(args.nnodes)
    if args.command == "launch" and high == 1 and args.driver is None:
        return LaunchConfig(**common)  # type: ignore[arg-type]
    return ClusterConfig(**common, nnodes=high, min_nodes=low, node_timeout=args.node_timeout,  # type: ignore[arg-type]
                         evict_after=args.evict_after, rdzv_endpoint=args.rdzv_endpoint)  # fmt: skip


def _agent(args: argparse.Namespace, command: list[str], config: LaunchConfig, url: str) -> NodeAgent:
    assert config.token is not None
    return NodeAgent(command, AgentConfig(
        node=args.node_rank or socket.gethostname(), driver_url=url, token=config.token,
        nproc_per_node=config.nproc_per_node, run_dir=config.run_dir, storage=config.storage,
        cafile=args.tls_ca or args.tls_cert, driver_timeout=config.timeouts.startup_timeout,
        warm=not args.no_warm, warm_spares=args.warm_spares, in_place=args.restart_in_place,
        warm_imports=[m.strip() for m in args.warm_import.split(",") if m.strip()],
        self_check=config.self_check,
        check_timeout=min(config.self_check_timeout, config.timeouts.collective_timeout),
    ))  # fmt: skip


def _run_node(args: argparse.Namespace, command: list[str], config: ClusterConfig) -> int:
    """One node of a multi-node run; with no --driver, this node also runs the driver (in a thread)."""
    if args.driver is not None:
        return _agent(args, command, config, args.driver.rstrip("/")).run()
    driver = ClusterDriver(config)
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(driver.run().ok), name="megascale-ft-driver")
    thread.start()
    while not driver.ready.wait(0.1):
        if not thread.is_alive():
            return 1  # the driver could not start (its error is in the log)
    code = _agent(args, command, config, driver.url).run()
    if code == 3:
        log.warning("this node was evicted; the driver on it goes on with the others")
    thread.join()
    return 0 if outcome and outcome[0] else 1


def main(argv: list[str] | None = None) -> int:
    """Run ``megascale-ft``; the exit code (2: a usage error, printed in one line; ``--traceback``: its
    trace)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="[megascale-ft %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )  # fmt: skip
    return report_user_errors(f"megascale-ft {args.command}", lambda: _run(args), traceback=args.traceback)


def read_token_file(path: Path) -> str:
    """The token in ``path``, which only its owner may read or write (like an ssh key): a token others on
    the machine can read lets them forge heartbeats and orders."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(
            f"--token-file {path} is readable or writable by group or others (mode {stat.S_IMODE(mode):o}): "
            f"anyone on the machine could forge heartbeats and orders with it; run `chmod 600 {path}`"
        )
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty: put the job's token in it")
    return token


def _run(args: argparse.Namespace) -> int:
    command = (
        []
        if args.command == "driver"
        else args.training[1:]
        if args.training[:1] == ["--"]
        else args.training
    )
    token = os.environ.get("MEGASCALE_FT_TOKEN")
    if args.token_file is not None:
        token = read_token_file(args.token_file)
    config = _config(args, token)
    if args.command == "launch" and not command:
        raise ValueError("no training command: give it after '--', e.g. -- train.py --steps 100")
    if args.command == "driver":
        assert isinstance(config, ClusterConfig)
        return 0 if ClusterDriver(config).run().ok else 1
    if isinstance(config, ClusterConfig):
        return _run_node(args, command, config)
    launcher = Launcher(command, config)
    report = launcher.run()
    if launcher.usage_error is not None:
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
