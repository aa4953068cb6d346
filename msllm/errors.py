"""User-facing errors and the one way command-line fronts report them.

Every problem caused by the user's input (a bad file, record, key or flag) is raised as
:class:`MsllmError` with a message naming the file / record / key and what was expected.
Command-line fronts wrap their ``main`` in :func:`cli_main`, which prints that one message to
stderr and exits with status 2, without a traceback. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable[..., object])

EXIT_USER_ERROR = 2


class MsllmError(Exception):
    """An error in the user's input: its message alone must tell the user what to fix."""


def cli_main(fn: F) -> F:
    """Decorate a CLI ``main``: :class:`MsllmError` -> one ``error: ...`` line, exit code 2.

    ``OSError`` (a full disk, a permission denied; its text names the file) is reported the same way.

    ``KeyboardInterrupt`` exits with 130 (the shell convention for SIGINT).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MsllmError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except OSError as exc:  # disk full, permission denied ...: the environment, not a bug
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
