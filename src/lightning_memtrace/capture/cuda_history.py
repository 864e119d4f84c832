"""The CUDA caching allocator's history recording and OOM observer, guarded by what the installed torch has.

The raw (private) calls and their version guards are in :mod:`~lightning_memtrace.capture.torch_private`; this module
is what the recorder uses of them, and the one process-wide OOM observer that forwards to the recorders alive now.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning_memtrace.capture.torch_private import (
    cuda_history_supported,
    cuda_oom_observer_attacher,
    cuda_snapshot,
    set_allocation_metadata,
    start_cuda_history,
    stop_cuda_history,
)

__all__ = [
    "add_cuda_oom_listener",
    "cuda_history_supported",
    "cuda_snapshot",
    "remove_cuda_oom_listener",
    "set_allocation_metadata",
    "start_cuda_history",
    "stop_cuda_history",
]

# One process-wide observer forwards to the recorders alive now: torch offers no way to detach an observer.
_OOM_LISTENERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_OBSERVER_ATTACHED = False


def add_cuda_oom_listener(listener: Any) -> bool:
    """Call ``listener.on_cuda_oom(device, requested, device_allocated, device_free)`` when the allocator fails."""
    global _OBSERVER_ATTACHED
    attach = cuda_oom_observer_attacher()
    if attach is None:
        return False
    if not _OBSERVER_ATTACHED:
        attach(_observer)
        _OBSERVER_ATTACHED = True
    _OOM_LISTENERS.add(listener)
    return True


def remove_cuda_oom_listener(listener: Any) -> None:
    _OOM_LISTENERS.discard(listener)


def _observer(device: int, requested: int, device_allocated: int, device_free: int) -> None:
    for listener in list(_OOM_LISTENERS):
        try:
            listener.on_cuda_oom(device, requested, device_allocated, device_free)
        except Exception:  # raised inside the allocator's C++ callback, which cannot take it: the next listener goes on
            pass
