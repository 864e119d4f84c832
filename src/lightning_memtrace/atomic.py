"""Atomic file writes: a temporary file beside the target, then a rename, so a crash leaves whole files."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_pickle(path: str | os.PathLike, obj: Any) -> Path:
    # Protocol 4: the unpickler inside pytorch.org/memory_viz (MemoryViz.js) accepts protocols 2 to 4 only.
    return atomic_write_bytes(path, pickle.dumps(obj, protocol=4))
