"""Out-of-memory errors: recognizing one, and reading the size the failed allocation asked for from its message."""

from __future__ import annotations

import re

import torch

_CPU_OOM_PATTERN = re.compile(r"tried to allocate (\d+) bytes")
_CUDA_OOM_PATTERN = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
#: numpy's ``_ArrayMemoryError``: "Unable to allocate 7.28 PiB for an array with shape ...".
_NUMPY_OOM_PATTERN = re.compile(r"Unable to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB|PiB|EiB)")
_UNIT_FACTORS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "PiB": 1024**5, "EiB": 1024**6}


def is_out_of_memory(exception: BaseException, device: torch.device | str | None = None) -> bool:
    """True for a CUDA ``OutOfMemoryError``, for the CPU allocator's "can't allocate memory" ``RuntimeError``, and,
    where the measured ``device`` is the CPU (or not given), for any ``MemoryError``: Python and numpy raise it when an
    allocation of host memory fails, which is the device's memory there (on an accelerator it is not, and only a
    message naming an out-of-memory counts)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    if isinstance(exception, MemoryError) and (device is None or torch.device(device).type == "cpu"):
        return True
    if isinstance(exception, (RuntimeError, MemoryError)):
        message = str(exception)
        return "can't allocate memory" in message or "out of memory" in message.lower()
    return False


def out_of_memory_in(exception: BaseException, device: torch.device | str | None = None) -> BaseException | None:
    """The out-of-memory error (see :func:`is_out_of_memory`) that ``exception`` is or was raised from: a library
    that turns one into an error of its own (a compiler's ``BackendCompilerFailed``, a wrapper adding advice) keeps it
    as the cause, or as the context where it raises while handling it. None where the chain holds none."""
    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        if is_out_of_memory(current, device):
            return current
        seen.add(id(current))
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__
    return None


def requested_bytes_from_message(message: str) -> int | None:
    """The size the failed allocation asked for, as stated in the allocator's error message."""
    found = _CPU_OOM_PATTERN.search(message)
    if found:
        return int(found.group(1))
    for pattern in (_CUDA_OOM_PATTERN, _NUMPY_OOM_PATTERN):
        found = pattern.search(message)
        if found:
            return int(float(found.group(1)) * _UNIT_FACTORS[found.group(2)])
    return None
