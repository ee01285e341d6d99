"""``python -m megascale.ft.torchrun ARGS``: torchrun on one machine, with its store on loopback only.

torchrun's ranks share a TCP store that its agent hosts (the static rendezvous of ``--master-addr`` and
``--master-port``). torch's TCPStore listens on every interface whatever host it is given, and a store has no
authentication: whoever reaches the port can read and write the job's keys. So this binds the store's socket
first, on 127.0.0.1 and a port the kernel picks, opens the store on it as a multi-tenant server, and then runs
torchrun (``torch.distributed.run``) in this same process at that address: when torchrun's agent asks for a
multi-tenant store on that port it gets this one (torch keeps one server per port in a process). Binding
first also leaves no window between choosing a port and binding it, in which another connection may take it.

ARGS are torchrun's, without ``--master-addr``/``--master-port``/``--rdzv-*``: one machine only (attempts across
nodes rendezvous at the stores of megascale-ft's driver, which are bound the same way).
"""

from __future__ import annotations

import socket
import sys

HOST = "127.0.0.1"


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default: this process's arguments) and a loopback store."""
    import torch.distributed as dist
    from torch.distributed.run import main as torchrun

    args = sys.argv[1:] if argv is None else argv
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(  # noqa: F841 -- torchrun's agent finds it by port while it lives
            HOST, port, is_master=True, multi_tenant=True, wait_for_workers=False,
            master_listen_fd=sock.fileno(), use_libuv=True,
        )  # fmt: skip
        torchrun([f"--master-addr={HOST}", f"--master-port={port}", *args])


if __name__ == "__main__":
    main()
