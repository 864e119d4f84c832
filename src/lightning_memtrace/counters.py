"""Allocated / reserved / peak counters: from the device's allocator where it has them, else from the tracker."""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_memtrace.tracker import AllocationTracker


class MemoryCounters(Protocol):
    name: str

    def read(self) -> tuple[int, int, int]:
        """Return ``(allocated, reserved, peak since the last read)`` in bytes and start a new peak window."""
        ...


class CudaCounters:
    """The CUDA caching allocator's own counters. Reading resets the device's peak statistics."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> tuple[int, int, int]:
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        peak = max(torch.cuda.max_memory_allocated(self.device), allocated)
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated, reserved, peak


class AcceleratorCounters:
    """``torch.accelerator`` counters (MPS, XPU, ...) where the installed torch has them."""

    name = "accelerator"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._accel = torch.accelerator
        if hasattr(self._accel, "reset_peak_memory_stats"):
            self._accel.reset_peak_memory_stats(device)

    def read(self) -> tuple[int, int, int]:
        allocated = int(self._accel.memory_allocated(self.device))
        reserved = int(self._accel.memory_reserved(self.device)) if hasattr(self._accel, "memory_reserved") else allocated
        peak = allocated
        if hasattr(self._accel, "max_memory_allocated"):
            peak = max(peak, int(self._accel.max_memory_allocated(self.device)))
        if hasattr(self._accel, "reset_peak_memory_stats"):
            self._accel.reset_peak_memory_stats(self.device)
        return allocated, reserved, peak


class TrackerCounters:
    """Counters of an :class:`AllocationTracker`: reserved equals allocated (no caching allocator to reserve).

    The tracker is read as it stands: call its ``sync()`` first to take in the allocator's reports (the recorder does,
    once per row).
    """

    name = "tracker"

    def __init__(self, tracker: AllocationTracker) -> None:
        self.tracker = tracker

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
        except Exception:
            return None
    return None
