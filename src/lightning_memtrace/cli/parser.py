"""The one ``memtrace`` parser: ``report``, ``summary``, ``diff``, ``estimate`` and subcommands other modules add.

Other modules add subcommands in one of two ways:

* list the module in :data:`SUBCOMMAND_MODULES`; the module defines ``add_subcommand(subparsers)``;
* or call :func:`register_subcommand` with such a function before :func:`main` runs.

``add_subcommand`` adds a parser with ``subparsers.add_parser(...)`` and sets ``parser.set_defaults(func=handler)``,
where ``handler(args: argparse.Namespace) -> int`` returns the exit status. Raising
:class:`~lightning_memtrace.analysis.loader.SnapshotError`, ``ValueError`` or ``OSError`` gives the one-line error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lightning_memtrace.cli import diff, report, summary
from lightning_memtrace.cli.errors import ERROR_EXIT, PROG, READ_ERRORS, CliError, Parser, fail, run_guarded

#: Modules that may define ``add_subcommand(subparsers)``; missing ones are skipped.
SUBCOMMAND_MODULES: tuple[str, ...] = ("lightning_memtrace.cli.estimate", "lightning_memtrace.cli.mcp")

SubcommandAdder = Callable[[Any], None]
_REGISTERED: list[SubcommandAdder] = []


def register_subcommand(adder: SubcommandAdder) -> SubcommandAdder:
    """Register ``adder(subparsers)`` to add a subcommand to ``memtrace`` (usable as a decorator)."""
    if adder not in _REGISTERED:
        _REGISTERED.append(adder)
    return adder


def _module_adders() -> list[SubcommandAdder]:
    adders: list[SubcommandAdder] = []
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:
                continue
            raise
        adder = getattr(module, "add_subcommand", None)
        if callable(adder) and adder not in adders:
            adders.append(adder)
    return adders


def build_parser(parser_class: type[Parser] = Parser) -> argparse.ArgumentParser:
    """The ``memtrace`` parser with every subcommand: built-in, listed in :data:`SUBCOMMAND_MODULES`, registered.

    ``parser_class`` makes the parser and every subcommand's (``RaisingParser``: errors raise instead of exiting)."""
    import lightning_memtrace

    # A package object without the attribute (a benchmark's stand-in for the lazy package) still gets a parser.
    version = getattr(lightning_memtrace, "__version__", "unknown")
    parser = parser_class(prog=PROG, description="Read PyTorch memory snapshots and MemTrace logs.")
    parser.add_argument("--version", action="version", version=f"{PROG} (lightning_memtrace) {version}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=parser_class)
    report.add_subcommand(subparsers)
    summary.add_subcommand(subparsers)
    diff.add_subcommand(subparsers)
    added = _module_adders()
    for adder in added:
        try:
            adder(subparsers)
        except argparse.ArgumentError:  # a name another module already took: keep the first
            continue
    for adder in _REGISTERED:
        if adder not in added:
            adder(subparsers)
    return parser


def _interrupted() -> int:
    sys.stderr.write(f"{PROG}: interrupted\n")
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memtrace``; returns the exit status (errors: one line on stderr, status 2)."""
    from lightning_memtrace.analysis.loader import SnapshotError
    from lightning_memtrace.collector import gc_paused

    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return ERROR_EXIT
    with gc_paused():
        return run_guarded(func, args, fail, _interrupted, (SnapshotError, CliError), READ_ERRORS)


