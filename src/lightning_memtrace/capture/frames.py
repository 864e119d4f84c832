"""Python stack capture in the frame format of PyTorch's memory snapshots (innermost frame first)."""

from __future__ import annotations

import os
import sys
from types import FrameType

Frame = dict  # {"filename": str, "line": int, "name": str}

_FRAME_CACHE: dict[tuple[object, int], Frame] = {}
_FRAME_CACHE_LIMIT = 200_000
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# torch's wrappers around a dispatch mode's handler: not where the allocation was asked for.
_DISPATCH_FILES = (
    os.path.join("_dynamo", "eval_frame.py"),
    os.path.join("torch", "_compile.py"),
    os.path.join("utils", "_python_dispatch.py"),
)


def capture_frames(skip: int = 1, depth: int = 48) -> list[Frame]:
    """The calling stack as snapshot frames, skipping MemTrace's own frames.

    Frame dicts are shared between events with the same code location, as PyTorch's pickles share them, which keeps
    snapshots small.
    """
    frame: FrameType | None = sys._getframe(skip)
    out: list[Frame] = []
    cache = _FRAME_CACHE
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if code.co_filename.startswith(_PACKAGE_DIR) or (not out and code.co_filename.endswith(_DISPATCH_FILES)):
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


def traceback_frames(exception: BaseException, depth: int = 48) -> list[Frame]:
    """Where an exception was raised, from its traceback, innermost frame first, without MemTrace's own frames."""
    out: list[Frame] = []
    tb = exception.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_PACKAGE_DIR):
            out.append({"filename": code.co_filename, "line": tb.tb_lineno, "name": code.co_name})
        tb = tb.tb_next
    out.reverse()
    return out[:depth]


_LIBRARY_MARKERS = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}lightning{os.sep}",
    f"{os.sep}pytorch_lightning{os.sep}",
    f"{os.sep}lightning_fabric{os.sep}",
    f"{os.sep}lightning_memtrace{os.sep}",
    f"{os.sep}lightning_utilities{os.sep}",
    "/torch/",
    "\\torch\\",
)


def is_library_frame(filename: str) -> bool:
    if not filename or filename.startswith("<") or filename in ("??", ""):
        return True
    if any(marker in filename for marker in _LIBRARY_MARKERS):
        return True
    # The standard library: under sys's prefix but not in site-packages.
    return filename.startswith(sys.base_prefix) and "site-packages" not in filename


def user_frame(frames: list[Frame] | None) -> Frame | None:
    """The innermost frame outside torch, Lightning and the standard library: the line a user would change."""
    if not frames:
        return None
    for frame in frames:
        if not is_library_frame(str(frame.get("filename", ""))):
            return frame
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename.endswith(".py"):
            return frame
    return frames[0]


def format_frame(frame: Frame | None) -> str:
    if frame is None:
        return "<unknown>"
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"
