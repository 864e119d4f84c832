"""``--rule NAME=REGEX`` in ``memtrace summary``, ``report`` and ``diff``: rule categories everywhere a category shows,
bad rules one line with status 2."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from json_schema import DIFF, SUMMARY, check_shape
from rules_snapshots import synthetic
from shared_files import fixture_path

from lightning_memtrace.cli import main


def _run(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert _run(args) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    code = _run(args)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtrace: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.fixture
def synthetic_file(tmp_path: Path) -> Path:
    path = tmp_path / "synthetic.pickle"
    path.write_bytes(pickle.dumps(synthetic()))
    return path


def test_summary_json_rule_categories_exact(synthetic_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = run_json(
        capsys,
        [
            "summary",
            str(synthetic_file),
            "--json",
            "--sites",
            "100",
            "--rule",
            "kv_cache=cache_utils\\.py",
            "--rule",
            "attention=attn",
        ],
    )
    check_shape(obj, SUMMARY)
    assert obj["category_rules"] == {"kv_cache": "cache_utils\\.py", "attention": "attn"}
    (device,) = obj["devices"]
    assert device["categories"] == {"attention": 1064, "kv_cache": 300, "activations": 200}
    assert list(device["categories"]) == ["attention", "kv_cache", "activations"]  # largest first
    sums: dict[str, int] = {}
    for site in device["sites"]:
        sums[site["category"]] = sums.get(site["category"], 0) + site["bytes"]
    assert sums == device["categories"]
    # without rules: the plain inferred categories, and no rules
    plain = run_json(capsys, ["summary", str(synthetic_file), "--json"])
    assert plain["category_rules"] == {} and plain["devices"][0]["categories"] == {
        "activations": 1500,
        "pre_existing": 64,
    }


def test_summary_text_and_report_show_rule_categories(
    synthetic_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    assert (
        _run(["summary", str(synthetic_file), "--rule", "kv_cache=cache_utils\\.py", "--rule", "attention=attn"]) == 0
    )
    out = capsys.readouterr().out
    assert "category rules" in out and "kv_cache=cache_utils\\.py, attention=attn" in out
    assert "│ attention " in out and "1,064" in out and "│ kv_cache " in out
    html_path = tmp_path / "r.html"
    assert _run(["report", str(synthetic_file), "-o", str(html_path), "--rule", "kv_cache=cache_utils"]) == 0
    html = html_path.read_text(encoding="utf-8")
    assert "User rules for categories" in html and "<code>kv_cache=cache_utils</code>" in html
    assert 'style="background:#e377c2"></span>kv_cache' in html  # the first rule colour, in the table's swatch
    assert html.count("#e377c2") >= 2  # and in the chart
    assert '"kv_cache"' in html  # in the embedded JSON summary's peak_by_category


def test_diff_json_and_text_with_rules(
    synthetic_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = synthetic()
    other["device_traces"][0].pop()  # B without the mlp.py allocation
    b = tmp_path / "b.pickle"
    b.write_bytes(pickle.dumps(other))
    obj = run_json(capsys, ["diff", str(synthetic_file), str(b), "--json", "--rule", "attention=attn"])
    check_shape(obj, DIFF)
    rows = {r["category"]: (r["a"], r["b"], r["delta"]) for r in obj["categories"]}
    assert rows == {"activations": (200, 0, -200), "attention": (1364, 1364, 0)}
    assert obj["a"]["categories"] == {"attention": 1364, "activations": 200}
    assert _run(["diff", str(synthetic_file), str(b), "--rule", "attention=attn"]) == 0
    assert "attention" in capsys.readouterr().out


def test_bad_rule_is_one_line_exit_2(synthetic_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(synthetic_file)
    for command in (
        ["summary", path],
        ["summary", path, "--json"],
        ["report", path, "-o", str(tmp_path / "x.html")],
        ["diff", path, path],
    ):
        line = one_line_error(capsys, [*command, "--rule", "attention=attn(", "--rule", "ok=x"])
        assert "argument --rule: rule 'attention': bad regular expression 'attn(': missing )" in line
        assert "noequals" in one_line_error(capsys, [*command, "--rule", "noequals"])
    assert not (tmp_path / "x.html").exists()


def test_fixture_rule_category_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """MAGMA27: the bytes of ``attention=attention`` at the peak (computed from the raw trace in
    tests/analysis/test_category_rules.py), and the sites still add up to the categories."""
    path = str(fixture_path("MAGMA27_assignment2_memory_snapshot.pickle"))
    obj = run_json(capsys, ["summary", path, "--json", "--sites", "1000000", "--rule", "attention=attention"])
    (device,) = obj["devices"]
    assert device["categories"]["attention"] == 2_732_064_768
    assert sum(device["categories"].values()) == device["peak_bytes"]
    sums: dict[str, int] = {}
    for site in device["sites"]:
        sums[site["category"]] = sums.get(site["category"], 0) + site["bytes"]
    assert {c: b for c, b in sums.items() if b} == device["categories"]


def test_readme_rules_excerpt_is_real_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``--rule`` excerpt (its categories and sites tables) is what the command prints, 120 columns wide."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("$ memtrace summary MAGMA27_assignment2_memory_snapshot.pickle --sites 4 --rule") :]
    command, _, rest = block.partition("\n")
    documented = [line.rstrip() for line in rest[: rest.index("```")].strip("\n").splitlines()]
    path = fixture_path("MAGMA27_assignment2_memory_snapshot.pickle")
    monkeypatch.chdir(path.parent)
    monkeypatch.setenv("COLUMNS", "120")
    assert _run(command.split()[2:]) == 0
    actual = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    start = actual.index(documented[0])
    assert actual[start : start + len(documented)] == documented
