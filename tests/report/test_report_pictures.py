"""The pictures of issue 13, point 9: the PNG's unit and legend, the HTML's phase labels, colours, the page title."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.report.figure import LABEL_CHAR_FRACTION, _band_labels, axis_unit, build_figure, timeline_data
from lightning_memtrace.report.style import CATEGORY_COLORS
from lightning_memtrace.units import MIB

USER = "/home/me/train.py"


def _ev(action: str, addr: int, size: int, t: int, phase: str, step: int, category: str) -> dict:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "time_us": t,
        "frames": [{"filename": USER, "line": 5, "name": "main"}],
        "user_metadata": f"phase={phase} step={step}",
        "category": category,
    }


def _hundred_mib_replay():
    trace, t = [], 0
    for step in range(3):
        for k, (phase, cat, size) in enumerate(
            (("forward", "activations", 40), ("backward", "gradients", 30), ("optimizer_step", "optimizer_state", 30))
        ):
            t += 1
            trace.append(_ev("alloc", 1000 * step + k + 1, size * MIB, t, phase, step, cat))
        for k in range(3):
            t += 1
            trace.append(_ev("free_completed", 1000 * step + k + 1, 0, t, "optimizer_step", step, "other"))
    for event in trace:
        if event["action"] == "free_completed":
            event["size"] = next(e["size"] for e in trace if e["action"] == "alloc" and e["addr"] == event["addr"])
    return replay({"segments": [], "device_traces": [trace]})


def test_axis_unit_follows_the_data() -> None:
    assert axis_unit(100 * MIB) == (MIB, "MiB")
    assert axis_unit(3 * 1024**3)[1] == "GiB"
    assert axis_unit(500)[1] == "B"


def test_png_unit_and_legend_clear_of_the_peak_label() -> None:
    pytest.importorskip("matplotlib")
    from lightning_memtrace.report.png import timeline_figure

    rep = _hundred_mib_replay()
    assert rep.peak.live_bytes == 100 * MIB
    fig = timeline_figure(rep.main, timeline_data(rep.main), "run")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "MiB"  # not GiB with 0.02 ticks
    assert ax.get_ylim()[1] > 100  # room above the peak for its label
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (peak_label,) = [t for t in ax.texts if t.get_text().startswith("peak ")]
    legend = ax.get_legend()
    assert not legend.get_window_extent(renderer).overlaps(peak_label.get_window_extent(renderer))


def test_png_leaves_the_users_matplotlib_alone(tmp_path: Path) -> None:
    """The report's PNG uses no pyplot: the user's backend (a notebook's inline one) and open figures stay."""
    pytest.importorskip("matplotlib")
    import matplotlib
    import matplotlib.pyplot as plt

    from lightning_memtrace.report.png import write_png

    rep = _hundred_mib_replay()
    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # the user's choice (any other than Agg; this one needs no display)
    try:
        users_figure = plt.figure()
        png = write_png(rep.main, timeline_data(rep.main), tmp_path / "t.png", "run")
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [users_figure.number]
    finally:
        plt.close("all")
        matplotlib.use(backend)


def test_png_draws_dollar_names_as_text_and_ignores_usetex(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run or file name with a pair of ``$`` (``snap$\\frac{$.pickle``) was read as a broken mathtext formula and
    stopped the drawing; a matplotlibrc with ``text.usetex: True`` sent the labels to a LaTeX that is not installed.
    The title shows the name as written; the user's setting is back afterwards."""
    pytest.importorskip("matplotlib")
    import matplotlib

    from lightning_memtrace.report.png import timeline_figure, write_png

    rep = _hundred_mib_replay()
    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", True)
    png = write_png(rep.main, timeline_data(rep.main), tmp_path / "t.png", "snap$\\frac{$.pickle")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and matplotlib.rcParams["text.usetex"] is True
    with matplotlib.rc_context({"text.usetex": False}):
        title = timeline_figure(rep.main, timeline_data(rep.main), "cost $x$ of run").axes[0].title
        assert title.get_text() == "cost \\$x\\$ of run"


def test_pre_existing_and_other_have_distinct_colours() -> None:
    colours = list(CATEGORY_COLORS.values())
    assert len(set(colours)) == len(colours)

    def rgb(c: str) -> tuple[int, ...]:
        return tuple(int(c[i : i + 2], 16) for i in (1, 3, 5))

    a, b = rgb(CATEGORY_COLORS["pre_existing"]), rgb(CATEGORY_COLORS["other"])
    assert sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 > 100  # not two greys


def _overlaps(annotations: list[dict], span: float) -> list[tuple[str, str]]:
    out = []
    rows: dict[float, list[tuple[float, float, str]]] = {}
    for a in annotations:
        width = (len(a["text"]) + 1) * LABEL_CHAR_FRACTION * span
        rows.setdefault(a["y"], []).append((a["x"], a["x"] + width, a["text"]))
    for row in rows.values():
        for (x0, x1, n0), (y0, y1, n1) in itertools.combinations(sorted(row), 2):
            if y0 < x1 and x0 < y1:
                out.append((n0, n1))
    return out


def test_phase_band_labels_never_overlap() -> None:
    # the bands of a short step: optimizer_step right after forward, narrow bands among wide ones
    labels = [
        (0.0, 30.0, "forward"),
        (30.0, 31.0, "zero_grad"),
        (31.0, 60.0, "backward"),
        (60.0, 62.0, "optimizer_step"),
        (62.0, 63.0, "forward"),
        (63.0, 100.0, "backward"),
    ]
    annotations = _band_labels(labels, 0.0, 100.0)
    assert _overlaps(annotations, 100.0) == []
    texts = [a["text"] for a in annotations]
    assert "forward" in texts and "backward" in texts
    assert "zero_grad" not in texts  # a band far narrower than its label gets none


def test_figure_labels_and_peak_do_not_collide() -> None:
    rep = _hundred_mib_replay()
    fig = build_figure(rep.main, timeline_data(rep.main), "t").to_dict()
    layout = fig["layout"]
    phase_labels = [a for a in layout["annotations"] if str(a.get("name", "")).startswith("phase-label")]
    xs = [float(x) for x in timeline_data(rep.main).x]
    assert phase_labels and _overlaps(phase_labels, max(xs) - min(xs)) == []
    assert layout["yaxis"]["range"][1] >= 1.15 * rep.peak.live_bytes  # the peak's label stays under the band labels


def test_log_folder_report_is_titled_by_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from lm_helpers import record_plain_loop
    from lightning_memtrace.report import write_report
    from lightning_memtrace.analysis.source import run_name

    folder = tmp_path / "lightning_logs" / "version_3" / "memtrace"
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record_plain_loop(model, optimizer, folder, 3, 8, history_skip_steps=1, history_steps=1)
    for path in (folder, folder.parent):
        assert run_name(path) == "lightning_logs/version_3"
        page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
        assert "<h1>Memory report: lightning_logs/version_3</h1>" in page
        assert "Memory report: memtrace<" not in page
    assert run_name(tmp_path / "x" / "snap.pickle") == "snap.pickle"


def test_estimate_table_is_formatted() -> None:
    import pandas as pd

    from lightning_memtrace.report.page import readable_numbers

    frame = pd.DataFrame(
        {"phase": ["forward"], "step": [12000], "estimated_bytes": [1572864], "error_percent": [3.14159]}
    )
    row = readable_numbers(frame).iloc[0].to_dict()
    assert row == {
        "phase": "forward",
        "step": "12,000",
        "estimated_bytes": "1.5 MiB (1,572,864 B)",
        "error_percent": "3.1%",
    }
