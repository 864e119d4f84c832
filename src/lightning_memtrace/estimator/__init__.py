"""Know before you run whether a training step fits: real training steps on fake tensors, measured by MemTrace.

:func:`estimate` copies a module onto fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no data, no real
memory), builds its optimizer on the fake parameters and runs a few training steps in Lightning's order::

    batch_start -> forward -> zero_grad (set_to_none) -> backward -> optimizer step -> batch_end

with the same :class:`~lightning_memtrace.capture.recorder.MemoryRecorder` and
:class:`~lightning_memtrace.capture.tracker.AllocationTracker` that the :class:`~lightning_memtrace.MemTrace` callback uses on a
real run. So the estimate is a measurement of the real code path (the model's own forward, autograd's saved tensors,
the optimizer's own update), not a formula, and its rows have the same phases, categories and ``peak_bytes``
semantics as the callback's CSV.

Beside the measured figures, :class:`ClosedForm` holds the textbook ones (N·P parameters, N·P gradients, 2·N·P for
Adam/AdamW, N·P for SGD with momentum).

Fake tensors keep no storage of their own: the tracker counts them on the ``meta`` device (their storages' device),
while the recorder's category counter matches their fake device. Where the target is CUDA and this machine has no CUDA,
the steps run on fake CPU tensors with CUDA's defaults emulated (foreach optimizers, ``step`` tensors on the host, not
counted, autocast on CUDA's op lists, cuBLAS's workspaces: see :func:`estimate`), and for any CUDA target the rows'
allocated, reserved and peak bytes are what CUDA's caching allocator would count (``modelled_cuda``).

Modules, in the order the data flows:

- ``inputs``: precision, optimizer names, the batch as tensors or :class:`InputSpec` shapes;
- ``fake``: modules and batches copied onto fake tensors (the private torch entry points);
- ``meta_recorder``: MemTrace's recorder counting fake tensors;
- ``attention``: SDPA's kernel on fake tensors, watched (and, for a CUDA target on CPU, stood in for);
- ``cuda_autocast``: CUDA's autocast op lists on the CPU tensors standing in for CUDA ones;
- ``blas_workspace``: cuBLAS's workspaces, one per thread that runs products, in a CUDA target's estimate;
- ``modelled_cuda``: a CUDA target's counters from the caching allocator's model
  (:mod:`~lightning_memtrace.analysis.caching_allocator`) that the fake run's allocations drive;
- ``allocator_log``: those requests and frees served again, under a capacity, other settings, and past the estimated
  steps until the allocator's state repeats;
- ``loop``: Lightning's automatic optimization loop, step for step, with the recorder's rows;
- ``run``: :func:`estimate` and :func:`estimate_for_module`;
- ``config``: a Hugging Face causal LM from its config on the meta device, :func:`estimate_from_config`;
- ``closed_form``: the textbook figures; ``result``: :class:`Estimate`, its table and JSON;
- ``search``: :func:`find_max_batch`; ``compare``: an estimate beside a real run;
- ``remedies``: what-if remedies (:class:`~.remedies.Remedy`), their prices and how each is applied;
- ``what_if``: each remedy estimated, the cheapest combination that fits (:func:`~.what_if.what_if`).
"""

from __future__ import annotations

from lightning_memtrace.estimator.closed_form import ClosedForm, closed_form
from lightning_memtrace.estimator.compare import (
    compare_estimate,
    compare_phase_peaks,
    comparison_path,
    comparison_text,
    write_comparison_csv,
)
from lightning_memtrace.estimator.config import AttentionUnavailableError, build_meta_model, estimate_from_config
from lightning_memtrace.estimator.inputs import InputSpec, OptimizerName, Precision, lm_batch
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.estimator.run import estimate, estimate_for_module
from lightning_memtrace.estimator.search import MaxBatchResult, find_max_batch

__all__ = [
    "AttentionUnavailableError",
    "ClosedForm",
    "Estimate",
    "InputSpec",
    "MaxBatchResult",
    "OptimizerName",
    "Precision",
    "build_meta_model",
    "closed_form",
    "compare_estimate",
    "compare_phase_peaks",
    "comparison_path",
    "comparison_text",
    "estimate",
    "estimate_for_module",
    "estimate_from_config",
    "find_max_batch",
    "lm_batch",
    "write_comparison_csv",
]
