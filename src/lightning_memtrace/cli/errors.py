"""How every ``memtrace`` subcommand fails: one line ``memtrace: error: ...`` on stderr and a non-zero exit status,
never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from lightning_memtrace.cli.console import visible

PROG = "memtrace"
#: Exit status of any error.
ERROR_EXIT = 2


class CliError(Exception):
    """An error to show as one line."""


def error_text(message: str) -> str:
    """``memtrace: error: <message on one line>``, its control characters shown as ``\\xNN`` (a message can quote a
    hostile file: the names a pickle asks for, a path)."""
    line = visible(" ".join(str(message).split()))
    return f"{PROG}: error: {line}"


def error_line(message: str) -> int:
    """Write ``memtrace: error: <message on one line>`` to stderr; returns :data:`ERROR_EXIT`."""
    sys.stderr.write(error_text(message) + "\n")
    sys.stderr.flush()
    return ERROR_EXIT


def fail(message: str) -> NoReturn:
    """:func:`error_line`, then exit."""
    raise SystemExit(error_line(message))


#: The one-line text of errors whose own message says nothing useful on the command line.
READ_ERRORS: dict[type[BaseException], str] = {
    MemoryError: "out of memory while reading the input (try --max-bytes to refuse files this large)",
}


def describe(
    error: BaseException, plain: tuple[type[BaseException], ...], fixed: dict[type[BaseException], str] | None = None
) -> str:
    """The one-line text of an error: the message alone for ``plain`` types, a ``fixed`` text, ``file: reason`` for
    other OS errors, ``Type: message`` for anything else."""
    if isinstance(error, plain):
        return str(error)
    for kind, text in (fixed or {}).items():
        if isinstance(error, kind):
            return text
    if isinstance(error, OSError):
        where = f"{error.filename}: " if getattr(error, "filename", None) else ""
        return f"{where}{error.strerror or error}"
    return f"{type(error).__name__}: {error}"


def run_guarded(
    handler: Callable[[argparse.Namespace], int | None],
    args: argparse.Namespace,
    on_error: Callable[[str], int],
    on_interrupt: Callable[[], int],
    plain: tuple[type[BaseException], ...],
    fixed: dict[type[BaseException], str] | None = None,
) -> int:
    """Run a subcommand's handler; an error becomes one line passed to ``on_error`` (``SystemExit`` passes through)."""
    try:
        return int(handler(args) or 0)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        return on_interrupt()
    except Exception as error:  # last resort included: still one line, never a traceback
        return on_error(describe(error, plain, fixed))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(usage_error(self, message))


def usage_error(parser: argparse.ArgumentParser, message: str) -> str:
    """The one-line text of a parser's error."""
    return f"{message} (see '{parser.prog} --help')"


class RaisingParser(Parser):
    """A :class:`Parser` whose errors raise :class:`CliError` (same one-line text) instead of exiting: for callers
    that parse ``memtrace`` arguments inside a process that must keep running (the MCP server)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(usage_error(self, message))

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise CliError(message or f"exit status {status}")
