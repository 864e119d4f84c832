"""The ``memtrace report``: one self-contained HTML file (and optionally a PNG) from a snapshot or a MemTrace log
folder.

The HTML embeds plotly.js inline and loads nothing from the network. It holds an interactive timeline of live memory
stacked by category with step and phase bands, the peak marked with its breakdown, reserved vs allocated, the largest
allocation sites at the peak, per-phase peaks from MemTrace's CSV, and plain-language findings. Every string taken
from a snapshot is HTML-escaped.

Modules: :mod:`.figure` (downsampling, the chart), :mod:`.png`, :mod:`.html` (tables), :mod:`.style`, :mod:`.page`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from lightning_memtrace.analysis.loader import DEFAULT_MAX_BYTES
from lightning_memtrace.analysis.rules import RulesLike
from lightning_memtrace.analysis.source import load_sources, run_name
from lightning_memtrace.atomic import atomic_write_text
from lightning_memtrace.report.figure import DEFAULT_MAX_POINTS
from lightning_memtrace.report.page import render_html, render_runs_html

__all__ = ["DEFAULT_MAX_POINTS", "render_html", "write_report"]


def write_report(
    source_path_or_dir: str | os.PathLike[str],
    html_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_points: int = DEFAULT_MAX_POINTS,
    progress: Callable[[int, int], None] | None = None,
    rules: RulesLike = None,
) -> Path:
    """Write the HTML report (and optionally a PNG timeline) for a snapshot or a MemTrace log folder.

    Nothing is written when the source cannot be read.

    Args:
        source_path_or_dir: A snapshot file (pickle, gzip pickle, memory_viz HTML), a log folder (``<log_dir>`` or
            ``<log_dir>/memtrace``), or a parent of several (``lightning_logs``): several runs get one page, an index
            and a section per run (the PNG is the newest run's).
        html_path: Where to write the HTML (parent folders are created).
        png_path: Where to write the PNG, or None.
        max_bytes: Size limit per snapshot file.
        max_points: Points per series in the browser chart.
        progress: Progress callback while reading large files.
        rules: User rules for categories (``{name: regex}`` or ``["NAME=REGEX", ...]``), applied before each
            snapshot header's ``category_rules`` (see :mod:`~lightning_memtrace.analysis.rules`).

    Returns:
        ``html_path`` as a Path.

    Raises:
        SnapshotError: The source is not readable.
        RuleError: A rule is not usable (a ``ValueError``).
    """
    sources = load_sources(source_path_or_dir, max_bytes=max_bytes, progress=progress, rules=rules)
    if len(sources) == 1:
        page = render_html(sources[0], max_points=max_points, png_path=png_path)
    else:
        title = run_name(Path(source_path_or_dir))
        page = render_runs_html(sources, title, max_points=max_points, png_path=png_path)
    return atomic_write_text(html_path, page)
