"""The one view of memory at a moment (a replay's peak, or the moment of an out-of-memory error): total, reserved,
shares by category and the largest sites, computed once and shown by the HTML report, ``memtrace summary`` and the
post-mortem text alike.

No pandas here (the post-mortem is written during training): a replay's site table is read by duck typing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_memtrace.analysis.frames import format_frame, user_frame
from lightning_memtrace.types import SHARDED_CATEGORIES, Category, category_label
from lightning_memtrace.units import percent

if TYPE_CHECKING:
    from lightning_memtrace.analysis.model import DeviceReplay, Peak
    from lightning_memtrace.analysis.postmortem import LiveBlock, PostMortem
    from lightning_memtrace.analysis.source import LoadedSnapshot

#: Sites a view keeps unless asked for more (the report's table shows 25).
DEFAULT_SITES = 25


def stage_and_step(stage: Any, step: int) -> str:
    """``"forward, step 3"``, or ``"forward"`` where no step is known (``step < 0``: a snapshot without MemTrace's
    marks)."""
    return f"{stage}, step {step}" if step >= 0 else str(stage)


@dataclasses.dataclass(frozen=True)
class Share:
    """One category's bytes and share of the total."""

    category: str
    bytes: int
    percent: float

    @property
    def label(self) -> str:
        return category_label(self.category)


@dataclasses.dataclass(frozen=True)
class SiteRow:
    """One allocation site (or live block): where, what for, how much."""

    where: str
    function: str
    category: str
    bytes: int
    count: int
    percent: float
    note: str = ""  # the post-mortem's block tag (``phase=... step=...``)

    @property
    def label(self) -> str:
        return category_label(self.category)


@dataclasses.dataclass(frozen=True)
class MemoryView:
    """The numbers every output shows about one moment.

    Attributes:
        total_bytes: Live (allocated) bytes.
        reserved_bytes: Reserved bytes (0 when unknown).
        categories: Shares by category (largest first for a replay; every category in order for a post-mortem).
        sites: The largest sites, largest first (at most the number asked for).
        site_count: How many sites there are in all.
        stage: The stage at that moment; ``step``: its step (-1: unknown).
        at_dump_time: The snapshot has no trace: the moment is the dump.
        before_trace: The moment is before the trace's first event (it begins by freeing blocks made before recording).
        inferred_bytes: Bytes whose category was inferred.
        name, device, events, segments, reserved_known, is_memtrace, inferred, rule_categories, category_rules: About
            the snapshot (replays only).
    """

    total_bytes: int
    reserved_bytes: int
    categories: list[Share]
    sites: list[SiteRow]
    site_count: int
    stage: str
    step: int
    at_dump_time: bool = False
    before_trace: bool = False
    inferred_bytes: int = 0
    name: str = ""
    device: Any = None
    events: int = 0
    segments: int = 0
    reserved_known: bool = False
    is_memtrace: bool = False
    inferred: bool = False
    #: The categories user rules added (not built in), in rule order; ``category_rules``: the rules applied.
    rule_categories: tuple[str, ...] = ()
    category_rules: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def by_category(self) -> dict[str, int]:
        return {s.category: s.bytes for s in self.categories}

    @property
    def moment(self) -> str | None:
        """``"forward, step 3"`` (``"forward"`` where no step is known, ``"before the first event"``); None at dump
        time."""
        if self.at_dump_time:
            return None
        if self.before_trace:
            return "before the first event"
        return stage_and_step(self.stage, self.step)

    @property
    def inferred_percent(self) -> float:
        return percent(self.inferred_bytes, self.total_bytes)


def shares(by_category: dict[str, int], total: int) -> list[Share]:
    """Shares in the order of ``by_category``."""
    return [Share(str(c), int(b), percent(b, total)) for c, b in by_category.items()]


def site_where(file: Any, line: Any) -> str:
    """``file:line``, or ``(no Python frame)``."""
    return f"{file}:{line}" if file else "(no Python frame)"


def snapshot_view(loaded: LoadedSnapshot, max_sites: int = DEFAULT_SITES) -> MemoryView:
    """The view of a replayed snapshot at its main device's peak."""
    dev = loaded.replay.main
    return moment_view(loaded, dev, dev.peak, max_sites)


def moment_view(loaded: LoadedSnapshot, dev: DeviceReplay, moment: Peak, max_sites: int = DEFAULT_SITES) -> MemoryView:
    """The view of one device of a replayed snapshot at any moment (its peak, or an answer of
    :mod:`~lightning_memtrace.analysis.questions`)."""
    rep = loaded.replay
    total = int(moment.live_bytes)
    sites = [
        SiteRow(
            site_where(row["file"], row["line"]),
            str(row["function"]),
            str(row["category"]),
            int(row["bytes"]),
            int(row["count"]),
            percent(int(row["bytes"]), total),
        )
        for row in moment.sites.head(max_sites).to_dict("records")
    ]
    about = {
        "name": loaded.path.name,
        "device": dev.device,
        "events": dev.num_events,
        "segments": rep.num_segments,
        "reserved_known": dev.reserved_known,
        "is_memtrace": rep.is_memtrace,
        "inferred": rep.inferred,
        "rule_categories": tuple(dev.rule_categories),
        "category_rules": dict(rep.category_rules),
    }
    when = {
        "stage": str(moment.stage),
        "step": int(moment.step),
        "at_dump_time": moment.index < 0 and dev.num_events == 0,
        "before_trace": moment.index < 0 and dev.num_events > 0,
    }
    return MemoryView(
        total_bytes=total,
        reserved_bytes=int(moment.reserved_bytes),
        categories=shares(moment.by_category, total),
        sites=sites,
        site_count=len(moment.sites),
        inferred_bytes=int(moment.inferred_bytes),
        **when,
        **about,
    )


def _block_where(block: LiveBlock, device: str) -> str:
    if block.frames:
        return format_frame(user_frame(block.frames))
    if device.startswith("cuda"):
        return "<no stack: the allocator's history was not recording>"
    if not block.metadata:
        return "<made before MemTrace started>"
    return "<no stack: made outside the history window>"


def post_mortem_view(pm: PostMortem) -> MemoryView:
    """The view at an out-of-memory error: every category in order (the sharded ones where they hold memory), the
    largest live blocks."""
    total = pm.allocated_bytes
    by_category = {
        c.value: int(pm.categories.get(c.value, 0))
        for c in Category
        if c not in SHARDED_CATEGORIES or pm.categories.get(c.value, 0)
    }
    sites = [
        SiteRow(_block_where(b, pm.device), "", b.category, b.nbytes, 1, percent(b.nbytes, total), b.metadata)
        for b in pm.largest
    ]
    return MemoryView(
        total_bytes=total,
        reserved_bytes=pm.reserved_bytes,
        categories=shares(by_category, total),
        sites=sites,
        site_count=len(sites),
        stage=pm.stage,
        step=pm.step,
    )
