"""The ``memtrace report``: one self-contained HTML file (and optionally a PNG) from a snapshot or a MemTrace log
folder.

The HTML embeds plotly.js inline and loads nothing from the network. It holds an interactive timeline of live memory
stacked by category with step and phase bands, the peak marked with its breakdown, reserved vs allocated, the largest
allocation sites at the peak, per-phase peaks from MemTrace's CSV, and plain-language findings. Every string taken
from a snapshot is HTML-escaped.
"""

from __future__ import annotations

import dataclasses
import glob
import html
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.atomic import atomic_write_text, atomic_write_with
from lightning_memtrace.findings import (
    Finding,
    RankImbalance,
    Severity,
    compute_findings,
    rank_imbalance,
    rank_imbalance_finding,
)
from lightning_memtrace.replay import CATEGORIES, CATEGORY_LABELS, DeviceReplay, Replay, replay
from lightning_memtrace.snapshot_loader import DEFAULT_MAX_BYTES, SnapshotError, load_snapshot
from lightning_memtrace.units import format_bytes, format_bytes_exact

#: Colours per category (stable across charts).
CATEGORY_COLORS: dict[str, str] = {
    "pre_existing": "#9e9e9e",
    "parameters": "#1f77b4",
    "optimizer_state": "#9467bd",
    "gradients": "#d62728",
    "inputs": "#8c564b",
    "activations": "#ff7f0e",
    "intermediates": "#ffbb78",
    "optimizer_intermediates": "#c5b0d5",
    "other": "#7f7f7f",
}
_PHASE_COLORS = {
    "forward": "rgba(255,127,14,0.07)",
    "backward": "rgba(214,39,40,0.07)",
    "optimizer_step": "rgba(148,103,189,0.10)",
    "zero_grad": "rgba(44,160,44,0.10)",
    "init": "rgba(31,119,180,0.07)",
    "validation": "rgba(23,190,207,0.08)",
    "after_step": "rgba(127,127,127,0.06)",
}

#: Points per series sent to the browser; every bucket keeps its exact local maximum and minimum.
DEFAULT_MAX_POINTS = 4000
_SNAPSHOT_PATTERNS = (
    "snapshot_rank*.pickle",
    "snapshot_rank*.pickle.gz",
    "snapshot_rank*.pkl",
    "oom_rank*.pickle",
    "oom_rank*.pickle.gz",
    "oom_rank*.pkl",
)


@dataclasses.dataclass
class LoadedSnapshot:
    """One snapshot of a source, replayed."""

    path: Path
    replay: Replay
    rank: int | None = None
    kind: str = "snapshot"  # "snapshot" or "oom"
    oom_text: str | None = None


@dataclasses.dataclass
class ReportSource:
    """What a report reads: one snapshot file, or every file of a MemTrace log folder.

    Attributes:
        path: What the user passed.
        snapshots: Replayed snapshots (may be empty for a log folder with only the phases CSV).
        phases: MemTrace's phases table, or None.
    """

    path: Path
    snapshots: list[LoadedSnapshot]
    phases: pd.DataFrame | None

    @property
    def main(self) -> LoadedSnapshot | None:
        """The snapshot with the highest peak."""
        if not self.snapshots:
            return None
        return max(self.snapshots, key=lambda s: s.replay.peak.live_bytes)


def _rank_of(name: str) -> int | None:
    found = re.search(r"rank(\d+)", name)
    return int(found.group(1)) if found else None


def _memtrace_dir(path: Path) -> Path:
    return path / "memtrace" if (path / "memtrace").is_dir() else path


def load_source(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> ReportSource:
    """Load a snapshot file, or a MemTrace log folder (``<log_dir>`` or ``<log_dir>/memtrace``).

    Args:
        path: Snapshot (pickle, gzip pickle, memory_viz HTML) or folder.
        max_bytes: Size limit per file.
        progress: Progress callback for large files (see :func:`load_snapshot`).

    Returns:
        The :class:`ReportSource`.

    Raises:
        SnapshotError: Unreadable input, or a folder without MemTrace files.
    """
    target = Path(path)
    if not target.exists():
        raise SnapshotError(f"{target}: no such file or directory")
    if not target.is_dir():
        snap = load_snapshot(target, max_bytes=max_bytes, progress=progress)
        return ReportSource(target, [LoadedSnapshot(target, replay(snap), rank=_rank_of(target.name))], None)
    folder = _memtrace_dir(target)
    files: list[Path] = []
    for pattern in _SNAPSHOT_PATTERNS:
        files.extend(Path(p) for p in glob.glob(str(folder / pattern)))
    files = sorted(set(files), key=lambda p: ((_rank_of(p.name) or 0), p.name))
    files = [f for f in files if not f.name.endswith(".tmp")]
    phases: pd.DataFrame | None
    try:
        from lightning_memtrace.phases_csv import load_phases

        phases = load_phases(folder)
    except FileNotFoundError:
        phases = None
    except ValueError as error:
        raise SnapshotError(f"{folder}: {error}") from None
    if not files and phases is None:
        raise SnapshotError(
            f"{target}: a directory without MemTrace files (phases_rank<R>.csv, snapshot_rank<R>_*.pickle)"
        )
    snapshots = []
    for file in files:
        snap = load_snapshot(file, max_bytes=max_bytes, progress=progress)
        kind = "oom" if file.name.startswith("oom_") else "snapshot"
        text = None
        txt = file.with_suffix(".txt")
        if kind == "oom" and txt.is_file():
            text = txt.read_text(encoding="utf-8", errors="replace")[:20000]
        snapshots.append(LoadedSnapshot(file, replay(snap, source=file.name), _rank_of(file.name), kind, text))
    return ReportSource(target, snapshots, phases)


# ---------------------------------------------------------------------------------------------------- ranks
#: Phases of the CSV shown per rank (those present in the folder).
RANK_PHASES = ("batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end")


@dataclasses.dataclass
class RankPeak:
    """One rank of a multi-rank log folder.

    Attributes:
        rank: The rank.
        snapshot: That rank's snapshot with the highest peak, or None (a rank with only the phases CSV).
        peak_bytes: Peak live bytes of ``snapshot``'s replay, or None.
        phase_peaks: Per phase, the max of ``peak_bytes`` over that rank's rows of the phases CSV.
        phases_peak: The max of ``peak_bytes`` over every row of that rank in the phases CSV, or None.
    """

    rank: int
    snapshot: LoadedSnapshot | None
    peak_bytes: int | None
    phase_peaks: dict[str, int]
    phases_peak: int | None = None


@dataclasses.dataclass
class RankOverview:
    """Every rank of a log folder side by side (only built for more than one rank)."""

    ranks: list[RankPeak]
    phase_columns: list[str]
    imbalance: RankImbalance | None


def rank_overview(source: ReportSource) -> RankOverview | None:
    """Per-rank peaks and the imbalance between ranks; None when the source holds fewer than two ranks.

    The imbalance compares snapshot replay peaks when every rank has a snapshot, else the phases CSV's peaks when
    every rank has rows there, else whichever of the two covers at least two ranks.
    """
    by_rank: dict[int, list[LoadedSnapshot]] = {}
    for s in source.snapshots:
        if s.rank is not None:
            by_rank.setdefault(s.rank, []).append(s)
    phases = source.phases
    phase_ranks: set[int] = set()
    if phases is not None and len(phases) and "rank" in phases:
        phase_ranks = {int(r) for r in phases["rank"].unique()}
    ranks = sorted(set(by_rank) | phase_ranks)
    if len(ranks) < 2:
        return None
    present = set(phases["phase"].astype(str)) if phases is not None and len(phases) else set()
    columns = [p for p in RANK_PHASES if p in present]
    rows: list[RankPeak] = []
    for rank in ranks:
        snaps = by_rank.get(rank, [])
        best = max(snaps, key=lambda s: s.replay.peak.live_bytes) if snaps else None
        phase_peaks: dict[str, int] = {}
        phases_peak: int | None = None
        if rank in phase_ranks:
            assert phases is not None
            mine = phases[phases["rank"] == rank]
            maxima = mine.groupby(mine["phase"].astype(str))["peak_bytes"].max()
            phase_peaks = {p: int(maxima[p]) for p in columns if p in maxima.index}
            phases_peak = int(mine["peak_bytes"].max())
        rows.append(
            RankPeak(rank, best, int(best.replay.peak.live_bytes) if best else None, phase_peaks, phases_peak)
        )
    snap_peaks = {r.rank: r.peak_bytes for r in rows if r.peak_bytes is not None}
    csv_peaks = {r.rank: r.phases_peak for r in rows if r.phases_peak is not None}
    if len(snap_peaks) == len(rows) or (len(snap_peaks) >= 2 and len(csv_peaks) < len(rows)):
        imbalance = rank_imbalance(snap_peaks, "snapshot replay peaks")  # type: ignore[arg-type]
    else:
        imbalance = rank_imbalance(csv_peaks, "phases CSV peaks")  # type: ignore[arg-type]
    return RankOverview(rows, columns, imbalance)


def add_rank_finding(findings: list[Finding], overview: RankOverview | None) -> list[Finding]:
    """Put the rank-imbalance warning (when there is one) right after the ``peak`` finding."""
    finding = rank_imbalance_finding(overview.imbalance) if overview is not None else None
    if finding is not None:
        at = 1 if findings and findings[0].code in ("peak", "empty") else 0
        findings.insert(at, finding)
    return findings


# ---------------------------------------------------------------------------------------------------- downsampling
def downsample_rows(
    live: np.ndarray, max_points: int = DEFAULT_MAX_POINTS, keep: list[int] | None = None
) -> np.ndarray:
    """Rows to draw: for each of ``max_points // 2`` equal buckets, its first row, its local maximum and minimum.

    The values at the kept rows are exact (no averaging), so every local peak, and the global one, is drawn at its
    true height.

    Args:
        live: Live bytes per row.
        max_points: Upper bound (about) on rows returned.
        keep: Rows that must be kept (OOM events...).

    Returns:
        Sorted unique row indices.
    """
    n = len(live)
    if n <= max_points:
        rows = np.arange(n)
    else:
        buckets = max(1, max_points // 3)
        edges = np.linspace(0, n, buckets + 1).astype(np.int64)
        starts = edges[:-1]
        # local max and min per bucket via reduceat on values, then locate them
        mx = np.maximum.reduceat(live, starts)
        mn = np.minimum.reduceat(live, starts)
        bucket_of = np.repeat(np.arange(buckets), np.diff(edges))
        is_max = live == mx[bucket_of]
        is_min = live == mn[bucket_of]
        # first occurrence per bucket
        max_rows = _first_per_bucket(is_max, bucket_of, buckets)
        min_rows = _first_per_bucket(is_min, bucket_of, buckets)
        rows = np.concatenate([starts, max_rows, min_rows, [n - 1]])
    if n:
        rows = np.concatenate([rows, [int(np.argmax(live))]])
    if keep:
        rows = np.concatenate([rows, np.asarray([k for k in keep if 0 <= k < n], dtype=np.int64)])
    return np.unique(rows.astype(np.int64))


def _first_per_bucket(mask: np.ndarray, bucket_of: np.ndarray, buckets: int) -> np.ndarray:
    idx = np.nonzero(mask)[0]
    b = bucket_of[idx]
    first = np.ones(len(idx), dtype=bool)
    first[1:] = b[1:] != b[:-1]
    return idx[first]


# ---------------------------------------------------------------------------------------------------- figure
def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _x_values(dev: DeviceReplay, rows: np.ndarray) -> tuple[np.ndarray, str]:
    tl = dev.timeline
    if dev.has_time and len(tl):
        t = tl["time_us"].to_numpy()
        t0 = int(t[0])
        return (t[rows] - t0) / 1e6, "seconds since the first event"
    return rows.astype(np.float64), "event number"


def _runs(codes: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end_exclusive, code) runs of equal values."""
    if len(codes) == 0:
        return []
    change = np.nonzero(codes[1:] != codes[:-1])[0] + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(codes)]])
    return [(int(s), int(e), int(codes[s])) for s, e in zip(starts, ends)]


@dataclasses.dataclass
class TimelineData:
    """What the chart draws for one device (also used for the PNG and by tests)."""

    rows: np.ndarray
    x: np.ndarray
    x_title: str
    series: pd.DataFrame  # per category, at rows
    total: np.ndarray
    reserved: np.ndarray | None
    peak_row: int
    peak_x: float


def timeline_data(dev: DeviceReplay, max_points: int = DEFAULT_MAX_POINTS) -> TimelineData:
    """Downsampled, exact-at-kept-rows series for one device."""
    tl = dev.timeline
    live = tl["live_bytes"].to_numpy()
    if len(live) == 0:
        # no trace (the old segment-list format): the state at dump time, drawn as a flat band
        peak = dev.peak
        cats = [c for c in CATEGORIES if c in peak.by_category]
        series = pd.DataFrame({c: [peak.by_category[c]] * 2 for c in cats}, index=[0, 1])
        reserved_end = dev.allocations_reserved_end()
        return TimelineData(
            np.zeros(0, dtype=np.int64),
            np.array([0.0, 1.0]),
            "dump time (the snapshot has no trace)",
            series,
            np.array([peak.live_bytes] * 2, dtype=np.int64),
            np.array([reserved_end] * 2, dtype=np.int64) if reserved_end else None,
            -1,
            0.0,
        )
    rows = downsample_rows(live, max_points, keep=dev.oom_rows)
    x, x_title = _x_values(dev, rows)
    series = dev.category_series(rows)
    total = live[rows]
    reserved = tl["reserved_bytes"].to_numpy()[rows] if dev.reserved_known else None
    peak_row = int(np.argmax(live)) if len(live) else -1
    pos = int(np.searchsorted(rows, peak_row)) if len(rows) else 0
    peak_x = float(x[pos]) if len(rows) else 0.0
    return TimelineData(rows, x, x_title, series, total, reserved, peak_row, peak_x)


class _Figure:
    """A plotly figure as a plain dict: built without plotly's per-element validation (seconds on large traces)."""

    def __init__(self) -> None:
        self.data: list[dict[str, Any]] = []
        self.layout: dict[str, Any] = {}

    def add_trace(self, trace: dict[str, Any]) -> None:
        self.data.append(trace)

    def update_layout(self, **layout: Any) -> None:
        if layout.pop("template", None) is not None:
            # plotly_white, written out: loading plotly's template registry costs most of a second
            layout.setdefault("paper_bgcolor", "white")
            layout.setdefault("plot_bgcolor", "white")
            for axis in ("xaxis", "yaxis"):
                style = {
                    "gridcolor": "#EBF0F8",
                    "linecolor": "#EBF0F8",
                    "zerolinecolor": "#EBF0F8",
                    "automargin": True,
                    "ticks": "",
                }
                style.update(layout.get(axis, {}))
                layout[axis] = style
            layout.setdefault("font", {"color": "#2a3f5f"})
            layout.setdefault("hoverlabel", {"align": "left"})
        self.layout.update(layout)

    def to_dict(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}


class _GraphObjects:
    """The two ``plotly.graph_objects`` names used here, producing plain dicts."""

    Figure = _Figure

    @staticmethod
    def Scatter(**kwargs: Any) -> dict[str, Any]:  # noqa: N802 - mirrors plotly's name
        return {"type": "scatter", **kwargs}


def binary_ticks(top: float, target: int = 6) -> dict[str, Any]:
    """Y-axis ticks at round 1024-based sizes (``tickvals``/``ticktext``), so the axis reads in KiB/MiB/GiB."""
    if top <= 0:
        return {}
    unit, name = 1, "B"
    for candidate, label in ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if top >= candidate:
            unit, name = candidate, label
            break
    raw = top / unit / target
    magnitude = 10 ** np.floor(np.log10(raw)) if raw > 0 else 1
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw) * unit
    count = int(np.floor(top / step)) + 1
    values = [i * step for i in range(count + 1)]
    text = [f"{v / unit:g} {name}" if v else "0" for v in values]
    return {"tickmode": "array", "tickvals": values, "ticktext": text}


def build_figure(dev: DeviceReplay, data: TimelineData, title: str) -> Any:
    """The plotly figure (a dict): stacked categories, total, reserved, phase bands, step lines, peak marker."""
    go = _GraphObjects

    fig = go.Figure()
    x = data.x.tolist()
    for cat in data.series.columns:
        values = data.series[cat].to_numpy()
        if not values.any():
            continue
        label = CATEGORY_LABELS.get(cat, cat)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[int(v) for v in values],
                name=_esc(label),
                mode="lines",
                line={"width": 0.5, "color": CATEGORY_COLORS.get(cat, "#444"), "shape": "hv"},
                stackgroup="live",
                meta=cat,
                hovertemplate=f"{_esc(label)}: %{{y:,}} B<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[int(v) for v in data.total],
            name="allocated (total)",
            mode="lines",
            meta="total",
            line={"width": 1.2, "color": "#111", "shape": "hv"},
            hovertemplate="allocated: %{y:,} B<extra></extra>",
        )
    )
    if data.reserved is not None and data.reserved.any():
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[int(v) for v in data.reserved],
                name="reserved",
                mode="lines",
                meta="reserved",
                line={"width": 1.2, "color": "#2ca02c", "dash": "dash", "shape": "hv"},
                hovertemplate="reserved: %{y:,} B<extra></extra>",
            )
        )
    peak = dev.peak
    if peak.index >= 0:
        breakdown = "<br>".join(
            f"{_esc(CATEGORY_LABELS.get(c, c))}: {_esc(format_bytes(b))}" for c, b in list(peak.by_category.items())[:6]
        )
        fig.add_trace(
            go.Scatter(
                x=[data.peak_x],
                y=[int(peak.live_bytes)],
                mode="markers+text",
                name="peak",
                meta="peak",
                marker={"size": 11, "color": "#000", "symbol": "triangle-down"},
                text=[_esc(f"peak {format_bytes(peak.live_bytes)}")],
                textposition="top center",
                hovertext=[f"<b>peak {_esc(format_bytes_exact(peak.live_bytes))}</b><br>{breakdown}"],
                hoverinfo="text",
            )
        )
    # Phase bands and step lines, from the full-resolution phase column.
    tl = dev.timeline
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    if len(tl):
        all_x = _x_values(dev, np.arange(len(tl)))[0]
        phase_codes = tl["phase"].cat.codes.to_numpy()
        phase_names = list(tl["phase"].cat.categories)
        runs = [r for r in _runs(phase_codes) if phase_names[r[2]] in _PHASE_COLORS]
        min_len = max(1, len(tl) // 400)
        runs = [r for r in runs if r[1] - r[0] >= min_len][:400]
        for s, e, code in runs:
            name = phase_names[code]
            shapes.append(
                {
                    "type": "rect",
                    "xref": "x",
                    "yref": "paper",
                    "x0": float(all_x[s]),
                    "x1": float(all_x[e - 1]),
                    "y0": 0,
                    "y1": 1,
                    "fillcolor": _PHASE_COLORS[name],
                    "line": {"width": 0},
                    "layer": "below",
                }
            )
            if len(runs) <= 40:
                annotations.append(
                    {
                        "x": float(all_x[s]),
                        "y": 1.0,
                        "xref": "x",
                        "yref": "paper",
                        "text": _esc(name),
                        "showarrow": False,
                        "xanchor": "left",
                        "yanchor": "top",
                        "font": {"size": 9, "color": "#555"},
                    }
                )
        steps = tl["step"].to_numpy()
        step_runs = _runs(steps)
        if 1 < len(step_runs) <= 60:
            for s, _, value in step_runs[1:]:
                shapes.append(
                    {
                        "type": "line",
                        "xref": "x",
                        "yref": "paper",
                        "x0": float(all_x[s]),
                        "x1": float(all_x[s]),
                        "y0": 0,
                        "y1": 1,
                        "line": {"width": 1, "dash": "dot", "color": "#888"},
                    }
                )
                annotations.append(
                    {
                        "x": float(all_x[s]),
                        "y": 0.02,
                        "xref": "x",
                        "yref": "paper",
                        "text": f"step {int(value)}",
                        "showarrow": False,
                        "xanchor": "left",
                        "font": {"size": 9, "color": "#666"},
                    }
                )
    fig.update_layout(
        title={"text": _esc(title)},
        xaxis={"title": {"text": data.x_title}},
        yaxis={
            "title": {"text": "bytes"},
            "rangemode": "tozero",
            **binary_ticks(
                float(
                    max(
                        data.total.max() if len(data.total) else 0,
                        data.reserved.max() if data.reserved is not None and len(data.reserved) else 0,
                    )
                )
            ),
        },
        hovermode="x unified",
        shapes=shapes,
        annotations=annotations,
        template="plotly_white",
        height=520,
        margin={"l": 70, "r": 20, "t": 50, "b": 50},
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


def write_png(dev: DeviceReplay, data: TimelineData, png_path: str | os.PathLike[str], title: str) -> Path:
    """A static PNG of the stacked timeline (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = 1024**3
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    cats = [c for c in data.series.columns if data.series[c].to_numpy().any()]
    if cats:
        ax.stackplot(
            data.x,
            *[data.series[c].to_numpy() / gib for c in cats],
            labels=[CATEGORY_LABELS.get(c, c) for c in cats],
            colors=[CATEGORY_COLORS.get(c, "#444") for c in cats],
            step="post",
            alpha=0.9,
        )
    ax.plot(data.x, data.total / gib, color="#111", lw=0.8, drawstyle="steps-post", label="allocated")
    if data.reserved is not None and data.reserved.any():
        ax.plot(data.x, data.reserved / gib, color="#2ca02c", lw=1, ls="--", drawstyle="steps-post", label="reserved")
    peak = dev.peak
    if peak.index >= 0:
        ax.plot([data.peak_x], [peak.live_bytes / gib], marker="v", color="black")
        ax.annotate(
            f"peak {format_bytes(peak.live_bytes)}",
            (data.peak_x, peak.live_bytes / gib),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=9,
        )
    ax.set_xlabel(data.x_title)
    ax.set_ylabel("GiB")
    ax.set_title(title[:120])
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    out = Path(png_path)
    try:
        atomic_write_with(out, lambda handle: fig.savefig(handle, format="png"))
    finally:
        plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top} th{background:#f5f5f5}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
ul.findings li{margin:6px 0} li.warning{color:#8a3b00}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px}
code{font-size:12px;word-break:break-all}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px;max-height:300px}
"""


def _chart_html(fig: Any, include_js: bool, config: dict[str, Any], div_id: str) -> str:
    """One plotly chart as an HTML fragment; plotly.js goes inline with the first chart of the page only."""
    import plotly.io as pio

    return pio.to_html(
        fig.to_dict(), validate=False, full_html=False, include_plotlyjs=include_js, config=config, div_id=div_id
    )


def _table(frame: pd.DataFrame, numeric: set[str] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{_esc(c)}</th>" for c in frame.columns)
    body = []
    for _, row in frame.iterrows():
        cells = []
        for c in frame.columns:
            cls = ' class="num"' if c in numeric else ""
            cells.append(f"<td{cls}>{_esc(row[c])}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _sites_table(sites: pd.DataFrame, total: int, limit: int = 25) -> str:
    if not len(sites):
        return "<p>No live allocation at the peak.</p>"
    rows = []
    for _, r in sites.head(limit).iterrows():
        b = int(r["bytes"])
        where = f"{r['file']}:{r['line']}" if r["file"] else "(no Python frame)"
        rows.append(
            "<tr>"
            f"<td><code>{_esc(where)}</code></td><td><code>{_esc(r['function'])}</code></td>"
            f"<td>{_esc(CATEGORY_LABELS.get(str(r['category']), r['category']))}</td>"
            f'<td class="num">{_esc(format_bytes(b))}</td><td class="num">{b:,}</td>'
            f'<td class="num">{100.0 * b / total if total else 0:.1f}%</td><td class="num">{int(r["count"]):,}</td>'
            "</tr>"
        )
    head = (
        "<tr><th>file:line</th><th>function</th><th>category</th><th>bytes</th><th>exact</th><th>of peak</th>"
        "<th>count</th></tr>"
    )
    more = f'<p class="meta">{len(sites) - limit} more sites not shown.</p>' if len(sites) > limit else ""
    return f"<table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>{more}"


def _breakdown_table(by_category: dict[str, int], total: int) -> str:
    rows = []
    for cat, b in by_category.items():
        color = CATEGORY_COLORS.get(cat, "#444")
        rows.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{_esc(CATEGORY_LABELS.get(cat, cat))}'
            f'</td><td class="num">{_esc(format_bytes(b))}</td><td class="num">{b:,}</td>'
            f'<td class="num">{100.0 * b / total if total else 0:.1f}%</td></tr>'
        )
    rows.append(
        f'<tr><th>total</th><th class="num">{_esc(format_bytes(total))}</th><th class="num">{total:,}</th>'
        "<th></th></tr>"
    )
    return (
        "<table><thead><tr><th>category</th><th>bytes</th><th>exact</th><th>share</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def phase_peaks_table(phases: pd.DataFrame, max_steps: int = 60) -> pd.DataFrame:
    """Per-step, per-phase peak bytes (max over ranks) from MemTrace's phases table."""
    pivot = phases.pivot_table(index="step", columns="phase", values="peak_bytes", aggfunc="max")
    order = [
        p
        for p in (
            "batch_start",
            "after_forward",
            "after_backward",
            "after_optimizer_step",
            "batch_end",
            "val_batch_start",
            "val_batch_end",
        )
        if p in pivot.columns
    ]
    pivot = pivot[order + [c for c in pivot.columns if c not in order]]
    if len(pivot) > max_steps:
        top = pivot.max(axis=1).nlargest(max_steps).index
        pivot = pivot.loc[sorted(top)]
    return pivot


def _phases_html(phases: pd.DataFrame) -> str:
    pivot = phase_peaks_table(phases)
    head = "<th>step</th>" + "".join(f"<th>{_esc(c)}</th>" for c in pivot.columns)
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
                cells.append(f'<td class="num"{style} title="{int(v):,} B">{_esc(format_bytes(int(v)))}</td>')
        rows.append(f'<tr><td class="num">{int(step)}</td>{"".join(cells)}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _phases_figure(phases: pd.DataFrame, title: str = "memory per phase row (MemTrace phases CSV)") -> Any:
    go = _GraphObjects

    fig = go.Figure()
    frame = phases.sort_values(["rank", "time_s"])
    t0 = float(frame["time_s"].min())
    x = (frame["time_s"] - t0).tolist()
    for cat in ("parameters", "optimizer_state", "gradients", "inputs", "activations", "other"):
        column = f"{cat}_bytes"
        if column in frame and frame[column].any():
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=frame[column].astype(int).tolist(),
                    name=CATEGORY_LABELS[cat],
                    stackgroup="live",
                    mode="lines",
                    meta=cat,
                    line={"color": CATEGORY_COLORS[cat], "width": 0.5, "shape": "hv"},
                )
            )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=frame["peak_bytes"].astype(int).tolist(),
            name="peak since last row",
            mode="lines+markers",
            line={"color": "#000", "width": 1, "shape": "hv"},
        )
    )
    fig.update_layout(
        title={"text": _esc(title)},
        template="plotly_white",
        xaxis={"title": {"text": "seconds since the first row"}},
        yaxis={"title": {"text": "bytes"}, "tickformat": ".3s"},
        height=420,
    )
    return fig


def _ranks_html(overview: RankOverview) -> str:
    """The "Ranks" section: one row per rank, peaks side by side, and the imbalance line."""
    imb = overview.imbalance
    high = imb.high_rank if imb is not None and imb.imbalance_bytes > 0 else None
    head = (
        "<th>rank</th><th>snapshot</th><th>peak (snapshot)</th><th>exact</th>"
        + "".join(f"<th>max {_esc(p)} (CSV)</th>" for p in overview.phase_columns)
    )
    rows = []
    for r in overview.ranks:
        bold = ' style="font-weight:bold"' if r.rank == high else ""
        if r.peak_bytes is not None and r.snapshot is not None:
            peak_cells = (
                f"<td><code>{_esc(r.snapshot.path.name)}</code></td>"
                f'<td class="num"{bold}>{_esc(format_bytes(r.peak_bytes))}</td>'
                f'<td class="num rank-peak" data-bytes="{int(r.peak_bytes)}">{int(r.peak_bytes):,}</td>'
            )
        else:
            peak_cells = '<td class="meta">no snapshot</td><td></td><td></td>'
        phase_cells = "".join(
            f'<td class="num" title="{r.phase_peaks[p]:,} B">{_esc(format_bytes(r.phase_peaks[p]))}</td>'
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
            f"<b>Imbalance</b> ({_esc(imb.basis)}, max - min over {len(imb.peaks)} ranks): {_esc(imb.sentence())}.</p>"
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


def _summary_json(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _rank_charts_html(
    overview: RankOverview,
    phases: pd.DataFrame | None,
    max_points: int,
    config: dict[str, Any],
    include_js: Any,
) -> tuple[str, Any]:
    """One timeline per rank, rank 0 first (div ids ``timeline-rank<R>``).

    A rank is drawn from its highest-peak snapshot like the main timeline, or from its rows of the phases CSV when it
    has no snapshot. Returns the HTML and the new ``include_js`` (plotly.js is embedded by the page's first chart only).
    """

    parts = ['<h2 id="rank-timelines">Timeline per rank</h2>']
    for r in overview.ranks:
        div_id = f"timeline-rank{int(r.rank)}"
        if r.snapshot is not None:
            dev = r.snapshot.replay.main
            data = timeline_data(dev, max_points)
            title = f"rank {r.rank}: {r.snapshot.path.name} — device {dev.device}: live memory by category"
            fig = build_figure(dev, data, title)
            note = (
                f"{len(data.rows):,} of {dev.num_events:,} events drawn; peak "
                f"{format_bytes_exact(dev.peak.live_bytes)}."
            )
        elif phases is not None and len(phases):
            mine = phases[phases["rank"] == r.rank]
            if not len(mine):
                continue
            fig = _phases_figure(mine, f"rank {r.rank}: memory per phase row (MemTrace phases CSV, no snapshot)")
            note = f"{len(mine):,} rows of the phases CSV (no snapshot for this rank)."
        else:
            continue
        chart = _chart_html(fig, include_js, config, div_id)
        include_js = False
        parts.append(f'<h3>Rank {int(r.rank)}</h3>{chart}<p class="meta">{_esc(note)}</p>')
    return "".join(parts), include_js


def render_html(
    source: ReportSource, *, max_points: int = DEFAULT_MAX_POINTS, png_path: str | os.PathLike[str] | None = None
) -> str:
    """The report page for a source (see :func:`write_report`)."""

    main = source.main
    sections: list[str] = []
    summary: dict[str, Any] = {"source": str(source.path)}
    config = {"displaylogo": False, "responsive": True}
    include_js: Any = True
    findings: list[Finding] = []
    if main is not None:
        rep = main.replay
        dev = rep.main
        peak = dev.peak
        data = timeline_data(dev, max_points)
        title = f"{main.path.name} — device {dev.device}: live memory by category"
        fig = build_figure(dev, data, title)
        findings = compute_findings(rep, source.phases)
        summary.update(
            {
                "snapshot": main.path.name,
                "device": dev.device,
                "events": dev.num_events,
                "peak_bytes": int(peak.live_bytes),
                "peak_index": int(peak.index),
                "peak_reserved_bytes": int(peak.reserved_bytes),
                "peak_stage": peak.stage,
                "peak_step": int(peak.step),
                "peak_by_category": {k: int(v) for k, v in peak.by_category.items()},
                "points": int(len(data.rows)),
                "inferred_categories": bool(rep.inferred),
            }
        )
        if png_path is not None:
            write_png(dev, data, png_path, title)
        chart = _chart_html(fig, include_js, config, "timeline")
        include_js = False
        where = f"{peak.stage}, step {peak.step}" if peak.index >= 0 else "at dump time (no trace)"
        rules = (
            "made in optimizer.step and kept → optimizer state, freed inside it → optimizer intermediates; made in "
            "backward and kept → gradients; made in a module's forward and kept past it → activations, freed within "
            "it → intermediates; alive before recording → pre-existing"
        )
        if not rep.is_memtrace and rep.inferred:
            inferred_note = (
                '<p class="meta">Categories are inferred from stack frames and lifetimes (the snapshot was not '
                f"written by MemTrace): {rules}.</p>"
            )
        elif rep.inferred:
            inferred_note = (
                '<p class="meta">Categories recorded by MemTrace; allocations it left uncategorised '
                f"({_esc(format_bytes(peak.inferred_bytes))} at the peak) are inferred: {rules}.</p>"
            )
        else:
            inferred_note = '<p class="meta">Categories recorded by MemTrace.</p>'
        sections.append(
            f'<h2>Timeline</h2>{chart}<p class="meta">{len(data.rows):,} of {dev.num_events:,} events drawn; every '
            "local maximum is drawn at its exact value. Shaded bands: phases (forward, backward, optimizer step...); "
            "dotted lines: steps.</p>"
        )
        sections.append(
            f"<h2>Peak: {_esc(format_bytes_exact(peak.live_bytes))} ({_esc(where)})</h2>"
            + _breakdown_table(peak.by_category, peak.live_bytes)
            + (
                f"<p>Reserved by the allocator at the peak: {_esc(format_bytes_exact(peak.reserved_bytes))}"
                f" ({_esc(format_bytes(max(peak.reserved_bytes - peak.live_bytes, 0)))} more than allocated).</p>"
                if dev.reserved_known and peak.reserved_bytes
                else ""
            )
            + inferred_note
        )
        sections.append("<h2>Largest allocation sites at the peak</h2>" + _sites_table(peak.sites, peak.live_bytes))
    elif source.phases is not None:
        findings = compute_findings_phases_only(source.phases)
        fig = _phases_figure(source.phases)
        chart = _chart_html(fig, include_js, config, "timeline")
        include_js = False
        sections.append(f"<h2>Memory per phase</h2>{chart}")
        summary["peak_bytes"] = int(source.phases["peak_bytes"].max())
    overview = rank_overview(source)
    if overview is not None:
        # after the main chart in page order: the per-rank charts rely on the plotly.js it embeds
        sections.insert(0, _ranks_html(overview))
        charts, include_js = _rank_charts_html(overview, source.phases, max_points, config, include_js)
        sections.append(charts)
        add_rank_finding(findings, overview)
        summary["ranks"] = [
            {
                "rank": int(r.rank),
                "snapshot": r.snapshot.path.name if r.snapshot is not None else None,
                "peak_bytes": r.peak_bytes,
                "phases_peak_bytes": r.phases_peak,
                "phase_peaks": dict(r.phase_peaks),
            }
            for r in overview.ranks
        ]
        if overview.imbalance is not None:
            imb = overview.imbalance
            summary["rank_imbalance"] = {
                "basis": imb.basis,
                "high_rank": imb.high_rank,
                "low_rank": imb.low_rank,
                "high_bytes": imb.high_bytes,
                "low_bytes": imb.low_bytes,
                "imbalance_bytes": imb.imbalance_bytes,
                "percent": imb.percent,
            }
    if source.phases is not None:
        sections.append("<h2>Per-phase peaks (MemTrace phases CSV)</h2>" + _phases_html(source.phases))
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
        sections.append("<h2>All snapshots</h2>" + _table(pd.DataFrame(rows), {"events", "peak"}))
    for estimate_csv in sorted(source.path.glob("**/estimate_vs_measured_rank*.csv")) if source.path.is_dir() else []:
        try:
            comparison = pd.read_csv(estimate_csv)
        except Exception:  # a comparison that cannot be read is left out, the report stands without it
            continue
        numeric = {c for c in comparison.columns if c.endswith(("_bytes", "_percent"))}
        sections.append(f"<h2>Estimate vs measured ({_esc(estimate_csv.name)})</h2>" + _table(comparison, numeric))
    for s in source.snapshots:
        if s.oom_text:
            sections.append(f"<h2>Out of memory: {_esc(s.path.name)}</h2><pre>{_esc(s.oom_text)}</pre>")
    items = (
        "".join(f'<li class="{_esc(f.severity)}">{_esc(f.message)}</li>' for f in findings) or "<li>No finding.</li>"
    )
    summary["findings"] = [{"code": f.code, "message": f.message} for f in findings]
    header = (
        f"<h1>Memory report: {_esc(source.path.name)}</h1>"
        f'<div class="meta">{_esc(str(source.path))} · {len(source.snapshots)} snapshot(s)'
        + (f" · {main.replay.num_segments:,} segments · {main.replay.num_events:,} events" if main else "")
        + "</div>"
        f'<h2>Findings</h2><ul class="findings">{items}</ul>'
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>memtrace report: {_esc(source.path.name)}</title><style>{_CSS}</style></head><body>"
        + header
        + "".join(sections)
        + f'<script type="application/json" id="memtrace-summary">{_summary_json(summary)}</script>'
        + "</body></html>\n"
    )


def compute_findings_phases_only(phases: pd.DataFrame) -> list[Finding]:
    """Findings when a log folder has the phases CSV but no snapshot."""
    from lightning_memtrace.findings import phase_findings

    out = phase_findings(phases)
    out.append(
        Finding(
            "no_snapshot",
            "no snapshot in the folder: the timeline is drawn from the phases table only",
            Severity.INFO,
            {},
        )
    )
    return out


def write_report(
    source_path_or_dir: str | os.PathLike[str],
    html_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_points: int = DEFAULT_MAX_POINTS,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the HTML report (and optionally a PNG timeline) for a snapshot or a MemTrace log folder.

    Nothing is written when the source cannot be read.

    Args:
        source_path_or_dir: A snapshot file (pickle, gzip pickle, memory_viz HTML), or a log folder (``<log_dir>`` or
            ``<log_dir>/memtrace``).
        html_path: Where to write the HTML (parent folders are created).
        png_path: Where to write the PNG, or None.
        max_bytes: Size limit per snapshot file.
        max_points: Points per series in the browser chart.
        progress: Progress callback while reading large files.

    Returns:
        ``html_path`` as a Path.

    Raises:
        SnapshotError: The source is not readable.
    """
    source = load_source(source_path_or_dir, max_bytes=max_bytes, progress=progress)
    page = render_html(source, max_points=max_points, png_path=png_path)
    return atomic_write_text(html_path, page)


# ---------------------------------------------------------------------------------------------------- diff
@dataclasses.dataclass
class Diff:
    """Two sources side by side: ``b - a``.

    Attributes:
        a_name: Name of the first.
        b_name: Name of the second.
        summary: Rows ``peak``, ``reserved at peak``, ``events``... with columns ``a, b, delta``.
        by_category: Live bytes at each peak per category: ``category, a, b, delta``.
        by_site: Live bytes at each peak per site (``site``, ``function``): ``a, b, delta``, largest change first.
    """

    a_name: str
    b_name: str
    summary: pd.DataFrame
    by_category: pd.DataFrame
    by_site: pd.DataFrame


def _site_key_frame(sites: pd.DataFrame, name_by_script: bool) -> pd.DataFrame:
    frame = sites.copy()
    if name_by_script:
        # different script names for the same line (profile_grad.py vs profile_no_grad.py) still match by basename
        frame["key"] = frame["function"].astype(str) + " @ line " + frame["line"].astype(str)
    else:
        frame["key"] = frame["site"].astype(str) + " (" + frame["function"].astype(str) + ")"
    return frame.groupby("key", sort=False)["bytes"].sum()


def diff_sources(a: ReportSource, b: ReportSource) -> Diff:
    """Compare the main snapshots (highest peak) of two sources at their peaks."""
    if a.main is None or b.main is None:
        raise SnapshotError("diff needs a snapshot on each side (a log folder without snapshot cannot be diffed)")
    ra, rb = a.main.replay, b.main.replay
    pa, pb = ra.peak, rb.peak
    summary = pd.DataFrame(
        [
            {"figure": "peak allocated", "a": pa.live_bytes, "b": pb.live_bytes},
            {"figure": "reserved at peak", "a": pa.reserved_bytes, "b": pb.reserved_bytes},
            {"figure": "reserved at dump", "a": ra.reserved_end_bytes, "b": rb.reserved_end_bytes},
            {"figure": "events", "a": ra.num_events, "b": rb.num_events},
        ]
    )
    summary["delta"] = summary["b"] - summary["a"]
    cats = [c for c in CATEGORIES if c in pa.by_category or c in pb.by_category]
    by_category = pd.DataFrame(
        {
            "category": cats,
            "a": [int(pa.by_category.get(c, 0)) for c in cats],
            "b": [int(pb.by_category.get(c, 0)) for c in cats],
        }
    )
    by_category["delta"] = by_category["b"] - by_category["a"]
    files_a = set(pa.sites["file"].astype(str)) if len(pa.sites) else set()
    files_b = set(pb.sites["file"].astype(str)) if len(pb.sites) else set()
    by_script = not (files_a & files_b)
    sa = _site_key_frame(pa.sites, by_script) if len(pa.sites) else pd.Series(dtype="int64")
    sb = _site_key_frame(pb.sites, by_script) if len(pb.sites) else pd.Series(dtype="int64")
    by_site = pd.DataFrame({"a": sa, "b": sb}).fillna(0).astype("int64")
    by_site["delta"] = by_site["b"] - by_site["a"]
    by_site = by_site.reindex(by_site["delta"].abs().sort_values(ascending=False, kind="stable").index)
    by_site.index.name = "site"
    by_site = by_site.reset_index()
    return Diff(a.main.path.name, b.main.path.name, summary, by_category, by_site)
