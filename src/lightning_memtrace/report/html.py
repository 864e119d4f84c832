"""HTML fragments of the report: tables (from the :class:`~lightning_memtrace.analysis.view.MemoryView`), the phases
pivot, the ranks section and a plotly chart."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pandas as pd
from lightning_utilities.core.imports import RequirementCache

from lightning_memtrace.analysis.phases import phase_peaks_table
from lightning_memtrace.analysis.ranks import RankOverview
from lightning_memtrace.analysis.view import MemoryView
from lightning_memtrace.report.style import category_color, esc
from lightning_memtrace.units import format_bytes


#: plotly is optional (the ``report`` extra): without it the report is written with its tables and no chart.
PLOTLY_AVAILABLE = RequirementCache("plotly>=5.5")  # to_html(div_id=...) came in 5.5
NO_PLOTLY_NOTE = (
    '<p class="meta">No interactive chart: it needs plotly (<code>pip install "lightning-memtrace[report]"</code>). '
    "The tables hold the same figures.</p>"
)


def chart_html(fig: Any, include_js: bool, config: dict[str, Any], div_id: str) -> str:
    """One plotly chart as an HTML fragment; plotly.js goes inline with the first chart of the page only (and so does
    the note that says why there is no chart, without plotly)."""
    if not PLOTLY_AVAILABLE:
        return NO_PLOTLY_NOTE if include_js else ""
    import plotly.io as pio

    # plotly before 6.6 replaces warnings.formatwarning for the whole process when to_html first imports plotly.tools:
    # every later warning of the user's run would print in plotly's format.
    formatwarning = warnings.formatwarning
    try:
        return pio.to_html(
            fig.to_dict(), validate=False, full_html=False, include_plotlyjs=include_js, config=config, div_id=div_id
        )
    finally:
        warnings.formatwarning = formatwarning


def table(frame: pd.DataFrame, numeric: set[str] | None = None) -> str:
    """A DataFrame as an HTML table (``numeric`` columns right-aligned)."""
    numeric = numeric or set()
    head = "".join(f"<th>{esc(c)}</th>" for c in frame.columns)
    body = []
    for _, row in frame.iterrows():
        cells = []
        for c in frame.columns:
            cls = ' class="num"' if c in numeric else ""
            cells.append(f"<td{cls}>{esc(row[c])}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def sites_table(view: MemoryView) -> str:
    """The largest allocation sites of the view."""
    if not view.site_count:
        return "<p>No live allocation at the peak.</p>"
    rows = []
    for site in view.sites:
        rows.append(
            "<tr>"
            f"<td><code>{esc(site.where)}</code></td><td><code>{esc(site.function)}</code></td>"
            f"<td>{esc(site.label)}</td>"
            f'<td class="num">{esc(format_bytes(site.bytes))}</td><td class="num">{site.bytes:,}</td>'
            f'<td class="num">{site.percent:.1f}%</td><td class="num">{site.count:,}</td>'
            "</tr>"
        )
    head = (
        "<tr><th>file:line</th><th>function</th><th>category</th><th>bytes</th><th>exact</th><th>of peak</th>"
        "<th>count</th></tr>"
    )
    hidden = view.site_count - len(view.sites)
    more = f'<p class="meta">{hidden} more sites not shown.</p>' if hidden > 0 else ""
    return f"<table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>{more}"


def breakdown_table(view: MemoryView) -> str:
    """Bytes and share per category, and the total."""
    rows = []
    for share in view.categories:
        color = category_color(share.category, view.rule_categories)
        rows.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{esc(share.label)}'
            f'</td><td class="num">{esc(format_bytes(share.bytes))}</td><td class="num">{share.bytes:,}</td>'
            f'<td class="num">{share.percent:.1f}%</td></tr>'
        )
    total = view.total_bytes
    rows.append(
        f'<tr><th>total</th><th class="num">{esc(format_bytes(total))}</th><th class="num">{total:,}</th><th></th></tr>'
    )
    return (
        "<table><thead><tr><th>category</th><th>bytes</th><th>exact</th><th>share</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def phases_html(phases: pd.DataFrame) -> str:
    pivot = phase_peaks_table(phases)
    head = "<th>step</th>" + "".join(f"<th>{esc(c)}</th>" for c in pivot.columns)
    best = pivot.max().max()
    rows = []
    for step, r in pivot.iterrows():
        cells = []
        for c in pivot.columns:
            v = r[c]
            if pd.isna(v):
                cells.append("<td></td>")
            else:
                style = ' style="font-weight:bold"' if v == best else ""
                cells.append(f'<td class="num"{style} title="{int(v):,} B">{esc(format_bytes(int(v)))}</td>')
        rows.append(f'<tr><td class="num">{int(step)}</td>{"".join(cells)}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def ranks_html(overview: RankOverview) -> str:
    """The "Ranks" section: one row per rank, peaks side by side, and the imbalance line."""
    imb = overview.imbalance
    high = imb.high_rank if imb is not None and imb.imbalance_bytes > 0 else None
    head = "<th>rank</th><th>snapshot</th><th>peak (snapshot)</th><th>exact</th>" + "".join(
        f"<th>max {esc(p)} (CSV)</th>" for p in overview.phase_columns
    )
    rows = []
    for r in overview.ranks:
        bold = ' style="font-weight:bold"' if r.rank == high else ""
        if r.peak_bytes is not None and r.snapshot is not None:
            peak_cells = (
                f"<td><code>{esc(r.snapshot.path.name)}</code></td>"
                f'<td class="num"{bold}>{esc(format_bytes(r.peak_bytes))}</td>'
                f'<td class="num rank-peak" data-bytes="{int(r.peak_bytes)}">{int(r.peak_bytes):,}</td>'
            )
        else:
            peak_cells = '<td class="meta">no snapshot</td><td></td><td></td>'
        phase_cells = "".join(
            f'<td class="num" title="{r.phase_peaks[p]:,} B">{esc(format_bytes(r.phase_peaks[p]))}</td>'
            if p in r.phase_peaks
            else "<td></td>"
            for p in overview.phase_columns
        )
        rows.append(f'<tr data-rank="{int(r.rank)}"><td class="num">{int(r.rank)}</td>{peak_cells}{phase_cells}</tr>')
    if imb is not None:
        pct = f"{imb.percent:.1f}" if imb.percent is not None else ""
        line = (
            f'<p id="rank-imbalance" data-bytes="{int(imb.imbalance_bytes)}" data-percent="{pct}" '
            f'data-high-rank="{int(imb.high_rank)}" data-low-rank="{int(imb.low_rank)}">'
            f"<b>Imbalance</b> ({esc(imb.basis)}, max - min over {len(imb.peaks)} ranks): {esc(imb.sentence())}.</p>"
        )
    else:
        line = '<p class="meta">Not enough peaks to compare ranks.</p>'
    return (
        '<h2 id="ranks">Ranks</h2>'
        + line
        + f'<table id="ranks-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
        + '<p class="meta">peak (snapshot): the highest live bytes in that rank\'s snapshot replay (its recorded '
        "window); max &lt;phase&gt; (CSV): the highest <code>peak_bytes</code> of that phase over every step of the "
        "rank's phases CSV.</p>"
    )


def summary_json(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
