"""What a replay holds: per device, the timeline of events and the table of allocations, and the peak read from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.events import scatter_add
from lightning_memtrace.types import CATEGORIES

if TYPE_CHECKING:
    from lightning_memtrace.analysis.allocator_replay import ExpandableWhatIf

SITE_COLUMNS = ["site", "file", "line", "function", "category", "bytes", "count"]


@dataclasses.dataclass
class Peak:
    """The highest live-bytes point of one device's replay.

    Attributes:
        device: The device index.
        index: Row (event position) at which it happens.
        time_us: Its time (event position when the trace had no times).
        live_bytes: Live bytes there (pre-existing included).
        reserved_bytes: Reserved bytes there (0 when unknown).
        stage: The stage (phase) there.
        step: The step there (-1 when unknown).
        by_category: Live bytes per category there, largest first.
        sites: The live allocations there grouped by site and category (a site whose allocations fall in several
            categories has a row per category): ``site, file, line, function, category, bytes, count``, largest first.
        inferred_bytes: How many of the live bytes have an inferred (not recorded) category.
    """

    device: int
    index: int
    time_us: int
    live_bytes: int
    reserved_bytes: int
    stage: str
    step: int
    by_category: dict[str, int]
    sites: pd.DataFrame
    inferred_bytes: int = 0


@dataclasses.dataclass
class DeviceReplay:
    """The replay of one device's trace.

    Attributes:
        device: Device index.
        timeline: One row per event: ``index, time_us, action, addr, size, delta, live_bytes, reserved_bytes,
            category, inferred, phase, step, site``.
        allocations: One row per allocation (pre-existing ones with ``alloc_index == -1``; ``end_index == n`` when
            still alive at the end): ``alloc_index, end_index, size, category, inferred, stage_alloc, stage_end, step,
            site, file, line, function``.
        seed_bytes: Live bytes before the first event.
        has_time: Whether the events carried ``time_us``.
        reserved_known: Whether reserved bytes could be followed (segments or segment events).
        unknown_frees: Frees of addresses the trace never allocated (taken as pre-existing blocks).
        oom_rows: Row indices of ``oom`` events.
        annotations: The snapshot's ``external_annotations`` of this device (``record_function`` ranges, MemTrace's
            phases): ``{"name", "stage": "START" | "END", "time_us", ...}``, ordered by time (see
            :mod:`~lightning_memtrace.analysis.annotations`).
        categories: The categories of this replay in chart order (the codes of the ``category`` columns): the built-in
            ones (:data:`~lightning_memtrace.types.CATEGORIES`), then the names of user rules
            (:mod:`~lightning_memtrace.analysis.rules`).
    """

    device: int
    timeline: pd.DataFrame
    allocations: pd.DataFrame
    seed_bytes: int
    has_time: bool
    reserved_known: bool
    unknown_frees: int
    oom_rows: list[int]
    annotations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    categories: tuple[str, ...] = CATEGORIES

    @property
    def rule_categories(self) -> tuple[str, ...]:
        """The categories user rules added (those not built in), in rule order."""
        return self.categories[len(CATEGORIES) :]

    @property
    def num_events(self) -> int:
        return len(self.timeline)

    @cached_property
    def peak(self) -> Peak:
        """The highest point of ``live_bytes`` (the first event that reaches it if several do), the state before the
        first event included: a trace that begins by freeing blocks made before recording can peak before it starts
        (``index == -1``, only when no event reaches as much: an event is a place in the trace to show)."""
        tl = self.timeline
        if len(tl) == 0:
            return self.peak_at(-1)
        live = tl["live_bytes"].to_numpy()
        index = int(np.argmax(live))
        if int(self.seed_bytes) > int(live[index]):
            return self.peak_at(-1)
        return self.peak_at(index)

    def allocations_reserved_end(self) -> int:
        return int(self.allocations.attrs.get("reserved_end", 0))

    def reserved_start(self) -> int:
        """Reserved bytes before the first event (the dump-time total when there is no trace)."""
        if len(self.timeline) == 0:
            return self.allocations_reserved_end()
        return int(self.timeline.attrs.get("reserved_start", 0))

    def peak_at(self, index: int) -> Peak:
        """The state at row ``index`` as a :class:`Peak` (``-1``: before the first event, at the first event's time;
        the dump when there is no trace)."""
        tl = self.timeline
        live = self.live_allocations(index)
        inferred_bytes = int(live["size"][live["inferred"]].sum())
        if index < 0 or len(tl) == 0:
            return Peak(
                self.device,
                -1,
                int(tl["time_us"].iloc[0]) if len(tl) else 0,
                int(self.seed_bytes),
                self.reserved_start(),
                "outside",
                -1,
                self._breakdown(-1),
                self._sites(-1),
                inferred_bytes,
            )
        row = tl.iloc[index]
        return Peak(
            inferred_bytes=inferred_bytes,
            device=self.device,
            index=index,
            time_us=int(row["time_us"]),
            live_bytes=int(row["live_bytes"]),
            reserved_bytes=int(row["reserved_bytes"]),
            stage=str(row["phase"]),
            step=int(row["step"]),
            by_category=self._breakdown(index),
            sites=self._sites(index),
        )

    def live_allocations(self, index: int) -> pd.DataFrame:
        """The allocations alive just after row ``index``."""
        al = self.allocations
        mask = (al["alloc_index"].to_numpy() <= index) & (al["end_index"].to_numpy() > index)
        return al[mask]

    def categories_at(self, index: int) -> dict[str, int]:
        """Live bytes per category just after row ``index`` (``-1``: before the first event), largest first."""
        return self._breakdown(index)

    def _breakdown(self, index: int) -> dict[str, int]:
        live = self.live_allocations(index)
        sums = live.groupby("category", observed=True)["size"].sum()
        out = {str(k): int(v) for k, v in sums.items() if int(v) != 0}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _sites(self, index: int) -> pd.DataFrame:
        live = self.live_allocations(index)
        if len(live) == 0:
            return pd.DataFrame(columns=SITE_COLUMNS)
        # one row per site and category: a site's bytes in category C never exceed C's total
        grouped = (
            live.groupby(["site", "file", "line", "function", "category"], observed=True, sort=False)
            .agg(bytes=("size", "sum"), count=("size", "size"))
            .reset_index()
            .sort_values(["bytes", "count"], ascending=[False, False], kind="stable")
            .reset_index(drop=True)
        )
        grouped["site"] = grouped["site"].astype(str)
        grouped["category"] = grouped["category"].astype(str)
        grouped["bytes"] = grouped["bytes"].astype("int64")
        grouped["count"] = grouped["count"].astype("int64")
        return grouped[SITE_COLUMNS]

    def category_series(self, rows: np.ndarray | None = None, categories: Sequence[str] | None = None) -> pd.DataFrame:
        """Live bytes per category after each row in ``rows`` (all rows when None); columns are categories.

        Every row sums exactly to ``live_bytes`` of the same row (when all categories are asked for).

        Args:
            rows: Rows to report.
            categories: Only these categories (all present ones when None).
        """
        tl = self.timeline
        n = len(tl)
        if rows is None:
            rows = np.arange(n)
        al = self.allocations
        out: dict[str, np.ndarray] = {}
        alloc_idx = al["alloc_index"].to_numpy()
        end_idx = al["end_index"].to_numpy()
        sizes = al["size"].to_numpy()
        codes = al["category"].cat.codes.to_numpy()
        cats = list(al["category"].cat.categories)
        for code, name in enumerate(cats):
            if categories is not None and str(name) not in categories:
                continue
            mask = codes == code
            if not mask.any():
                continue
            a = alloc_idx[mask]
            e = end_idx[mask]
            s = sizes[mask]
            seed = int(s[a < 0].sum())
            delta = scatter_add(n, a[a >= 0], s[a >= 0]) - scatter_add(n, e[e < n], s[e < n])
            series = seed + np.cumsum(delta)
            out[str(name)] = series[rows]
        ordered = {k: out[k] for k in self.categories if k in out}
        ordered.update({k: v for k, v in out.items() if k not in ordered})
        return pd.DataFrame(ordered, index=rows)


@dataclasses.dataclass
class Replay:
    """The replay of a whole snapshot: one :class:`DeviceReplay` per device that has a trace or live blocks.

    Attributes:
        devices: Per-device replays, by device index.
        source: Name of the snapshot.
        is_memtrace: Whether MemTrace wrote the snapshot (its categories and phases are used).
        memtrace: MemTrace's header, if any.
        allocator_settings: The snapshot's ``allocator_settings``.
        reserved_end_bytes: Sum of segment sizes at dump time, all devices.
        categories: Every category of the replay, in chart order (built-in ones, then user rules' names).
        category_rules: The user rules applied, ``{name: regex}`` in matching order (``--rule`` first, then the
            header's ``category_rules``); ``{}``: none.
        snapshot: The snapshot's data the replay was made from (to serve its trace again, see
            :mod:`~lightning_memtrace.analysis.allocator_replay`), or None.
    """

    devices: dict[int, DeviceReplay]
    source: str
    is_memtrace: bool
    memtrace: dict[str, Any] | None
    allocator_settings: dict[str, Any]
    reserved_end_bytes: int
    num_segments: int
    categories: tuple[str, ...] = CATEGORIES
    category_rules: dict[str, str] = dataclasses.field(default_factory=dict)
    snapshot: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @cached_property
    def expandable_what_if(self) -> ExpandableWhatIf | None:
        """What the main device's trace would have reserved with ``expandable_segments:True`` (see
        :func:`~lightning_memtrace.analysis.allocator_replay.expandable_segments_what_if`); None without the
        snapshot's data or a trace the caching allocator's model serves as the GPU did."""
        if self.snapshot is None or not self.devices:
            return None
        from lightning_memtrace.analysis.allocator_replay import expandable_segments_what_if

        return expandable_segments_what_if(self.snapshot, self.main.device)

    @property
    def main(self) -> DeviceReplay:
        """The device with the highest peak."""
        if not self.devices:
            raise ValueError("empty replay")
        return max(self.devices.values(), key=lambda d: (d.peak.live_bytes, -d.device))

    @property
    def peak(self) -> Peak:
        return self.main.peak

    @property
    def timeline(self) -> pd.DataFrame:
        """All devices' timelines, one after the other, with a ``device`` column."""
        frames = []
        for device, rep in sorted(self.devices.items()):
            frame = rep.timeline.copy()
            frame.insert(0, "device", device)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    @property
    def num_events(self) -> int:
        return sum(d.num_events for d in self.devices.values())

    @property
    def inferred(self) -> bool:
        """Whether any category shown was inferred rather than recorded."""
        return any(bool(d.allocations["inferred"].any()) for d in self.devices.values())
