"""Atomic file writes: a temporary file beside the target, then a rename, so a crash leaves whole files.

The temporary file is created with mode ``0o666`` under the process umask, exactly as a plain ``open(path, "w")``
would create the target, so the renamed file is as readable as the rest of the log folder (``tempfile.mkstemp``
would give ``0o600``); a file written again keeps its mode, as with ``open``. Where a plain ``open`` would write
elsewhere than the path's own directory entry, so does this: through a symbolic link into its target (the link
stays), and into a device or a pipe in place (``-o /dev/stdout``; a rename would put a regular file where the device
was).
"""

from __future__ import annotations

import os
import pickle
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
_PLAIN_OPEN_MODE = 0o666


def _open_temporary(target: Path) -> tuple[BinaryIO, Path]:
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, _CREATE_FLAGS, _PLAIN_OPEN_MODE)
        except FileExistsError:
            continue
        return os.fdopen(fd, "wb"), tmp
    raise FileExistsError(f"could not create a temporary file beside {target}")


def _special_file(path: Path) -> bool:
    """Whether ``path`` is, or links to, something other than a regular file or a folder (a device, a pipe)."""
    try:
        mode = os.stat(path).st_mode  # follows links, /dev/stdout's through /proc too
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _keep_mode_of(target: Path, tmp: Path) -> None:
    """Give the temporary file the mode of the file it replaces: a plain ``open`` of an existing file keeps its mode
    (a report made private with ``chmod 600`` stays private when written again)."""
    try:
        mode = os.stat(target).st_mode
    except OSError:  # a new file: the umask's mode, from its creation
        return
    if stat.S_ISREG(mode):
        os.chmod(tmp, stat.S_IMODE(mode))


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it to ``path``.

    Returns:
        ``path``, as given.
    """
    given = Path(path)
    if _special_file(given):
        with open(given, "wb") as handle:
            write(handle)
        return given
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = _open_temporary(target)
    try:
        with handle:
            write(handle)
            handle.flush()
            _keep_mode_of(target, tmp)
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return given


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write_with(path, lambda handle: handle.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_pickle(path: str | os.PathLike, obj: Any) -> Path:
    # Protocol 4: the unpickler inside pytorch.org/memory_viz (MemoryViz.js) accepts protocols 2 to 4 only.
    return atomic_write_bytes(path, pickle.dumps(obj, protocol=4))
