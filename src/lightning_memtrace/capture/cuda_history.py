"""The CUDA caching allocator's history recording and OOM observer, guarded by what the installed torch has.

The raw (private) calls and their version guards are in :mod:`~lightning_memtrace.capture.torch_private`; this module
is what the recorder uses of them, and the one process-wide OOM observer that forwards to the recorders alive now.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from lightning_memtrace.capture import torch_private
from lightning_memtrace.capture.torch_private import (
    cuda_history_enabled,
    cuda_history_supported,
    cuda_oom_observer_attacher,
    cuda_snapshot,
    start_cuda_history,
    stop_cuda_history,
)

__all__ = [
    "add_cuda_oom_listener",
    "carry_allocation_tag",
    "cuda_history_enabled",
    "cuda_history_supported",
    "cuda_snapshot",
    "remove_cuda_oom_listener",
    "tag_allocations",
    "start_cuda_history",
    "stop_cuda_history",
]


# The allocator keeps its tag (``user_metadata``) per thread, and autograd runs a CUDA backward on a device thread of
# its own: a tag set on the training thread alone leaves every allocation of the backward untagged. The training
# thread's tag is carried to such a thread by hooks that run there (the loss's pre-hook, the saved-tensor unpack hook)
# and cleared there when that backward ends, so no tag outlives MemTrace's window on a thread it does not watch.
class _CarriedTag(threading.local):
    generation = -1


_tag = ""
_generation = 0
_tagging_thread: int | None = None
_carried = _CarriedTag()


def tag_allocations(text: str) -> bool:
    """Tag the CUDA allocations made from now on, on this thread and (through :func:`carry_allocation_tag`) on the
    threads autograd runs backward on. Returns whether this torch could tag them."""
    global _tag, _generation, _tagging_thread
    if not torch_private.set_allocation_metadata(text):
        return False
    _tag, _generation, _tagging_thread = text, _generation + 1, threading.get_ident()
    return True


def carry_allocation_tag(*_: Any) -> None:
    """Give the calling thread the tag of :func:`tag_allocations` if it lacks it (a hook's body: takes and returns
    nothing that matters), and clear it there when the running backward ends."""
    if _tagging_thread is None or _carried.generation == _generation or threading.get_ident() == _tagging_thread:
        return
    generation = _generation
    if not torch_private.set_allocation_metadata(_tag):
        return
    _carried.generation = generation
    torch_private.queue_backward_callback(_clear_carried_tag)


def _clear_carried_tag() -> None:
    if threading.get_ident() != _tagging_thread:
        torch_private.set_allocation_metadata("")
        _carried.generation = -1

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
