"""``save_on_cpu`` in a step: on a CUDA target its copies are host memory, on a CPU target they are the run's own."""

from __future__ import annotations

import pytest
import torch

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.estimator import compare_phase_peaks, estimate_for_module
from lm_helpers import OffloadedStack, trainer

ROWS, WIDTH, LAYERS = 2048, 256, 8
HIDDEN = ROWS * WIDTH * 4  # one layer's output, float32


def _forward_row(est):
    return next(r for r in est.records if r.step == est.steady_step and r.phase.value == "after_forward")


@pytest.mark.parametrize("pin_memory", [True, False])
def test_offloaded_activations_leave_a_cuda_targets_memory(pin_memory):
    plain_module, offloaded_module = OffloadedStack(offload=False), OffloadedStack(True, pin_memory)
    batch = next(iter(plain_module.train_dataloader()))
    plain = estimate_for_module(plain_module, batch, device="cuda")
    offloaded = estimate_for_module(offloaded_module, batch, device="cuda")
    plain_row, offloaded_row = _forward_row(plain), _forward_row(offloaded)
    # Each Linear saves its input and each ReLU its output (the next Linear's input): the batch and 7 outputs, and
    # the last output, which the loss's pow saves outside save_on_cpu. Offloaded, only that last one stays.
    assert plain_row.activations_bytes == LAYERS * HIDDEN
    assert offloaded_row.activations_bytes == HIDDEN
    # no host copy (2 MiB each) left in other: only the caching allocator's rounding of blocks to 512 B
    assert offloaded_row.other_bytes - offloaded.blas_workspace_bytes < 16 * 1024
    assert plain_row.allocated_bytes - offloaded_row.allocated_bytes == (LAYERS - 1) * HIDDEN
    # backward brings each saved tensor back to the device as it needs it: far below the plain step's peak (16 layer
    # outputs and the parameters' bytes there, 9 offloaded)
    assert offloaded.peak_bytes < plain.peak_bytes - 6 * HIDDEN
    assert torch.autograd.graph.save_on_cpu.__init__.__name__ == "__init__"  # the class is as torch made it again


def test_on_a_cpu_target_the_copies_are_the_runs_own_memory(tmp_path):
    # On CPU save_on_cpu copies each saved tensor (pin_memory=True: into a new CPU tensor), on the same device: the
    # estimate counts them, as the real run does.
    module = OffloadedStack(offload=True, pin_memory=True)
    callback = MemTrace(estimate=True, what_if_budget_s=0, history=False, report=False)
    trainer(tmp_path, [callback], max_steps=3).fit(module)
    peaks = compare_phase_peaks(callback.estimated, load_phases(callback.output_dir))
    assert len(peaks) == 15
    assert (peaks.peak_bytes_estimated - peaks.peak_bytes_measured).abs().max() <= 256, peaks
    cuda = estimate_for_module(module, next(iter(module.train_dataloader())), device="cuda")
    assert callback.estimated.peak_bytes > cuda.peak_bytes - cuda.blas_workspace_bytes + 4 * HIDDEN
