"""The package's boundaries: reading snapshots never imports torch or Lightning; what a training run imports to
capture brings no pandas, plotly or matplotlib of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from shared_files import fixture_path

HEAVY_FOR_CAPTURE = ("pandas", "plotly", "matplotlib")


def _modules_after(code: str) -> set[str]:
    script = code + "\nimport sys\nprint(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return set(out.stdout.split("\n")[-2].split())


@pytest.mark.parametrize("command", ["report", "summary"])
def test_reading_a_snapshot_imports_no_torch(tmp_path: Path, command: str) -> None:
    snapshot = fixture_path("shreyansh26_profile_grad.pkl")
    extra = f", '-o', {str(tmp_path / 'r.html')!r}" if command == "report" else ""
    loaded = _modules_after(
        "import contextlib, io\n"
        "from lightning_memtrace.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main([{command!r}, {str(snapshot)!r}{extra}]) == 0"
    )
    assert "lightning_memtrace" in loaded
    assert not {"torch", "lightning", "pytorch_lightning"} & loaded


@pytest.mark.parametrize(
    "module",
    [
        "lightning_memtrace.capture",
        "lightning_memtrace.capture.phases_writer",
        "lightning_memtrace.capture.frames",
        "lightning_memtrace.capture.recorder",
    ],
)
def test_capture_imports_nothing_heavy(module: str) -> None:
    loaded = _modules_after(f"import {module}")
    assert not set(HEAVY_FOR_CAPTURE) & loaded


def test_post_mortem_text_imports_nothing_heavy() -> None:
    """The recorder writes the post-mortem during training: its text and view need no pandas."""
    loaded = _modules_after("import lightning_memtrace.analysis.postmortem, lightning_memtrace.analysis.view")
    assert not set(HEAVY_FOR_CAPTURE) & loaded and "torch" not in loaded
