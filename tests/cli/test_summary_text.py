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


@pytest.mark.parametrize(
    ("name", "args", "expected_name"),
    [
        # the window holds the peak (event 17, the second call's forward)
        (
            "shreyansh26_profile_grad.pkl",
            ["--window", "1735227250490000:1735227250513363"],
            "summary_window_shreyansh26_profile_grad.txt",
        ),
        ("shreyansh26_profile_grad.pkl", ["--at", "5", "--file", "profile_grad.py"], "summary_at_file_shreyansh26.txt"),
        ("drisspg_mini_snapshot.pickle", ["--file", "misc/attention.py"], "summary_file_drisspg_mini_snapshot.txt"),
    ],
)
def test_summary_question_text(
    name: str, args: list[str], expected_name: str, capsys: pytest.CaptureFixture[str], expected, monkeypatch
) -> None:
    """Issue 16, point 3: the text of the questions of time."""
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["summary", str(fixture_path(name)), "--sites", "5", *args]) == 0
    expected(capsys.readouterr().out, expected_name)


def test_report_and_summary_read_one_view() -> None:
    source = load_source(fixture_path("shreyansh26_profile_grad.pkl"))
    assert source.main is not None
    view = snapshot_view(source.main, max_sites=3)
    peak = source.main.replay.peak
    assert view.total_bytes == peak.live_bytes and view.by_category == peak.by_category
    assert len(view.sites) == min(3, len(peak.sites)) and view.site_count == len(peak.sites)
    assert sum(s.bytes for s in view.categories) == view.total_bytes
    assert isinstance(source.main, LoadedSnapshot) and replay  # the view is computed from the replayed snapshot


def test_shorten_where_keeps_file_and_line() -> None:
    from lightning_memtrace.cli.summary import shorten_where

    where = "/home/me/project/pkg/sub/module.py:1234"
    assert shorten_where(where, 80) == where
    assert shorten_where(where, 24) == "…/pkg/sub/module.py:1234"
    assert shorten_where(where, 23) == "…/sub/module.py:1234"
    assert shorten_where(where, 5) == "…/module.py:1234"  # never cuts the file name or the line
    assert shorten_where("(no Python frame)", 5) == "(no Python frame)"


@pytest.mark.parametrize("columns", ["120", "160"])
def test_summary_sites_keep_line_numbers(columns: str, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """Two lines of one file stay told apart at 120 columns and piped at 160 (issue 13, point 4)."""
    monkeypatch.setenv("COLUMNS", columns)
    path = fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")
    assert main(["summary", str(path), "--sites", "8"]) == 0
    out = capsys.readouterr().out
    sites = out[out.index("largest allocation sites") : out.index("findings")]
    assert max(len(line) for line in sites.splitlines()) <= int(columns)
    for where in ("optimizers.py:82 ", "optimizers.py:84 ", "optimizers.py:100 ", "_backends.py:288 "):
        assert where in sites, where
