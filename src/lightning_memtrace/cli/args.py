"""Argument types and options shared by every ``memtrace`` subcommand, so that they all read sizes and counts alike."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from lightning_memtrace.units import parse_bytes


def _checked(parse: Callable[[str], int], text: str, kind: str, example: str = "") -> int:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {kind}: {text!r}{example}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive {kind.split()[-1]}: {text!r}")
    return value


def bytes_arg(text: str) -> int:
    """A positive size: ``4GiB``, ``512MiB``, ``80GB`` (1000-based), ``1e9``."""
    return _checked(parse_bytes, text, "a size", " (e.g. 4GiB, 512MiB, 1e9)")


def positive_int(text: str) -> int:
    """A positive integer."""
    return _checked(int, text, "an integer")


def probability(text: str) -> float:
    """A number from 0 (inclusive) to 1 (exclusive): a dropout probability."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"not a probability from 0 to below 1: {text!r}")
    return value


def add_max_bytes(parser: argparse.ArgumentParser) -> None:
    """``--max-bytes`` / ``--max-size``: the size limit per snapshot file."""
    parser.add_argument(
        "--max-bytes",
        "--max-size",
        dest="max_bytes",
        type=bytes_arg,
        default=None,
        help="refuse files larger than this (default 8GiB)",
    )


def add_sites(parser: argparse.ArgumentParser) -> None:
    """``--sites``: how many allocation sites to list."""
    parser.add_argument("--sites", type=positive_int, default=10, help="allocation sites to list (default 10)")


def rule_arg(text: str) -> tuple[str, str]:
    """``NAME=REGEX``: a user rule for categories, its regex checked (a bad one fails the command in one line)."""
    from lightning_memtrace.analysis.rules import RuleError, compile_rule, parse_rule

    try:
        name, pattern = parse_rule(text)
        name, regex = compile_rule(name, pattern)
    except RuleError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name, regex.pattern


def add_rules(parser: argparse.ArgumentParser) -> None:
    """``--rule NAME=REGEX`` (repeatable): user rules for categories."""
    parser.add_argument(
        "--rule",
        dest="rules",
        action="append",
        type=rule_arg,
        default=None,
        metavar="NAME=REGEX",
        help="put the allocations whose stack has a frame matching REGEX (searched in 'file:line function', innermost "
        "frame first, the first rule given first) in category NAME, before inferred categories; repeatable; adds to "
        "(a same NAME replaces) the snapshot header's category_rules",
    )


def loader_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The snapshot loader's options from ``--max-bytes`` and ``--rule``."""
    from lightning_memtrace.analysis.loader import DEFAULT_MAX_BYTES

    options: dict[str, Any] = {"max_bytes": getattr(args, "max_bytes", None) or DEFAULT_MAX_BYTES}
    rules = getattr(args, "rules", None)
    if rules:
        options["rules"] = list(rules)
    return options
