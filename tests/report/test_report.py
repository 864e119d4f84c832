"""The HTML/PNG report: self-contained, exact at the peak, escaped, small for large traces, log folders."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from report_pages import external_loads, plotly_data, summary_json
from shared_files import ALL_FIXTURES
from shared_files import FIXTURES as SNAPSHOTS

from lightning_memtrace.analysis.loader import SnapshotError, load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.source import load_source
from lightning_memtrace.report import write_report
from lightning_memtrace.report.figure import downsample_rows


def snapshot_fixture(name: str) -> Path:
    """A file of ../shared/fixtures/snapshots, or skip when the folder (or file) is absent."""
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"shared fixture {name} is absent")
    return path


def check_chart_peak(page: str, peak: int) -> None:
    """The stacked categories at their highest point, and the total line, equal the replay's peak exactly."""
    traces = plotly_data(page)
    stacked = [t for t in traces if t.get("stackgroup") == "live"]
    assert stacked
    sums = np.sum([np.asarray(t["y"], dtype=np.int64) for t in stacked], axis=0)
    assert int(sums.max()) == peak
    total = next(t for t in traces if t.get("meta") == "total")
    assert int(max(total["y"])) == peak
    assert (np.asarray(total["y"], dtype=np.int64) == sums).all()


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_reports(tmp_path: Path, name: str) -> None:
    source = snapshot_fixture(name)
    out = write_report(source, tmp_path / "report.html")
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert external_loads(page) == []
    assert "Plotly.newPlot" in page
    rep = replay(load_snapshot(source))
    summary = summary_json(page)
    assert summary["peak_bytes"] == rep.peak.live_bytes
    assert summary["peak_by_category"] == rep.peak.by_category
    if rep.main.num_events:
        check_chart_peak(page, rep.peak.live_bytes)
    assert f"{rep.peak.live_bytes:,}" in page
    assert len(page.encode()) < 10 * 1024**2


def test_report_figures_shreyansh(tmp_path: Path) -> None:
    out = write_report(snapshot_fixture("shreyansh26_profile_grad.pkl"), tmp_path / "r.html", tmp_path / "t.png")
    page = out.read_text(encoding="utf-8")
    assert "4,434,803,008" in page
    assert "2,000,200,000" in page  # parameters at the peak
    assert "400,000,000" in page  # two inputs
    assert "profile_grad.py:11" in page
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    findings = summary_json(page)["findings"]
    assert findings[0]["code"] == "peak"
    assert "peak 4.1 GiB (4,434,803,008 B) in forward" in findings[0]["message"]
    assert "inferred" in findings[0]["message"]


def test_kkaitlyn_findings(tmp_path: Path) -> None:
    out = write_report(snapshot_fixture("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle"), tmp_path / "r.html")
    summary = summary_json(out.read_text(encoding="utf-8"))
    assert summary["peak_bytes"] == 54_802_667_524
    assert summary["peak_stage"] == "optimizer_step"
    codes = [f["code"] for f in summary["findings"]]
    assert "pre_existing" in codes
    peak = summary["findings"][0]["message"]
    assert "optimizer state 50% (25.4 GiB)" in peak
    assert "the largest share is optimizer state: a sharded optimizer" in peak
    pre = next(f["message"] for f in summary["findings"] if f["code"] == "pre_existing")
    assert pre.startswith("12.7 GiB (13,628,553,216 B, 25% of the peak) was allocated before recording began")
    assert "most likely the parameters" in pre
    top = next(f["message"] for f in summary["findings"] if f["code"] == "top_site")
    assert top.startswith("/home/c-kaitwang/assignment1/cs336_basics/optimizers.py:82 (step) holds 12.7 GiB")


def test_strings_from_the_snapshot_are_escaped(tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    frames = [{"name": evil, "filename": "/home/u/<img src=x onerror=alert(2)>.py", "line": 3}]
    snap = {
        "segments": [],
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 10, "time_us": 1, "frames": frames, "user_metadata": evil},
                {"action": "alloc", "addr": 2, "size": 20, "time_us": 2, "frames": frames},
            ]
        ],
    }
    path = tmp_path / f"{'x'}.pickle"
    path.write_bytes(pickle.dumps(snap))
    page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<script>alert(1)" not in page
    assert "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert external_loads(page) == []


def test_without_plotly_the_report_is_written_with_its_tables_and_a_note(tmp_path: Path, monkeypatch) -> None:
    from lightning_memtrace.report import html

    monkeypatch.setattr(html, "PLOTLY_AVAILABLE", False)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_big_trace(500)))
    page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Plotly.newPlot" not in page
    assert page.count("No interactive chart: it needs plotly") == 1
    peak = replay(load_snapshot(path)).peak.live_bytes
    assert summary_json(page)["peak_bytes"] == peak
    assert f"{peak:,}" in page


def test_writing_a_chart_leaves_the_warning_format_alone(tmp_path: Path, monkeypatch) -> None:
    """plotly before 6.6 sets ``warnings.formatwarning`` for the whole process when ``to_html`` first imports
    ``plotly.tools`` (checked with plotly 5.18 and 6.5); the report puts the user's back."""
    import warnings

    import plotly.io as pio

    real_to_html = pio.to_html

    def to_html_of_old_plotly(*args: Any, **kwargs: Any) -> str:
        html = real_to_html(*args, **kwargs)
        warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"{category.__name__}:\n\n"
        return html

    monkeypatch.setattr(pio, "to_html", to_html_of_old_plotly)
    users_format = warnings.formatwarning
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_big_trace(50)))
    page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert plotly_data(page)  # the chart was written through the patched to_html
    assert warnings.formatwarning is users_format


def _big_trace(n_pairs: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(512, 1 << 24, size=n_pairs)
    frames = [[{"name": f"f{k}", "filename": f"/home/u/m{k}.py", "line": k}] for k in range(50)]
    trace = []
    live: list[int] = []
    t = 1_700_000_000_000_000
    for i in range(n_pairs):
        trace.append({"action": "alloc", "addr": i, "size": int(sizes[i]), "time_us": t, "frames": frames[i % 50]})
        live.append(i)
        t += 3
        if len(live) > 40 or (live and rng.random() < 0.45):
            addr = live.pop(int(rng.integers(0, len(live))))
            trace.append(
                {
                    "action": "free_completed",
                    "addr": addr,
                    "size": int(sizes[addr]),
                    "time_us": t,
                    "frames": frames[addr % 50],
                }
            )
            t += 2
    return {"segments": [], "device_traces": [trace]}


def test_large_trace_downsampled_exact(tmp_path: Path) -> None:
    snap = _big_trace(100_000)
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(snap))
    rep = replay(load_snapshot(path))
    n = rep.main.num_events
    assert n > 150_000
    out = write_report(path, tmp_path / "big.html", max_points=3000)
    page = out.read_text(encoding="utf-8")
    assert len(page.encode()) < 10 * 1024**2
    check_chart_peak(page, rep.peak.live_bytes)
    traces = plotly_data(page)
    total = next(t for t in traces if t.get("meta") == "total")
    assert len(total["y"]) <= 3000 + 10


def test_downsample_keeps_every_local_maximum() -> None:
    rng = np.random.default_rng(1)
    live = np.cumsum(rng.integers(-100, 101, size=50_000)).astype(np.int64)
    rows = downsample_rows(live, max_points=900)
    assert len(rows) <= 900 + 2
    assert int(np.argmax(live)) in set(rows.tolist())
    edges = np.linspace(0, len(live), 900 // 3 + 1).astype(np.int64)  # the buckets downsample_rows uses
    kept = set(rows.tolist())
    for lo, hi in zip(edges[:-1], edges[1:]):
        bucket = np.arange(lo, hi)
        local = bucket[np.argmax(live[bucket])]
        assert local in kept  # the bucket's maximum, at its exact row and value
        assert bucket[np.argmin(live[bucket])] in kept


def test_log_folder(tmp_path: Path) -> None:
    from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
    from lightning_memtrace.types import Phase, PhaseRecord

    folder = tmp_path / "logs" / "memtrace"
    folder.mkdir(parents=True)
    for rank in (0, 1):
        writer = PhaseCsvWriter(folder / f"phases_rank{rank}.csv")
        for step in range(3):
            for k, phase in enumerate((Phase.BATCH_START, Phase.AFTER_FORWARD, Phase.AFTER_BACKWARD)):
                peak = 1000 * (step + 1) + 100 * k + rank
                writer.write(
                    PhaseRecord(
                        step,
                        0,
                        step,
                        rank,
                        phase,
                        1.7e9 + step + k / 10,
                        peak - 50,
                        peak + 500,
                        peak,
                        300,
                        100 * k,
                        0,
                        200,
                        10,
                        0,
                    )
                )
        writer.close()
        ev = [
            {
                "action": "alloc",
                "addr": 1,
                "size": 300 + rank,
                "time_us": 1,
                "user_metadata": "phase=forward step=0",
                "category": "parameters",
                "frames": [],
            },
            {
                "action": "alloc",
                "addr": 2,
                "size": 700,
                "time_us": 2,
                "user_metadata": "phase=forward step=0",
                "category": "activations",
                "frames": [],
            },
        ]
        snap = {
            "segments": [],
            "device_traces": [ev],
            "memtrace": {
                "format": 1,
                "device": "cpu",
                "rank": rank,
                "steps": [0, 2],
                "allocated_bytes": 1000,
                "phases": [],
            },
        }
        (folder / f"snapshot_rank{rank}_steps0-2.pickle").write_bytes(pickle.dumps(snap))
    (folder / "oom_rank1_step2.pickle").write_bytes(
        pickle.dumps(
            {
                "segments": [],
                "device_traces": [
                    [
                        {
                            "action": "oom",
                            "addr": 0,
                            "size": 5000,
                            "time_us": 9,
                            "user_metadata": "phase=backward step=2",
                            "device_free": 0,
                            "frames": [],
                        }
                    ]
                ],
            }
        )
    )
    (folder / "oom_rank1_step2.txt").write_text("OOM in <backward> at step 2")
    source = load_source(tmp_path / "logs")
    assert len(source.snapshots) == 3
    assert source.phases is not None and len(source.phases) == 18
    assert source.main is not None and source.main.path.name == "snapshot_rank1_steps0-2.pickle"
    page = write_report(tmp_path / "logs", tmp_path / "r.html").read_text(encoding="utf-8")
    assert summary_json(page)["peak_bytes"] == 1001
    assert "Per-phase peaks" in page
    assert "3.1 KiB" in page  # the highest per-phase peak, 3201 B (rank 1, step 2, after_backward)
    assert "OOM in &lt;backward&gt; at step 2" in page
    assert "Categories recorded by MemTrace." in page  # nothing inferred in this folder's snapshots
    assert external_loads(page) == []
    codes = [f["code"] for f in summary_json(page)["findings"]]
    assert "phase_peak" in codes
    # a log folder with only the CSV still reports
    for f in folder.glob("*.pickle"):
        f.unlink()
    page = write_report(tmp_path / "logs", tmp_path / "r2.html").read_text(encoding="utf-8")
    assert summary_json(page)["peak_bytes"] == 3201
    assert external_loads(page) == []


def test_nothing_written_for_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(b"\x80\x04\x95")
    with pytest.raises(SnapshotError):
        write_report(bad, tmp_path / "out.html", tmp_path / "out.png")
    with pytest.raises(SnapshotError, match="without MemTrace files"):
        write_report(tmp_path, tmp_path / "out.html")
    assert not (tmp_path / "out.html").exists()
    assert not (tmp_path / "out.png").exists()


def test_real_memtrace_recorder_output(tmp_path: Path) -> None:
    """End to end on what MemTrace's recorder writes (CPU tracker): recorded categories, figures agree with its CSV."""
    torch = pytest.importorskip("torch")
    from lm_helpers import record_plain_loop

    from lightning_memtrace.analysis.phases import load_phases

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    optimizer = torch.optim.AdamW(model.parameters())
    out = tmp_path / "run"
    record_plain_loop(model, optimizer, out, 4, 32, history_skip_steps=1, history_steps=2)
    snapshots = sorted(out.rglob("snapshot_rank0_*.pickle"))
    if not snapshots:
        pytest.skip("the recorder wrote no snapshot")
    snap = load_snapshot(snapshots[0])
    rep = replay(snap)
    assert rep.is_memtrace
    meta = snap.memtrace or {}
    steps = meta.get("steps", [1, 2])
    al = rep.main.allocations
    recorded = al[~al["inferred"]]
    assert {"parameters", "optimizer_state", "gradients"} <= set(recorded["category"].astype(str))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert rep.peak.by_category["parameters"] == params
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a scalar step per parameter
    assert 2 * params <= rep.peak.by_category["optimizer_state"] <= 2 * params + 64 * len(list(model.parameters()))
    if "allocated_at_start_bytes" in meta:
        assert rep.main.seed_bytes == meta["allocated_at_start_bytes"]
    phases = load_phases(out)
    window = phases[(phases["step"] >= steps[0]) & (phases["step"] <= steps[1]) & (phases["phase"] != "batch_start")]
    assert rep.peak.live_bytes == int(window["peak_bytes"].max())
    page = write_report(out, tmp_path / "r.html").read_text(encoding="utf-8")
    assert summary_json(page)["peak_bytes"] == rep.peak.live_bytes
    assert "Per-phase peaks" in page
    assert external_loads(page) == []


def test_findings_name_causes_with_numbers() -> None:
    from lightning_memtrace.analysis.findings import compute_findings

    gib = 1024**3

    def ev(action: str, addr: int, size: int, t: int, phase: str, step: int, cat: str) -> dict[str, Any]:
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "time_us": t,
            "user_metadata": f"phase={phase} step={step}",
            "category": cat,
            "frames": [],
        }

    trace = [
        ev("alloc", 1, 2 * gib, 1, "outside", 3, "parameters"),
        ev("alloc", 2, gib + gib // 5, 2, "backward", 2, "gradients"),  # last step's gradients, never freed
        ev("alloc", 3, 4 * gib, 3, "forward", 3, "activations"),
        ev("alloc", 4, gib // 2, 4, "forward", 3, "activations"),
        ev("free_completed", 4, gib // 2, 5, "backward", 3, "activations"),
    ]
    snap = {
        "segments": [
            {"device": 0, "address": a, "total_size": s, "blocks": []}
            for a, s in ((1 << 40, 6 * gib), (2 << 40, 4 * gib))
        ],  # 10 GiB reserved
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": False},
    }
    rep = replay(snap)
    assert rep.peak.live_bytes == 2 * gib + gib + gib // 5 + 4 * gib + gib // 2
    findings = {f.code: f for f in compute_findings(rep)}
    peak = findings["peak"]
    assert peak.numbers["stage"] == "forward" and peak.numbers["step"] == 3
    assert peak.message.startswith("peak 7.7 GiB (8,267,812,044 B) in forward of step 3: activations 58% (4.5 GiB)")
    assert "gradient checkpointing" in peak.message
    stale = findings["stale_gradients"]
    assert stale.numbers["gradients_bytes"] == gib + gib // 5
    assert stale.message.startswith(
        "the previous step's gradients, 1.2 GiB (1,288,490,188 B), are alive during forward"
    )
    assert stale.numbers["peak_saving_bytes"] == gib + gib // 5 and "Lightning does" not in stale.message
    frag = findings["fragmentation"]
    assert frag.numbers["reserved_bytes"] == 10 * gib
    assert frag.message.startswith("reserved exceeds allocated by 30% at the peak")
    assert "expandable_segments" in frag.message
