"""Questions of time asked of one device's replay (``memtrace summary --window/--at/--step/--phase/--file``).

Each answer is a moment of the trace, shown like the peak (live bytes, by category, by site):

* a window ``[start_us, end_us]`` (event times; event positions when the trace has no times): the highest point of
  the live bytes inside it, the state at its start included (the state after the last event before it);
* ``at`` event N (0-based, as ``peak_event`` in the JSON): the live state just after that event;
* a step and/or a stage (``forward``, ``backward``...; the replay's ``phase`` column, from MemTrace's tags or the
  stacks): the highest point over the events of that step and stage;
* nothing: the peak of the whole trace (:attr:`DeviceReplay.peak`).

``file`` adds, at the moment answered, the live bytes per line of one source file (the allocation sites whose file
ends with the given path at a path separator).

No torch here; bytes are ints. A question that cannot be answered raises :class:`QuestionError` (one line).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.events import first_positions
from lightning_memtrace.analysis.frames import normalize_path
from lightning_memtrace.analysis.model import DeviceReplay, Peak
from lightning_memtrace.types import STAGES


class QuestionError(ValueError):
    """A question with a bad value (a window that ends before it starts, an event out of range, an unknown phase)."""


@dataclasses.dataclass(frozen=True)
class Question:
    """What ``memtrace summary`` asks of every device answered.

    Attributes:
        window: ``(start_us, end_us)``, both included, or None.
        at: Event index (0-based) whose after-state is asked, or None.
        step: Step to restrict to, or None.
        phase: Stage name to restrict to (one of :data:`~lightning_memtrace.types.STAGES`), or None.
        file: Source file (a path suffix) whose lines to break the live bytes into, or None.
    """

    window: tuple[int, int] | None = None
    at: int | None = None
    step: int | None = None
    phase: str | None = None
    file: str | None = None

    @property
    def asks_time(self) -> bool:
        """Whether the moment differs from the whole trace's peak (anything but ``file`` set)."""
        return self.window is not None or self.at is not None or self.step is not None or self.phase is not None

    @property
    def empty(self) -> bool:
        return not self.asks_time and self.file is None

    def check(self) -> None:
        """Raise :class:`QuestionError` for values no trace can answer."""
        if self.window is not None and self.window[1] < self.window[0]:
            raise QuestionError(f"--window {self.window[0]}:{self.window[1]}: the end is before the start")
        if self.at is not None and (self.window is not None or self.step is not None or self.phase is not None):
            raise QuestionError("--at names one moment: it cannot be combined with --window, --step or --phase")
        if self.window is not None and (self.step is not None or self.phase is not None):
            raise QuestionError("--window cannot be combined with --step or --phase")
        if self.phase is not None and self.phase not in STAGES:
            raise QuestionError(f"unknown phase {self.phase!r} (one of: {', '.join(STAGES)})")
        if self.at is not None and self.at < 0:
            raise QuestionError(f"--at {self.at}: events are numbered from 0")


@dataclasses.dataclass(frozen=True)
class FileLine:
    """Live bytes of one line of the file asked for, at the moment answered."""

    file: str
    line: int
    function: str
    bytes: int
    count: int


@dataclasses.dataclass(frozen=True)
class Answer:
    """One device's answer.

    Attributes:
        device: The device index.
        scope: The question in words (``"whole trace"``, ``"window 10:20 us"``, ``"after event 5"``,
            ``"step 3, phase forward"``).
        events: How many events the scope holds.
        moment: The state answered: the scope's peak, or the state after the event asked for.
        peak: The highest point of the scope (with ``at``: of the whole trace).
        lines: With ``file``: live bytes per line of that file at ``moment`` (by file, then line); else None.
        at: The event asked for with ``at``, else None.
    """

    device: int
    scope: str
    events: int
    moment: Peak
    peak: Peak
    lines: list[FileLine] | None = None
    at: int | None = None


def state_bytes(dev: DeviceReplay, row: int) -> int:
    """Live bytes just after event ``row`` (``-1``: before the first event)."""
    return int(dev.seed_bytes) if row < 0 else int(dev.timeline["live_bytes"].iloc[row])


def highest(dev: DeviceReplay, rows: np.ndarray, start_row: int | None) -> Peak:
    """The state with the most live bytes after one of ``rows`` (the first on a tie), or at ``start_row`` (the state
    before the scope, ``-1``: before the first event) when that holds strictly more or ``rows`` is empty."""
    live = dev.timeline["live_bytes"].to_numpy()
    if len(rows) == 0:
        return dev.peak_at(-1 if start_row is None else start_row)
    best = int(rows[int(np.argmax(live[rows]))])
    if start_row is not None and state_bytes(dev, start_row) > int(live[best]):
        return dev.peak_at(start_row)
    return dev.peak_at(best)


def window_answer(dev: DeviceReplay, start_us: int, end_us: int) -> tuple[str, np.ndarray, Peak]:
    """The peak inside ``[start_us, end_us]``, the state at its start included."""
    times = dev.timeline["time_us"].to_numpy()
    rows = np.nonzero((times >= start_us) & (times <= end_us))[0]
    if len(rows):
        start_row = int(rows[0]) - 1
    else:
        before = np.nonzero(times < start_us)[0]
        start_row = int(before[-1]) if len(before) else -1
    unit = "us" if dev.has_time else "(event positions: the trace has no times)"
    return f"window {start_us}:{end_us} {unit}", rows, highest(dev, rows, start_row)


def _step_range(steps: np.ndarray) -> str:
    known = steps[steps >= 0]
    return f"steps {int(known.min())} to {int(known.max())}" if len(known) else "no step recorded"


def selection_answer(dev: DeviceReplay, step: int | None, phase: str | None) -> tuple[str, np.ndarray, Peak]:
    """The peak over the events of ``step`` and/or ``phase`` (both: the events of that phase in that step)."""
    tl = dev.timeline
    mask = np.ones(len(tl), dtype=bool)
    words = []
    if step is not None:
        steps = tl["step"].to_numpy()
        if step < 0 or not (steps == step).any():
            raise QuestionError(f"step {step} is not in the trace of device {dev.device} ({_step_range(steps)})")
        mask &= steps == step
        words.append(f"step {step}")
    if phase is not None:
        mask &= (tl["phase"].astype(str) == phase).to_numpy()
        words.append(f"phase {phase}")
        if not mask.any():
            present = ", ".join(sorted(set(tl["phase"].astype(str)), key=STAGES.index))
            where = f" in step {step}" if step is not None else ""
            raise QuestionError(f"no event of phase {phase}{where} on device {dev.device} (phases: {present})")
    rows = np.nonzero(mask)[0]
    return ", ".join(words), rows, highest(dev, rows, None)


def _matches(file: str, suffix: str) -> bool:
    path = normalize_path(file)
    return bool(path) and (path == suffix or path.endswith("/" + suffix))


def file_lines(dev: DeviceReplay, moment: Peak, path: str) -> list[FileLine]:
    """Live bytes per line of the file that ends with ``path`` (at a path separator), at ``moment``.

    Raises:
        QuestionError: No allocation of the device has its site in such a file.
    """
    suffix = normalize_path(path).lstrip("/") if path.strip("/\\") else path
    files = {str(f) for f in dev.allocations["file"].dropna().unique()}
    matching = {f for f in files if _matches(f, suffix)}
    if not matching:
        raise QuestionError(f"--file {path}: no allocation site of device {dev.device} is in a file ending with it")
    sites = moment.sites[moment.sites["file"].astype(str).isin(matching)]
    if len(sites) == 0:
        return []
    grouped = (
        sites.groupby(["file", "line", "function"], sort=True)
        .agg(bytes=("bytes", "sum"), count=("count", "sum"))
        .reset_index()
    )
    return [
        FileLine(str(r["file"]), int(r["line"]), str(r["function"]), int(r["bytes"]), int(r["count"]))
        for r in grouped.to_dict("records")
    ]


def ask(dev: DeviceReplay, question: Question) -> Answer:
    """Answer ``question`` on one device.

    Args:
        dev: The device's replay.
        question: What to ask (checked here too).

    Returns:
        The :class:`Answer`.

    Raises:
        QuestionError: A bad value, or one this device cannot answer (event out of range, step or phase absent,
            no site in the file).
    """
    question.check()
    n = dev.num_events
    if question.at is not None:
        if question.at >= n:
            raise QuestionError(f"--at {question.at}: device {dev.device} has {n} events (0 to {n - 1})")
        scope, rows, moment, peak = f"after event {question.at}", np.arange(n), dev.peak_at(question.at), dev.peak
    elif question.window is not None:
        scope, rows, moment = window_answer(dev, *question.window)
        peak = moment
    elif question.step is not None or question.phase is not None:
        scope, rows, moment = selection_answer(dev, question.step, question.phase)
        peak = moment
    else:
        scope, rows, moment, peak = "whole trace", np.arange(n), dev.peak, dev.peak
    lines = file_lines(dev, moment, question.file) if question.file is not None else None
    return Answer(dev.device, scope, len(rows), moment, peak, lines, question.at)


def phase_peaks(dev: DeviceReplay) -> pd.DataFrame:
    """The peak of every (step, phase) of the trace, in the order they start: ``phase, step, first_event,
    last_event, events, peak_bytes, peak_event``; each peak is that of ``ask(step=, phase=)``."""
    tl = dev.timeline
    columns = ["phase", "step", "first_event", "last_event", "events", "peak_bytes", "peak_event"]
    if len(tl) == 0:
        return pd.DataFrame(columns=columns)
    phase = tl["phase"].cat
    codes = phase.codes.to_numpy().astype(np.int64)
    step = tl["step"].to_numpy().astype(np.int64)
    index = tl["index"].to_numpy()
    live = tl["live_bytes"].to_numpy()
    # a (step, phase) pair as one int, numbered in order of first event (a phase's codes start at -1: NaN)
    group, _ = pd.factorize(step * (len(phase.categories) + 1) + (codes + 1))
    count = int(group.max()) + 1
    n = len(group)
    first = first_positions(group, count)
    last = n - 1 - first_positions(group[::-1], count)
    # sorted by group, then highest live bytes, then earliest: each group's first row is its peak (idxmax's pick)
    order = np.lexsort((np.arange(n), -live, group))
    top = order[np.searchsorted(group[order], np.arange(count))]
    names = np.array([*map(str, phase.categories), "nan"], dtype=object)
    return pd.DataFrame(
        {
            "phase": pd.Series(names[codes[first]]).astype(str),
            "step": step[first],
            "first_event": index[first].astype(np.int64),
            "last_event": index[last].astype(np.int64),
            "events": np.bincount(group, minlength=count).astype(np.int64),
            "peak_bytes": live[top].astype(np.int64),
            "peak_event": index[top].astype(np.int64),
        },
        columns=columns,
    )
