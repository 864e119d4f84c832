"""Issue 16, points 3 and 4: ``memtrace summary --json`` / ``diff --json`` hold their documented schema
(tests/json_schema.py, the README's "Machine-readable answers"), their numbers are exact on the real fixtures, and the
questions of time answer MemTrace's own CPU snapshots by step and phase; bad values are one-line errors."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from json_schema import DIFF, SUMMARY, check_shape
from shared_files import ALL_FIXTURES, fixture_path

from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.cli import main


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtrace: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def assert_sites_add_up(device: dict[str, Any]) -> None:
    """Every site has one category, and a category's sites add up to its bytes (all sites listed)."""
    assert device["site_count"] == len(device["sites"])
    sums: dict[str, int] = defaultdict(int)
    for site in device["sites"]:
        assert site["category"] in device["categories"] or site["bytes"] == 0, site
        sums[site["category"]] += site["bytes"]
    assert {c: b for c, b in sums.items() if b} == device["categories"]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_summary_json_schema_and_exact_sums(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    obj = run_json(capsys, ["summary", str(fixture_path(name)), "--json", "--sites", "1000000"])
    check_shape(obj, SUMMARY)
    assert obj["schema"] == "memtrace.summary/1" and obj["file"].endswith(name) and obj["snapshot"] == name
    rep = replay(load_snapshot(fixture_path(name)))
    assert [d["device"] for d in obj["devices"]] == sorted(rep.devices)
    for device in obj["devices"]:
        dev = rep.devices[device["device"]]
        assert device["scope"] == "whole trace" and device["live_bytes"] is None
        assert device["peak_bytes"] == dev.peak.live_bytes == sum(device["categories"].values())
        assert device["peak_event"] == dev.peak.index and device["events"] == dev.num_events
        assert_sites_add_up(device)
        live = dev.timeline["live_bytes"].to_numpy()
        for phase in device["phases"]:  # each (step, phase) peak, from the timeline
            rows = (dev.timeline["phase"].astype(str) == phase["phase"]).to_numpy() & (
                dev.timeline["step"].to_numpy() == phase["step"]
            )
            assert phase["events"] == int(rows.sum()) and phase["peak_bytes"] == int(live[rows].max())
        assert sum(p["events"] for p in device["phases"]) == dev.num_events


def test_summary_json_known_figures(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(fixture_path("shreyansh26_profile_grad.pkl"))
    (device,) = run_json(capsys, ["summary", path, "--json"])["devices"]
    assert device["peak_bytes"] == 4_434_803_008
    assert device["categories"]["parameters"] == 2_000_200_000 and device["categories"]["inputs"] == 400_000_000
    assert len(device["sites"]) == 5 and device["annotations"] == []
    obj = run_json(capsys, ["summary", path, "--json", "--at", "5", "--file", "profile_grad.py"])
    check_shape(obj, SUMMARY)
    (device,) = obj["devices"]
    assert obj["question"] == {"window_us": None, "at": 5, "step": None, "phase": None, "file": "profile_grad.py"}
    assert device["live_bytes"] == 2_200_200_000 and device["peak_bytes"] == 4_434_803_008  # the trace's peak
    assert device["categories"] == {"parameters": 2_000_200_000, "inputs": 200_000_000}
    assert [(x["line"], x["bytes"], x["count"]) for x in device["file_lines"]] == [
        (8, 2_000_200_000, 2),
        (10, 200_000_000, 1),
    ]


def test_summary_json_findings_with_their_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """The findings of the text summary and the report, each with its code, severity, sentence and figures."""
    path = fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")
    obj = run_json(capsys, ["summary", str(path), "--json"])
    check_shape(obj, SUMMARY)
    (device,) = obj["devices"]
    by_code = {f["code"]: f for f in obj["findings"]}
    assert [f["code"] for f in obj["findings"]] == ["peak", "reserved", "top_site", "pre_existing"]
    assert by_code["peak"]["numbers"]["peak_bytes"] == device["peak_bytes"] == 54_802_667_524
    assert by_code["peak"]["numbers"]["by_category"] == device["categories"]
    assert by_code["peak"]["numbers"]["top_category"] == "optimizer_state"
    reserved = by_code["reserved"]["numbers"]
    assert (reserved["reserved_bytes"], reserved["allocated_bytes"]) == (61_111_009_280, 54_802_667_524)
    assert reserved["extra_bytes"] == 61_111_009_280 - 54_802_667_524
    assert by_code["top_site"]["numbers"]["site"].endswith("cs336_basics/optimizers.py:82")
    assert "54,802,667,524 B" in by_code["peak"]["message"]
    # asked about a moment, the findings are still the run's
    at = run_json(capsys, ["summary", str(path), "--json", "--at", "5"])
    assert at["findings"] == obj["findings"]


def test_summary_json_of_an_out_of_memory_run_holds_its_post_mortem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where and why the run died, what was live, the line that asked and what to change, as data."""
    import torch

    from lm_helpers import record_plain_loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

    def ask_too_much(step: int) -> None:
        if step == 1:
            torch.empty(10**15, dtype=torch.uint8)

    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        record_plain_loop(model, optimizer, tmp_path, 2, 8, in_forward=ask_too_much, what_if_budget_s=0)
    obj = run_json(capsys, ["summary", str(tmp_path), "--json"])
    check_shape(obj, SUMMARY)
    (pm,) = obj["post_mortems"]
    text = (tmp_path / "oom_rank0_step1.txt").read_text()
    where = (pm["file"], pm["step"], pm["stage"], pm["requested_bytes"])
    assert where == ("oom_rank0_step1.pickle", 1, "forward", 10**15)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert pm["categories"]["parameters"] == params and pm["categories"]["optimizer_state"] == 2 * params + 4 * 4
    assert sum(pm["categories"].values()) == pm["allocated_bytes"]
    assert pm["failed_at"].endswith("ask_too_much") and __file__.rsplit("/", 1)[-1] in pm["failed_at"]
    assert f"failed at:     {pm['failed_at']}" in text
    assert pm["advice"] and all(" ".join(tip.split()) in " ".join(text.split()) for tip in pm["advice"])
    assert pm["what_if"] is None  # what_if_budget_s=0
    assert any(f["code"] == "oom" for f in obj["findings"])
    # the text summary shows it as a table, and the report's embedded summary holds the same object
    from report_pages import summary_json

    from lightning_memtrace.report import write_report

    monkeypatch.setenv("COLUMNS", "400")  # no cell wrapped
    assert main(["summary", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "out of memory: oom_rank0_step1.pickle" in shown and f"failed at │ {pm['failed_at']}" in shown
    assert "requested │ 909.5 TiB (1,000,000,000,000,000 B)" in shown and "what to change │" in shown
    page = write_report(tmp_path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert summary_json(page)["post_mortems"] == obj["post_mortems"]
    # a snapshot without one, and a post-mortem of the wrong shape (the file is untrusted): none, no error
    plain = fixture_path("shreyansh26_profile_grad.pkl")
    assert run_json(capsys, ["summary", str(plain), "--json"])["post_mortems"] == []
    import pickle

    snapshot = pickle.loads((tmp_path / "oom_rank0_step1.pickle").read_bytes())
    snapshot["memtrace"]["post_mortem"] = {"step": "one", "message": 3, "largest": "x"}
    (tmp_path / "hostile.pickle").write_bytes(pickle.dumps(snapshot))
    assert run_json(capsys, ["summary", str(tmp_path / "hostile.pickle"), "--json"])["post_mortems"] == []
    snapshot["memtrace"]["post_mortem"] = {"step": 2, "message": "m", "categories": {"a": "b"}, "largest": [{}, 5]}
    (tmp_path / "odd.pickle").write_bytes(pickle.dumps(snapshot))
    (odd,) = run_json(capsys, ["summary", str(tmp_path / "odd.pickle"), "--json"])["post_mortems"]
    assert (odd["step"], odd["categories"], odd["requested_bytes"], odd["failed_at"]) == (2, {}, None, None)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    snapshot["memtrace"]["post_mortem"].update(what_if={"made": True, "what_if": deep})
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # to write it: the reader keeps the usual limit
    try:
        (tmp_path / "deep.pickle").write_bytes(pickle.dumps(snapshot))
    finally:
        sys.setrecursionlimit(limit)
    (deep_pm,) = run_json(capsys, ["summary", str(tmp_path / "deep.pickle"), "--json"])["post_mortems"]
    assert deep_pm["what_if"] is None and deep_pm["step"] == 2


def test_summary_json_window_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    path = fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")
    dev = replay(load_snapshot(path)).main
    times = dev.timeline["time_us"].to_numpy()
    live = dev.timeline["live_bytes"].to_numpy()
    start, end = int(times[len(times) // 3]) + 1, int(times[2 * len(times) // 3])
    rows = np.nonzero((times >= start) & (times <= end))[0]
    at_start = int(live[rows[0] - 1])
    obj = run_json(capsys, ["summary", str(path), "--json", "--sites", "1000000", "--window", f"{start}:{end}"])
    (device,) = obj["devices"]
    assert obj["question"]["window_us"] == [start, end] and device["scope_events"] == len(rows)
    assert device["peak_bytes"] == max(at_start, int(live[rows].max()))
    assert device["peak_event"] == (rows[0] - 1 if at_start > live[rows].max() else rows[np.argmax(live[rows])])
    assert sum(device["categories"].values()) == device["peak_bytes"]
    assert_sites_add_up(device)


def test_summary_json_empty_window_is_the_state_at_its_start(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(fixture_path("shreyansh26_profile_grad.pkl"))
    obj = run_json(capsys, ["summary", path, "--json", "--window", "1735227250513550:1735227250513560"])
    (device,) = obj["devices"]  # no event inside: the state after event 23 (the last one before it)
    assert (device["scope_events"], device["peak_event"], device["peak_bytes"]) == (0, 23, 3_233_754_432)
    assert device["categories"] == {
        "parameters": 2_000_200_000,
        "inputs": 200_000_000,
        "activations": 1_000_000_000,
        "other": 33_554_432,
    }


def test_diff_json(capsys: pytest.CaptureFixture[str]) -> None:
    a = str(fixture_path("shreyansh26_profile_no_grad.pkl"))
    b = str(fixture_path("shreyansh26_profile_grad.pkl"))
    obj = run_json(capsys, ["diff", a, b, "--json"])
    check_shape(obj, DIFF)
    assert obj["schema"] == "memtrace.diff/1"
    assert (obj["a"]["peak_bytes"], obj["b"]["peak_bytes"]) == (4_234_803_008, 4_434_803_008)
    inputs = next(row for row in obj["categories"] if row["category"] == "inputs")
    assert (inputs["a"], inputs["b"], inputs["delta"]) == (200_000_000, 400_000_000, 200_000_000)
    peak = next(row for row in obj["figures"] if row["figure"] == "peak allocated")
    assert peak["delta"] == 200_000_000 == sum(row["delta"] for row in obj["categories"])
    for side in ("a", "b"):
        assert sum(obj[side]["categories"].values()) == obj[side]["peak_bytes"]


def test_bad_values_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(fixture_path("shreyansh26_profile_grad.pkl"))
    for args, fragment in (
        (["--window", "5:3"], "the end is before the start"),
        (["--window", "abc"], "START_US:END_US"),
        (["--at", "33"], "has 33 events (0 to 32)"),
        (["--at", "-1"], "numbered from 0"),
        (["--phase", "fwd"], "unknown phase 'fwd'"),
        (["--step", "3"], "step 3 is not in the trace"),
        (["--at", "3", "--step", "1"], "cannot be combined"),
        (["--file", "nosuch.py"], "nosuch.py"),
        (["--device", "4", "--at", "1"], "--device 4"),
    ):
        for json_flag in ([], ["--json"]):
            assert fragment in run_error(capsys, ["summary", path, *args, *json_flag])


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MemTrace CPU snapshot of a plain loop (steps 1 and 2 recorded)."""
    torch = pytest.importorskip("torch")
    from lm_helpers import record_plain_loop

    folder = tmp_path_factory.mktemp("cpu_run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    record_plain_loop(model, torch.optim.AdamW(model.parameters()), folder, 4, 16, history_steps=2)
    if not sorted(folder.rglob("snapshot_rank0_*.pickle")):
        pytest.skip("the recorder wrote no snapshot")
    return folder


def test_step_and_phase_of_a_memtrace_snapshot(cpu_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (snapshot,) = sorted(cpu_run.rglob("snapshot_rank0_*.pickle"))
    dev = replay(load_snapshot(snapshot)).main
    tl = dev.timeline
    assert set(tl["step"].unique().tolist()) >= {1, 2}
    for step, phase in ((2, "forward"), (1, "backward"), (1, "optimizer_step"), (2, None), (None, "forward")):
        args = ["summary", str(cpu_run), "--json", "--sites", "1000000"]
        args += (["--step", str(step)] if step is not None else []) + (["--phase", phase] if phase else [])
        obj = run_json(capsys, args)
        check_shape(obj, SUMMARY)
        assert obj["is_memtrace"] and obj["question"]["step"] == step and obj["question"]["phase"] == phase
        (device,) = obj["devices"]
        rows = np.ones(len(tl), dtype=bool)
        if step is not None:
            rows &= tl["step"].to_numpy() == step
        if phase is not None:
            rows &= (tl["phase"].astype(str) == phase).to_numpy()
        assert device["scope_events"] == int(rows.sum()) > 0
        assert device["peak_bytes"] == int(tl["live_bytes"].to_numpy()[rows].max())
        assert (phase is None or device["stage"] == phase) and (step is None or device["step"] == step)
        assert sum(device["categories"].values()) == device["peak_bytes"]
        assert_sites_add_up(device)
    assert "step 7 is not in the trace" in run_error(capsys, ["summary", str(cpu_run), "--step", "7"])
    assert "no event of phase validation" in run_error(capsys, ["summary", str(cpu_run), "--phase", "validation"])


def test_step_and_phase_text(cpu_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["summary", str(cpu_run), "--step", "2", "--phase", "backward"]) == 0
    out = capsys.readouterr().out
    assert "step 2, phase backward" in out and "live at the peak in scope, by category" in out
    assert "largest allocation sites at the peak in scope" in out and "findings" not in out


def test_readme_excerpt_is_real_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ``summary --json`` excerpt is what the command prints (its ``phases`` cut to the first entry)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("$ memtrace summary shreyansh26_profile_grad.pkl --json") :]
    command, _, rest = block.partition("\n")
    documented = json.loads(rest[: rest.index("\n```")])
    path = fixture_path("shreyansh26_profile_grad.pkl")
    monkeypatch.chdir(path.parent)
    actual = run_json(capsys, command.split()[2:])
    actual["devices"][0]["phases"] = actual["devices"][0]["phases"][:1]
    assert actual == documented
