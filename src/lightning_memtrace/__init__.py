"""lightning_memtrace: where the memory of a PyTorch (Lightning) training run goes, phase by phase, and why.

Names are imported on first use, so that the ``memtrace`` command starts without importing torch or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "MemTrace": "lightning_memtrace.callback",
    "MemoryRecorder": "lightning_memtrace.capture.recorder",
    "MemTraceWarning": "lightning_memtrace.capture.recorder",
    "RecorderConfig": "lightning_memtrace.capture.config",
    "AllocationTracker": "lightning_memtrace.capture.tracker",
    "is_out_of_memory": "lightning_memtrace.capture.oom_errors",
    "load_phases": "lightning_memtrace.analysis.phases",
    "Category": "lightning_memtrace.types",
    "Phase": "lightning_memtrace.types",
    "PhaseRecord": "lightning_memtrace.types",
    "Stage": "lightning_memtrace.types",
    "write_report": "lightning_memtrace.report",
    "load_snapshot": "lightning_memtrace.analysis.loader",
    "SnapshotError": "lightning_memtrace.analysis.loader",
    "estimate": "lightning_memtrace.estimator",
    "estimate_for_module": "lightning_memtrace.estimator",
    "estimate_from_config": "lightning_memtrace.estimator",
    "find_max_batch": "lightning_memtrace.estimator",
    "compare_estimate": "lightning_memtrace.estimator",
    "Estimate": "lightning_memtrace.estimator",
    "ClosedForm": "lightning_memtrace.estimator",
    "InputSpec": "lightning_memtrace.estimator",
    "what_if": "lightning_memtrace.estimator.what_if",
    "what_if_result": "lightning_memtrace.estimator.what_if",
    "what_if_from_config": "lightning_memtrace.estimator.what_if",
    "WhatIf": "lightning_memtrace.estimator.what_if_results",
    "Remedy": "lightning_memtrace.estimator.remedies",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lightning_memtrace.callback import MemTrace
    from lightning_memtrace.estimator import (
        ClosedForm,
        Estimate,
        InputSpec,
        compare_estimate,
        estimate,
        estimate_for_module,
        estimate_from_config,
        find_max_batch,
    )
    from lightning_memtrace.estimator.remedies import Remedy
    from lightning_memtrace.estimator.what_if import what_if, what_if_from_config, what_if_result
    from lightning_memtrace.estimator.what_if_results import WhatIf
    from lightning_memtrace.capture.config import RecorderConfig
    from lightning_memtrace.analysis.phases import load_phases
    from lightning_memtrace.capture.recorder import MemoryRecorder, MemTraceWarning
    from lightning_memtrace.report import write_report
    from lightning_memtrace.analysis.loader import SnapshotError, load_snapshot
    from lightning_memtrace.capture.oom_errors import is_out_of_memory
    from lightning_memtrace.capture.tracker import AllocationTracker
    from lightning_memtrace.types import Category, Phase, PhaseRecord, Stage


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_memtrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
