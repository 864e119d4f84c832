"""MemTrace under sharded training on CUDA: FSDP2 (``ModelParallelStrategy``) and FSDP1 (``FSDPStrategy``).

Skipped without CUDA; FSDP2 runs over every GPU here up to two (one rank per GPU, nccl). The same script runs on CPU
with gloo in ``tests/test_fsdp2.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_helpers import launcher_env

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture.storages import unique_storage_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SCRIPT = Path(__file__).resolve().parents[1] / "fsdp2_run.py"


def _padded_bytes(shape: tuple[int, ...], world: int) -> int:
    """FSDP2 shards dim 0, padding it to a multiple of the world size; float32."""
    rows = math.ceil(shape[0] / world) * world
    return rows * math.prod(shape[1:]) * 4


def test_fsdp2_on_cuda_counts_local_shards_and_gathered_parameters(tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())
    env = launcher_env()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(world), "cuda"],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "switched itself off" not in output
    phases = load_phases(tmp_path / "memtrace")
    gathered = _padded_bytes((3, 65), world) + _padded_bytes((3,), world)  # the last Linear, kept gathered
    for rank in range(world):
        held = json.loads((tmp_path / f"local_rank{rank}.json").read_text())
        rows = phases[(phases["rank"] == rank) & (phases.step >= 1)]
        assert len(rows) == 10
        assert (rows.parameters_bytes == held["parameters"]).all()
        stepped = rows[rows.phase.isin(["after_optimizer_step", "batch_end"])]
        assert (stepped.gradients_bytes == held["gradients"]).all()
        assert (stepped.optimizer_state_bytes == held["optimizer_state"]).all()
        forward = rows.phase == "after_forward"
        assert (rows[forward].unsharded_parameters_bytes == gathered).all()
        assert (rows[~forward].unsharded_parameters_bytes == 0).all()
        assert (rows.reserved_bytes >= rows.allocated_bytes).all()


def test_fsdp1_on_one_gpu_stays_on_and_counts_the_flat_parameters(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy
    from lm_helpers import MLP

    module = MLP(width=256)
    callback = MemTrace(report=False)
    pl.Trainer(
        default_root_dir=str(tmp_path), accelerator="gpu", devices=1, strategy=FSDPStrategy(), max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback],
    ).fit(module)
    phases = load_phases(callback.output_dir)
    assert len(phases) == 15
    rows = phases[phases.step >= 1]
    held = unique_storage_bytes(p for p in module.parameters())  # FSDP1's flat parameter (one rank: all of it)
    assert held >= sum(p.numel() * 4 for p in MLP(width=256).parameters())
    assert (rows.parameters_bytes == held).all()
    assert (rows[rows.phase == "batch_end"].gradients_bytes == held).all()
    assert (rows[rows.phase == "batch_end"].optimizer_state_bytes == 2 * held).all()
    assert (rows.unsharded_parameters_bytes == 0).all()  # FSDP1's gathered parameters are not told apart
