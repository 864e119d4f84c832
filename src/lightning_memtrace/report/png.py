"""The timeline as a static PNG (matplotlib, Agg)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_memtrace.analysis.model import DeviceReplay
from lightning_memtrace.atomic import atomic_write_with
from lightning_memtrace.report.figure import TimelineData, axis_unit
from lightning_memtrace.report.style import category_color
from lightning_memtrace.types import category_label
from lightning_memtrace.units import format_bytes

#: The settings the picture is drawn under whatever the user's matplotlibrc says: ``text.usetex`` would hand every
#: label to a LaTeX that may not be installed.
_DRAWN_WITH = {"text.usetex": False}


def _literal(text: str) -> str:
    """``text`` drawn as it is: a pair of ``$`` in a file or category name would be read as mathtext (and a bad
    formula there stops the drawing)."""
    return text.replace("$", r"\$")


def timeline_figure(dev: DeviceReplay, data: TimelineData, title: str) -> Any:
    """The matplotlib figure of the stacked timeline: the unit picked from the data, the legend outside the axes (it
    never covers the peak's label)."""
    # A figure on an Agg canvas of its own, without pyplot: the process's backend (a notebook's inline one, a
    # window) and pyplot's list of figures stay as the user has them.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    top = max(
        float(data.total.max()) if len(data.total) else 0.0,
        float(data.reserved.max()) if data.reserved is not None and len(data.reserved) else 0.0,
    )
    unit, unit_name = axis_unit(top)
    fig = Figure(figsize=(12, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    cats = [c for c in data.series.columns if data.series[c].to_numpy().any()]
    if cats:
        ax.stackplot(
            data.x,
            *[data.series[c].to_numpy() / unit for c in cats],
            labels=[_literal(category_label(c)) for c in cats],
            colors=[category_color(c, dev.rule_categories) for c in cats],
            step="post",
            alpha=0.9,
        )
    ax.plot(data.x, data.total / unit, color="#111", lw=0.8, drawstyle="steps-post", label="allocated")
    if data.reserved is not None and data.reserved.any():
        ax.plot(data.x, data.reserved / unit, color="#2ca02c", lw=1, ls="--", drawstyle="steps-post", label="reserved")
    peak = dev.peak
    if peak.index >= 0:
        ax.plot([data.peak_x], [peak.live_bytes / unit], marker="v", color="black")
        ax.annotate(
            f"peak {format_bytes(peak.live_bytes)}",
            (data.peak_x, peak.live_bytes / unit),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=9,
        )
    ax.set_xlabel(data.x_title)
    ax.set_ylabel(unit_name)
    ax.set_title(_literal(title[:120]))
    ax.set_ylim(bottom=0, top=(top / unit) * 1.12 if top > 0 else 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)
    fig.tight_layout()
    return fig


def write_png(dev: DeviceReplay, data: TimelineData, png_path: str | os.PathLike[str], title: str) -> Path:
    """A static PNG of the stacked timeline (matplotlib, Agg)."""
    import matplotlib

    with matplotlib.rc_context(_DRAWN_WITH):
        fig = timeline_figure(dev, data, title)
        out = Path(png_path)
        atomic_write_with(out, lambda handle: fig.savefig(handle, format="png"))
    return out
