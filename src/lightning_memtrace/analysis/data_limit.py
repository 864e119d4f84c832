"""A cap on how much more memory the process may map while it reads an untrusted pickle.

CPython's C unpickler sizes its memo from the index a ``PUT``/``LONG_BINPUT`` opcode names: a file of a few bytes that
names index 10⁹ makes it allocate and zero 16 GB before it reads on, which no check of ours can see coming (the
opcode is deep inside C). A snapshot needs a few bytes of Python objects per byte of pickle (2.9× to 7.8× for the real
snapshots of ``shared/fixtures``), so while one is unpickled the process's data segment may grow by
:func:`unpickling_budget` bytes and no more: beyond that the allocation fails with ``MemoryError``, which the loader
turns into its one-line error.

Linux only (``RLIMIT_DATA`` counts every private writable mapping there since 4.7); elsewhere, or where the limit
cannot be set, nothing is capped.

When the cap strikes inside the C unpickler between lending a bytearray's buffer out and taking it back, CPython
itself prints ``SystemError: deallocated bytearray object has exported buffers`` (through ``sys.excepthook``) while
unwinding: :func:`data_growth_capped` keeps exactly that line off the console.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

#: Room for the unpickled objects: a fixed part, and a multiple of the pickle's size well above what snapshots need.
_FIXED_BUDGET = 1024**3
_BUDGET_PER_BYTE = 64

_lock = threading.Lock()
#: What CPython prints when a bytearray whose buffer is still lent out is freed (here: by an allocation failing).
_EXPORTED_BUFFERS = "deallocated bytearray object has exported buffers"


def unpickling_budget(pickle_bytes: int) -> int:
    """Bytes the data segment may grow by while a pickle of ``pickle_bytes`` bytes is unpickled."""
    return _FIXED_BUDGET + _BUDGET_PER_BYTE * max(0, pickle_bytes)


def _data_segment_bytes() -> int | None:
    """The process's data segment as the kernel counts it for ``RLIMIT_DATA`` (``VmData``), or None if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def data_growth_capped(extra_bytes: int) -> Iterator[None]:
    """While inside, the data segment may grow by at most ``extra_bytes``; a tighter limit already set is kept.

    The limit is the process's: another thread that maps more meanwhile fails the same way. Calls on several threads
    at once cap only the first.
    """
    if not sys.platform.startswith("linux") or not _lock.acquire(blocking=False):
        yield
        return
    try:
        import resource

        limits = _capped(resource, extra_bytes)
        try:
            with _exported_buffer_errors_quiet():
                yield
        finally:
            if limits is not None:
                resource.setrlimit(resource.RLIMIT_DATA, limits)
    finally:
        _lock.release()


@contextlib.contextmanager
def _exported_buffer_errors_quiet() -> Iterator[None]:
    """While inside, ``sys.excepthook`` drops CPython's "exported buffers" SystemError (see the module's docstring)
    and hands every other exception to the hook that was there."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if kind is SystemError and str(value) == _EXPORTED_BUFFERS:
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
    try:
        yield
    finally:
        if sys.excepthook is hook:
            sys.excepthook = previous


def _capped(resource: Any, extra_bytes: int) -> tuple[int, int] | None:
    """Lower the soft ``RLIMIT_DATA`` to the data segment now plus ``extra_bytes``; the limits to restore, or None
    where nothing was set (the segment unknown, a tighter limit already set, the limit not settable)."""
    used = _data_segment_bytes()
    if used is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = used + extra_bytes if hard == resource.RLIM_INFINITY else min(used + extra_bytes, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    except (ValueError, OSError):
        return None
    return soft, hard
