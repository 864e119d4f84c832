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


#: Control characters (C0 but the newline and the tab, DEL, C1) as the escapes that show them: text from a snapshot
#: (file names, function names, annotations) is untrusted, and an escape sequence in it would drive the terminal.
_VISIBLE_CONTROLS = {
    code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(code) not in "\n\t"
}


def visible(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN`` escapes (see :data:`_VISIBLE_CONTROLS`)."""
    return text.translate(_VISIBLE_CONTROLS)


def console(stderr: bool = False) -> Any:
    """A rich console that shows text as it is: no markup (a ``[bold]`` in a function name stays text) and no
    control characters (escape sequences in a hostile snapshot's names are shown, not obeyed)."""
    from rich.console import Console

    class PlainConsole(Console):
        def render_str(self, text: str, *args: Any, **kwargs: Any) -> Any:
            return super().render_str(visible(text), *args, **kwargs)

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else _piped_width()
    return PlainConsole(file=stream, width=width, highlight=False, soft_wrap=False, markup=False)


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
