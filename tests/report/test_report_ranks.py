"""A multi-rank MemTrace log folder: the report shows every rank (peaks side by side, imbalance, one timeline each)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from report_pages import PLOTLY_CALL, external_loads, summary_json

from lm_helpers import record_plain_loop
from lightning_memtrace import cli
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.ranks import (
    RANK_IMBALANCE_PERCENT,
    rank_imbalance,
    rank_imbalance_finding,
    rank_overview,
)
from lightning_memtrace.analysis.source import load_source
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.report import write_report


def _run_rank(folder: Path, rank: int, batch: int, steps: int = 2) -> None:
    """A plain training loop recorded as ``rank``: writes phases_rank<R>.csv and snapshot_rank<R>_steps0-0.pickle."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    record_plain_loop(model, optimizer, folder, steps, batch, rank=rank, history_skip_steps=0, history_steps=1)


@pytest.fixture(scope="module")
def two_rank_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ranks") / "memtrace"
    _run_rank(folder, 0, batch=8)
    _run_rank(folder, 1, batch=256)
    for rank in (0, 1):
        assert (folder / f"phases_rank{rank}.csv").is_file()
        assert (folder / f"snapshot_rank{rank}_steps0-0.pickle").is_file()
    return folder


def _rank_peaks_in_page(page: str) -> dict[int, int]:
    table = re.search(r'<table id="ranks-table">(.*?)</table>', page, re.S)
    assert table, "no Ranks table"
    rows = re.findall(r'<tr data-rank="(\d+)">(.*?)</tr>', table.group(1), re.S)
    peaks = {}
    for rank, row in rows:
        cell = re.search(r'<td class="num rank-peak" data-bytes="(\d+)">([\d,]+)</td>', row)
        assert cell, row
        assert int(cell.group(2).replace(",", "")) == int(cell.group(1))
        peaks[int(rank)] = int(cell.group(1))
    return peaks


def test_two_rank_report_shows_every_rank(two_rank_folder: Path, tmp_path: Path) -> None:
    expected = {
        rank: replay(load_snapshot(two_rank_folder / f"snapshot_rank{rank}_steps0-0.pickle")).peak.live_bytes
        for rank in (0, 1)
    }
    assert expected[1] > expected[0]
    page = write_report(two_rank_folder.parent, tmp_path / "r.html").read_text(encoding="utf-8")

    # one chart per rank, rank 0 first, after the main (highest-peak) timeline; plotly.js embedded once
    assert page.count('id="timeline-rank0"') == 1 and page.count('id="timeline-rank1"') == 1
    assert page.index('id="timeline-rank0"') < page.index('id="timeline-rank1"')
    assert page.count('class="plotly-graph-div"') == 3
    assert len(PLOTLY_CALL.findall(page)) == 3
    assert len(re.findall(r"\* plotly\.js v\d", page)) == 1
    assert external_loads(page) == []
    assert len(page.encode()) < 20 * 1024**2

    # the Ranks table: exact peaks from each rank's snapshot replay, and the imbalance
    assert '<h2 id="ranks">Ranks</h2>' in page
    assert _rank_peaks_in_page(page) == expected
    diff = max(expected.values()) - min(expected.values())
    imbalance = re.search(r'<p id="rank-imbalance" data-bytes="(\d+)"', page)
    assert imbalance and int(imbalance.group(1)) == diff
    assert "rank 1 peaks" in page and f"({diff:,} B, " in page and "above rank 0" in page
    summary = summary_json(page)
    assert summary["rank_imbalance"]["imbalance_bytes"] == diff
    assert summary["rank_imbalance"]["high_rank"] == 1 and summary["rank_imbalance"]["low_rank"] == 0
    assert summary["rank_imbalance"]["percent"] == pytest.approx(100.0 * diff / expected[0])
    assert [r["peak_bytes"] for r in summary["ranks"]] == [expected[0], expected[1]]
    # per-phase maxima of the CSV per rank
    for r in summary["ranks"]:
        assert {"after_forward", "after_backward", "after_optimizer_step"} <= set(r["phase_peaks"])
    assert "max after_backward (CSV)" in page
    # the finding (rank 1's batch is 32x larger: far above 5%)
    assert summary["rank_imbalance"]["percent"] > RANK_IMBALANCE_PERCENT
    finding = next(f for f in summary["findings"] if f["code"] == "rank_imbalance")
    assert f"{diff:,} B" in finding["message"]
    # and why: at its peak row rank 1 holds the larger batch (256 vs 8 rows of 64 float32) and its activations
    overview = rank_overview(load_source(two_rank_folder.parent))
    assert overview.imbalance_parts["inputs"] == (256 - 8) * 64 * 4
    assert "parameters" not in overview.imbalance_parts  # the same model on both ranks
    assert "at its peak row it holds" in finding["message"] and "more inputs" in finding["message"]
    assert summary["findings"][0]["code"] == "peak"


def test_single_rank_folder_has_no_ranks_section(two_rank_folder: Path, tmp_path: Path) -> None:
    single = tmp_path / "single" / "memtrace"
    single.mkdir(parents=True)
    for name in ("phases_rank0.csv", "snapshot_rank0_steps0-0.pickle"):
        shutil.copy(two_rank_folder / name, single / name)
    page = write_report(single.parent, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Ranks</h2>" not in page and 'id="ranks' not in page
    assert "timeline-rank" not in page
    assert page.count('class="plotly-graph-div"') == 1
    summary = summary_json(page)
    assert "ranks" not in summary and "rank_imbalance" not in summary
    assert all(f["code"] != "rank_imbalance" for f in summary["findings"])
    assert external_loads(page) == []


def test_summary_command_per_rank_table(two_rank_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["summary", str(two_rank_folder.parent)]) == 0
    out = capsys.readouterr().out
    assert "per-rank peaks" in out
    for rank in (0, 1):
        peak = replay(load_snapshot(two_rank_folder / f"snapshot_rank{rank}_steps0-0.pickle")).peak.live_bytes
        assert f"{peak:,} B" in out
    assert "rank imbalance" in out and "rank 1 peaks" in out


def test_summary_json_has_the_reports_findings(
    two_rank_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``summary --json`` carries the findings the report and the text summary show, with their numbers."""
    page = write_report(two_rank_folder.parent, tmp_path / "r.html").read_text(encoding="utf-8")
    assert cli.main(["summary", str(two_rank_folder.parent), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["findings"] == summary_json(page)["findings"]
    codes = [f["code"] for f in obj["findings"]]
    assert codes[:2] == ["peak", "rank_imbalance"]
    peaks = {
        rank: replay(load_snapshot(two_rank_folder / f"snapshot_rank{rank}_steps0-0.pickle")).peak.live_bytes
        for rank in (0, 1)
    }
    peak, imbalance = obj["findings"][:2]
    assert peak["severity"] == "info" and peak["numbers"]["peak_bytes"] == obj["devices"][0]["peak_bytes"]
    assert imbalance["severity"] == "warning"
    assert imbalance["numbers"]["peaks"] == {"0": peaks[0], "1": peaks[1]}
    assert imbalance["numbers"]["imbalance_bytes"] == peaks[1] - peaks[0]
    assert imbalance["numbers"]["by_category"]["inputs"] == (256 - 8) * 64 * 4
    assert cli.main(["summary", str(two_rank_folder.parent)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ranks are imbalanced" in text and f"({peaks[1] - peaks[0]:,} B, " in text


def test_rank_imbalance_threshold() -> None:
    at = rank_imbalance({0: 100, 1: 105}, "test")
    assert at is not None and at.imbalance_bytes == 5 and at.percent == pytest.approx(5.0)
    assert rank_imbalance_finding(at) is None  # exactly 5%: not above
    above = rank_imbalance({2: 106, 0: 100, 1: 103}, "test")
    assert above is not None and (above.high_rank, above.low_rank, above.imbalance_bytes) == (2, 0, 6)
    finding = rank_imbalance_finding(above)
    assert finding is not None and finding.code == "rank_imbalance" and finding.numbers["imbalance_bytes"] == 6
    assert "rank 2 peaks 6 B (6 B, 6.0%) above rank 0" in finding.message
    same = rank_imbalance({0: 7, 1: 7}, "test")
    assert same is not None and same.imbalance_bytes == 0 and rank_imbalance_finding(same) is None
    assert rank_imbalance({0: 7}, "test") is None
