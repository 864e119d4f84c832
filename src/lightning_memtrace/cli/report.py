"""``memtrace report``: the HTML report (and optionally a PNG)."""

from __future__ import annotations

import argparse
import fnmatch
import os
import stat
import sys
from pathlib import Path
from typing import Any

from lightning_memtrace.cli.args import add_max_bytes, add_rules, loader_kwargs, positive_int
from lightning_memtrace.cli.console import progress
from lightning_memtrace.cli.errors import CliError
from lightning_memtrace.files import PHASES_GLOB
from lightning_memtrace.units import format_bytes


def add_subcommand(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report (and optionally a PNG) from a snapshot or a MemTrace log folder",
        description="Where the peak is, what it is made of, which lines made it and what to change: one HTML file "
        "that works offline.",
    )
    parser.add_argument(
        "path", help="snapshot (.pickle/.pkl, gzip, memory_viz .html), MemTrace log folder or its phases_rank<R>.csv"
    )
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    parser.add_argument("--png", default=None, help="also write the timeline as a PNG here")
    add_max_bytes(parser)
    add_rules(parser)
    parser.add_argument(
        "--max-points", type=positive_int, default=None, help="points per series in the browser chart (default 4000)"
    )
    parser.set_defaults(func=run)


def check_output(path: str | None) -> None:
    """Fail with one clear line when a file to write cannot be: a folder on its way is a file, or it is a folder."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise CliError(f"cannot write {target}: it is a folder (give a file name, e.g. {target / 'report.html'})")
    for folder in target.parents:
        if folder.exists():
            if not folder.is_dir():
                raise CliError(f"cannot write {target}: {folder} is a file, not a folder")
            break


def check_not_an_input(path: str | None, source: str) -> None:
    """Fail with one line where writing ``path`` would destroy something to read: the input itself (``-o`` given
    the snapshot's name), or another snapshot (a pickle, gzip or ``torch.save`` archive) or MemTrace phases table."""
    from lightning_memtrace.analysis.loader import SNAPSHOT_BINARY_HEADS

    if path is None:
        return
    target = Path(path)
    if not target.is_file():
        return
    try:
        same = os.path.samefile(target, source)
    except OSError:
        same = False
    if same:
        raise CliError(f"cannot write {target}: it is the input (give the report another name)")
    try:
        with open(target, "rb") as handle:
            head = handle.read(max(map(len, SNAPSHOT_BINARY_HEADS)))
    except OSError:
        return
    if head.startswith(SNAPSHOT_BINARY_HEADS) or fnmatch.fnmatch(target.name, PHASES_GLOB):
        raise CliError(f"cannot write {target}: it holds a snapshot or MemTrace's rows (give the report another name)")


def run(args: argparse.Namespace) -> int:
    from lightning_memtrace.report import DEFAULT_MAX_POINTS, write_report

    check_output(args.output)
    check_output(args.png)
    check_not_an_input(args.output, args.path)
    check_not_an_input(args.png, args.path)

    with progress() as callback:
        out = write_report(
            args.path,
            args.output,
            args.png,
            max_points=args.max_points or DEFAULT_MAX_POINTS,
            progress=callback,
            **loader_kwargs(args),
        )
    said = f" and {args.png}" if args.png else ""
    written = out.stat()
    if stat.S_ISREG(written.st_mode):
        print(f"wrote {out} ({format_bytes(written.st_size)}){said}")
    else:  # the page went to a pipe or the terminal (-o /dev/stdout): stdout holds the page only
        print(f"wrote {out}{said}", file=sys.stderr)
    return 0
