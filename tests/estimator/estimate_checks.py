"""Shared by the estimator's tests: a real CPU run measured by MemTrace, and the estimate checked against it."""

from __future__ import annotations


import pandas as pd
from lm_helpers import trainer

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.estimator import Estimate, compare_phase_peaks
from lightning_memtrace.models import TINY_QWEN2_CONFIG

from shared_files import CONFIGS  # noqa: F401  (the tests import it from here)
PHASES = ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]
EXACT = ["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "inputs_bytes"]
TINY_PARAM_BYTES = 13_714_432
TINY_PARAM_TENSORS = 50  # distinct parameter tensors of the tiny Qwen2 (one float32 `step` each on CPU)
MLP_PARAM_BYTES = (32 * 128 + 128 + 128 * 128 + 128 + 128 + 1) * 4
ONE_LAYER = dict(TINY_QWEN2_CONFIG, num_hidden_layers=1)
ONE_LAYER_PARAM_BYTES = 5_002_240  # 1,250,560 parameters, tied embeddings once
ONE_LAYER_TENSORS = 14


def real_run(tmp_path, module, max_steps: int = 3, allocation_backend: str = "dispatch", **kwargs) -> pd.DataFrame:
    # The estimate runs on fake tensors and sees storages; the storage-level (dispatch) tracker measures the same
    # thing on the real run. The default CPU tracker ("auto") also counts temporaries inside operators.
    callback = MemTrace(history=False, allocation_backend=allocation_backend)
    trainer(tmp_path, [callback], max_steps=max_steps, **kwargs).fit(module)
    return load_phases(callback.output_dir)


def check_against_real(est: Estimate, phases: pd.DataFrame) -> pd.DataFrame:
    """Per (step, phase): categories exact to the byte, peak within 3%; returns the per-phase peak comparison."""
    est_rows = est.to_dataframe()
    real = phases[phases.phase.isin(PHASES)]
    merged = pd.merge(est_rows, real, on=["step", "batch_idx", "phase"], suffixes=("_est", "_real"))
    assert len(merged) == len(real) == len(est_rows)
    for column in EXACT:
        assert (merged[f"{column}_est"] == merged[f"{column}_real"]).all(), column
    peaks = compare_phase_peaks(est, phases)
    assert len(peaks) == len(real)
    assert (peaks.error_percent.abs() <= 3.0).all(), peaks
    return peaks
