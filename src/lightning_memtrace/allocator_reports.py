"""The CPU allocator's own allocation reports, read through a PyTorch profiler session that records nothing else.

PyTorch's CPU allocator reports every allocation and free (address, size) to the profiler of the calling thread when
that profiler profiles memory. A session with no operator scopes, no shapes and no stacks records only those reports,
in C++, at no Python cost per operator; :class:`AllocatorReports` reads them at each measurement by closing the
session and opening the next one at once (under a paused garbage collector, so nothing is freed in between).

The session belongs to the thread that opened it and is given up to any profiler the user starts: a
``torch.profiler.profile`` opened later takes the thread over, which :meth:`AllocatorReports.drain` notices.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

#: (time in Unix nanoseconds, address, signed size: positive for an allocation, negative for a free)
AllocatorEvent = tuple[int, int, int]


class SessionLost(RuntimeError):
    """Another profiler took the thread's profiling session over: the reports since the last drain are lost."""


@functools.cache
def _profiler_api() -> tuple[Any, Any] | None:
    try:
        from torch._C import _autograd as autograd_api
        from torch._C import _profiler as profiler_api
    except ImportError:
        return None
    needed = {
        autograd_api: ("_prepare_profiler", "_enable_profiler", "_disable_profiler", "_profiler_enabled"),
        profiler_api: (
            "ProfilerConfig", "ProfilerState", "ProfilerActivity", "RecordScope", "_ExperimentalConfig",
            "_ExtraFields_Allocation",
        ),
    }
    if all(hasattr(module, name) for module, names in needed.items() for name in names):
        return autograd_api, profiler_api
    return None


def another_profiler_active() -> bool:
    """A profiler (``torch.profiler``, ``torch.autograd.profiler``, or a raw session) is recording on this thread."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return True
    api = _profiler_api()
    return api is not None and bool(api[0]._profiler_enabled())


def unavailable_reason() -> str | None:
    """Why allocator reports cannot be read here, or None when they can."""
    if _profiler_api() is None:
        return "this torch has no profiler API for allocator reports"
    if another_profiler_active():
        return "another profiler is recording on this thread"
    return None


def _accelerator_in_use() -> bool:
    """Whether this process has started an accelerator's allocator (whose reports a CPU session would also get)."""
    if torch.cuda.is_initialized():
        return True
    for name in ("xpu", "mps", "mtia"):
        module = getattr(torch, name, None)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is None:
            if name == "mps" and module is not None and torch.backends.mps.is_available():
                return True
            continue
        try:
            if is_initialized():
                return True
        except Exception:  # a backend that cannot answer: check each report's device
            return True
    return False


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to the null device (C++ logging writes there directly, not through ``sys.stderr``)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocatorReports:
    """One thread's CPU allocator reports, read in order.

    Call :meth:`start`, then :meth:`drain` whenever the reports so far are wanted, and :meth:`stop` at the end.
    """

    def __init__(self) -> None:
        api = _profiler_api()
        if api is None:
            raise RuntimeError("this torch has no profiler API for allocator reports")
        self._autograd, profiler = api
        self._config = profiler.ProfilerConfig(
            profiler.ProfilerState.KINETO, False, True, False, False, False, profiler._ExperimentalConfig()
        )
        self._activities = {profiler.ProfilerActivity.CPU}
        # A scope no training code opens: operators and record_function ranges stay unrecorded.
        self._scopes = {profiler.RecordScope.LITE_INTERPRETER}
        self._allocation_type = profiler._ExtraFields_Allocation
        self.active = False

    def start(self) -> None:
        if self.active:
            return
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        # The allocator logs a C++ warning on the first free (and every 1000th) of a block made before any session
        # ("Memory block of unknown size was allocated before the profiling started"): training frees such blocks
        # (made before MemTrace started) as a matter of course, so spend that first line here, where it says nothing.
        block = torch.empty(1, dtype=torch.uint8)
        self._open()
        self.active = True
        with _stderr_silenced():
            del block

    def _open(self) -> None:
        self._autograd._prepare_profiler(self._config, self._activities)
        self._autograd._enable_profiler(self._config, self._activities, self._scopes)

    def owned(self) -> bool:
        """The thread's profiling session is still this one (no user profiler took over)."""
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            return False
        return bool(self._autograd._profiler_enabled())

    def drain(self, reopen: bool = True) -> list[AllocatorEvent]:
        """The reports since the last drain, oldest first; the session goes on unless ``reopen`` is False.

        Raises:
            SessionLost: Another profiler took the session over (it is then no longer active here).
        """
        if not self.active:
            return []
        if not self.owned():
            self.active = False
            raise SessionLost("another profiler took over the profiling session")
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            result = self._autograd._disable_profiler()
            if reopen:
                self._open()
            else:
                self.active = False
        finally:
            if collecting:
                gc.enable()
        return self._events(result)

    def _events(self, result: Any) -> list[AllocatorEvent]:
        allocation_type = self._allocation_type
        out: list[AllocatorEvent] = []
        append = out.append
        if _accelerator_in_use():
            # Only then can the session hold other allocators' reports (reading a report's device costs a
            # microsecond, as much as the rest of it).
            for event in result.experimental_event_tree():
                fields = event.extra_fields
                if type(fields) is allocation_type and fields.device.type == "cpu":
                    append((event.start_time_ns, fields.ptr, fields.alloc_size))
        else:
            for event in result.experimental_event_tree():
                fields = event.extra_fields
                if type(fields) is allocation_type:
                    append((event.start_time_ns, fields.ptr, fields.alloc_size))
        if any(out[i][0] > out[i + 1][0] for i in range(len(out) - 1)):
            out.sort(key=lambda e: e[0])
        return out

    def stop(self) -> list[AllocatorEvent]:
        """The last reports; closes the session (if it is still this one)."""
        try:
            return self.drain(reopen=False)
        except SessionLost:
            return []
