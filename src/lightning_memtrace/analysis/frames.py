"""THE rule for "is this frame library code?", and the user frame it picks: one rule for the post-mortem, the replay
and so the report and ``memtrace summary``, so that they all blame the same line for the same allocation.

A frame is library code when its file is unknown (empty, ``<...>``, ``??``), lies in one of :data:`LIBRARY_PACKAGES`
(torch, Lightning and its helpers, torchmetrics among them, MemTrace itself, accelerate), or in the standard library
(``lib/python3.X/`` outside ``site-packages``/``dist-packages``, or under this interpreter's base prefix outside
them). Paths are compared with ``/`` separators, so Windows paths classify alike.
"""

from __future__ import annotations

import re
import sys

from lightning_memtrace.types import Frame

#: Packages whose frames are never the line a user would change.
LIBRARY_PACKAGES: tuple[str, ...] = (
    "torch",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_memtrace",
    "lightning_utilities",
    "torchmetrics",
    "accelerate",
)
_LIBRARY_PARTS = tuple(f"/{name}/" for name in LIBRARY_PACKAGES)
_STDLIB_RE = re.compile(r"/lib/python3(\.\d+)?/(?!site-packages/|dist-packages/)")
_BASE_PREFIX = sys.base_prefix.replace("\\", "/")


def normalize_path(filename: str) -> str:
    """``\\`` → ``/``."""
    return filename.replace("\\", "/")


def is_library_file(filename: str) -> bool:
    """Whether a frame's file is library code (see the module docstring). Works on any path, from any machine."""
    if not filename or filename.startswith("<") or filename == "??":
        return True
    path = normalize_path(filename)
    if any(part in path for part in _LIBRARY_PARTS) or _STDLIB_RE.search(path):
        return True
    return path.startswith(_BASE_PREFIX) and "site-packages" not in path and "dist-packages" not in path


def user_frame(frames: list[Frame] | None) -> Frame | None:
    """The line a user would change: the innermost frame outside the library (see :func:`is_library_file`) inside the
    training step, that is, before the first frame of what drives the step (:func:`is_driver_file`). Where the step's
    code is all library code (an optimizer's step, a Lightning callback's weight averaging), the innermost library
    frame there outside torch's machinery (:func:`is_machinery_file`): a user frame beyond the driver only called it
    (``trainer.fit(model)``). Else the innermost frame outside the library; else the innermost Python frame; else the
    innermost frame."""
    if not frames:
        return None
    names = [normalize_path(str(frame.get("filename", ""))) for frame in frames]
    driver_at = next((k for k, name in enumerate(names) if is_driver_file(name)), len(frames))
    inside = range(driver_at)
    for k in inside:
        if not is_library_file(names[k]):
            return frames[k]
    if driver_at < len(frames):
        for k in inside:
            if names[k].endswith(".py") and not is_machinery_file(names[k]):
                return frames[k]
    for frame, name in zip(frames, names):
        if not is_library_file(name):
            return frame
    for frame, name in zip(frames, names):
        if name.endswith(".py"):
            return frame
    return frames[0]


#: Where torch's own machinery runs (dispatch, fake tensors, dynamo's wrappers) and MemTrace's: never the code
#: that asked for something, only the way the asking went.
_MACHINERY_RE = re.compile(r"/torch/(_[^/]*|utils/_[^/]*|overrides\.py)(/|$)|/lightning_memtrace/")
#: What drives a training step (the Trainer's loops, the estimate's own): a user's line beyond it called the step
#: (``trainer.fit(model)``), it did not ask.
_DRIVER_RE = re.compile(r"/(lightning|pytorch_lightning|lightning_fabric)/|/lightning_memtrace/estimator/loop\.py$")


def is_machinery_file(filename: str) -> bool:
    """Whether a frame's file is torch's machinery or MemTrace's: never the code that asked (:data:`_MACHINERY_RE`)."""
    return _MACHINERY_RE.search(normalize_path(filename)) is not None


def is_driver_file(filename: str) -> bool:
    """Whether a frame's file drives the training step (Lightning, the estimate's loop, see :data:`_DRIVER_RE`)."""
    return _DRIVER_RE.search(normalize_path(filename)) is not None


def asking_frame(frames: list[Frame] | None) -> Frame | None:
    """The code that asked for what an error is about, innermost first: the user's line inside the step where there
    is one (``loss.item()`` in ``training_step``, also when a library it called asked), else the innermost library
    frame outside torch's machinery and MemTrace (``torch/optim/lbfgs.py`` reading the loss in the optimizer's
    step), else as :func:`user_frame`."""
    library = None
    for frame in frames or ():
        filename = normalize_path(str(frame.get("filename", "")))
        if is_driver_file(filename):
            break
        if not filename.endswith(".py") or is_machinery_file(filename):
            continue
        if not is_library_file(filename):
            return frame
        if library is None:
            library = frame
    return library if library is not None else user_frame(frames)


def format_frame(frame: Frame | None) -> str:
    """``file:line in function`` (``<unknown>`` for None)."""
    if frame is None:
        return "<unknown>"
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"
