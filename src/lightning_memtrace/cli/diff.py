"""``memtrace diff``: two snapshots or runs at their peaks, B - A."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_memtrace.cli.args import add_max_bytes, add_rules, add_sites, loader_kwargs
from lightning_memtrace.cli.console import console, progress
from lightning_memtrace.types import category_label
from lightning_memtrace.units import format_bytes


def add_subcommand(subparsers: Any) -> None:
    parser = subparsers.add_parser("diff", help="compare two snapshots or runs at their peaks (B - A)")
    parser.add_argument("a", help="first snapshot, log folder or phases CSV (A)")
    parser.add_argument("b", help="second snapshot, log folder or phases CSV (B)")
    add_sites(parser)
    add_max_bytes(parser)
    add_rules(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema in the README)")
    parser.set_defaults(func=run)


def _signed(value: int) -> str:
    if value == 0:
        return "0 B"
    sign = "+" if value > 0 else "-"
    return f"{sign}{format_bytes(abs(value))} ({sign}{abs(value):,} B)"


def _bytes(value: int) -> str:
    return f"{format_bytes(value)} ({value:,} B)"


def _load(args: argparse.Namespace, callback: Any = None) -> tuple[Any, Any, Any]:
    from lightning_memtrace.analysis.diff import diff_sources
    from lightning_memtrace.analysis.source import load_source

    a = load_source(args.a, progress=callback, **loader_kwargs(args))
    b = load_source(args.b, progress=callback, **loader_kwargs(args))
    return diff_sources(a, b), a, b


def diff_payload(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """``memtrace diff --json``'s object for parsed ``args``: what the command prints and the MCP ``diff`` tool
    returns."""
    from lightning_memtrace.analysis.answers import diff_object

    result, a, b = _load(args, progress)
    return diff_object(result, a, b, args.sites)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.json:
        import json

        with progress() as callback:
            payload = diff_payload(args, callback)
        print(json.dumps(payload, indent=2))
        return 0
    with progress() as callback:
        result, _, _ = _load(args, callback)
    out = console()
    out.print(f"A = {result.a_name}\nB = {result.b_name}")
    for title, frame, key in (
        ("at the peak", result.summary, "figure"),
        ("live bytes at the peak, by category", result.by_category, "category"),
        ("live bytes at the peak, by allocation site", result.by_site.head(args.sites), "site"),
    ):
        table = Table(title=title)
        table.add_column(key)
        table.add_column("A", justify="right")
        table.add_column("B", justify="right")
        table.add_column("B - A", justify="right")
        for _, row in frame.iterrows():
            name = category_label(row[key]) if key == "category" else str(row[key])
            if key == "figure" and name == "events":
                table.add_row(name, f"{int(row['a']):,}", f"{int(row['b']):,}", f"{int(row['delta']):+,}")
            else:
                table.add_row(name, _bytes(int(row["a"])), _bytes(int(row["b"])), _signed(int(row["delta"])))
        out.print(table)
    return 0
