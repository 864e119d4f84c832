"""What a process forked while MemTrace measures (a DataLoader's workers, forked at every epoch) must not inherit.

``fork`` copies the forking thread with its thread-local state: a profiling session open on it, a dispatch mode on its
mode stack. A worker would then report every allocation to a session that nobody reads (a list growing for the
worker's whole life) or run each of its operators through MemTrace's mode. Each :class:`ForkGuarded` object registered
with :func:`guard` is told of every fork of the process: before it (on the forking thread, where it can let go: the
allocator-reports session is closed, its reports kept for the next read), after it in the parent (the session is
opened again) and after it in the child (MemTrace's dispatch mode is taken off the stack, the allocator's settings are
put back). The child never measures anything for MemTrace.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol


class ForkGuarded(Protocol):
    """What is told of a fork: ``after_fork_in_child``, and where it has them, ``before_fork`` (on the forking thread)
    and ``after_fork_in_parent``."""

    def after_fork_in_child(self) -> None: ...


_guarded: weakref.WeakSet[ForkGuarded] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def guard(obj: ForkGuarded) -> None:
    """Tell ``obj`` of every fork from now on (until :func:`unguard`; it is held weakly)."""
    global _registered
    with _lock:
        if not _registered and hasattr(os, "register_at_fork"):  # registered once: it cannot be taken back
            os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
            _registered = True
        _guarded.add(obj)


def unguard(obj: ForkGuarded) -> None:
    with _lock:
        _guarded.discard(obj)


def _each(method: str) -> None:
    # An exception here would be printed by the interpreter ("Exception ignored in ...") into the user's console, and
    # must not stop the fork: a guard that fails is left as it is.
    for obj in list(_guarded):
        hook = getattr(obj, method, None)
        if hook is None:
            continue
        try:
            hook()
        except Exception:  # noqa: S110
            pass


def _before() -> None:
    _each("before_fork")


def _after_in_parent() -> None:
    _each("after_fork_in_parent")


def _after_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _each("after_fork_in_child")
    _guarded.clear()
