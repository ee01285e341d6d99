"""One-line errors for the ``megascale-ft`` console script.

A user's mistake reaching a console script prints ``PROG: error: MESSAGE`` and one hint line on stderr and
exits with code 2; ``--traceback`` on the command line (or ``MEGASCALE_TRACEBACK=1`` in the environment)
shows the full trace instead. What counts as a user mistake (``USER_ERRORS``):

- ``UserError``, raised by megascale's own validation (a subclass of ValueError);
- ``ValueError``: every "this value/layout/config is wrong, do X" of megascale is one;
- ``FileNotFoundError``, ``NotADirectoryError``, ``IsADirectoryError``, ``FileExistsError``,
  ``PermissionError``: a path the user gave;
- ``ImportError``: a missing optional package (the messages name the extra to install).

Anything else (TypeError, RuntimeError, KeyError, ...) is a bug or an environment failure and keeps its full
traceback. A bug that raises one of the types above still shows its trace under ``--traceback``, which the
hint line names.

The same small helper is in megascale.core.cli_errors (``megascale``, ``megascale plan``, ``convert``) and
megascale-data: each package installs alone, so each carries its own copy.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

__all__ = [
    "TRACEBACK_ENV",
    "TRACEBACK_FLAG",
    "USER_ERRORS",
    "UserError",
    "pop_traceback_flag",
    "report_user_errors",
    "traceback_wanted",
]

TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "MEGASCALE_TRACEBACK"


class UserError(ValueError):
    """A mistake in what the user gave (an option, a file, a config); the message names it and the fix."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # UserError included
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    PermissionError,
    ImportError,
)
HINT = f"(a usage error, not a bug: {TRACEBACK_FLAG} or {TRACEBACK_ENV}=1 shows the full trace)"


def traceback_wanted() -> bool:
    """Whether ``MEGASCALE_TRACEBACK`` asks for full traces (1, true, yes)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes")


def pop_traceback_flag(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--traceback`` (only before a ``--``, after which arguments belong to another
    program), and whether it was there."""
    out: list[str] = []
    found = False
    for i, arg in enumerate(argv):
        if arg == "--":
            out += list(argv[i:])
            break
        if arg == TRACEBACK_FLAG:
            found = True
        else:
            out.append(arg)
    return out, found


def _message(error: BaseException) -> str:
    text = str(error).strip()
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        # "[Errno 2] No such file or directory: 'x'" → "No such file or directory: x"
        text = f"{error.strerror}: {error.filename}"
    return text or type(error).__name__


def report_user_errors(
    prog: str,
    body: Callable[[], int | None],
    *,
    traceback: bool = False,
    user_errors: tuple[type[BaseException], ...] = USER_ERRORS,
) -> int:
    """Run ``body``; its exit code, or 2 after printing a user mistake (one of ``user_errors``) as
    ``PROG: error: MESSAGE`` and a hint line. With ``traceback`` (or ``MEGASCALE_TRACEBACK=1``) the
    exception propagates with its full trace; other exceptions always do."""
    try:
        return int(body() or 0)
    except user_errors as error:
        if traceback or traceback_wanted():
            raise
        print(f"{prog}: error: {_message(error)}", file=sys.stderr)
        print(f"  {HINT}", file=sys.stderr)
        return 2
