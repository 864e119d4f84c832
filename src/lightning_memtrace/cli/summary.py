"""``memtrace summary``: the report's figures and findings as terminal tables (from the same view as the report)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from lightning_memtrace.cli.args import add_max_bytes, add_rules, add_sites, loader_kwargs
from lightning_memtrace.cli.console import console, progress
from lightning_memtrace.cli.moments import add_question_options, print_moment, question_of, summary_payload
from lightning_memtrace.units import format_bytes


def add_subcommand(subparsers: Any) -> None:
    parser = subparsers.add_parser("summary", help="print the report's findings as terminal tables")
    parser.add_argument("path", help="snapshot, MemTrace log folder or its phases_rank<R>.csv")
    add_sites(parser)
    add_max_bytes(parser)
    add_rules(parser)
    add_question_options(parser)
    parser.set_defaults(func=run)


def _table(title: str | None, columns: list[tuple[str, str]], rows: list[list[str]], **options: Any) -> Any:
    from rich.table import Table

    table = Table(title=title, **options)
    for column, justify in columns:
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*row)
    return table


def info_table(view: Any) -> Any:
    """Events, segments, the peak and how categories were made."""
    rows = [
        ["events", f"{view.events:,}"],
        ["segments", f"{view.segments:,}"],
        ["peak allocated", f"{format_bytes(view.total_bytes)} ({view.total_bytes:,} B)"],
    ]
    if view.reserved_known:
        rows.append(["reserved at peak", f"{format_bytes(view.reserved_bytes)} ({view.reserved_bytes:,} B)"])
    rows.append(["peak at", view.moment or "dump time (no trace)"])
    if not view.is_memtrace:
        rows.append(["categories", "inferred from frames" if view.inferred else "recorded"])
    else:
        rows.append(["categories", f"recorded by MemTrace ({view.inferred_percent:.0f}% of the peak inferred)"])
    if view.category_rules:
        rules = ", ".join(f"{name}={pattern}" for name, pattern in view.category_rules.items())
        rows.append(["category rules", rules])
    columns = [("figure", "left"), ("value", "right")]
    return _table(f"{view.name} (device {view.device})", columns, rows, show_header=False)


def categories_table(view: Any, title: str = "live at the peak, by category") -> Any:
    rows = [[s.label, format_bytes(s.bytes), f"{s.bytes:,}", f"{s.percent:.1f}%"] for s in view.categories]
    columns = [("category", "left"), ("bytes", "right"), ("exact", "right"), ("share", "right")]
    return _table(title, columns, rows)


def shorten_where(where: str, width: int) -> str:
    """``file:line`` in at most ``width`` characters: the file name and line number are kept whole, the directories
    are dropped from the left (``…/pkg/file.py:123``)."""
    if len(where) <= width:
        return where
    path, sep, line = where.rpartition(":")
    if not sep or not line.isdigit():
        path, line = where, ""
    tail = f":{line}" if line else ""
    parts = path.replace("\\", "/").split("/")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        candidate = f"{part}/{kept}"
        if len(f"…/{candidate}{tail}") > width:
            break
        kept = candidate
    return f"…/{kept}{tail}" if kept != path else f"{kept}{tail}"


#: The widest the function column gets before the file:line column is shortened.
FUNCTION_WIDTH = 24


def sites_table(view: Any, width: int | None = None, title: str = "largest allocation sites at the peak") -> Any:
    """The largest sites; with ``width`` (the console's), ``file:line`` is shortened in the middle to fit."""
    cells = [[s.where, s.function, s.label, format_bytes(s.bytes), f"{s.bytes:,}", f"{s.count:,}"] for s in view.sites]
    columns = [
        ("file:line", "left"),
        ("function", "left"),
        ("category", "left"),
        ("bytes", "right"),
        ("exact", "right"),
        ("count", "right"),
    ]
    if width is not None and cells:
        widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _) in enumerate(columns)]
        others = min(widths[1], FUNCTION_WIDTH) + sum(widths[2:])
        budget = max(24, width - others - (3 * len(columns) + 1))
        cells = [[shorten_where(row[0], budget), *row[1:]] for row in cells]
    from rich.table import Table

    table = Table(title=title)
    for i, (column, justify) in enumerate(columns):
        table.add_column(column, justify=justify, no_wrap=i == 0, min_width=None)  # type: ignore[arg-type]
    for row in cells:
        table.add_row(*row)
    return table


def ranks_table(overview: Any) -> Any:
    columns = [("rank", "right"), ("snapshot", "left"), ("peak (snapshot)", "right"), ("exact", "right")]
    columns += [(f"max {phase} (CSV)", "right") for phase in overview.phase_columns]
    rows = [
        [
            str(r.rank),
            r.snapshot.path.name if r.snapshot is not None else "(none)",
            format_bytes(r.peak_bytes) if r.peak_bytes is not None else "",
            f"{r.peak_bytes:,} B" if r.peak_bytes is not None else "",
            *[format_bytes(r.phase_peaks[p]) if p in r.phase_peaks else "" for p in overview.phase_columns],
        ]
        for r in overview.ranks
    ]
    return _table("per-rank peaks", columns, rows)


def phases_table(phases: Any) -> Any:
    from lightning_memtrace.analysis.phases import phase_peaks_table

    pivot = phase_peaks_table(phases, max_steps=20)
    columns = [("step", "right")] + [(str(column), "right") for column in pivot.columns]
    rows = [
        [str(int(step)), *["" if math.isnan(v) else format_bytes(int(v)) for v in row.tolist()]]
        for step, row in pivot.iterrows()
    ]
    return _table("per-phase peaks (phases CSV)", columns, rows)


def findings_table(findings: list[Any]) -> Any:
    from rich.table import Table

    table = Table(title="findings", show_header=False)
    table.add_column("", no_wrap=True)
    table.add_column("finding")
    for finding in findings:
        table.add_row("!" if str(finding.severity) == "warning" else "-", finding.message)
    return table


def post_mortem_table(pm: dict[str, Any]) -> Any:
    """One out-of-memory post-mortem (:func:`~lightning_memtrace.analysis.answers.post_mortem_objects`): where and why
    the run died, what was live, the line that asked and what to change."""
    died = f"{pm['stage']}, step {pm['step']} (epoch {pm['epoch']}, batch_idx {pm['batch_idx']})"
    rows = [["error", f"{pm['exception_type']}: {pm['message']}"], ["died in", died]]
    if pm["raised_as"]:
        rows.append(["raised as", pm["raised_as"]])
    for key in ("requested_bytes", "allocated_bytes", "reserved_bytes"):
        value = pm[key]
        shown = "unknown" if value is None else f"{format_bytes(value)} ({value:,} B)"
        rows.append([key.removesuffix("_bytes"), shown])
    if pm["failed_at"]:
        rows.append(["failed at", pm["failed_at"]])
    rows += [["what to change" if i == 0 else "", tip] for i, tip in enumerate(pm["advice"])]
    return _table(f"out of memory: {pm['file']}", [("", "left"), ("", "left")], rows, show_header=False)


#: Annotated ranges the summary lists (the report lists more).
MAX_ANNOTATED_RANGES = 40


def _duration(us: int | None) -> str:
    if us is None:
        return "open"
    return f"{us / 1000:.1f} ms" if us >= 100 else f"{us} µs"


def annotations_table(dev: Any, max_rows: int = MAX_ANNOTATED_RANGES) -> Any | None:
    """The device's annotated ranges (torch's ``external_annotations``: ``record_function`` ranges, MemTrace's
    phases): live bytes at each START and END, the peak inside and its largest categories; None when it has none."""
    from lightning_memtrace.analysis.annotations import annotated_ranges
    from lightning_memtrace.types import category_label

    ranges = annotated_ranges(dev)
    if not ranges:
        return None
    rows = []
    for r in ranges[:max_rows]:
        top = ", ".join(f"{category_label(c)} {format_bytes(b)}" for c, b in list(r.by_category.items())[:3])
        rows.append(
            [
                "  " * min(r.depth, 6) + r.name + ("" if r.start_us is not None else " (started before)"),
                str(r.step) if r.step >= 0 else "",
                _duration(r.duration_us),
                format_bytes(r.start_live_bytes),
                format_bytes(r.end_live_bytes),
                format_bytes(r.peak_bytes),
                f"{r.peak_bytes:,}",
                top,
            ]
        )
    columns = [
        ("range", "left"),
        ("step", "right"),
        ("duration", "right"),
        ("at START", "right"),
        ("at END", "right"),
        ("peak inside", "right"),
        ("exact", "right"),
        ("largest categories at that peak", "left"),
    ]
    more = len(ranges) - max_rows
    caption = f"{more:,} more ranges: see memtrace report" if more > 0 else None
    return _table("annotations (annotated ranges)", columns, rows, caption=caption)


def compile_context_table(dev: Any) -> Any | None:
    """Live bytes at the peak by ``torch.compile`` context (CUDA events recorded with ``compile_context``), with
    each context's largest site; None when the events carry no compile context."""
    from lightning_memtrace.analysis.annotations import compile_context_sites
    from lightning_memtrace.types import category_label

    groups = compile_context_sites(dev, max_sites=1)
    if not groups:
        return None
    rows = [
        [
            g["compile_context"] or "(not compiled / before the trace)",
            format_bytes(g["bytes"]),
            f"{g['bytes']:,}",
            f"{g['count']:,}",
            f"{g['sites'][0]['site']} ({category_label(g['sites'][0]['category'])})" if g["sites"] else "",
        ]
        for g in groups
    ]
    columns = [("compile context", "left"), ("bytes", "right"), ("exact", "right"), ("count", "right")]
    return _table("live at the peak, by compile context", [*columns, ("largest site", "left")], rows)


def print_annotations(out: Any, main: Any) -> None:
    """The annotations table (and the compile-context table) of the main snapshot's main device, where it has them."""
    if main is None:
        return
    for table in (annotations_table(main.replay.main), compile_context_table(main.replay.main)):
        if table is not None:
            out.print(table)


def print_source(out: Any, source: Any, sites: int) -> None:
    """One run's tables: the peak, categories, sites, ranks, per-phase peaks and findings."""
    from lightning_memtrace.analysis.answers import post_mortem_objects
    from lightning_memtrace.analysis.ranks import rank_overview, source_findings
    from lightning_memtrace.analysis.view import snapshot_view

    main = source.main
    if main is not None:
        view = snapshot_view(main, max_sites=sites)
        for table in (info_table(view), categories_table(view), sites_table(view, out.width)):
            out.print(table)
    overview = rank_overview(source)
    findings = source_findings(source, overview)
    if overview is not None:
        out.print(ranks_table(overview))
        if overview.imbalance is not None:
            imb = overview.imbalance
            out.print(f"rank imbalance ({imb.basis}, max - min): {imb.sentence()}")
    if source.phases is not None:
        out.print(phases_table(source.phases))
    out.print(findings_table(findings))
    for pm in post_mortem_objects(source):
        out.print(post_mortem_table(pm))
    print_annotations(out, source.main)


def run(args: argparse.Namespace) -> int:
    from lightning_memtrace.analysis.source import load_sources

    if args.json:
        with progress() as callback:
            payload = summary_payload(args, progress=callback)
        print(json.dumps(payload, indent=2))
        return 0
    question = question_of(args)
    with progress() as callback:
        sources = load_sources(args.path, progress=callback, **loader_kwargs(args))
    out = console()
    if len(sources) > 1:
        out.print(f"{args.path}: {len(sources)} runs, oldest first")
    for source in sources:
        if len(sources) > 1:
            out.rule(f"run: {source.label}", characters="=")
        if question.empty and args.device is None:
            print_source(out, source, args.sites)
        else:
            print_moment(out, source, question, args)
    return 0
