"""``memtrace summary`` compared with tests/expected/ (``--update-expected`` rewrites it); the width is fixed (160
columns when stdout is not a terminal) so that the tables are the same on every machine."""

from __future__ import annotations

import pytest
from shared_files import fixture_path

from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.source import LoadedSnapshot, load_source
from lightning_memtrace.analysis.view import snapshot_view
from lightning_memtrace.cli import main


@pytest.mark.parametrize("name", ["shreyansh26_profile_grad.pkl", "drisspg_mini_snapshot.pickle"])
def test_summary_text(name: str, capsys: pytest.CaptureFixture[str], expected, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    path = fixture_path(name)
    assert main(["summary", str(path), "--sites", "5"]) == 0
    expected(capsys.readouterr().out, f"summary_{path.stem}.txt")


def test_report_and_summary_read_one_view() -> None:
    source = load_source(fixture_path("shreyansh26_profile_grad.pkl"))
    assert source.main is not None
    view = snapshot_view(source.main, max_sites=3)
    peak = source.main.replay.peak
    assert view.total_bytes == peak.live_bytes and view.by_category == peak.by_category
    assert len(view.sites) == min(3, len(peak.sites)) and view.site_count == len(peak.sites)
    assert sum(s.bytes for s in view.categories) == view.total_bytes
    assert isinstance(source.main, LoadedSnapshot) and replay  # the view is computed from the replayed snapshot
