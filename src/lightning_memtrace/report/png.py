"""The timeline as a static PNG (matplotlib, Agg)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_memtrace.analysis.model import DeviceReplay
from lightning_memtrace.atomic import atomic_write_with
from lightning_memtrace.report.figure import TimelineData
from lightning_memtrace.report.style import CATEGORY_COLORS
from lightning_memtrace.types import category_label
from lightning_memtrace.units import GIB, format_bytes


def write_png(dev: DeviceReplay, data: TimelineData, png_path: str | os.PathLike[str], title: str) -> Path:
    """A static PNG of the stacked timeline (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = GIB
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    cats = [c for c in data.series.columns if data.series[c].to_numpy().any()]
    if cats:
        ax.stackplot(
            data.x,
            *[data.series[c].to_numpy() / gib for c in cats],
            labels=[category_label(c) for c in cats],
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
