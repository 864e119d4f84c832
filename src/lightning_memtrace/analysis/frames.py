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
    """The line a user would change, as :mod:`~lightning_memtrace.analysis.stacks` names an allocation's site: where
    a frame drives the training step (:func:`is_driver_file`), the step's own code before it (:func:`_in_step`): a
    user frame beyond the driver only called the step (``trainer.fit(model)``). Else the innermost Python frame
    outside the library (see :func:`is_library_file`); else the innermost Python frame; else the innermost frame (a
    C++ frame, such as torch's ``memory_snapshot.cpp`` recording the stack, is never the user's line)."""
    if not frames:
        return None
    names = [normalize_path(str(frame.get("filename", ""))) for frame in frames]
    if any(map(is_driver_file, names)):
        in_step = _in_step(frames, names)
        if in_step is not None:
            return in_step
    python = [(frame, name) for frame, name in zip(frames, names) if name.endswith(".py")]
    for frame, name in python:
        if not is_library_file(name):
            return frame
    return python[0][0] if python else frames[0]


def _in_step(frames: list[Frame], names: list[str]) -> Frame | None:
    """Inside the training step (before the first frame that drives it; the whole stack where none does): the
    innermost user Python frame, else the innermost library Python frame outside torch's machinery; None where there
    is neither. ``names``: the frames' file names, normalized."""
    library = None
    for frame, name in zip(frames, names):
        if is_driver_file(name):
            break
        if not name.endswith(".py") or is_machinery_file(name):
            continue
        if not is_library_file(name):
            return frame
        if library is None:
            library = frame
    return library


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
    if not frames:
        return None
    in_step = _in_step(frames, [normalize_path(str(frame.get("filename", ""))) for frame in frames])
    return in_step if in_step is not None else user_frame(frames)


def format_frame(frame: Frame | None) -> str:
    """``file:line in function`` (``<unknown>`` for None)."""
    if frame is None:
        return "<unknown>"
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"
