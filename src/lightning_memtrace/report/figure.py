"""The timeline chart: exact-at-kept-rows downsampling and the plotly figure (a plain dict, no plotly import), for a
replay or for the phases CSV alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.model import DeviceReplay
from lightning_memtrace.report.style import CATEGORY_COLORS, PHASE_COLORS, category_color, esc
from lightning_memtrace.types import RECORDED_CATEGORIES, category_label
from lightning_memtrace.units import format_bytes, format_bytes_exact

#: Points per series sent to the browser; every bucket keeps its exact local maximum and minimum.
DEFAULT_MAX_POINTS = 4000


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
        cats = [c for c in dev.categories if c in peak.by_category]
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


def _scatter(**kwargs: Any) -> dict[str, Any]:
    """A plotly scatter trace as a plain dict."""
    return {"type": "scatter", **kwargs}


def axis_unit(top: float) -> tuple[int, str]:
    """The 1024-based unit an axis reaching ``top`` bytes reads in (``(1024**2, "MiB")`` for 100 MiB), as the tables."""
    for candidate, label in ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if top >= candidate:
            return candidate, label
    return 1, "B"


def binary_ticks(top: float, target: int = 6) -> dict[str, Any]:
    """Y-axis ticks at round 1024-based sizes (``tickvals``/``ticktext``), so the axis reads in KiB/MiB/GiB."""
    if top <= 0:
        return {}
    unit, name = axis_unit(top)
    raw = top / unit / target
    magnitude = 10 ** np.floor(np.log10(raw)) if raw > 0 else 1
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw) * unit
    count = int(np.floor(top / step)) + 1
    values = [i * step for i in range(count + 1)]
    text = [f"{v / unit:g} {name}" if v else "0" for v in values]
    return {"tickmode": "array", "tickvals": values, "ticktext": text}


def _category_traces(
    data: TimelineData, x: list[float], rule_categories: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    traces = []
    for cat in data.series.columns:
        values = data.series[cat].to_numpy()
        if not values.any():
            continue
        label = category_label(cat)
        traces.append(
            _scatter(
                x=x,
                y=[int(v) for v in values],
                name=esc(label),
                mode="lines",
                line={"width": 0.5, "color": category_color(cat, rule_categories), "shape": "hv"},
                stackgroup="live",
                meta=cat,
                hovertemplate=f"{esc(label)}: %{{y:,}} B<extra></extra>",
            )
        )
    return traces


def _line(x: list[float], values: np.ndarray, name: str, line: dict[str, Any]) -> dict[str, Any]:
    """An unstacked line (total or reserved) with its hover text."""
    return _scatter(
        x=x,
        y=[int(v) for v in values],
        name=f"{name} (total)" if name == "allocated" else name,
        mode="lines",
        meta="total" if name == "allocated" else name,
        line=line,
        hovertemplate=f"{name}: %{{y:,}} B<extra></extra>",
    )


def _total_traces(data: TimelineData, x: list[float]) -> list[dict[str, Any]]:
    traces = [_line(x, data.total, "allocated", {"width": 1.2, "color": "#111", "shape": "hv"})]
    if data.reserved is not None and data.reserved.any():
        style = {"width": 1.2, "color": "#2ca02c", "dash": "dash", "shape": "hv"}
        traces.append(_line(x, data.reserved, "reserved", style))
    return traces


def _peak_traces(dev: DeviceReplay, data: TimelineData) -> list[dict[str, Any]]:
    peak = dev.peak
    if peak.index < 0:
        return []
    breakdown = "<br>".join(
        f"{esc(category_label(c))}: {esc(format_bytes(b))}" for c, b in list(peak.by_category.items())[:6]
    )
    return [
        _scatter(
            x=[data.peak_x],
            y=[int(peak.live_bytes)],
            mode="markers+text",
            name="peak",
            meta="peak",
            marker={"size": 11, "color": "#000", "symbol": "triangle-down"},
            text=[esc(f"peak {format_bytes(peak.live_bytes)}")],
            textposition="top center",
            hovertext=[f"<b>peak {esc(format_bytes_exact(peak.live_bytes))}</b><br>{breakdown}"],
            hoverinfo="text",
        )
    ]


def _label(x: float, y: float, text: str, color: str, **extra: Any) -> dict[str, Any]:
    return {
        "x": x,
        "y": y,
        "xref": "x",
        "yref": "paper",
        "text": text,
        "showarrow": False,
        "xanchor": "left",
        **extra,
        "font": {"size": 9, "color": color},
    }


#: Width of one character of a band label, as a fraction of the plot's width (9 px font, ~1200 px plot).
LABEL_CHAR_FRACTION = 6.0 / 1100
#: Rows of band labels (paper y), top first: adjacent labels alternate between them.
LABEL_ROWS = (1.0, 0.955)


def _band_labels(labels: list[tuple[float, float, str]], x_min: float, x_max: float) -> list[dict[str, Any]]:
    """Labels for phase bands that never overlap: each goes in the first row where it fits after the label before it;
    a band narrower than half its label, or one that fits in no row, gets none (its colour and hover still tell)."""
    span = max(x_max - x_min, 1e-12)
    row_end = [float("-inf")] * len(LABEL_ROWS)
    out = []
    for x0, x1, name in labels:
        width = (len(name) + 1) * LABEL_CHAR_FRACTION * span
        if x1 - x0 < width / 2:
            continue
        for row, y in enumerate(LABEL_ROWS):
            if x0 >= row_end[row]:
                row_end[row] = x0 + width
                out.append(_label(x0, y, esc(name), "#555", yanchor="top", name=f"phase-label-row{row}"))
                break
    return out


def _phase_bands(tl: Any, all_x: np.ndarray) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shaded bands per run of a phase (runs shorter than 1/400 of the trace dropped, at most 400), labelled when few."""
    phase_codes = tl["phase"].cat.codes.to_numpy()
    phase_names = list(tl["phase"].cat.categories)
    runs = [r for r in _runs(phase_codes) if phase_names[r[2]] in PHASE_COLORS]
    min_len = max(1, len(tl) // 400)
    runs = [r for r in runs if r[1] - r[0] >= min_len][:400]
    shapes: list[dict[str, Any]] = []
    labels: list[tuple[float, float, str]] = []
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
                "fillcolor": PHASE_COLORS[name],
                "line": {"width": 0},
                "layer": "below",
            }
        )
        labels.append((float(all_x[s]), float(all_x[e - 1]), name))
    return shapes, _band_labels(labels, float(all_x[0]) if len(all_x) else 0.0, float(all_x[-1]) if len(all_x) else 0.0)
    return shapes, annotations


def _step_lines(tl: Any, all_x: np.ndarray) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A dotted line where each step starts (only for 2 to 60 steps)."""
    step_runs = _runs(tl["step"].to_numpy())
    if not 1 < len(step_runs) <= 60:
        return [], []
    shapes, annotations = [], []
    for s, _, value in step_runs[1:]:
        x = float(all_x[s])
        shapes.append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": x,
                "x1": x,
                "y0": 0,
                "y1": 1,
                "line": {"width": 1, "dash": "dot", "color": "#888"},
            }
        )
        annotations.append(_label(x, 0.02, f"step {int(value)}", "#666"))
    return shapes, annotations


def _y_top(data: TimelineData) -> float:
    return float(
        max(
            data.total.max() if len(data.total) else 0,
            data.reserved.max() if data.reserved is not None and len(data.reserved) else 0,
        )
    )


def build_figure(dev: DeviceReplay, data: TimelineData, title: str) -> Any:
    """The plotly figure (a dict): stacked categories, total, reserved, phase bands, step lines, peak marker."""
    fig = _Figure()
    x = data.x.tolist()
    for trace in _category_traces(data, x, dev.rule_categories) + _total_traces(data, x) + _peak_traces(dev, data):
        fig.add_trace(trace)
    # Phase bands and step lines, from the full-resolution phase column.
    tl = dev.timeline
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    if len(tl):
        all_x = _x_values(dev, np.arange(len(tl)))[0]
        for more_shapes, more_annotations in (_phase_bands(tl, all_x), _step_lines(tl, all_x)):
            shapes += more_shapes
            annotations += more_annotations
    fig.update_layout(
        title={"text": esc(title)},
        xaxis={"title": {"text": data.x_title}},
        yaxis={
            "title": {"text": "bytes"},
            "range": [0, _y_top(data) * 1.18 or 1],  # room for the peak's label under the phase labels
            **binary_ticks(_y_top(data)),
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


def phases_figure(phases: pd.DataFrame, title: str = "memory per phase row (MemTrace phases CSV)") -> Any:
    fig = _Figure()
    frame = phases.sort_values(["rank", "time_s"])
    t0 = float(frame["time_s"].min())
    x = (frame["time_s"] - t0).tolist()
    for cat in RECORDED_CATEGORIES:
        column = f"{cat}_bytes"
        if column in frame and frame[column].any():
            fig.add_trace(
                _scatter(
                    x=x,
                    y=frame[column].astype(int).tolist(),
                    name=category_label(cat),
                    stackgroup="live",
                    mode="lines",
                    meta=cat,
                    line={"color": CATEGORY_COLORS[cat], "width": 0.5, "shape": "hv"},
                )
            )
    fig.add_trace(
        _scatter(
            x=x,
            y=frame["peak_bytes"].astype(int).tolist(),
            name="peak since last row",
            mode="lines+markers",
            line={"color": "#000", "width": 1, "shape": "hv"},
        )
    )
    fig.update_layout(
        title={"text": esc(title)},
        template="plotly_white",
        xaxis={"title": {"text": "seconds since the first row"}},
        yaxis={"title": {"text": "bytes"}, "tickformat": ".3s"},
        height=420,
    )
    return fig
