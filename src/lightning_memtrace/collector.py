"""Pausing Python's cyclic garbage collector around work that makes many short-lived or acyclic objects."""

from __future__ import annotations

import gc
from typing import Any


class gc_paused:  # noqa: N801 (used as a function: ``with gc_paused():``)
    """Pause Python's cyclic garbage collector, as it was after.

    A snapshot is millions of small dicts and lists (acyclic: reference counting frees them); building or walking
    them otherwise triggers collections that walk them all again, over and over (3x slower on a million events). The
    loader, the replay and each ``memtrace`` command (from the load to its last line of output) run under it. During
    training, reading the allocator's reports makes a few objects per report, most of them gone again by the end:
    paused, they set off none of the training process's collections (about 1 ms each).

    A class rather than a generator: leaving it allocates nothing after the collector is back on, so a collection
    the paused work made due starts at the caller's next allocation, not inside the block's exit.
    """

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self._was_enabled:
            gc.enable()
