"""Python stack capture in the frame format of PyTorch's memory snapshots (innermost frame first).

Which of these frames is library code is :mod:`lightning_memtrace.analysis.frames`' business.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

from lightning_memtrace.types import Frame

_FRAME_CACHE: dict[tuple[object, int], Frame] = {}
_FRAME_CACHE_LIMIT = 200_000
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_memtrace/
#: A prefix no file name starts with (a NUL byte).
_NO_FILE = "\0"
# torch's wrappers around a dispatch mode's handler: not where the allocation was asked for.
_DISPATCH_FILES = (
    os.path.join("_dynamo", "eval_frame.py"),
    os.path.join("torch", "_compile.py"),
    os.path.join("utils", "_python_dispatch.py"),
)


def capture_frames(skip: int = 1, depth: int = 48, own_frames: bool = False) -> list[Frame]:
    """The calling stack as snapshot frames, skipping MemTrace's own frames (unless ``own_frames``: to tell what
    MemTrace's estimate called from what called it).

    Frame dicts are shared between events with the same code location, as PyTorch's pickles share them, which keeps
    snapshots small.
    """
    frame: FrameType | None = sys._getframe(skip)
    out: list[Frame] = []
    cache = _FRAME_CACHE
    skipped = _NO_FILE if own_frames else _PACKAGE_DIR
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if code.co_filename.startswith(skipped) or (not out and code.co_filename.endswith(_DISPATCH_FILES)):
            frame = frame.f_back
            continue
        key = (code, frame.f_lineno)
        entry = cache.get(key)
        if entry is None:
            if len(cache) > _FRAME_CACHE_LIMIT:
                cache.clear()
            entry = {"filename": code.co_filename, "line": frame.f_lineno, "name": code.co_name}
            cache[key] = entry
        out.append(entry)
        frame = frame.f_back
    return out


def traceback_frames(exception: BaseException, depth: int = 48, own_frames: bool = False) -> list[Frame]:
    """Where an exception was raised, from its traceback, innermost frame first, without MemTrace's own frames
    (unless ``own_frames``)."""
    out: list[Frame] = []
    tb = exception.__traceback__
    skipped = _NO_FILE if own_frames else _PACKAGE_DIR
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skipped):
            out.append({"filename": code.co_filename, "line": tb.tb_lineno, "name": code.co_name})
        tb = tb.tb_next
    out.reverse()
    return out[:depth]
