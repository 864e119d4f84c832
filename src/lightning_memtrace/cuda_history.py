"""The CUDA caching allocator's history recording and OOM observer, guarded by what the installed torch has."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch


def cuda_history_supported() -> bool:
    memory = getattr(torch.cuda, "memory", None)
    return (
        torch.cuda.is_available()
        and memory is not None
        and hasattr(memory, "_record_memory_history")
        and hasattr(memory, "_snapshot")
    )


def start_cuda_history(max_entries: int) -> None:
    """Record alloc/free events with Python stacks into a ring buffer of ``max_entries`` events."""
    record = torch.cuda.memory._record_memory_history
    parameters = inspect.signature(record).parameters
    if "enabled" in parameters and "stacks" in _impl_parameters():
        record(enabled="all", context="all", stacks="python", max_entries=max_entries)
    elif "enabled" in parameters:
        record(enabled="all", max_entries=max_entries)
    else:  # torch < 2.1: the legacy boolean signature
        record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=True)


def _impl_parameters() -> dict[str, Any]:
    impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    return dict(inspect.signature(impl).parameters) if impl is not None else {}


def stop_cuda_history() -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except TypeError:
        torch.cuda.memory._record_memory_history(False)


def cuda_snapshot() -> dict[str, Any]:
    return torch.cuda.memory._snapshot()


def set_allocation_metadata(text: str) -> bool:
    """Tag the CUDA allocations made from now on (``user_metadata`` in snapshots) where torch supports it."""
    setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
    if setter is None or not torch.cuda.is_available():
        return False
    try:
        setter(text)
        return True
    except Exception:
        return False


# One process-wide observer forwards to the recorders alive now: torch offers no way to detach an observer.
_OOM_LISTENERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_OBSERVER_ATTACHED = False


def add_cuda_oom_listener(listener: Any) -> bool:
    """Call ``listener.on_cuda_oom(device, requested, device_allocated, device_free)`` when the allocator fails."""
    global _OBSERVER_ATTACHED
    attach: Callable[..., Any] | None = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
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
        except Exception:
            pass
