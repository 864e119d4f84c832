"""Allocated / reserved / peak counters: from the device's allocator where it has them, else from the tracker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lightning_memtrace.capture.tracker import AllocationTracker


class MemoryCounters(Protocol):
    name: str
    #: Highest allocated bytes seen since the counters were made, including the peak the device's own statistics
    #: held then (reading resets those statistics, so this is where the run's true maximum stays available).
    max_allocated: int
    #: The same for reserved bytes.
    max_reserved: int

    def read(self) -> tuple[int, int, int]:
        """Return ``(allocated, reserved, peak since the last read)`` in bytes and start a new peak window."""
        ...


class CudaCounters:
    """The CUDA caching allocator's own counters.

    The allocator keeps one peak per device, and the only way to learn the peak of a phase is to reset it at the
    phase's start (``torch.cuda.reset_peak_memory_stats``): after a row, ``torch.cuda.max_memory_allocated()`` reads the
    peak since that row. :attr:`max_allocated` and :attr:`max_reserved` keep the maximum over the whole run, the peak
    the statistics held before the first reset included.
    """

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        _, _, self.max_allocated, self.max_reserved = self._stats()
        torch.cuda.reset_peak_memory_stats(device)

    def _stats(self) -> tuple[int, int, int, int]:
        """Allocated, reserved and their peaks, from one read of the allocator's statistics.

        ``torch.cuda.memory_allocated`` and its kin each build and sort the whole flattened statistics (~100 entries);
        four of them per row cost more than the rest of a row on a GPU step of a few milliseconds.
        """
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        return (
            int(allocated.get("current", 0)),
            int(reserved.get("current", 0)),
            int(allocated.get("peak", 0)),
            int(reserved.get("peak", 0)),
        )

    def read(self) -> tuple[int, int, int]:
        allocated, reserved, peak, peak_reserved = self._stats()
        peak = max(peak, allocated)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.max_allocated = max(self.max_allocated, peak)
        self.max_reserved = max(self.max_reserved, peak_reserved, reserved)
        return allocated, reserved, peak


class AcceleratorCounters:
    """``torch.accelerator`` counters (MPS, XPU, ...) where the installed torch has them."""

    name = "accelerator"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._accel = torch.accelerator
        self.max_allocated = self.max_reserved = 0
        if hasattr(self._accel, "max_memory_allocated"):
            self.max_allocated = int(self._accel.max_memory_allocated(device))
        if hasattr(self._accel, "max_memory_reserved"):
            self.max_reserved = int(self._accel.max_memory_reserved(device))
        if hasattr(self._accel, "reset_peak_memory_stats"):
            self._accel.reset_peak_memory_stats(device)

    def read(self) -> tuple[int, int, int]:
        allocated = int(self._accel.memory_allocated(self.device))
        reserved = allocated
        if hasattr(self._accel, "memory_reserved"):
            reserved = int(self._accel.memory_reserved(self.device))
        peak = allocated
        if hasattr(self._accel, "max_memory_allocated"):
            peak = max(peak, int(self._accel.max_memory_allocated(self.device)))
        peak_reserved = reserved
        if hasattr(self._accel, "max_memory_reserved"):
            peak_reserved = max(reserved, int(self._accel.max_memory_reserved(self.device)))
        if hasattr(self._accel, "reset_peak_memory_stats"):
            self._accel.reset_peak_memory_stats(self.device)
        self.max_allocated = max(self.max_allocated, peak)
        self.max_reserved = max(self.max_reserved, peak_reserved)
        return allocated, reserved, peak


class TrackerCounters:
    """Counters of an :class:`AllocationTracker`: reserved equals allocated (no caching allocator to reserve).

    The tracker is read as it stands: call its ``sync()`` first to take in the allocator's reports (the recorder does,
    once per row).
    """

    name = "tracker"

    def __init__(self, tracker: AllocationTracker) -> None:
        self.tracker = tracker

    @property
    def max_allocated(self) -> int:
        return self.tracker.max_allocated

    max_reserved = max_allocated

    def read(self) -> tuple[int, int, int]:
        tracker = self.tracker
        allocated, peak = tracker.counters()
        peak = max(peak, allocated)
        tracker.reset_peak()
        return allocated, allocated, peak


def allocator_has_counters(device: torch.device) -> bool:
    """Whether the device's allocator reports allocated bytes itself (CUDA, or torch.accelerator on MPS/XPU)."""
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type in ("cpu", "meta"):
        return False
    accel = getattr(torch, "accelerator", None)
    return accel is not None and hasattr(accel, "memory_allocated")


def allocator_counters(device: torch.device) -> MemoryCounters | None:
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaCounters(device)
    if allocator_has_counters(device):
        try:
            counters = AcceleratorCounters(device)
            counters.read()
            return counters
        except Exception:  # a backend whose counters cannot be read here: the tracker counts instead
            return None
    return None
