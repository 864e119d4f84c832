"""The ``memtrace`` command: ``report``, ``summary`` and ``diff`` (and subcommands other modules register).

Every error prints one line ``memtrace: error: ...`` on stderr and exits with status 2; no traceback.

Other modules add subcommands in one of two ways:

* list the module in :data:`SUBCOMMAND_MODULES`; the module defines ``add_subcommand(subparsers)``;
* or call :func:`register_subcommand` with such a function before :func:`main` runs.

``add_subcommand`` adds a parser with ``subparsers.add_parser(...)`` and sets ``parser.set_defaults(func=handler)``,
where ``handler(args: argparse.Namespace) -> int`` returns the exit status. Raising
:class:`~lightning_memtrace.snapshot_loader.SnapshotError`, ``ValueError`` or ``OSError`` gives the one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from lightning_memtrace.units import format_bytes, parse_bytes

PROG = "memtrace"
ERROR_EXIT = 2

#: Modules that may define ``add_subcommand(subparsers)``; missing ones are skipped.
SUBCOMMAND_MODULES: tuple[str, ...] = ("lightning_memtrace.estimate_cli",)

SubcommandAdder = Callable[[Any], None]
_REGISTERED: list[SubcommandAdder] = []


def register_subcommand(adder: SubcommandAdder) -> SubcommandAdder:
    """Register ``adder(subparsers)`` to add a subcommand to ``memtrace`` (usable as a decorator)."""
    if adder not in _REGISTERED:
        _REGISTERED.append(adder)
    return adder


class CliError(Exception):
    """An error to show as one line."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> NoReturn:
    line = " ".join(str(message).split())
    sys.stderr.write(f"{PROG}: error: {line}\n")
    sys.stderr.flush()
    raise SystemExit(ERROR_EXIT)


def _bytes_arg(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1e9)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


@contextlib.contextmanager
def _progress(enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr for reading large files; yields the loader's progress callback."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    progress = Progress(
        TextColumn("reading"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        console=_console(stderr=True),
        transient=True,
    )
    task: list[Any] = []

    def update(done: int, total: int) -> None:
        if not task:
            progress.start()
            task.append(progress.add_task("read", total=total))
        progress.update(task[0], completed=done, total=total)

    try:
        yield update
    finally:
        if task:
            progress.stop()


# ---------------------------------------------------------------------------------------------------- report
def _add_report(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report (and optionally a PNG) from a snapshot or a MemTrace log folder",
        description="Where the peak is, what it is made of, which lines made it and what to change: one HTML file "
        "that works offline.",
    )
    parser.add_argument("path", help="snapshot (.pickle/.pkl, gzip, memory_viz .html) or MemTrace log folder")
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    parser.add_argument("--png", default=None, help="also write the timeline as a PNG here")
    parser.add_argument("--max-bytes", "--max-size", dest="max_bytes", type=_bytes_arg, default=None, help="refuse files larger than this (default 8GiB)")
    parser.add_argument(
        "--max-points", type=_positive_int, default=None, help="points per series in the browser chart (default 4000)"
    )
    parser.set_defaults(func=_cmd_report)


def _loader_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_memtrace.snapshot_loader import DEFAULT_MAX_BYTES

    return {"max_bytes": args.max_bytes or DEFAULT_MAX_BYTES}


def _cmd_report(args: argparse.Namespace) -> int:
    from lightning_memtrace.report import DEFAULT_MAX_POINTS, write_report

    with _progress() as progress:
        out = write_report(
            args.path,
            args.output,
            args.png,
            max_points=args.max_points or DEFAULT_MAX_POINTS,
            progress=progress,
            **_loader_kwargs(args),
        )
    size = out.stat().st_size
    print(f"wrote {out} ({format_bytes(size)})" + (f" and {args.png}" if args.png else ""))
    return 0


# ---------------------------------------------------------------------------------------------------- summary
def _add_summary(subparsers: Any) -> None:
    parser = subparsers.add_parser("summary", help="print the report's findings as terminal tables")
    parser.add_argument("path", help="snapshot or MemTrace log folder")
    parser.add_argument("--sites", type=_positive_int, default=10, help="allocation sites to list (default 10)")
    parser.add_argument("--max-bytes", "--max-size", dest="max_bytes", type=_bytes_arg, default=None, help="refuse files larger than this (default 8GiB)")
    parser.set_defaults(func=_cmd_summary)


def _cmd_summary(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from lightning_memtrace.findings import compute_findings
    from lightning_memtrace.replay import CATEGORY_LABELS
    from lightning_memtrace.report import (
        add_rank_finding,
        compute_findings_phases_only,
        load_source,
        phase_peaks_table,
        rank_overview,
    )

    with _progress() as progress:
        source = load_source(args.path, progress=progress, **_loader_kwargs(args))
    console = _console()
    main = source.main
    if main is not None:
        rep = main.replay
        dev = rep.main
        peak = dev.peak
        findings = compute_findings(rep, source.phases)
        info = Table(title=f"{main.path.name} (device {dev.device})", show_header=False)
        info.add_column("figure")
        info.add_column("value", justify="right")
        info.add_row("events", f"{dev.num_events:,}")
        info.add_row("segments", f"{rep.num_segments:,}")
        info.add_row("peak allocated", f"{format_bytes(peak.live_bytes)} ({peak.live_bytes:,} B)")
        if dev.reserved_known:
            info.add_row("reserved at peak", f"{format_bytes(peak.reserved_bytes)} ({peak.reserved_bytes:,} B)")
        info.add_row("peak at", f"{peak.stage}, step {peak.step}" if peak.index >= 0 else "dump time (no trace)")
        if not rep.is_memtrace:
            info.add_row("categories", "inferred from frames" if rep.inferred else "recorded")
        else:
            share = 100.0 * peak.inferred_bytes / peak.live_bytes if peak.live_bytes else 0.0
            info.add_row("categories", f"recorded by MemTrace ({share:.0f}% of the peak inferred)")
        console.print(info)
        cats = Table(title="live at the peak, by category")
        cats.add_column("category")
        cats.add_column("bytes", justify="right")
        cats.add_column("exact", justify="right")
        cats.add_column("share", justify="right")
        for cat, b in peak.by_category.items():
            share = 100.0 * b / peak.live_bytes if peak.live_bytes else 0.0
            cats.add_row(CATEGORY_LABELS.get(cat, cat), format_bytes(b), f"{b:,}", f"{share:.1f}%")
        console.print(cats)
        sites = Table(title="largest allocation sites at the peak")
        for column, justify in (
            ("file:line", "left"),
            ("function", "left"),
            ("category", "left"),
            ("bytes", "right"),
            ("exact", "right"),
            ("count", "right"),
        ):
            sites.add_column(column, justify=justify)  # type: ignore[arg-type]
        for _, row in peak.sites.head(args.sites).iterrows():
            where = f"{row['file']}:{row['line']}" if row["file"] else "(no Python frame)"
            sites.add_row(
                where,
                str(row["function"]),
                CATEGORY_LABELS.get(str(row["category"]), str(row["category"])),
                format_bytes(int(row["bytes"])),
                f"{int(row['bytes']):,}",
                f"{int(row['count']):,}",
            )
        console.print(sites)
    else:
        assert source.phases is not None
        findings = compute_findings_phases_only(source.phases)
    overview = rank_overview(source)
    if overview is not None:
        add_rank_finding(findings, overview)
        ranks = Table(title="per-rank peaks")
        ranks.add_column("rank", justify="right")
        ranks.add_column("snapshot")
        ranks.add_column("peak (snapshot)", justify="right")
        ranks.add_column("exact", justify="right")
        for phase in overview.phase_columns:
            ranks.add_column(f"max {phase} (CSV)", justify="right")
        for r in overview.ranks:
            ranks.add_row(
                str(r.rank),
                escape(r.snapshot.path.name) if r.snapshot is not None else "(none)",
                format_bytes(r.peak_bytes) if r.peak_bytes is not None else "",
                f"{r.peak_bytes:,} B" if r.peak_bytes is not None else "",
                *[format_bytes(r.phase_peaks[p]) if p in r.phase_peaks else "" for p in overview.phase_columns],
            )
        console.print(ranks)
        if overview.imbalance is not None:
            imb = overview.imbalance
            console.print(f"rank imbalance ({imb.basis}, max - min): {imb.sentence()}", markup=False)
    if source.phases is not None:
        pivot = phase_peaks_table(source.phases, max_steps=20)
        table = Table(title="per-phase peaks (phases CSV)")
        table.add_column("step", justify="right")
        for column in pivot.columns:
            table.add_column(str(column), justify="right")
        for step, row in pivot.iterrows():
            table.add_row(str(int(step)), *["" if v != v else format_bytes(int(v)) for v in row.tolist()])
        console.print(table)
    table = Table(title="findings", show_header=False)
    table.add_column("", no_wrap=True)
    table.add_column("finding")
    for finding in findings:
        table.add_row("!" if str(finding.severity) == "warning" else "-", finding.message)
    console.print(table)
    return 0


# ---------------------------------------------------------------------------------------------------- diff
def _add_diff(subparsers: Any) -> None:
    parser = subparsers.add_parser("diff", help="compare two snapshots or runs at their peaks (B - A)")
    parser.add_argument("a", help="first snapshot or log folder (A)")
    parser.add_argument("b", help="second snapshot or log folder (B)")
    parser.add_argument("--sites", type=_positive_int, default=10, help="allocation sites to list (default 10)")
    parser.add_argument("--max-bytes", "--max-size", dest="max_bytes", type=_bytes_arg, default=None, help="refuse files larger than this (default 8GiB)")
    parser.set_defaults(func=_cmd_diff)


def _signed(value: int) -> str:
    if value == 0:
        return "0 B"
    return f"{'+' if value > 0 else '-'}{abs(value):,} B ({'+' if value > 0 else '-'}{format_bytes(abs(value))})"


def _cmd_diff(args: argparse.Namespace) -> int:
    from rich.table import Table

    from lightning_memtrace.replay import CATEGORY_LABELS
    from lightning_memtrace.report import diff_sources, load_source

    with _progress() as progress:
        a = load_source(args.a, progress=progress, **_loader_kwargs(args))
        b = load_source(args.b, progress=progress, **_loader_kwargs(args))
    result = diff_sources(a, b)
    console = _console()
    console.print(f"A = {result.a_name}\nB = {result.b_name}")
    for title, frame, key, labels in (
        ("at the peak", result.summary, "figure", None),
        ("live bytes at the peak, by category", result.by_category, "category", CATEGORY_LABELS),
        ("live bytes at the peak, by allocation site", result.by_site.head(args.sites), "site", None),
    ):
        table = Table(title=title)
        table.add_column(key)
        table.add_column("A", justify="right")
        table.add_column("B", justify="right")
        table.add_column("B - A", justify="right")
        for _, row in frame.iterrows():
            name = str(row[key])
            if labels:
                name = labels.get(name, name)
            if key == "figure" and name == "events":
                table.add_row(name, f"{int(row['a']):,}", f"{int(row['b']):,}", f"{int(row['delta']):+,}")
            else:
                table.add_row(name, f"{int(row['a']):,} B", f"{int(row['b']):,} B", _signed(int(row["delta"])))
        console.print(table)
    return 0


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """The ``memtrace`` parser with every subcommand: built-in, listed in :data:`SUBCOMMAND_MODULES`, registered."""
    parser = _Parser(prog=PROG, description="Read PyTorch memory snapshots and MemTrace logs.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_report(subparsers)
    _add_summary(subparsers)
    _add_diff(subparsers)
    added: list[SubcommandAdder] = []
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:
                continue
            raise
        adder = getattr(module, "add_subcommand", None)
        if callable(adder) and adder not in added:
            added.append(adder)
            try:
                adder(subparsers)
            except argparse.ArgumentError:  # a name another module already took: keep the first
                continue
    for adder in _REGISTERED:
        if adder not in added:
            adder(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memtrace``; returns the exit status (errors: one line on stderr, status 2)."""
    from lightning_memtrace.snapshot_loader import SnapshotError

    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return ERROR_EXIT
    try:
        return int(func(args) or 0)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    except (SnapshotError, CliError) as error:
        _fail(str(error))
    except MemoryError:
        _fail("out of memory while reading the input (try --max-bytes to refuse files this large)")
    except OSError as error:
        where = f"{error.filename}: " if getattr(error, "filename", None) else ""
        _fail(f"{where}{error.strerror or error}")
    except Exception as error:  # last resort: still one line, never a traceback
        _fail(f"{type(error).__name__}: {error}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
