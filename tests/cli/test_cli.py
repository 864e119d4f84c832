"""The ``memtrace`` command: report, summary, diff, registered subcommands, and one-line errors with status 2."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memtrace import cli
from lightning_memtrace.cli import parser as cli_parser

SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "snapshots"


def snapshot_fixture(name: str) -> Path:
    """A file of ../shared/fixtures/snapshots, or skip when the folder (or file) is absent."""
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"shared fixture {name} is absent")
    return path


def run_main(args: list[str]) -> int:
    try:
        return cli.main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def assert_one_line_error(capsys: pytest.CaptureFixture[str], code: int, *fragments: str) -> str:
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("memtrace: error: ")
    assert "Traceback" not in captured.err
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "report.html"
    png = tmp_path / "timeline.png"
    code = run_main(
        ["report", str(snapshot_fixture("shreyansh26_profile_grad.pkl")), "-o", str(out), "--png", str(png)]
    )
    assert code == 0
    assert out.is_file() and png.is_file()
    assert "4,434,803,008" in out.read_text(encoding="utf-8")
    assert f"wrote {out}" in capsys.readouterr().out


def test_summary_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_main(["summary", str(snapshot_fixture("shreyansh26_profile_grad.pkl")), "--sites", "3"])
    assert code == 0
    out = capsys.readouterr().out
    assert "4,434,803,008" in out
    assert "2,000,200,000" in out  # parameters
    assert "400,000,000" in out  # inputs
    assert "profile_grad.py:11" in out
    assert "inferred from frames" in out
    assert "peak 4.1 GiB (4,434,803,008 B) in forward" in out


def test_summary_of_a_trace_that_peaks_before_its_first_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 16, point 1: a trace that begins by freeing a block made before recording peaks before its first event."""
    monkeypatch.setenv("COLUMNS", "200")
    block = {"address": 0, "size": 3_276_800, "requested_size": 3_276_800, "state": "active_allocated"}
    snap = {
        "segments": [{"device": 0, "address": 0, "total_size": 4_194_304, "blocks": [block]}],
        "device_traces": [
            [
                {"action": "free_completed", "addr": 8_000_000, "size": 1_000_000, "time_us": 5},
                {"action": "alloc", "addr": 8_000_000, "size": 200, "time_us": 6},
            ]
        ],
    }
    path = tmp_path / "frees_first.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert run_main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(4,276,800 B)" in out and "before the first event" in out
    assert "peak 4.1 MiB (4,276,800 B) before the first event" in out


def test_diff_command_shows_the_extra_input(capsys: pytest.CaptureFixture[str]) -> None:
    a = snapshot_fixture("shreyansh26_profile_no_grad.pkl")
    b = snapshot_fixture("shreyansh26_profile_grad.pkl")
    code = run_main(["diff", str(a), str(b)])
    assert code == 0
    out = capsys.readouterr().out
    inputs_row = next(line for line in out.splitlines() if " inputs " in line)
    assert "200,000,000 B" in inputs_row and "400,000,000 B" in inputs_row and "+200,000,000 B" in inputs_row
    peak_row = next(line for line in out.splitlines() if "peak allocated" in line)
    assert "4,234,803,008 B" in peak_row and "4,434,803,008 B" in peak_row and "+200,000,000 B" in peak_row


def test_diff_api() -> None:
    from lightning_memtrace.analysis.diff import diff_sources
    from lightning_memtrace.analysis.source import load_source

    d = diff_sources(
        load_source(snapshot_fixture("shreyansh26_profile_no_grad.pkl")),
        load_source(snapshot_fixture("shreyansh26_profile_grad.pkl")),
    )
    row = d.by_category.set_index("category").loc["inputs"]
    assert (int(row["a"]), int(row["b"]), int(row["delta"])) == (200_000_000, 400_000_000, 200_000_000)
    assert int(d.by_category["delta"].sum()) == 200_000_000
    assert int(d.summary.set_index("figure").loc["peak allocated", "delta"]) == 200_000_000


def test_error_paths_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    raw = snapshot_fixture("shreyansh26_profile_grad.pkl").read_bytes()
    truncated = tmp_path / "cut.pkl"
    truncated.write_bytes(raw[:5000])
    assert_one_line_error(capsys, run_main(["report", str(truncated), "-o", str(out)]), "truncated")
    empty = tmp_path / "empty.pkl"
    empty.write_bytes(b"")
    assert_one_line_error(capsys, run_main(["report", str(empty), "-o", str(out)]), "empty file")
    png = tmp_path / "image.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    assert_one_line_error(capsys, run_main(["report", str(png), "-o", str(out)]), "PNG image")
    assert_one_line_error(capsys, run_main(["report", str(tmp_path), "-o", str(out)]), "without MemTrace files")
    assert_one_line_error(capsys, run_main(["summary", str(tmp_path / "nope.pkl")]), "no such file")
    assert_one_line_error(capsys, run_main(["diff", str(empty), str(truncated)]), "empty file")
    assert_one_line_error(capsys, run_main(["report", str(truncated), "--max-bytes", "lots"]), "not a size")
    assert_one_line_error(capsys, run_main(["report"]), "required")
    assert_one_line_error(capsys, run_main(["frobnicate"]), "invalid choice")
    assert_one_line_error(
        capsys,
        run_main(
            ["report", str(snapshot_fixture("shreyansh26_profile_grad.pkl")), "-o", str(out), "--max-bytes", "1KiB"]
        ),
        "size limit",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "phases_rank0.csv is empty, not a MemTrace phases CSV"),  # pandas said "No columns to parse from file"
        (b"\x98\xff\x00binary", "phases_rank0.csv is not text, not a MemTrace phases CSV"),
        (b"phase,step\nbatch_start,0\n", "is not a MemTrace phases CSV: missing columns"),
    ],
)
def test_a_log_folder_whose_phases_csv_is_no_such_csv_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    folder = tmp_path / "memtrace"
    folder.mkdir()
    (folder / "phases_rank0.csv").write_bytes(content)
    for argv in (["summary", str(folder)], ["report", str(folder), "-o", str(tmp_path / "r.html")]):
        assert_one_line_error(capsys, run_main(argv), message)


def test_builtin_subcommands() -> None:
    parser = cli.build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"report", "summary", "diff"} <= set(choices)


def test_registered_subcommand(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_parser, "_REGISTERED", [])

    def add_subcommand(subparsers) -> None:
        parser = subparsers.add_parser("dummy", help="a subcommand registered by another module")
        parser.add_argument("--batch", type=int, default=1)
        parser.set_defaults(func=lambda args: print(f"batch={args.batch}") or 0)

    cli.register_subcommand(add_subcommand)
    assert run_main(["dummy", "--batch", "4"]) == 0
    assert capsys.readouterr().out.strip() == "batch=4"

    def failing(subparsers) -> None:
        parser = subparsers.add_parser("boom")
        parser.set_defaults(func=lambda args: (_ for _ in ()).throw(ValueError("bad\nvalue")))

    cli.register_subcommand(failing)
    assert_one_line_error(capsys, run_main(["boom"]), "bad value")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory cap is Linux's RLIMIT_DATA")
def test_console_script_refuses_a_memo_bomb_at_once(tmp_path: Path) -> None:
    """9 bytes whose LONG_BINPUT names memo index 2**30 (CPython's C unpickler would zero 16 GiB for it): exit 2 and
    one line naming the pickle corrupt or hostile."""
    bomb = tmp_path / "bomb.pickle"
    bomb.write_bytes(b"\x80\x02]r" + (2**30).to_bytes(4, "little") + b".")
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from lightning_memtrace.cli import main; sys.exit(main())", "summary",
         str(bomb)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith(f"memtrace: error: {bomb}: corrupt or hostile pickle")


def test_console_script_refuses_hostile_pickle(tmp_path: Path) -> None:
    """The real entry point, in a subprocess: exit 2, one line, the command in the pickle never runs."""
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(Evil()))
    out = tmp_path / "r.html"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from lightning_memtrace.cli import main; sys.exit(main())",
            "report",
            str(evil),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("memtrace: error: ")
    assert "refused" in result.stderr and "posix.system" in result.stderr
    assert not marker.exists()
    assert not out.exists()


def test_summary_of_a_log_folder_with_only_the_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
    from lightning_memtrace.types import Phase, PhaseRecord

    folder = tmp_path / "memtrace"
    writer = PhaseCsvWriter(folder / "phases_rank0.csv")
    for step, peak in ((0, 5_000_000), (1, 7_340_032)):
        writer.write(
            PhaseRecord(
                step,
                0,
                step,
                0,
                Phase.AFTER_BACKWARD,
                1.7e9 + step,
                peak - 1000,
                peak * 2,
                peak,
                1000,
                2000,
                3000,
                4000,
                0,
                0,
            )
        )
    writer.close()
    assert run_main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per-phase peaks" in out
    assert "7.0 MiB" in out
    assert "highest peak in the phases table: 7.0 MiB (7,340,032 B) by after_backward of step 1 (rank 0)" in out
    assert "no snapshot in the folder" in out


def _recorded_run(folder: Path, width: int) -> Path:
    torch = pytest.importorskip("torch")
    from lm_helpers import record_plain_loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    record_plain_loop(model, optimizer, folder, 4, 16, history_skip_steps=1, history_steps=2)
    snapshots = sorted(folder.rglob("snapshot_rank0_*.pickle"))
    if not snapshots:
        pytest.skip("the recorder wrote no snapshot")
    return snapshots[0]


def test_diff_of_two_cpu_runs_names_sides_by_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13, point 7: equal file names are told apart by their folders; nothing reserved on CPU; human units."""
    monkeypatch.setenv("COLUMNS", "200")
    a = _recorded_run(tmp_path / "run_a", 128)
    b = _recorded_run(tmp_path / "run_b", 256)
    assert a.name == b.name
    assert run_main(["diff", str(tmp_path / "run_a"), str(tmp_path / "run_b")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("A = run_a/") and lines[0].endswith(a.name)
    assert lines[1].startswith("B = run_b/") and lines[1].endswith(b.name)
    assert "reserved" not in out
    peak_row = next(line for line in lines if "peak allocated" in line)
    assert "KiB (" in peak_row and " B)" in peak_row  # human units with the exact bytes, as summary shows them
    params_row = next(line for line in lines if " parameters " in line)
    assert "KiB (+" in params_row
    # memory allocated before the window is one site per category, named once (not "<...> (<...>)")
    before = [line for line in lines if "<allocated before recording>" in line]
    assert any("· parameters " in line for line in before)
    assert all(line.count("<allocated before recording>") == 1 for line in before)


def test_side_names() -> None:
    from lightning_memtrace.analysis.diff import side_names

    assert side_names(Path("/x/a.pickle"), Path("/y/b.pickle")) == ("a.pickle", "b.pickle")
    assert side_names(Path("/r/v0/memtrace/s.pickle"), Path("/r/v1/memtrace/s.pickle")) == (
        "v0/memtrace/s.pickle",
        "v1/memtrace/s.pickle",
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_memtrace import __version__

    assert run_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memtrace (lightning_memtrace) {__version__}"


def test_output_under_a_file_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    snapshot = str(snapshot_fixture("shreyansh26_profile_grad.pkl"))
    line = assert_one_line_error(capsys, run_main(["report", snapshot, "-o", str(afile / "x.html")]), "is a file")
    assert "File exists" not in line and str(afile) in line
    line = assert_one_line_error(
        capsys, run_main(["report", snapshot, "-o", str(tmp_path / "r.html"), "--png", str(afile / "t.png")])
    )
    assert "is a file, not a folder" in line
    assert_one_line_error(capsys, run_main(["report", snapshot, "-o", str(tmp_path)]), "is a folder")
    assert not (tmp_path / "r.html").exists()


def test_a_hostile_snapshot_cannot_drive_the_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Names in a snapshot are untrusted text: escape sequences in them are shown as ``\\x1b``, not written to the
    terminal (they could retitle it, recolour it, hide lines), and rich markup in them stays text."""
    name = "\x1b]0;owned\x07\x1b[31mred\x1b[0m[bold red]tag[/bold red]\x9b2J"
    frames = [{"filename": f"{name}.py", "line": 7, "name": name}]
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 4096, "stream": 0,
                                                    "frames": frames, "time_us": 1}]]}
    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    assert run_main(["summary", str(path), "--sites", "1"]) == 0
    out = capsys.readouterr().out
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in out)
    assert "[bold red]tag[/bold red]" in out and "\\x1b[31mred" in out


def test_a_phases_csv_without_a_complete_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of the table has a field that is no number (or the run died before its first row): one line for
    each command, not ``cannot convert float NaN to integer``; with a snapshot beside it, the snapshot's report."""
    from lightning_memtrace.types import PHASE_COLUMNS

    folder = tmp_path / "memtrace"
    folder.mkdir()
    row = {c: "1" for c in PHASE_COLUMNS} | {"phase": "batch_start", "run": "r", "allocated_bytes": "abc"}
    (folder / "phases_rank0.csv").write_text(",".join(PHASE_COLUMNS) + "\n" + ",".join(row[c] for c in PHASE_COLUMNS)
                                             + "\n")
    said = f"{folder}: its phases CSV has no complete row (a field missing or not a number)"
    for command in (["report", str(tmp_path), "-o", str(tmp_path / "r.html")], ["summary", str(tmp_path)],
                    ["diff", str(tmp_path), str(tmp_path)]):
        assert assert_one_line_error(capsys, run_main(command)) == f"memtrace: error: {said}"
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512, "frames": []}]]}
    (folder / "snapshot_rank0_steps1-2.pickle").write_bytes(pickle.dumps(snapshot, protocol=4))
    assert run_main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").is_file()


def test_an_error_line_quoting_a_hostile_pickle_shows_its_escapes(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal names the global the pickle asks for, which the file chose: its escape sequences are shown."""
    path = tmp_path / "escape.pickle"
    path.write_bytes(b"\x80\x02cos\x1b]0;owned\x07\nsystem\n.")
    line = assert_one_line_error(capsys, run_main(["summary", str(path)]), "Python object os\\x1b]0;owned\\x07.system")
    assert "\x1b" not in line and "\x07" not in line


@pytest.mark.parametrize("name", ["run [a]", "run *?", "run [!x]{1}"])
def test_a_log_folder_named_like_a_glob_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """The folder's name is a name: its files were looked up with the name read as a pattern (``[a]`` matched ``a``
    only), so a run under ``default_root_dir="run [a]"`` had "a directory without MemTrace files" and no report."""
    from lightning_memtrace import load_phases
    from lightning_memtrace.types import PHASE_COLUMNS

    folder = tmp_path / name / "memtrace"
    folder.mkdir(parents=True)
    row = {c: "1" for c in PHASE_COLUMNS} | {"phase": "batch_start", "run": "r", "time_s": "1.5"}
    (folder / "phases_rank0.csv").write_text(",".join(PHASE_COLUMNS) + "\n" + ",".join(row[c] for c in PHASE_COLUMNS)
                                             + "\n")
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512, "frames": []}]]}
    (folder / "snapshot_rank0_steps1-2.pickle").write_bytes(pickle.dumps(snapshot, protocol=4))
    assert len(load_phases(tmp_path / name)) == len(load_phases(folder)) == 1
    assert run_main(["summary", str(tmp_path / name)]) == 0
    assert run_main(["report", str(folder), "-o", str(tmp_path / "r.html")]) == 0
    assert "512" in (tmp_path / "r.html").read_text(encoding="utf-8")


def test_a_report_never_overwrites_its_input_or_another_snapshot(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``memtrace report snap.pickle -o snap.pickle`` (a slip of the shell's history) replaced the snapshot with the
    page; so would ``-o`` another snapshot or a phases table. A page over an older page is fine."""
    snapshot = pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                                 "frames": []}]]}, protocol=4)
    source, other, rows = tmp_path / "snap.pickle", tmp_path / "other.pkl", tmp_path / "phases_rank0.csv"
    saved = tmp_path / "saved.pt"  # torch.save's zip archive
    source.write_bytes(snapshot)
    other.write_bytes(snapshot)
    rows.write_text("step\n")
    saved.write_bytes(b"PK\x03\x04" + bytes(60))
    cases = [("-o", source, "it is the input"), ("--png", source, "it is the input"),
             ("-o", other, "it holds a snapshot"), ("-o", rows, "it holds a snapshot or MemTrace's rows"),
             ("-o", saved, "it holds a snapshot")]
    for flag, out, said in cases:
        assert_one_line_error(capsys, run_main(["report", str(source), flag, str(out)]), f"cannot write {out}: {said}")
    assert source.read_bytes() == other.read_bytes() == snapshot and rows.read_text() == "step\n"
    assert saved.read_bytes() == b"PK\x03\x04" + bytes(60)
    for _ in range(2):
        assert run_main(["report", str(source), "-o", str(tmp_path / "r.html")]) == 0
