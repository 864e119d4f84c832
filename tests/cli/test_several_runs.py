"""Issue 13, point 3: a parent folder (``lightning_logs``) and a folder written by several fits are read as several
runs by ``load_phases``, ``load_sources``, ``memtrace summary`` and ``memtrace report``; ``diff`` asks for one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lm_helpers import MLP, trainer  # noqa: E402

from lightning_memtrace import MemTrace, load_phases  # noqa: E402
from lightning_memtrace.analysis.source import load_source, load_sources  # noqa: E402
from lightning_memtrace.analysis.loader import SnapshotError  # noqa: E402
from lightning_memtrace.cli import main  # noqa: E402

STEPS = 3
ROWS_PER_RUN = 5 * STEPS  # batch_start, after_forward, after_backward, after_optimizer_step, batch_end


def _run_cli(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Two fits of one script: ``lightning_logs/version_0`` and ``version_1``, each with its CSV and snapshot."""
    root = tmp_path_factory.mktemp("runs")
    runs = []
    for _ in range(2):
        callback = MemTrace(report=False)
        trainer(root, [callback], max_steps=STEPS, logger=CSVLogger(root)).fit(MLP())
        runs.append(callback.run_id)
    return root / "lightning_logs", runs


def test_load_phases_of_the_parent_tells_the_runs_apart(two_versions: tuple[Path, list[str]]) -> None:
    parent, runs = two_versions
    phases = load_phases(parent)
    assert phases.groupby("run").size().to_dict() == {runs[0]: ROWS_PER_RUN, runs[1]: ROWS_PER_RUN}


def test_load_sources_gives_one_source_per_version(two_versions: tuple[Path, list[str]]) -> None:
    parent, runs = two_versions
    sources = load_sources(parent)
    assert [s.label for s in sources] == ["version_0", "version_1"]
    assert [s.run for s in sources] == runs
    for source, run in zip(sources, runs):
        assert source.phases is not None and source.phases.run.unique().tolist() == [run]
        assert [s.path.name for s in source.snapshots] == ["snapshot_rank0_steps1-2.pickle"]
        assert source.snapshots[0].replay.memtrace["run"] == run  # the header names the run
    # one run's folder is still one run, named by what was passed
    (single,) = load_sources(parent / "version_1")
    assert single.path == parent / "version_1" and single.run == runs[1]


def test_summary_of_the_parent_prints_every_run(
    two_versions: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    parent, _ = two_versions
    assert _run_cli(["summary", str(parent)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{parent}: 2 runs, oldest first"
    assert out.index("run: version_0") < out.index("run: version_1")
    assert out.count("live at the peak, by category") == 2
    assert out.count("per-phase peaks (phases CSV)") == 2
    assert "no snapshot" not in out


def test_summary_json_of_the_parent_has_one_object_per_run(
    two_versions: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 16, point 4: ``{"file", "runs": [...]}``, each run the object one run's folder gives."""
    from json_schema import SUMMARY, SUMMARY_RUNS, check_shape

    parent, runs = two_versions
    assert _run_cli(["summary", str(parent), "--json", "--step", "2", "--phase", "forward"]) == 0
    obj = json.loads(capsys.readouterr().out)
    check_shape(obj, SUMMARY_RUNS)
    assert obj["file"] == str(parent) and [r["run"] for r in obj["runs"]] == runs
    assert [r["label"] for r in obj["runs"]] == ["version_0", "version_1"]
    for run in obj["runs"]:
        (device,) = run["devices"]
        assert run["is_memtrace"] and device["scope"] == "step 2, phase forward" and device["stage"] == "forward"
    assert _run_cli(["summary", str(parent / "version_1"), "--json", "--step", "2", "--phase", "forward"]) == 0
    single = json.loads(capsys.readouterr().out)
    check_shape(single, SUMMARY)
    assert {k: v for k, v in single.items() if k not in ("schema", "file", "label")} == {
        k: v for k, v in obj["runs"][1].items() if k != "label"
    }


def test_report_of_the_parent_has_a_section_per_run(two_versions: tuple[Path, list[str]], tmp_path: Path) -> None:
    parent, runs = two_versions
    out = tmp_path / "report.html"
    assert _run_cli(["report", str(parent), "-o", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    index = html[html.index('<table id="runs-table">') : html.index("</table>", html.index('id="runs-table"'))]
    assert index.count("<tr>") == 3  # the head and two runs
    assert '<a href="#run-0">version_0</a>' in index and '<a href="#run-1">version_1</a>' in index
    assert '<section id="run-0" class="run">' in html and '<section id="run-1" class="run">' in html
    summary = json.loads(re.search(r'id="memtrace-summary">(.*?)</script>', html, re.S).group(1))
    assert [r["run"] for r in summary["runs"]] == runs
    chart_ids = re.findall(r'<div id="([^"]+)" class="plotly-graph-div"', html)
    assert len(chart_ids) >= 2 and len(chart_ids) == len(set(chart_ids))  # every run's chart draws in its own place
    assert html.count("plotly.js v") <= 2  # plotly.js embedded once (its banner may name the version twice)


def test_diff_asks_for_one_run(two_versions: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    parent, _ = two_versions
    code = _run_cli(["diff", str(parent), str(parent / "version_0")])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err
    assert "holds 2 runs (version_0, version_1); pass one run's folder" in lines[0]
    with pytest.raises(SnapshotError, match="holds 2 runs"):
        load_source(parent)


def test_two_fits_into_one_folder_are_two_sources(tmp_path: Path) -> None:
    runs = []
    for width in (64, 128):
        callback = MemTrace(dirpath=tmp_path / "mt", report=False)
        trainer(tmp_path, [callback], max_steps=STEPS).fit(MLP(width=width))
        runs.append(callback.run_id)
    sources = load_sources(tmp_path / "mt")
    assert [s.run for s in sources] == runs
    assert [s.label.split(" · ")[1] for s in sources] == [f"run {run}" for run in runs]
    assert [len(s.phases) for s in sources] == [ROWS_PER_RUN, ROWS_PER_RUN]
    # the second fit writes its snapshot beside the first's, never over it: each run keeps its own
    assert [[s.path.name for s in source.snapshots] for source in sources] == [
        ["snapshot_rank0_steps1-2.pickle"],
        ["snapshot_rank0_steps1-2.1.pickle"],
    ]
    assert [s.replay.memtrace["run"] for source in sources for s in source.snapshots] == runs
    widths = [int(s.phases.parameters_bytes.max()) for s in sources]
    assert widths == [4 * (32 * w + w + w * w + w + w + 1) for w in (64, 128)]


def test_ranks_of_plain_loops_pair_up_run_by_run(tmp_path: Path) -> None:
    """Plain loops give each rank's recorder its own id: the k-th run of every rank is one run."""
    import torch
    from lm_helpers import record_plain_loop

    for batch in (8, 16):
        for rank in (0, 1):
            model = torch.nn.Linear(16, 16)
            record_plain_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path, 2, batch, rank=rank,
                              history=False)
    sources = load_sources(tmp_path)
    assert len(sources) == 2
    for source, batch in zip(sources, (8, 16)):
        assert sorted(source.phases["rank"].unique().tolist()) == [0, 1]
        assert source.phases["run"].nunique() == 2  # one id per rank's recorder
        assert int(source.phases["inputs_bytes"].max()) == 4 * batch * 16


def test_a_phases_csv_passed_alone_stands_for_its_log_folder(
    two_versions: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    parent, runs = two_versions
    folder = parent / "version_1" / "memtrace"
    (source,) = load_sources(folder / "phases_rank0.csv")
    assert source.run == runs[1] and len(source.phases) == ROWS_PER_RUN
    assert [s.path.name for s in source.snapshots] == ["snapshot_rank0_steps1-2.pickle"]
    assert _run_cli(["summary", str(folder / "phases_rank0.csv"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == runs[1]


def test_the_search_below_a_folder_is_bounded(
    two_versions: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from lightning_memtrace.analysis import source as source_module

    parent, _ = two_versions
    run = parent / "version_0" / "memtrace"
    depth = source_module.SEARCH_DEPTH
    # a run's memtrace folder SEARCH_DEPTH folders below is found; one deeper, or in a hidden folder, is not
    shutil.copytree(run, tmp_path.joinpath(*["d"] * (depth - 1), "memtrace"))
    shutil.copytree(run, tmp_path.joinpath(*["e"] * depth, "memtrace"))
    shutil.copytree(run, tmp_path / ".hidden" / "memtrace")
    (tmp_path / "d" / "loop").symlink_to(tmp_path)  # a link back up: searched once
    assert source_module.run_folders(tmp_path) == [tmp_path.joinpath(*["d"] * (depth - 1), "memtrace")]
    # a folder with more folders below it than the search looks into is one clear error
    monkeypatch.setattr(source_module, "SEARCH_FOLDERS_MAX", 5)
    with pytest.raises(SnapshotError, match=r"over 5 folders to search for MemTrace's; pass a log folder"):
        load_sources(tmp_path)
