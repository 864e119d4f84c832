"""The report page: sections built from a :class:`~lightning_memtrace.analysis.source.ReportSource` and its view."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from lightning_memtrace.analysis.annotations import annotated_ranges, annotation_rows, compile_context_sites
from lightning_memtrace.analysis.answers import finding_object, post_mortem_objects
from lightning_memtrace.analysis.categories import INFERENCE_RULES
from lightning_memtrace.analysis.findings import Finding
from lightning_memtrace.analysis.ranks import RankOverview, rank_overview, source_findings
from lightning_memtrace.analysis.source import LoadedSnapshot, ReportSource, run_name
from lightning_memtrace.analysis.view import MemoryView, snapshot_view
from lightning_memtrace.files import ESTIMATE_COMPARISON_GLOB, WHAT_IF_GLOB, rank_of, what_if_filename
from lightning_memtrace.report.figure import DEFAULT_MAX_POINTS, build_figure, phases_figure, timeline_data
from lightning_memtrace.report.html import (
    breakdown_table,
    chart_html,
    phases_html,
    ranks_html,
    sites_table,
    summary_json,
    table,
)
from lightning_memtrace.report.png import write_png
from lightning_memtrace.report.style import CSS, esc
from lightning_memtrace.types import category_label
from lightning_memtrace.units import format_bytes, format_bytes_exact

#: Annotated ranges the report lists (a long window of many steps has several per step).
MAX_REPORT_RANGES = 500


@dataclasses.dataclass
class _Page:
    """What the sections add up to: HTML sections, the JSON summary, findings, and whether plotly.js is embedded."""

    sections: list[str]
    summary: dict[str, Any]
    findings: list[Finding]
    include_js: Any = True
    config: dict[str, Any] = dataclasses.field(default_factory=lambda: {"displaylogo": False, "responsive": True})
    #: Put before every chart's element id, so that several runs' charts share a page.
    id_prefix: str = ""

    def chart(self, fig: Any, div_id: str) -> str:
        html = chart_html(fig, self.include_js, self.config, self.id_prefix + div_id)
        self.include_js = False
        return html


def _rules_note(view: MemoryView) -> str:
    if not view.category_rules:
        return ""
    rules = ", ".join(f"<code>{esc(name)}={esc(pattern)}</code>" for name, pattern in view.category_rules.items())
    return (
        '<p class="meta">User rules for categories (each frame searched as <code>file:line function</code>, innermost '
        f"first; before inferred categories, after recorded ones): {rules}.</p>"
    )


def _inferred_note(view: MemoryView) -> str:
    return _inferred_text(view) + _rules_note(view)


def _inferred_text(view: MemoryView) -> str:
    if not view.is_memtrace and view.inferred:
        return (
            '<p class="meta">Categories are inferred from stack frames and lifetimes (the snapshot was not '
            f"written by MemTrace): {INFERENCE_RULES}.</p>"
        )
    if view.inferred:
        return (
            '<p class="meta">Categories recorded by MemTrace; allocations it left uncategorised '
            f"({esc(format_bytes(view.inferred_bytes))} at the peak) are inferred: {INFERENCE_RULES}.</p>"
        )
    return '<p class="meta">Categories recorded by MemTrace.</p>'


def _peak_section(view: MemoryView) -> str:
    where = view.moment or "at dump time (no trace)"
    reserved = (
        f"<p>Reserved by the allocator at the peak: {esc(format_bytes_exact(view.reserved_bytes))}"
        f" ({esc(format_bytes(max(view.reserved_bytes - view.total_bytes, 0)))} more than allocated).</p>"
        if view.reserved_known and view.reserved_bytes
        else ""
    )
    return (
        f"<h2>Peak: {esc(format_bytes_exact(view.total_bytes))} ({esc(where)})</h2>"
        + breakdown_table(view)
        + reserved
        + _inferred_note(view)
    )


def _snapshot_sections(page: _Page, main: LoadedSnapshot, source: ReportSource, max_points: int, png_path: Any) -> None:
    """Timeline, peak and sites of the main snapshot."""
    rep = main.replay
    dev = rep.main
    view = snapshot_view(main)
    data = timeline_data(dev, max_points)
    title = f"{main.path.name} — device {dev.device}: live memory by category"
    fig = build_figure(dev, data, title)
    page.summary.update(
        {
            "snapshot": main.path.name,
            "device": dev.device,
            "events": dev.num_events,
            "peak_bytes": view.total_bytes,
            "peak_index": int(dev.peak.index),
            "peak_reserved_bytes": view.reserved_bytes,
            "peak_stage": view.stage,
            "peak_step": view.step,
            "peak_by_category": view.by_category,
            "points": len(data.rows),
            "inferred_categories": bool(view.inferred),
        }
    )
    if png_path is not None:
        write_png(dev, data, png_path, title)
    page.sections.append(
        f'<h2>Timeline</h2>{page.chart(fig, "timeline")}<p class="meta">{len(data.rows):,} of {dev.num_events:,} '
        "events drawn; every local maximum is drawn at its exact value. Shaded bands: phases (forward, backward, "
        "optimizer step...); dotted lines: steps.</p>"
    )
    page.sections.append(_peak_section(view))
    page.sections.append("<h2>Largest allocation sites at the peak</h2>" + sites_table(view))
    _annotations_section(page, dev)
    _compile_context_section(page, dev)


def _compile_context_section(page: _Page, dev: Any) -> None:
    """Live bytes at the peak by torch.compile context (CUDA events recorded with ``compile_context``), if any."""
    groups = compile_context_sites(dev)
    if not groups:
        return
    page.summary["peak_by_compile_context"] = groups
    rows = [
        {
            "compile context": g["compile_context"] or "(not compiled / before the trace)",
            "bytes": format_bytes_exact(g["bytes"]),
            "count": f"{g['count']:,}",
            "largest sites": "; ".join(
                f"{x['site']} ({category_label(x['category'])}, {format_bytes(x['bytes'])})" for x in g["sites"][:3]
            ),
        }
        for g in groups
    ]
    page.sections.append(
        "<h2>Live at the peak by compile context</h2>" + table(pd.DataFrame(rows), {"bytes", "count"})
    )


def _annotations_section(page: _Page, dev: Any) -> None:
    """"Annotated ranges": the snapshot's ``external_annotations`` (``record_function`` ranges, MemTrace's phases),
    each START/END pair with the live bytes at both ends and the peak inside; and both in the JSON summary."""
    ranges = annotated_ranges(dev)
    if not ranges:
        return
    page.summary["annotations"] = annotation_rows(dev)
    page.summary["annotated_ranges"] = [r.as_dict() for r in ranges]
    rows = [
        {
            "range": "\u00a0\u00a0" * min(r.depth, 6) + r.name + ("" if r.start_us is not None else " (started before)"),
            "step": "" if r.step < 0 else r.step,
            "duration": "open" if r.duration_us is None else f"{r.duration_us / 1000:.3f} ms",
            "at START": format_bytes_exact(r.start_live_bytes),
            "at END": format_bytes_exact(r.end_live_bytes),
            "peak inside": format_bytes_exact(r.peak_bytes),
            "categories at that peak": ", ".join(
                f"{category_label(c)} {format_bytes(b)}" for c, b in r.by_category.items()
            ),
        }
        for r in ranges[:MAX_REPORT_RANGES]
    ]
    more = len(ranges) - MAX_REPORT_RANGES
    note = f"<p class=\"meta\">{more:,} more ranges are in the JSON summary.</p>" if more > 0 else ""
    page.sections.append(
        "<h2>Annotated ranges</h2>"
        '<p class="meta">The snapshot\'s annotations (torch\'s <code>external_annotations</code>: '
        "<code>record_function</code> ranges and MemTrace's phases): live bytes at each START and END (after every "
        "event up to that time) and the highest live bytes inside the range, with its categories.</p>"
        + table(pd.DataFrame(rows), {"step", "duration", "at START", "at END", "peak inside"})
        + note
    )


def _phases_only_sections(page: _Page, phases: pd.DataFrame) -> None:
    page.sections.append(f"<h2>Memory per phase</h2>{page.chart(phases_figure(phases), 'timeline')}")
    page.summary["peak_bytes"] = int(phases["peak_bytes"].max())


def _rank_chart(r: Any, phases: pd.DataFrame | None, max_points: int) -> tuple[Any, str] | None:
    """One rank's figure and note: from its highest-peak snapshot, else its rows of the phases CSV."""
    if r.snapshot is not None:
        dev = r.snapshot.replay.main
        data = timeline_data(dev, max_points)
        title = f"rank {r.rank}: {r.snapshot.path.name} — device {dev.device}: live memory by category"
        note = f"{len(data.rows):,} of {dev.num_events:,} events drawn; peak {format_bytes_exact(dev.peak.live_bytes)}."
        return build_figure(dev, data, title), note
    if phases is None or not len(phases):
        return None
    mine = phases[phases["rank"] == r.rank]
    if not len(mine):
        return None
    fig = phases_figure(mine, f"rank {r.rank}: memory per phase row (MemTrace phases CSV, no snapshot)")
    return fig, f"{len(mine):,} rows of the phases CSV (no snapshot for this rank)."


def _rank_charts_html(page: _Page, overview: RankOverview, phases: pd.DataFrame | None, max_points: int) -> str:
    """One timeline per rank, rank 0 first (div ids ``timeline-rank<R>``)."""
    parts = ['<h2 id="rank-timelines">Timeline per rank</h2>']
    for r in overview.ranks:
        made = _rank_chart(r, phases, max_points)
        if made is None:
            continue
        fig, note = made
        chart = page.chart(fig, f"timeline-rank{int(r.rank)}")
        parts.append(f'<h3>Rank {int(r.rank)}</h3>{chart}<p class="meta">{esc(note)}</p>')
    return "".join(parts)


def _rank_summary(overview: RankOverview) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "ranks": [
            {
                "rank": int(r.rank),
                "snapshot": r.snapshot.path.name if r.snapshot is not None else None,
                "peak_bytes": r.peak_bytes,
                "phases_peak_bytes": r.phases_peak,
                "phase_peaks": dict(r.phase_peaks),
            }
            for r in overview.ranks
        ]
    }
    imb = overview.imbalance
    if imb is not None:
        summary["rank_imbalance"] = {
            "basis": imb.basis,
            "high_rank": imb.high_rank,
            "low_rank": imb.low_rank,
            "high_bytes": imb.high_bytes,
            "low_bytes": imb.low_bytes,
            "imbalance_bytes": imb.imbalance_bytes,
            "percent": imb.percent,
        }
    return summary


def _rank_sections(page: _Page, source: ReportSource, overview: RankOverview | None, max_points: int) -> None:
    if overview is None:
        return
    # after the main chart in page order: the per-rank charts rely on the plotly.js it embeds
    page.sections.insert(0, ranks_html(overview))
    page.sections.append(_rank_charts_html(page, overview, source.phases, max_points))
    page.summary.update(_rank_summary(overview))


#: The columns of a what-if CSV the report shows (the CSV has one ``<category>_bytes`` column per category too).
WHAT_IF_COLUMNS = ("remedy", "peak_bytes", "saved_bytes", "fits", "max_micro_batch", "kind", "price")


def _what_if_section(path: Path) -> str | None:
    """The "What would fit" section: the rows of ``what_if_rank<R>.csv``, then the combination line, its snippet and
    any note from the ``.json`` beside it; None where the CSV cannot be read."""
    try:
        frame = pd.read_csv(path)
    except Exception:  # noqa: BLE001 - a table that cannot be read is left out, the report stands without it
        return None
    frame = frame[[c for c in WHAT_IF_COLUMNS if c in frame.columns]]
    numeric = {c for c in frame.columns if c.endswith("_bytes")} | {"max_micro_batch"}
    html = f"<h2>What would fit ({esc(path.name)})</h2>" + table(readable_numbers(frame), numeric)
    try:
        extra = json.loads(path.with_suffix(".json").read_text())
    except Exception:  # noqa: BLE001 - the CSV alone still says most of it
        extra = {}
    notes = [str(extra.get(key) or "") for key in ("combination_text", "note")]
    if any(notes):
        html += f"<pre>{esc(chr(10).join(n for n in notes if n))}</pre>"
    return html


def _estimate_sections(folder: Path) -> list[str]:
    """Each rank's estimate-vs-measured table, each followed by its what-if (then what-ifs without a comparison)."""
    sections = []
    shown: set[Path] = set()
    for estimate_csv in sorted(folder.glob(ESTIMATE_COMPARISON_GLOB)):
        try:
            comparison = pd.read_csv(estimate_csv)
        except Exception:  # a comparison that cannot be read is left out, the report stands without it
            continue
        numeric = {c for c in comparison.columns if c.endswith(("_bytes", "_percent"))}
        comparison = readable_numbers(comparison)
        sections.append(f"<h2>Estimate vs measured ({esc(estimate_csv.name)})</h2>" + table(comparison, numeric))
        rank = rank_of(estimate_csv.name)
        what_if_csv = estimate_csv.with_name(what_if_filename(rank)) if rank is not None else None
        if what_if_csv is not None and what_if_csv.is_file():
            shown.add(what_if_csv)
            sections.append(_what_if_section(what_if_csv) or "")
    for what_if_csv in sorted(set(folder.glob(WHAT_IF_GLOB)) - shown):
        sections.append(_what_if_section(what_if_csv) or "")
    return [section for section in sections if section]


def _other_sections(source: ReportSource) -> list[str]:
    """Per-phase peaks, every snapshot, estimate-vs-measured and what-if tables, and post-mortem texts."""
    sections = []
    if source.phases is not None:
        sections.append("<h2>Per-phase peaks (MemTrace phases CSV)</h2>" + phases_html(source.phases))
    if len(source.snapshots) > 1:
        rows = [
            {
                "file": s.path.name,
                "rank": "" if s.rank is None else s.rank,
                "kind": s.kind,
                "events": f"{s.replay.num_events:,}",
                "peak": format_bytes_exact(s.replay.peak.live_bytes),
            }
            for s in source.snapshots
        ]
        sections.append("<h2>All snapshots</h2>" + table(pd.DataFrame(rows), {"events", "peak"}))
    if source.path.is_dir():
        sections.extend(_estimate_sections(source.path))
    for s in source.snapshots:
        if s.oom_text:
            sections.append(f"<h2>Out of memory: {esc(s.path.name)}</h2><pre>{esc(s.oom_text)}</pre>")
    return sections


def readable_numbers(frame: pd.DataFrame) -> pd.DataFrame:
    """``*_bytes`` columns as ``1.5 MiB (1,572,864 B)``, ``*_percent`` as ``12.3%``, other integers with separators."""
    out = frame.copy().astype(object)
    for column in frame.columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        if values.isna().all():
            continue
        for index, value in values.items():
            if pd.isna(value):
                continue
            if str(column).endswith("_bytes"):
                out.at[index, column] = format_bytes_exact(int(value))
            elif str(column).endswith("_percent"):
                out.at[index, column] = f"{float(value):.1f}%"
            elif float(value).is_integer() and abs(value) >= 1000:
                out.at[index, column] = f"{int(value):,}"
    return out


def _header(source: ReportSource, findings: list[Finding], title: str) -> str:
    main = source.main
    items = "".join(f'<li class="{esc(f.severity)}">{esc(f.message)}</li>' for f in findings) or "<li>No finding.</li>"
    return (
        title
        + f'<div class="meta">{esc(str(source.path))} · {len(source.snapshots)} snapshot(s)'
        + (f" · {main.replay.num_segments:,} segments · {main.replay.num_events:,} events" if main else "")
        + "</div>"
        f'<h2>Findings</h2><ul class="findings">{items}</ul>'
    )


def _fill(page: _Page, source: ReportSource, max_points: int, png_path: str | os.PathLike[str] | None) -> None:
    """Every section of one run, and its findings in the JSON summary."""
    main = source.main
    if main is not None:
        _snapshot_sections(page, main, source, max_points, png_path)
    elif source.phases is not None:
        _phases_only_sections(page, source.phases)
    overview = rank_overview(source)
    _rank_sections(page, source, overview, max_points)
    page.sections += _other_sections(source)
    page.findings = source_findings(source, overview)
    page.summary["findings"] = [finding_object(f) for f in page.findings]
    page.summary["post_mortems"] = post_mortem_objects(source)


def _document(title: str, body: str, summary: dict[str, Any]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>memtrace report: {esc(title)}</title><style>{CSS}</style></head><body>"
        + body
        + f'<script type="application/json" id="memtrace-summary">{summary_json(summary)}</script>'
        + "</body></html>\n"
    )


def render_html(
    source: ReportSource, *, max_points: int = DEFAULT_MAX_POINTS, png_path: str | os.PathLike[str] | None = None
) -> str:
    """The report page for a source (see :func:`~lightning_memtrace.report.write_report`)."""
    page = _Page(sections=[], summary={"source": str(source.path)}, findings=[])
    _fill(page, source, max_points, png_path)
    name = run_name(source.path)
    body = _header(source, page.findings, f"<h1>Memory report: {esc(name)}</h1>") + "".join(page.sections)
    return _document(name, body, page.summary)


def _runs_index(sources: list[ReportSource]) -> str:
    rows = []
    for index, source in enumerate(sources):
        main = source.main
        peak = main.replay.peak.live_bytes if main is not None else None
        if peak is None and source.phases is not None and not source.phases.empty:
            peak = int(source.phases["peak_bytes"].max())
        steps = "" if source.phases is None or source.phases.empty else f"{source.phases['step'].nunique():,}"
        rows.append(
            f'<tr><td><a href="#run-{index}">{esc(source.label)}</a></td><td>{esc(source.run)}</td>'
            f'<td class="num">{steps}</td><td class="num">{len(source.snapshots)}</td>'
            f'<td class="num">{esc(format_bytes_exact(peak)) if peak is not None else ""}</td></tr>'
        )
    head = "".join(f"<th>{h}</th>" for h in ("run folder", "run id", "steps", "snapshots", "peak"))
    return f'<h2 id="runs">Runs</h2><table id="runs-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def render_runs_html(
    sources: list[ReportSource],
    title: str,
    *,
    max_points: int = DEFAULT_MAX_POINTS,
    png_path: str | os.PathLike[str] | None = None,
) -> str:
    """One page for several runs (a parent of several log folders): an index, then each run's report in its own
    section, oldest first; the PNG (if asked for) is the newest run's timeline."""
    include_js: Any = True
    parts = [f"<h1>Memory report: {esc(title)} ({len(sources)} runs)</h1>", _runs_index(sources)]
    summaries = []
    for index, source in enumerate(sources):
        summary = {"source": str(source.path), "run": source.run, "label": source.label}
        page = _Page(sections=[], summary=summary, findings=[], include_js=include_js, id_prefix=f"run{index}-")
        _fill(page, source, max_points, png_path if index == len(sources) - 1 else None)
        include_js = page.include_js
        heading = f'<h1 class="run-title">Run: {esc(source.label)}</h1>'
        parts.append(f'<section id="run-{index}" class="run">{_header(source, page.findings, heading)}')
        parts.append("".join(page.sections) + "</section>")
        summaries.append(page.summary)
    return _document(title, "".join(parts), {"source": title, "runs": summaries})
