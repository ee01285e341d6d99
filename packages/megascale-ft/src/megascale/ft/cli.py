"""``megascale-ft``: run a training command with heartbeats, self-checks and automatic restarts.

    megascale-ft launch --nproc-per-node 4 --max-restarts 3 --storage s3://bucket/run1 -- train.py --steps 1000

The token of the heartbeats is random per run unless ``MEGASCALE_FT_TOKEN`` or ``--token-file`` gives one
(never on the command line, where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megascale.ft.config import DriverAddress, Timeouts, TLSConfig
from megascale.ft.launcher import LaunchConfig, Launcher

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale-ft", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser(
        "launch", help="run a training command under torchrun, watch it, restart it on faults",
        description="Run COMMAND (script.py args, or -m module args) on --nproc-per-node ranks under torchrun.",
    )  # fmt: skip
    d, t = LaunchConfig(), Timeouts()
    launch.add_argument("--nproc-per-node", type=int, default=d.nproc_per_node)
    launch.add_argument("--max-restarts", type=int, default=d.max_restarts)
    launch.add_argument("--repeat-limit", type=int, default=d.repeat_limit,
                        help="stop after this many consecutive attempts that failed the same way")  # fmt: skip
    launch.add_argument("--heartbeat-interval", type=float, default=t.heartbeat_interval)
    launch.add_argument("--hang-timeout", type=float, default=t.hang_timeout)
    launch.add_argument("--collective-timeout", type=float, default=t.collective_timeout)
    launch.add_argument("--startup-timeout", type=float, default=t.startup_timeout)
    launch.add_argument("--host", default=DriverAddress().host, help="heartbeat server address (loopback)")
    launch.add_argument("--port", type=int, default=0, help="heartbeat server port (0: a free one)")
    launch.add_argument("--token-file", type=Path, help="file holding the heartbeat token")
    launch.add_argument("--tls-cert", help="PEM certificate of the heartbeat server (required off loopback)")
    launch.add_argument("--tls-key", help="PEM private key of --tls-cert")
    launch.add_argument("--tls-ca", help="what ranks verify the certificate with (default: the certificate)")
    launch.add_argument("--no-self-check", action="store_true", help="skip the self-checks before attempts")
    launch.add_argument("--self-check-timeout", type=float, default=d.self_check_timeout)
    launch.add_argument("--storage", help="checkpoint storage URL the self-check probes")
    launch.add_argument("--run-dir", default=d.run_dir, help="report, self-check reports, timeline")
    launch.add_argument("--straggler-threshold", type=float, default=d.straggler_threshold)
    launch.add_argument("-v", "--verbose", action="store_true")
    launch.add_argument("training", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    return parser


def _tls(args: argparse.Namespace) -> TLSConfig | None:
    if args.tls_cert is None and args.tls_key is None:
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="[megascale-ft %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )  # fmt: skip
    command = args.training[1:] if args.training[:1] == ["--"] else args.training
    token = os.environ.get("MEGASCALE_FT_TOKEN")
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
    try:
        config = LaunchConfig(
            nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts, repeat_limit=args.repeat_limit,
            timeouts=Timeouts(args.heartbeat_interval, args.hang_timeout, args.collective_timeout,
                              args.startup_timeout),
            address=DriverAddress(args.host, args.port), token=token, self_check=not args.no_self_check,
            self_check_timeout=args.self_check_timeout, storage=args.storage, run_dir=args.run_dir,
            straggler_threshold=args.straggler_threshold, tls=_tls(args),
        )  # fmt: skip
        launcher = Launcher(command, config)
        if not command:
            raise ValueError("no training command: give it after '--', e.g. -- train.py --steps 100")
    except ValueError as e:
        print(f"megascale-ft: error: {e}", file=sys.stderr)
        return 2
    return 0 if launcher.run().ok else 1


if __name__ == "__main__":
    sys.exit(main())
