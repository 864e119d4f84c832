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
import ctypes
import functools
import gc
import operator
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

#: (time in Unix nanoseconds, address, signed size: positive for an allocation, negative for a free)
AllocatorEvent = tuple[int, int, int]
_EXTRA_FIELDS = operator.attrgetter("extra_fields")
_START_NS = operator.attrgetter("start_time_ns")
_PTR = operator.attrgetter("ptr")
_SIZE = operator.attrgetter("alloc_size")


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


def track_every_cpu_block() -> None:
    """Note every CPU block's size from now on (see :meth:`_NativeLogging.track_every_cpu_block`), where possible.

    Called as early as MemTrace is made, so that blocks of the model and data made afterwards are known to a later
    session.
    """
    native = _native_logging()
    if native is not None:
        native.track_every_cpu_block()


def unavailable_reason() -> str | None:
    """Why allocator reports cannot be read here, or None when they can."""
    if _profiler_api() is None:
        return "this torch has no profiler API for allocator reports"
    if _native_logging() is None:
        return "this torch does not export the C++ log levels that keep a reports session off the console"
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


class _NativeLogging:
    """The C++ log levels that a reports session would otherwise write to the console through.

    Kineto, the profiler library under the session, logs each start and stop of a trace ("profiler_start",
    "Completed Stage: ...") at levels that its own setting never hides; the CPU allocator logs one warning for the
    first (and every 1000th) free of a block it has no size for. Both levels are plain integers exported by torch's
    shared libraries: raising them for the few microseconds of MemTrace's own calls, on its own thread, silences
    exactly those lines and nothing that anyone else logs.
    """

    #: Above every kineto and c10 severity.
    SILENT = 1000

    def __init__(self, kineto_severity: ctypes.c_int, c10_log_level: ctypes.c_int, report_cpu: ctypes.c_bool) -> None:
        self._kineto = kineto_severity
        self._c10 = c10_log_level
        self._report_cpu = report_cpu
        #: Whether this process has spent the CPU allocator's first "unknown size" warning (it logs the 1st, 1001st, ...).
        self.unknown_free_warning_spent = False

    @contextlib.contextmanager
    def kineto_silenced(self) -> Iterator[None]:
        kineto = self._kineto
        previous = kineto.value
        kineto.value = self.SILENT
        try:
            yield
        finally:
            if kineto.value != self.SILENT:
                # The first session of the process initialized kineto inside the call, which set kineto's own level
                # (what the user's profilers get from now on): keep that one.
                previous = kineto.value
            kineto.value = previous

    @contextlib.contextmanager
    def c10_silenced(self) -> Iterator[None]:
        c10 = self._c10
        previous = c10.value
        c10.value = self.SILENT
        try:
            yield
        finally:
            c10.value = previous

    def track_every_cpu_block(self) -> None:
        """Have the CPU allocator note every block's size from now on, on every thread, also while no session records.

        The allocator warns (on the 1st, 1001st, ... occasion) when a session sees a block freed whose size it never
        noted: a block made while no session was open, such as one of an earlier run in the same process. Noting
        every block costs the allocator a table insert per allocation; it stays on for the rest of the process, since
        a block made while it is off is unknown whenever it is freed. Once on, the allocator checks every free, session
        or not: the first warning is spent here, silenced, on a block made for the purpose. The allocator also logs
        each block at INFO level then, so it is never turned on where the C++ log level shows INFO lines.
        """
        if self._report_cpu.value or self._c10.value <= 0:
            return
        self._report_cpu.value = True
        self.spend_unknown_free_warning()

    def spend_unknown_free_warning(self) -> None:
        """Free an unknown block, silenced, once per process: the allocator's first "unknown size" warning is spent.

        The allocator checks a free only while it notes blocks or a session records: call it in one of those states.
        """
        if self.unknown_free_warning_spent:
            return
        self.unknown_free_warning_spent = True
        block = self.unknown_block()
        with self.c10_silenced():
            del block

    def unknown_block(self) -> torch.Tensor:
        """A block whose size the CPU allocator does not note (freeing it under a session is an "unknown" free)."""
        previous = self._report_cpu.value
        self._report_cpu.value = False
        try:
            return torch.empty(1, dtype=torch.uint8)
        finally:
            self._report_cpu.value = previous


def _library(name: str) -> ctypes.CDLL | None:
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for pattern in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        path = os.path.join(folder, pattern)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


@functools.cache
def _native_logging() -> _NativeLogging | None:
    torch_cpu, c10 = _library("torch_cpu"), _library("c10")
    if torch_cpu is None or c10 is None:
        return None
    try:
        return _NativeLogging(
            ctypes.c_int.in_dll(torch_cpu, "_ZN9libkineto6Logger14severityLevel_E"),
            ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level"),
            ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage"),
        )
    except (ValueError, OSError):
        return None


def _quiet_activity(profiler: Any) -> Any:
    """A profiler activity whose device this machine does not use.

    Memory reports come with any activity; with CPU's, the session would also hook every operator and build a trace
    of them when it closes (twice the cost).
    """
    for name, module_name in (("MTIA", "mtia"), ("HPU", "hpu"), ("PrivateUse1", None), ("XPU", "xpu")):
        activity = getattr(profiler.ProfilerActivity, name, None)
        if activity is None:
            continue
        module = getattr(torch, module_name, None) if module_name else None
        try:
            in_use = bool(module is not None and module.is_available())
        except Exception:
            in_use = True
        if module_name is None:
            in_use = torch._C._get_privateuse1_backend_name() != "privateuseone"
        if not in_use:
            return activity
    return profiler.ProfilerActivity.CPU


class AllocatorReports:
    """One thread's CPU allocator reports, read in order.

    Call :meth:`start`, then :meth:`drain` whenever the reports so far are wanted, and :meth:`stop` at the end.
    """

    def __init__(self) -> None:
        api = _profiler_api()
        native = _native_logging()
        if api is None or native is None:
            raise RuntimeError(unavailable_reason() or "allocator reports are unavailable")
        self._autograd, profiler = api
        self._native = native
        self._config = profiler.ProfilerConfig(
            profiler.ProfilerState.KINETO, False, True, False, False, False, profiler._ExperimentalConfig()
        )
        self._activities = {_quiet_activity(profiler)}
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
        # Training frees blocks made before MemTrace started as a matter of course, and the allocator warns on the
        # first such free (see _NativeLogging.track_every_cpu_block, which spends that warning where it can).
        native = self._native
        native.track_every_cpu_block()
        self._open()
        self.active = True
        native.spend_unknown_free_warning()

    def _open(self) -> None:
        # Two silenced calls: kineto's first use in the process sets its own level inside the first one.
        with self._native.kineto_silenced():
            self._autograd._prepare_profiler(self._config, self._activities)
        with self._native.kineto_silenced():
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
            with self._native.kineto_silenced(), self._native.c10_silenced(), warnings.catch_warnings():
                # An out-of-memory report has no kineto event to pair with (the session traces no CPU operators):
                # torch warns about exactly that, in C++ or as a Python warning.
                warnings.filterwarnings("ignore", message="Failed to recover relationship between all profiler")
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
        tree = result.experimental_event_tree()
        # Reading a field of an event costs a C++ call each: map them at C speed, a field at a time.
        fields = list(map(_EXTRA_FIELDS, tree))
        if not all(type(f) is allocation_type for f in fields) or _accelerator_in_use():
            # Other events (a record_function range) or other allocators' reports: keep the CPU allocations only.
            check_device = _accelerator_in_use()
            kept = [
                (event, f)
                for event, f in zip(tree, fields)
                if type(f) is allocation_type and (not check_device or f.device.type == "cpu")
            ]
            tree, fields = [event for event, _ in kept], [f for _, f in kept]
        out = list(zip(map(_START_NS, tree), map(_PTR, fields), map(_SIZE, fields)))
        if any(out[i][0] > out[i + 1][0] for i in range(len(out) - 1)):
            out.sort(key=lambda e: e[0])
        return out

    def stop(self) -> list[AllocatorEvent]:
        """The last reports; closes the session (if it is still this one)."""
        try:
            return self.drain(reopen=False)
        except SessionLost:
            return []
