"""MemTrace under real 2-process DDP (gloo on CPU): per-rank files, rank maxima, one rank dying of OOM."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from lm_helpers import launcher_env
from test_console import CPP_LINE

from lightning_memtrace import load_phases

SCRIPT = Path(__file__).resolve().parent / "ddp_run.py"


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    env = launcher_env()
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), mode],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path),
    )


def test_ddp_two_ranks_write_their_own_files_and_rank_zero_logs_maxima(tmp_path):
    result = _run(tmp_path, "normal")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in (result.stdout + result.stderr).splitlines() if CPP_LINE.search(line)]
    folder = tmp_path / "logs" / "version_0" / "memtrace"
    assert sorted(p.name for p in folder.glob("phases_rank*.csv")) == ["phases_rank0.csv", "phases_rank1.csv"]
    assert sorted(p.name for p in folder.glob("snapshot_*.pickle")) == [
        "snapshot_rank0_steps1-2.pickle", "snapshot_rank1_steps1-2.pickle",
    ]
    phases = load_phases(folder)
    assert sorted(phases["rank"].unique()) == [0, 1]
    assert (phases.groupby("rank").size() == 15).all()
    rank0 = phases[phases["rank"] == 0].set_index(["step", "phase"])
    rank1 = phases[phases["rank"] == 1].set_index(["step", "phase"])
    # same model and optimizer on both ranks: the same parameter and optimizer-state bytes
    assert (rank0.parameters_bytes == rank1.parameters_bytes).all()
    assert (rank0.optimizer_state_bytes == rank1.optimizer_state_bytes).all()

    maxima = json.loads((tmp_path / "rank_maxima.json").read_text())
    assert maxima["memtrace/after_forward/allocated_max_rank"] == 1.0  # rank 1 holds 1 MiB more
    assert maxima["memtrace/after_forward/allocated_max"] == pytest.approx(
        rank1.loc[(2, "after_forward"), "allocated_bytes"] / 1024**2
    )
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert any(r.get("memtrace/after_optimizer_step/optimizer_state_max_rank") for r in rows)


def test_ddp_one_rank_out_of_memory(tmp_path):
    result = _run(tmp_path, "oom")
    assert result.returncode != 0
    assert not [line for line in (result.stdout + result.stderr).splitlines() if CPP_LINE.search(line)]
    folder = tmp_path / "logs" / "version_0" / "memtrace"
    assert sorted(p.name for p in folder.glob("oom_*")) == ["oom_rank1_step1.pickle", "oom_rank1_step1.txt"]
    text = (folder / "oom_rank1_step1.txt").read_text()
    assert "(rank 1)" in text and "(1,000,000,000,000,000 B)" in text
    # the other rank's files are whole: every line of its CSV parses, no temporary file is left
    for rank in (0, 1):
        lines = (folder / f"phases_rank{rank}.csv").read_text().splitlines()
        assert all(line.count(",") == 18 for line in lines)  # 19 columns: the two unsharded ones, then dataloader_idx
    assert not list(folder.glob(".*.tmp"))
    phases = load_phases(folder)
    assert set(phases[phases["rank"] == 1].step) == {0, 1}
