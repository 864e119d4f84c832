"""MemTrace under FSDP2 (Lightning's ModelParallelStrategy, 2 processes, gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_memtrace import load_phases

SCRIPT = Path(__file__).resolve().parent / "fsdp2_run.py"


def test_fsdp2_two_ranks_stay_on_and_count_their_local_shards(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "2"], capture_output=True, text=True, timeout=240, env=env,
        cwd=str(tmp_path),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "switched itself off" not in output
    folder = tmp_path / "memtrace"
    assert sorted(p.name for p in folder.glob("phases_rank*.csv")) == ["phases_rank0.csv", "phases_rank1.csv"]
    assert sorted(p.name for p in folder.glob("snapshot_*.pickle")) == [
        "snapshot_rank0_steps1-2.pickle", "snapshot_rank1_steps1-2.pickle",
    ]
    phases = load_phases(folder)
    for rank in (0, 1):
        held = json.loads((tmp_path / f"local_rank{rank}.json").read_text())
        # the local shards (padding included) are about half of the full parameters, never all of them
        assert held["full_parameters"] / 2 <= held["parameters"] < held["full_parameters"]
        rows = phases[(phases["rank"] == rank) & (phases.step >= 1)]
        assert len(rows) == 10
        assert (rows.parameters_bytes == held["parameters"]).all()
        stepped = rows[rows.phase.isin(["after_optimizer_step", "batch_end"])]
        assert (stepped.gradients_bytes == held["gradients"]).all()
        assert (stepped.optimizer_state_bytes == held["optimizer_state"]).all()
        assert (rows.allocated_bytes >= rows.parameters_bytes + rows.optimizer_state_bytes).all()
        # the last layer stays gathered from forward to backward (reshard_after_forward=False): at after_forward its
        # full parameters, padded to 2 rows per rank, are alive: weight 4 x 65 and bias 4, float32
        forward = rows.phase == "after_forward"
        assert (rows[forward].unsharded_parameters_bytes == (4 * 65 + 4) * 4).all()
        assert (rows[~forward].unsharded_parameters_bytes == 0).all()
        assert (rows.unsharded_gradients_bytes == 0).all()  # reduce-scattered before every row
    # the report's findings say what resharding after forward would change
    from lightning_memtrace.analysis.findings import phase_findings

    finding = next(f for f in phase_findings(phases) if f.code == "reshard_after_forward")
    assert finding.numbers["unsharded_parameters_bytes"] == 1056 and "reshard_after_forward=True" in finding.message
