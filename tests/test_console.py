"""Nothing on the console that the user did not ask for: a run with MemTrace prints what the same run without it
prints, and no C++ log line (kineto, profiler stages, allocator warnings), on every path.

Each run is a fresh process whose real file descriptors 1 and 2 are captured (C++ logging writes to fd 2 directly).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from lm_helpers import launcher_env

SCRIPT = Path(__file__).resolve().parent / "console_run.py"
CPP_LINE = re.compile(
    r"USDT:|STAGE:|INFO:\d|SyncActivityProfilerHandler|ActivityProfiler|libkineto|profiler_(start|stop)"
    r"|Memory block of unknown size|collection\.cpp|^\[[WIE]\d{4} "
)
# Lines that differ between two runs of the same script whatever they do: times (to the second: kineto's own lines,
# such as a CUDA build's "gpuGetDeviceCount failed" under the user's profiler on a machine without a GPU), speeds,
# temporary paths, version folders (a second run writes version_1), progress-bar redraws.
_VOLATILE = re.compile(r"\d+(\.\d+)?(it/s|s/it)|\d\d:\d\d(:\d\d)?|/tmp/\S+|version_\d+|\d+\.\d+e?-?\d*|\d+:\d+ ")
# The process id in glog-style lines (``W1203 14:09:25.537000 14303 torch/utils/_pytree.py:630] ...``).
_GLOG_PID = re.compile(r"(?<=\d) \d+ (?=\S+\.py:\d+\])")
# The report of a user's own profiler measures the run, MemTrace's work included: its rows are not compared.
_PROFILER_TABLE = re.compile(r"%|^-{8,}|Profiler Report|Self CPU|CPU time total")


def _run(tmp_path: Path, mode: str, steps: int, memtrace: bool) -> tuple[int, list[str]]:
    out = tmp_path / f"{mode}_{steps}_{'memtrace' if memtrace else 'bare'}"
    env = launcher_env()
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="default")
    args = [sys.executable, str(SCRIPT), str(out), mode, str(steps)] + (["memtrace"] if memtrace else [])
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    text = (result.stdout + "\n" + result.stderr).replace("\r", "\n")
    return result.returncode, [line for line in text.splitlines() if line.strip()]


def _memtrace_own(line: str) -> bool:
    """A line of MemTrace's own Python warnings (once per condition), which are allowed."""
    return "MemTrace" in line or "lightning_memtrace" in line


#: The line of carets Python (3.13 more often than 3.11) prints under a traceback's source line.
_CARETS = re.compile(r"^\s*[~^]+\s*$")


def _without_memtrace_frames(lines: list[str]) -> list[str]:
    """Drop MemTrace's lines, and in a traceback the source line (and its carets) under a frame of MemTrace's (its
    dispatch mode runs in the history window, so an error raised by an operator there passes through it)."""
    out, skip_source = [], False
    for line in lines:
        if _memtrace_own(line):
            skip_source = line.lstrip().startswith("File ")
            continue
        if skip_source and (line.startswith("    ") or _CARETS.match(line)):
            continue
        skip_source = False
        out.append(line)
    return out


def _normalized(lines: list[str]) -> set[str]:
    # Progress-bar redraws depend on timing: which frames reach the pipe varies from run to run.
    return {
        _VOLATILE.sub("#", _GLOG_PID.sub(" # ", line)).strip()
        for line in lines
        if "━" not in line and not _PROFILER_TABLE.search(line) and not CPP_LINE.search(line)
    }


@pytest.mark.parametrize("mode", ["fit", "oom", "profiler", "resume", "rounds"])
def test_memtrace_adds_no_console_line(tmp_path, mode):
    bare_code, bare = _run(tmp_path, mode, 4, memtrace=False)
    code, lines = _run(tmp_path, mode, 4, memtrace=True)
    assert code == bare_code
    assert not [line for line in bare if CPP_LINE.search(line)] or mode == "profiler"
    cpp = [line for line in lines if CPP_LINE.search(line)]
    bare_cpp = [line for line in bare if CPP_LINE.search(line)]
    assert len(cpp) == len(bare_cpp), cpp[:5]  # the user's own profiler may log; MemTrace adds nothing to it
    extra = _normalized(_without_memtrace_frames(lines)) - _normalized(bare)
    assert not extra, sorted(extra)[:10]


def test_no_line_per_step(tmp_path):
    _, short = _run(tmp_path, "fit", 3, memtrace=True)
    _, long = _run(tmp_path, "fit", 12, memtrace=True)
    assert not [line for line in long if CPP_LINE.search(line)]
    assert len([line for line in long if _memtrace_own(line)]) == len([line for line in short if _memtrace_own(line)])
