"""Warm spares: a node's next ranks, already started and with torch imported, waiting for their attempt.

A restart used to pay for process start: torchrun, the c10d rendezvous, and every rank importing Python,
torch and the script's modules (5 s of the 12 s from fault to resumed at 2 × 2 loopback nodes). MegaScale
and ByteRobust keep warm standbys instead; so does the node agent (`megascale.ft.agent`), with a *warm
group* per spare: one supervisor process (this module, ``python -m megascale.ft.warm``) that imports torch,
``torch.distributed`` and the training script's top-level imports once, then forks one worker per local
rank. The workers wait on a pipe. When the driver orders an attempt, the agent sends the group the
attempt's environment (the same one a torchrun worker gets: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ...); each worker sets it and runs the script as ``__main__`` (runpy), so
``init_process_group`` forms a real gloo/NCCL group at a TCP store, like any torchrun job. The supervisor
then plays torchrun's part: it waits for its workers, stops the others a moment after one fails, and exits
with their verdict; its workers are its children (``os.getppid()`` of a rank is the attempt's root, as
under torchrun).

Ranks are assigned by the driver, which knows the nodes of the attempt: node ``i`` of ``n`` gets ranks
``i * nproc .. (i + 1) * nproc - 1``. Every rank is a client of a TCP store the driver opens for this attempt
(``TORCHELASTIC_USE_AGENT_STORE``: no rank hosts a store; a fresh store per attempt, so nothing of a failed
attempt's gloo keys is left behind).

Self-checks run in the group too: the supervisor forks one short-lived checker per local rank (a node-local
gloo group over a `FileStore` in the run directory: no socket listens for it), which exits afterwards, so
the workers that train are never the ones that checked. A spare checks itself once imported, ahead of any
fault; the driver accepts that verdict for nodes the last fault did not touch and has the faulted node (and
nodes new to the run) check again, in their warm group (no process start, no import).

Why fork after importing: one import per node instead of one per rank (on a small machine the imports of
several ranks compete for the same cores), and a fork costs milliseconds. The supervisor never runs a torch
operation, starts a thread or initialises CUDA before forking, so the children start as clean as a fresh
interpreter that imported the same modules. A warm import that initialises CUDA or starts threads breaks
that: leave such modules out (``--warm-import`` adds modules; imports of the script's own directory are
never imported ahead, since they may read the rank's environment at import time).

Protocol (JSON lines): agent → supervisor on ``--command-fd``: ``{"cmd": "check", ...}``, ``{"cmd": "run",
"env": {...}, "ranks": [{...}, ...]}``; supervisor → agent on ``--report-fd``: ``{"event": "ready", ...}``,
``{"event": "checked", ...}``. The supervisor's and workers' stdout/stderr are the agent's, as with torchrun.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["WarmGroup", "rank_env", "script_imports", "split_command"]

log = logging.getLogger("megascale.ft")

# like torchrun's --monitor-interval under the launcher: a failed rank's peers are stopped only after this,
# so the driver hears which rank died first (its peers fail a moment later on the broken connections)
FAILED_PEERS_GRACE_S = 2.0
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL, for the peers of a failed rank
POLL_S = 0.05
# in place: a failed rank's peers fail by themselves once its process group is destroyed (their connections
# to it close), then go through the script's own error handling; a peer still running after this is stopped
IN_PLACE_GRACE_S = 15.0
# in place: how long a failed run's threads and child processes may take to end once it returned
SETTLE_S = 5.0


# --- what to run ----------------------------------------------------------------------------------------------
def split_command(command: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """``(script, module, args)`` of a training command (``script.py args`` or ``-m module args``; a
    leading ``python`` is dropped, as torchrun's launcher does)."""
    command = list(command)
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]
    if not command:
        raise ValueError("no training command: give it after '--', e.g. -- train.py --steps 100")
    if command[0] in ("-m", "--module"):
        if len(command) < 2:
            raise ValueError("-m needs a module name")
        return None, command[1], command[2:]
    return command[0], None, command[1:]


def script_imports(script: str) -> list[str]:
    """Modules the script imports at its top level (``import a.b``, ``from a.b import c``: ``a.b`` and
    ``a.b.c``), without relative imports and ``__future__``: what a warm spare imports ahead."""
    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []  # the script's own run reports what is wrong with it
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.level
            and node.module != "__future__"
        ):
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*")]
    return list(dict.fromkeys(found))


def _outside(name: str, directory: Path) -> bool:
    """``name``'s top-level package resolves somewhere other than ``directory`` (the script's own modules
    are not imported ahead: they may read the rank's environment at import time)."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)  # a namespace package
    return origin is not None and directory not in Path(origin).resolve().parents


def _warm_import(name: str) -> bool:
    """Import ``name`` (a module, or ``module.attribute``: ``from megascale.ft import TwoStageCheckpointer``
    imports what the attribute's lazy import needs). False when it does not import."""
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        pass
    except Exception:  # the script's own run reports it
        return False
    parent, _, attribute = name.rpartition(".")
    try:
        getattr(importlib.import_module(parent), attribute)
        return True
    except Exception:  # the script's own run reports it
        return False


def rank_env(
    *, node_rank: int, nnodes: int, nproc: int, local_rank: int, master: str, run_id: str
) -> dict[str, str]:
    """The variables torchrun gives a worker (``master``: ``host:port`` of the attempt's store, which every
    rank joins as a client)."""
    host, _, port = master.rpartition(":")
    world = nnodes * nproc
    rank = node_rank * nproc + local_rank
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
        "MASTER_ADDR": host.strip("[]"), "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        # every rank is a client of the driver's store, none hosts one (torch.distributed.rendezvous)
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip


# --- the agent's side ----------------------------------------------------------------------------------------
class WarmGroup:
    """One warm group on this node: the supervisor process and its pipes (`megascale.ft.agent` holds a pool).

    Args:
        command: the training command (``script.py args`` or ``-m module args``).
        nproc: workers (local ranks).
        env: the supervisor's environment (the agent's; ``OMP_NUM_THREADS`` must be in it already: the
            OpenMP runtime reads it when torch is imported).
        imports: modules to import ahead besides torch, ``torch.distributed`` and the script's.
        name: for log lines.
        on_event: called (from a reader thread) when the group reports something: ready, a verdict.
        in_place: when a run fails with an exception (no process gone), the workers settle and the group
            waits to run the next attempt in the same processes (`ended`), instead of exiting.
    """

    def __init__(
        self, command: Sequence[str], nproc: int, env: Mapping[str, str], imports: Sequence[str] = (),
        name: str = "warm", on_event: Callable[[], None] | None = None, in_place: bool = False,
    ) -> None:  # fmt: skip
        self.name, self._on_event = name, on_event
        self.created = time.time()
        commands_r, commands_w = os.pipe()
        reports_r, reports_w = os.pipe()
        argv = [
            sys.executable, "-u", "-m", "megascale.ft.warm", f"--nproc={nproc}", f"--command-fd={commands_r}",
            f"--report-fd={reports_w}", *(f"--import={m}" for m in imports), *(["--in-place"] if in_place else []),
            "--", *command,
        ]  # fmt: skip
        try:
            # a session of its own, like torchrun under the agent: kill_tree finds it by its session too
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                argv, env=dict(env), stdin=subprocess.DEVNULL, pass_fds=(commands_r, reports_w),
                start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(commands_r)
            os.close(reports_w)
        self._commands: IO[str] = os.fdopen(commands_w, "w", buffering=1)
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.info: dict[str, Any] = {}  # the "ready" event: worker pids, import seconds, ...
        self.checks: dict[int, dict[str, Any]] = {}  # check id -> verdict
        self._next_check = 0
        self.started_run = False
        self.runs = 0  # attempts run in this group (more than one: restarted in place)
        # in place: the last run failed and every worker waits to run again ({"workers": pids, "at": ...})
        self.ended: dict[str, Any] | None = None
        self._reader = threading.Thread(
            target=self._read, args=(os.fdopen(reports_r),), daemon=True, name=f"megascale-ft-{name}"
        )
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                with self._lock:
                    if event.get("event") == "ready":
                        self.info = event
                        self.ready.set()
                    elif event.get("event") == "checked":
                        self.checks[int(event["id"])] = event
                    elif event.get("event") == "ended":
                        self.ended = event
                if self._on_event is not None:
                    self._on_event()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def workers(self) -> list[int]:
        """The waiting workers' pids (empty until the group is ready)."""
        return [int(p) for p in self.info.get("workers", [])]

    def alive(self) -> bool:
        return self.process.poll() is None

    def _send(self, message: dict[str, Any]) -> bool:
        try:
            self._commands.write(json.dumps(message) + "\n")
            return True
        except (OSError, ValueError):  # the supervisor is gone: the caller sees it exit
            return False

    def check(self, report: Path, timeout: float, storage: str | None) -> int:
        """Ask for the self-checks (queued behind the imports when not ready yet); the id of `result`."""
        with self._lock:
            self._next_check += 1
            ident = self._next_check
        self._send(
            {"cmd": "check", "id": ident, "report": str(report), "timeout": timeout, "storage": storage}
        )
        return ident

    def result(self, ident: int) -> dict[str, Any] | None:
        """The verdict of check ``ident`` (``{"ok", "report", "summary", "seconds"}``), None while it runs."""
        with self._lock:
            return self.checks.get(ident)

    def run(self, env: Mapping[str, str], ranks: Sequence[Mapping[str, str]]) -> None:
        """Start the attempt: worker i gets ``env`` and ``ranks[i]``. From here the group is the attempt's
        process tree (its supervisor exits with the workers' verdict, or, in place, reports `ended` and
        takes the next ``run``)."""
        self.started_run = True
        self.runs += 1
        with self._lock:
            self.ended = None
        self._send({"cmd": "run", "env": dict(env), "ranks": [dict(r) for r in ranks]})
        with contextlib.suppress(OSError):
            self._commands.flush()

    def close(self) -> None:
        """Kill the group (a spare no longer needed, or the agent leaving)."""
        from megascale.ft._procs import kill_tree

        with contextlib.suppress(OSError, ValueError):
            self._commands.close()
        if self.process.poll() is None:
            kill_tree(self.process.pid, wait=5.0)
        self.process.wait()


# --- the supervisor ----------------------------------------------------------------------------------------
def _say(fd: int, event: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(event) + "\n").encode())


class _Lines:
    """JSON lines from a pipe, read in chunks (a byte at a time, an attempt's environment of a few kB is
    thousands of system calls on a busy machine)."""

    def __init__(self, fd: int) -> None:
        self.fd, self._buffer, self._eof = fd, bytearray(), False

    def readline(self, timeout: float | None) -> str | None:
        """The next line (blocking up to ``timeout``): "" at EOF, None when no whole line came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                return line.decode()
            if self._eof:
                return ""
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if chunk:
                self._buffer += chunk
            else:
                self._eof = True


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _refresh_rank_caches() -> None:
    """Modules imported ahead that cached the rank from the environment at import time (Lightning's
    ``rank_zero_only.rank``) learn the rank the worker has now."""
    for name in ("lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        module = sys.modules.get(name)
        if module is not None:
            with contextlib.suppress(Exception):
                module.rank_zero_only.rank = module._get_rank() or 0


def _run_script(script: str | None, module: str | None, args: list[str]) -> int:
    """Run the training command as ``__main__``; its exit code (1 for an exception, after printing it)."""
    import runpy

    try:
        if module is not None:
            sys.argv = [module, *args]  # run_module sets argv[0] to the module's file
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            assert script is not None
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return _exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _run_once(script: str | None, module: str | None, args: list[str]) -> tuple[int, list[tuple[Any, ...]]]:
    """`_run_script` as a process would run it, so that what it leaves can be ended after a failure: in a
    context of its own (context variables it sets, jsonargparse's parser and through it the CLI's trainer, go
    with it) and with the exit handlers it registers recorded (a data loader's reader stop, say)."""
    import atexit
    import contextvars

    handlers: list[tuple[Any, ...]] = []
    register = atexit.register

    def recorded(func: Callable[..., Any], *a: Any, **k: Any) -> Callable[..., Any]:
        handlers.append((func, a, k))
        return register(func, *a, **k)

    atexit.register = recorded  # type: ignore[assignment]
    try:
        return contextvars.copy_context().run(_run_script, script, module, args), handlers
    finally:
        atexit.register = register  # type: ignore[assignment]


def _run_exit_handlers(handlers: list[tuple[Any, ...]]) -> None:
    """A failed run's exit handlers, last registered first, as at the end of a process; then forgotten."""
    import atexit

    for func, a, k in reversed(handlers):
        atexit.unregister(func)
        try:
            func(*a, **k)
        except Exception:
            traceback.print_exc()


def _settle(threads_before: set[threading.Thread]) -> str | None:
    """After a failed run (its exit handlers already run), make this process fit to run the command again:
    the checkpointers it left open closed (a save in flight ends first), its process groups aborted and
    destroyed and their connections shut (so peers blocked on this rank fail at once, not at the collective
    timeout), and nothing the run started still running. None when fit, else why not."""
    import gc

    import torch.distributed as dist

    checkpoints = sys.modules.get("megascale.ft.checkpoint")
    if checkpoints is not None:  # a save in flight ends first: it needs the process groups (its docstring)
        closing = threading.Thread(target=checkpoints.close_open_checkpointers, daemon=True)
        threads_before.add(closing)
        closing.start()
        closing.join(SETTLE_S)
        if closing.is_alive():
            return (
                f"a checkpoint save of the failed run did not end within {SETTLE_S:.0f} s ({_where(closing)})"
            )
    if dist.is_available() and dist.is_initialized():
        try:
            for group in list(dist.distributed_c10d._world.pg_map):
                with contextlib.suppress(Exception):
                    group.abort()  # NCCL: its communicators aborted, so peers' kernels fail now
            dist.destroy_process_group()
        except Exception as e:  # a group that cannot be torn down is not one to build on
            return f"destroy_process_group failed: {type(e).__name__}: {e}"
        gc.collect()
        _shut_native_connections()
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()  # what the failed run left: its objects' pools and loaders end their threads when freed
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        children = _children()
        if not threads and not children:
            return None
        if time.monotonic() > deadline:
            what = [f"thread {t.name!r} ({_where(t)})" for t in threads]
            what += [f"child process {pid}" for pid in children]
            return f"the failed run left {', '.join(what)} running after {SETTLE_S:.0f} s"
        time.sleep(POLL_S)


def _shut_native_connections() -> int:
    """Shut down this process's TCP connections that no Python socket owns (gloo's pairs, the store client);
    how many. A destroyed process group closes its connections only once nothing refers to it any more, and
    a trainer's objects (a device mesh, a pipeline's pending receives) may outlive the failed run: until then
    the peers blocked on this rank would wait for the collective timeout. Sockets of Python code (heartbeats,
    HTTP clients) are left alone. Linux (``/proc``); elsewhere nothing is shut."""
    import gc
    import socket

    if not os.path.isdir("/proc/self/fd"):
        return 0
    owned: set[int] = set()
    for obj in gc.get_objects():
        # type(), not isinstance: that reads __class__, on which some module proxies warn
        if issubclass(type(obj), socket.socket):
            with contextlib.suppress(OSError, ValueError):
                owned.add(obj.fileno())
    shut = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd in owned or not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves the owner's fd open
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                sock.getpeername()  # connected, not a listening socket
                sock.shutdown(socket.SHUT_RDWR)  # the connection itself, for every fd that shares it
                shut += 1
            except OSError:
                continue
    return shut


def _where(thread: threading.Thread) -> str:
    """Where ``thread`` is now: its innermost frames, as ``file:line in function``."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "no frame"
    stack = traceback.extract_stack(frame)[-3:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(stack))


def _children() -> list[int]:
    """This process's child processes that still run (a failed run's data loader workers, say)."""
    from megascale.ft._procs import descendants

    return [pid for pid in descendants(os.getpid()) if _proc_state(pid) not in ("Z", "X", "gone")]


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _worker(
    local: int, read_fd: int, report_fd: int | None, script: str | None, module: str | None, args: list[str]
) -> int:
    """A forked worker: wait for the attempt's environment, then run the training command as ``__main__``.

    In place (``report_fd`` given): when the run fails with an exception, the worker settles (`_settle`),
    tells the supervisor whether it can run again, and if so waits for the next attempt's environment on the
    same pipe: a restart of this node then starts no process at all (`megascale.ft.agent`)."""
    lines = _Lines(read_fd)
    code = 0
    while True:
        line = lines.readline(None)
        if not line:
            return code  # the group was discarded (after a failed run kept in place: that run's verdict)
        message = json.loads(line)
        os.environ.clear()
        os.environ.update(message["env"])
        _refresh_rank_caches()
        threads_before = set(threading.enumerate())
        if report_fd is None:
            return _run_script(script, module, args)
        code, handlers = _run_once(script, module, args)
        if code == 0:
            return code
        failed_at = time.time()
        _run_exit_handlers(handlers)
        why = _settle(threads_before)
        _say(report_fd, {"event": "ended", "local": local, "pid": os.getpid(), "code": code, "why": why,
                         "failed_at": failed_at, "settle_s": time.time() - failed_at})  # fmt: skip
        if why is not None:
            print(f"megascale-ft warm: local rank {local} cannot restart in place: {why}", file=sys.stderr,
                  flush=True)  # fmt: skip
            return code


def _end_worker(code: int) -> None:
    """Exit as an interpreter would (non-daemon threads joined, atexit handlers run), then ``os._exit``: no
    unwinding into the supervisor's frames (this is a fork of it), and no interpreter teardown, where gloo
    sometimes aborts (shared notes)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    except Exception:
        traceback.print_exc()
    try:
        import atexit

        atexit._run_exitfuncs()
    except Exception:
        traceback.print_exc()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code & 0xFF if code >= 0 else 1)


class _Supervisor:
    def __init__(self, args: argparse.Namespace, script: str | None, module: str | None, rest: list[str]):
        self.args, self.script, self.module, self.rest = args, script, module, rest
        self.workers: dict[int, int] = {}  # pid -> local rank
        self.pipes: dict[int, int] = {}  # local rank -> write end of its pipe
        self.codes: dict[int, int] = {}  # local rank -> exit code
        self.stopping = 0  # SIGTERMs received
        self.commands = _Lines(args.command_fd)
        self.parked: dict[int, dict[str, Any]] = {}  # in place: local rank -> its "ended" event
        self.events: _Lines | None = None  # in place: what the workers say (one pipe, lines under PIPE_BUF)
        self.events_w: int | None = None
        if args.in_place:
            events_r, self.events_w = os.pipe()
            self.events = _Lines(events_r)

    # forking: only from the main thread of a process that has run no torch operation
    def _fork(self, child: Any) -> int:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.close(self.args.command_fd)
                os.close(self.args.report_fd)
                if self.events is not None:
                    os.close(self.events.fd)
                code = child()
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException:
                traceback.print_exc()
            _end_worker(code)
        return pid

    def fork_workers(self) -> None:
        for local in range(self.args.nproc):  # `local` is bound per worker through `child`'s defaults
            read_fd, write_fd = os.pipe()
            others = list(self.pipes.values())

            def child(
                read_fd: int = read_fd,
                write_fd: int = write_fd,
                others: list[int] = others,
                local: int = local,
            ) -> int:
                os.close(write_fd)
                for fd in others:
                    os.close(fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)  # torchrun's workers read nothing either
                os.close(devnull)
                return _worker(local, read_fd, self.events_w, self.script, self.module, self.rest)

            pid = self._fork(child)
            os.close(read_fd)
            self.workers[pid] = local
            self.pipes[local] = write_fd
        if self.events_w is not None:
            os.close(self.events_w)  # the workers hold it: EOF when the last one exits
            self.events_w = None

    def check(self, order: dict[str, Any]) -> dict[str, Any]:
        """The node's self-checks in forked checkers (a node-local gloo group over a FileStore)."""
        from megascale.ft.selfcheck import check_node_local, load_report

        started = time.time()
        report = Path(order["report"])
        report.parent.mkdir(parents=True, exist_ok=True)
        store = report.with_name(f".{report.name}.store")
        with contextlib.suppress(FileNotFoundError):
            store.unlink()
        timeout = float(order["timeout"])
        storage = order.get("storage")
        checkers = {
            self._fork(
                lambda r=r: check_node_local(r, self.args.nproc, str(store), str(report), storage, timeout)
            ): r
            for r in range(self.args.nproc)
        }
        codes: dict[int, int] = {}
        deadline = time.monotonic() + timeout + 5
        while checkers.keys() - codes.keys() and time.monotonic() < deadline:
            for pid in checkers.keys() - codes.keys():
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(POLL_S)
        for pid in checkers.keys() - codes.keys():  # hung: the verdict says so
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = -signal.SIGKILL
        with contextlib.suppress(FileNotFoundError):
            store.unlink()
        summary = ""
        if report.exists():
            with contextlib.suppress(Exception):
                summary = load_report(report).summary()
        ok = all(code == 0 for code in codes.values()) and report.exists()
        if not ok and not summary:
            summary = f"self-check processes exited with codes {sorted(codes.values())} within {timeout} s"
        return {"ok": ok, "report": str(report), "summary": summary, "seconds": time.time() - started}

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping += 1
        sig = signal.SIGTERM if self.stopping == 1 else signal.SIGKILL
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self, order: dict[str, Any]) -> int | None:
        """Hand each worker its environment, then wait for them as torchrun would; the exit code, or None
        (in place) when the run failed but every worker settled and waits to run again."""
        ranks = order["ranks"]
        for local, write_fd in self.pipes.items():
            env = {**order["env"], **ranks[local]}
            with contextlib.suppress(OSError):
                os.write(write_fd, (json.dumps({"env": env}) + "\n").encode())
            if not self.args.in_place:
                os.close(write_fd)
        if not self.args.in_place:
            self.pipes.clear()
        self.codes, self.parked = {}, {}
        grace = IN_PLACE_GRACE_S if self.args.in_place else FAILED_PEERS_GRACE_S
        failed_at: float | None = None
        killed_at: float | None = None
        while len(self.codes) < len(self.workers):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in self.workers:
                self._ended(self.workers[pid], os.waitstatus_to_exitcode(status), None)
                if failed_at is None and self.codes[self.workers[pid]] != 0:
                    failed_at = time.monotonic()
                    grace = min(grace, FAILED_PEERS_GRACE_S)  # a process is gone: no restart in place
                continue
            for event in self._events():
                self._ended(int(event["local"]), int(event["code"]), event)
                failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if failed_at is not None and killed_at is None and now > failed_at + grace:
                killed_at = now
                self._signal_running(signal.SIGTERM)
            if killed_at is not None and now > killed_at + TERM_GRACE_S:
                self._signal_running(signal.SIGKILL)
            if self.commands.readline(0) == "":  # the agent is gone: nothing supervises the ranks
                self._signal_running(signal.SIGKILL)
                self.discard()
                return 1
            time.sleep(POLL_S)
        if all(code == 0 for code in self.codes.values()):
            return 0
        if (
            self.args.in_place
            and all(e.get("why") is None for e in self.parked.values())
            and len(self.parked) == len(self.workers)
        ):
            return None
        self.discard()  # parked workers: EOF on their pipes, they exit
        return 1

    def _ended(self, local: int, code: int, event: dict[str, Any] | None) -> None:
        """Worker ``local`` ended its run with ``code``: it exited (``event`` None) or, in place, said so."""
        if local in self.codes and event is None and local in self.parked:
            del self.parked[local]  # it said it ended, then exited after all: it cannot run again
            return
        self.codes[local] = code
        if event is not None:
            self.parked[local] = event
        if code != 0:
            how = "failed" if event is None else "failed and waits to restart in place"
            if event is not None and event.get("why"):
                how = "failed and cannot restart in place"
            pid = next(p for p, w in self.workers.items() if w == local)
            print(f"megascale-ft warm: local rank {local} (pid {pid}) {how} (exitcode: {code})", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        while self.events is not None:
            line = self.events.readline(0)
            if not line:
                break
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def _signal_running(self, sig: int) -> None:
        for pid, local in self.workers.items():
            if local not in self.codes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def discard(self) -> None:
        for write_fd in self.pipes.values():
            with contextlib.suppress(OSError):
                os.close(write_fd)  # EOF: the workers exit
        self.pipes.clear()
        for pid in self.workers:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m megascale.ft.warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--command-fd", type=int, required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--import", dest="imports", action="append", default=[])
    parser.add_argument("--in-place", action="store_true", help="a failed run's workers may run again")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return args, command


def main(argv: list[str] | None = None) -> int:
    """The supervisor of one warm group (started by `WarmGroup`)."""
    args, command = _parse(argv)
    script, module, rest = split_command(command)
    started = time.time()
    if script is not None:  # as `python script.py` would: the script's directory first on the path
        sys.path[0] = str(Path(script).resolve().parent)
    # torch._dynamo: DistributedDataParallel, FSDP and torch.compile import it (with inductor and triton, some
    # 300 modules, seconds) when first used, i.e. in the ranks' restore; imported here, a restart skips that
    names = ["torch", "torch.distributed", "torch._dynamo", "megascale.ft.executor", "megascale.ft.selfcheck"]
    if script is not None:
        here = Path(script).resolve().parent
        names += [n for n in script_imports(script) if _outside(n, here)]
    names += args.imports
    imported = [n for n in dict.fromkeys(names) if _warm_import(n)]
    supervisor = _Supervisor(args, script, module, rest)
    if threading.active_count() > 1:  # a fork copies only this thread: say so, it may matter to the script
        print(f"megascale-ft warm: the warm imports started {threading.active_count() - 1} thread(s), which "
              "the forked ranks do not have", file=sys.stderr, flush=True)  # fmt: skip
    supervisor.fork_workers()
    _say(args.report_fd, {"event": "ready", "workers": list(supervisor.workers), "imported": imported,
                          "seconds": time.time() - started, "at": time.time()})  # fmt: skip
    signal.signal(signal.SIGTERM, supervisor._on_sigterm)
    while True:
        line = supervisor.commands.readline(1.0)
        if line is None:
            for pid, local in supervisor.workers.items():  # a worker lost while waiting: this group is spent
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    print(f"megascale-ft warm: waiting worker {local} (pid {pid}) exited "
                          f"({os.waitstatus_to_exitcode(status)}); the group is discarded", file=sys.stderr)  # fmt: skip
                    supervisor.discard()
                    return 1
            continue
        if line == "":  # the agent closed the group (or is gone)
            supervisor.discard()
            return 0
        order = json.loads(line)
        if order.get("cmd") == "check":
            _say(args.report_fd, {"event": "checked", "id": order["id"], **supervisor.check(order)})
        elif order.get("cmd") == "run":
            code = supervisor.run(order)
            if code is not None:
                return code
            # in place: every worker settled after a failed run; the agent keeps this group for the next
            # attempt (another "run") or discards it (EOF)
            parked = sorted((local, e["pid"]) for local, e in supervisor.parked.items())
            events = supervisor.parked.values()
            _say(args.report_fd, {"event": "ended", "code": 1, "in_place": True,
                                  "workers": [pid for _, pid in parked], "at": time.time(),
                                  "settle_s": max(e["settle_s"] for e in events)})  # fmt: skip


if __name__ == "__main__":
    exit_code = 1
    try:
        exit_code = main()
    except SystemExit as e:  # argparse
        exit_code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
    finally:
        # os._exit: tearing down an interpreter that imported torch takes seconds on a busy machine, and the
        # agent (and the driver) wait for this exit to learn the attempt's verdict
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
