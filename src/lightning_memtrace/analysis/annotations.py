"""A snapshot's annotations (torch's ``external_annotations``): live bytes at each of them, and per annotated range
the peak and its categories.

Torch writes a ``START`` and an ``END`` entry (``{"name", "stage", "time_us", "device"}``) for each
``record_function`` range while it records the CUDA allocator's history; MemTrace writes the same for its phases
(``forward``, ``backward``, ``optimizer_step``, ``after_step``, ``validation``) and, on CPU, for the
``record_function`` ranges inside its history window. Any snapshot's annotations are read the same way here:

* the live bytes at an annotation are those of the state after every event whose time is at or before the
  annotation's (the bytes live before the trace when no event is);
* a range is a ``START`` and the next ``END`` of the same name (ranges of one name may nest: an ``END`` closes the
  latest open ``START`` of its name); its peak is the highest live bytes from the state at its start through every
  event up to its end, with the categories live there.

No torch here: only the replay's timeline and allocation table are read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lightning_memtrace.analysis.model import DeviceReplay

START, END = "START", "END"


@dataclasses.dataclass(frozen=True)
class AnnotatedRange:
    """One ``START``/``END`` pair of an annotation name, and the memory inside it.

    Attributes:
        name: The annotation's name (``forward``, ``Optimizer.step#AdamW.step``, a user's ``record_function`` name).
        start_us: Time of the ``START`` (None: the ``END`` has no ``START`` in the file; the range is taken from the
            trace's beginning).
        end_us: Time of the ``END`` (None: still open at the end of the file; the range runs to the last event).
        depth: How many other ranges were open at its start (for indenting nested ranges).
        step: The step of the first event inside the range (else of the state at its start); -1 when unknown.
        start_live_bytes: Live bytes at the ``START``; ``end_live_bytes``: at the ``END``.
        peak_bytes: The highest live bytes inside the range (its start state included).
        peak_index: The timeline row of that peak (-1: the state before the first event).
        peak_time_us: The time of that row (the range's start when the peak is its start state before any event).
        by_category: Live bytes per category at the peak, largest first.
        events: How many events fall inside the range.
    """

    name: str
    start_us: int | None
    end_us: int | None
    depth: int
    step: int
    start_live_bytes: int
    end_live_bytes: int
    peak_bytes: int
    peak_index: int
    peak_time_us: int
    by_category: dict[str, int]
    events: int

    @property
    def complete(self) -> bool:
        """Both ends are in the file."""
        return self.start_us is not None and self.end_us is not None

    @property
    def duration_us(self) -> int | None:
        return self.end_us - self.start_us if self.start_us is not None and self.end_us is not None else None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values (the ``annotated_ranges`` of a JSON summary)."""
        return {
            "name": self.name,
            "start_us": self.start_us,
            "end_us": self.end_us,
            "depth": self.depth,
            "step": self.step,
            "start_live_bytes": self.start_live_bytes,
            "end_live_bytes": self.end_live_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_time_us": self.peak_time_us,
            "peak_by_category": dict(self.by_category),
            "events": self.events,
        }


def _timeline_arrays(dev: DeviceReplay) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(running maximum of the event times, live bytes, step) per row: times made non-decreasing so that "every event
    at or before t" is a prefix of the trace."""
    tl = dev.timeline
    times = tl["time_us"].to_numpy(dtype=np.int64) if len(tl) else np.zeros(0, dtype=np.int64)
    if len(times):
        times = np.maximum.accumulate(times)
    live = tl["live_bytes"].to_numpy(dtype=np.int64) if len(tl) else np.zeros(0, dtype=np.int64)
    step = tl["step"].to_numpy(dtype=np.int64) if len(tl) else np.zeros(0, dtype=np.int64)
    return times, live, step


def _row_at(times: np.ndarray, t: int) -> int:
    """The last row whose time is at or before ``t`` (-1: none)."""
    return int(np.searchsorted(times, t, side="right")) - 1


def _live(dev: DeviceReplay, live: np.ndarray, row: int) -> int:
    return int(live[row]) if row >= 0 else int(dev.seed_bytes)


def placed(dev: DeviceReplay) -> bool:
    """Whether the device's annotations can be placed on its trace (the events carry times)."""
    return bool(dev.annotations) and (dev.has_time or dev.num_events == 0)


def annotation_rows(dev: DeviceReplay) -> list[dict[str, Any]]:
    """Every annotation of the device, in time order, with the live bytes there.

    Returns:
        ``[{"name", "stage", "time_us", "live_bytes", "index", "step"}]``: ``index`` is the timeline row of the state
        (-1: before the first event), ``step`` that row's step (-1: unknown). ``[]`` when the trace has no times
        (nothing to place the annotations against).
    """
    if not placed(dev):
        return []
    times, live, step = _timeline_arrays(dev)
    rows = []
    for a in dev.annotations:
        t = int(a["time_us"])
        row = _row_at(times, t)
        rows.append(
            {
                "name": str(a.get("name", "")),
                "stage": str(a.get("stage", "")).upper(),
                "time_us": t,
                "live_bytes": _live(dev, live, row),
                "index": row,
                "step": int(step[row]) if row >= 0 else -1,
            }
        )
    return rows


def _pairs(annotations: list[dict[str, Any]]) -> list[tuple[str, int | None, int | None, int]]:
    """``(name, start, end, depth)`` of every range, ordered by start (ranges without a start first)."""
    open_by_name: dict[str, list[tuple[int, int]]] = {}
    open_count = 0
    out: list[tuple[str, int | None, int | None, int]] = []
    for a in annotations:
        name = str(a.get("name", ""))
        stage = str(a.get("stage", "")).upper()
        t = int(a["time_us"])
        if stage == START:
            open_by_name.setdefault(name, []).append((t, open_count))
            open_count += 1
        elif stage == END:
            started = open_by_name.get(name)
            if started:
                start, depth = started.pop()
                open_count -= 1
                out.append((name, start, t, depth))
            else:
                out.append((name, None, t, 0))
    for name, started in open_by_name.items():
        out.extend((name, start, None, depth) for start, depth in started)
    return sorted(out, key=lambda r: (-1 if r[1] is None else r[1], r[3]))


def annotated_ranges(dev: DeviceReplay) -> list[AnnotatedRange]:
    """The device's annotated ranges with the live bytes at both ends and the peak inside (see the module's text);
    ordered by start. ``[]`` when the trace has no times."""
    if not placed(dev):
        return []
    times, live, step = _timeline_arrays(dev)
    n = len(times)
    out = []
    for name, start, end, depth in _pairs(dev.annotations):
        first = _row_at(times, start) if start is not None else -1
        last = _row_at(times, end) if end is not None else n - 1
        last = max(last, first)
        window = live[max(first, 0) : last + 1]
        if first < 0:  # the state before the first event is part of the range
            peak_row, peak = -1, int(dev.seed_bytes)
            if len(window) and int(window.max()) > peak:
                peak_row = int(np.argmax(window))
                peak = int(window[peak_row])
        else:
            offset = int(np.argmax(window))
            peak_row, peak = first + offset, int(window[offset])
        inside = last - first
        step_row = first + 1 if inside > 0 else first
        if peak_row >= 0 and not (peak_row == first and start is not None):
            peak_time = int(dev.timeline["time_us"].iat[peak_row])
        else:
            peak_time = start if start is not None else (int(times[0]) if n else 0)
        out.append(
            AnnotatedRange(
                name=name,
                start_us=start,
                end_us=end,
                depth=depth,
                step=int(step[step_row]) if step_row >= 0 and n else -1,
                start_live_bytes=_live(dev, live, first),
                end_live_bytes=_live(dev, live, last),
                peak_bytes=peak,
                peak_index=peak_row,
                peak_time_us=peak_time,
                by_category=dev.categories_at(peak_row),
                events=inside,
            )
        )
    return out


def compile_context_sites(dev: DeviceReplay, index: int | None = None, max_sites: int = 5) -> list[dict[str, Any]]:
    """The allocations live at row ``index`` (the peak by default) grouped by the ``torch.compile`` context they were
    made in (the ``compile_context`` torch adds to CUDA events when asked), largest first, each with its largest sites.

    Returns:
        ``[{"compile_context", "bytes", "count", "sites": [{"site", "category", "bytes", "count"}]}]``; allocations
        outside compiled code (``"N/A"``) or older than the trace are under ``""``. ``[]`` when the events carry no
        compile context.
    """
    al = dev.allocations
    if "compile_context" not in al.columns:
        return []
    row = dev.peak.index if index is None else index
    live = dev.live_allocations(row)
    out = []
    for context, group in live.groupby("compile_context", observed=True, sort=False):
        sites = (
            group.groupby(["site", "category"], observed=True, sort=False)["size"]
            .agg(["sum", "size"])
            .sort_values("sum", ascending=False, kind="stable")
        )
        out.append(
            {
                "compile_context": str(context),
                "bytes": int(group["size"].sum()),
                "count": len(group),
                "sites": [
                    {"site": str(site), "category": str(category), "bytes": int(total), "count": int(count)}
                    for (site, category), total, count in zip(
                        sites.index.tolist(), sites["sum"].tolist(), sites["size"].tolist()
                    )
                ][:max_sites],
            }
        )
    return sorted(out, key=lambda c: (-c["bytes"], c["compile_context"]))
