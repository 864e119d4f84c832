"""lightning_memtrace: where the memory of a PyTorch (Lightning) training run goes, phase by phase, and why."""

from lightning_memtrace.callback import MemTrace
from lightning_memtrace.phases_csv import load_phases
from lightning_memtrace.recorder import MemoryRecorder, MemTraceWarning
from lightning_memtrace.tracker import AllocationTracker, is_out_of_memory
from lightning_memtrace.types import Category, Phase, PhaseRecord, Stage

__version__ = "0.1.0.dev0"

__all__ = [
    "AllocationTracker",
    "Category",
    "MemTrace",
    "MemTraceWarning",
    "MemoryRecorder",
    "Phase",
    "PhaseRecord",
    "Stage",
    "is_out_of_memory",
    "load_phases",
]
