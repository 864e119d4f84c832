"""Terminal output of ``memtrace``: a rich console (``COLUMNS`` wide, else 160, when not a terminal), a progress bar on
stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

#: Width of the tables when the output is not a terminal and ``COLUMNS`` is not set.
PIPED_WIDTH = 160


def _piped_width() -> int:
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return PIPED_WIDTH
    return width if width >= 40 else PIPED_WIDTH


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else _piped_width()
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr for reading large files; yields the loader's progress callback."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    progress = Progress(
        TextColumn("reading"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        console=console(stderr=True),
        transient=True,
    )
    task: list[Any] = []

    def update(done: int, total: int) -> None:
        if not task:
            progress.start()
            task.append(progress.add_task("read", total=total))
        progress.update(task[0], completed=done, total=total)

    try:
        yield update
    finally:
        if task:
            progress.stop()
