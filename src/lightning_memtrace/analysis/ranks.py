"""Ranks side by side: each rank's peak (snapshot replay and phases CSV) and the imbalance between them."""

from __future__ import annotations

import dataclasses

import pandas as pd

from lightning_memtrace.analysis.findings import Finding, Severity, compute_findings, compute_findings_phases_only
from lightning_memtrace.analysis.source import LoadedSnapshot, ReportSource
from lightning_memtrace.types import ROW_CATEGORIES, TRAIN_PHASES, category_label
from lightning_memtrace.units import format_bytes, percent

#: A rank whose peak is more than this percent above the lowest rank's gets a warning.
RANK_IMBALANCE_PERCENT = 5.0


@dataclasses.dataclass(frozen=True)
class RankImbalance:
    """The spread of peaks across ranks: the highest rank's peak minus the lowest rank's.

    Attributes:
        peaks: Peak bytes per rank.
        basis: Where the peaks come from (``snapshot replay`` or ``phases CSV``).
        high_rank: The rank with the highest peak (the lowest such rank on ties).
        low_rank: The rank with the lowest peak (the lowest such rank on ties).
        high_bytes: Its peak.
        low_bytes: Its peak.
        imbalance_bytes: ``high_bytes - low_bytes``.
        percent: ``imbalance_bytes`` as a percent of ``low_bytes``; None when ``low_bytes`` is 0.
    """

    peaks: dict[int, int]
    basis: str
    high_rank: int
    low_rank: int
    high_bytes: int
    low_bytes: int
    imbalance_bytes: int
    percent: float | None

    def sentence(self) -> str:
        """E.g. ``rank 1 peaks 12.0 MiB (12,582,912 B, 8.0%) above rank 0 (160.0 MiB vs 148.0 MiB)``."""
        if self.imbalance_bytes == 0:
            return f"every rank peaks at {format_bytes(self.high_bytes)} ({self.high_bytes:,} B)"
        pct = f", {self.percent:.1f}%" if self.percent is not None else ""
        return (
            f"rank {self.high_rank} peaks {format_bytes(self.imbalance_bytes)} ({self.imbalance_bytes:,} B{pct}) "
            f"above rank {self.low_rank} ({format_bytes(self.high_bytes)} vs {format_bytes(self.low_bytes)})"
        )

    @property
    def exceeds(self) -> bool:
        """Above :data:`RANK_IMBALANCE_PERCENT` (or any imbalance over a rank that peaks at 0 bytes)."""
        if self.imbalance_bytes <= 0:
            return False
        return self.percent is None or self.percent > RANK_IMBALANCE_PERCENT


def rank_imbalance(peaks: dict[int, int], basis: str) -> RankImbalance | None:
    """The imbalance between ranks' peaks; None for fewer than two ranks."""
    if len(peaks) < 2:
        return None
    clean = {int(r): int(b) for r, b in peaks.items()}
    high_rank = min(clean, key=lambda r: (-clean[r], r))
    low_rank = min(clean, key=lambda r: (clean[r], r))
    high, low = clean[high_rank], clean[low_rank]
    diff = high - low
    share = percent(diff, low) if low > 0 else (0.0 if diff == 0 else None)
    return RankImbalance(dict(sorted(clean.items())), basis, high_rank, low_rank, high, low, diff, share)


def imbalance_parts(phases: pd.DataFrame | None, high_rank: int, low_rank: int) -> dict[str, int]:
    """Why one rank peaks above another: per category, what the high rank's peak row holds beyond the low rank's
    (the rows with each rank's highest ``peak_bytes`` in the phases CSV; ``transient`` is the peak above what stayed
    allocated at the row), largest difference first, only the differences that are not zero."""
    if phases is None or not len(phases) or "rank" not in phases:
        return {}
    rows = {}
    for rank in (high_rank, low_rank):
        mine = phases[phases["rank"] == rank]
        if not len(mine):
            return {}
        rows[rank] = mine.loc[mine["peak_bytes"].idxmax()]
    parts = {
        category: int(rows[high_rank][f"{category}_bytes"]) - int(rows[low_rank][f"{category}_bytes"])
        for category in ROW_CATEGORIES
        if f"{category}_bytes" in phases
    }
    high, low = rows[high_rank], rows[low_rank]
    parts["transient"] = int(high.peak_bytes - high.allocated_bytes) - int(low.peak_bytes - low.allocated_bytes)
    return dict(sorted(((c, b) for c, b in parts.items() if b), key=lambda kv: -abs(kv[1])))


def _parts_sentence(parts: dict[str, int]) -> str:
    shown = [f"{format_bytes(abs(b))} {'more' if b > 0 else 'less'} {category_label(c)}" for c, b in parts.items()]
    return f"; at its peak row it holds {', '.join(shown[:3])}" if shown else ""


def rank_imbalance_finding(imbalance: RankImbalance | None, parts: dict[str, int] | None = None) -> Finding | None:
    """A warning when one rank peaks more than :data:`RANK_IMBALANCE_PERCENT` above another, saying which categories
    make the difference (``parts``, from :func:`imbalance_parts`); None otherwise."""
    if imbalance is None or not imbalance.exceeds:
        return None
    return Finding(
        "rank_imbalance",
        f"ranks are imbalanced ({imbalance.basis}, {len(imbalance.peaks)} ranks): {imbalance.sentence()}"
        f"{_parts_sentence(parts or {})}; every rank "
        "must fit in the same memory, so the highest one sets the limit: uneven batches or sequence lengths, work "
        "done on one rank only (logging, metrics, checkpointing, validation) or uneven sharding are the usual causes",
        Severity.WARNING,
        {
            "by_category": dict(parts or {}),
            "peaks": dict(imbalance.peaks),
            "basis": imbalance.basis,
            "high_rank": imbalance.high_rank,
            "low_rank": imbalance.low_rank,
            "high_bytes": imbalance.high_bytes,
            "low_bytes": imbalance.low_bytes,
            "imbalance_bytes": imbalance.imbalance_bytes,
            "percent": imbalance.percent,
        },
    )


#: Phases of the CSV shown per rank (those present in the folder).
RANK_PHASES = tuple(p.value for p in TRAIN_PHASES)


@dataclasses.dataclass
class RankPeak:
    """One rank of a multi-rank log folder.

    Attributes:
        rank: The rank.
        snapshot: That rank's snapshot with the highest peak, or None (a rank with only the phases CSV).
        peak_bytes: Peak live bytes of ``snapshot``'s replay, or None.
        phase_peaks: Per phase, the max of ``peak_bytes`` over that rank's rows of the phases CSV.
        phases_peak: The max of ``peak_bytes`` over every row of that rank in the phases CSV, or None.
    """

    rank: int
    snapshot: LoadedSnapshot | None
    peak_bytes: int | None
    phase_peaks: dict[str, int]
    phases_peak: int | None = None


@dataclasses.dataclass
class RankOverview:
    """Every rank of a log folder side by side (only built for more than one rank)."""

    ranks: list[RankPeak]
    phase_columns: list[str]
    imbalance: RankImbalance | None
    #: What the highest rank's peak row holds beyond the lowest rank's, per category (see :func:`imbalance_parts`).
    imbalance_parts: dict[str, int] = dataclasses.field(default_factory=dict)


def _snapshots_by_rank(source: ReportSource) -> dict[int, list[LoadedSnapshot]]:
    by_rank: dict[int, list[LoadedSnapshot]] = {}
    for s in source.snapshots:
        if s.rank is not None:
            by_rank.setdefault(s.rank, []).append(s)
    return by_rank


def _phase_ranks(phases: pd.DataFrame | None) -> set[int]:
    if phases is not None and len(phases) and "rank" in phases:
        return {int(r) for r in phases["rank"].unique()}
    return set()


def _rank_peak(rank: int, snaps: list[LoadedSnapshot], phases: pd.DataFrame | None, columns: list[str]) -> RankPeak:
    """One rank's row: its highest-peak snapshot, and the maxima of its rows of the phases CSV."""
    best = max(snaps, key=lambda s: s.replay.peak.live_bytes) if snaps else None
    phase_peaks: dict[str, int] = {}
    phases_peak: int | None = None
    if phases is not None and rank in _phase_ranks(phases):
        mine = phases[phases["rank"] == rank]
        maxima = mine.groupby(mine["phase"].astype(str))["peak_bytes"].max()
        phase_peaks = {p: int(maxima[p]) for p in columns if p in maxima.index}
        phases_peak = int(mine["peak_bytes"].max())
    return RankPeak(rank, best, int(best.replay.peak.live_bytes) if best else None, phase_peaks, phases_peak)


def _imbalance(rows: list[RankPeak]) -> RankImbalance | None:
    """Snapshot peaks when every rank has one (or CSV peaks do not cover every rank), else the CSV's peaks."""
    snap_peaks = {r.rank: r.peak_bytes for r in rows if r.peak_bytes is not None}
    csv_peaks = {r.rank: r.phases_peak for r in rows if r.phases_peak is not None}
    if len(snap_peaks) == len(rows) or (len(snap_peaks) >= 2 and len(csv_peaks) < len(rows)):
        return rank_imbalance(snap_peaks, "snapshot replay peaks")  # type: ignore[arg-type]
    return rank_imbalance(csv_peaks, "phases CSV peaks")  # type: ignore[arg-type]


def rank_overview(source: ReportSource) -> RankOverview | None:
    """Per-rank peaks and the imbalance between ranks; None when the source holds fewer than two ranks.

    The imbalance compares snapshot replay peaks when every rank has a snapshot, else the phases CSV's peaks when
    every rank has rows there, else whichever of the two covers at least two ranks.
    """
    by_rank = _snapshots_by_rank(source)
    phases = source.phases
    ranks = sorted(set(by_rank) | _phase_ranks(phases))
    if len(ranks) < 2:
        return None
    present = set(phases["phase"].astype(str)) if phases is not None and len(phases) else set()
    columns = [p for p in RANK_PHASES if p in present]
    rows = [_rank_peak(rank, by_rank.get(rank, []), phases, columns) for rank in ranks]
    imbalance = _imbalance(rows)
    parts = imbalance_parts(phases, imbalance.high_rank, imbalance.low_rank) if imbalance is not None else {}
    return RankOverview(rows, columns, imbalance, parts)


def source_findings(source: ReportSource, overview: RankOverview | None) -> list[Finding]:
    """Every finding of one run, as the report, ``memtrace summary`` and its ``--json`` give them: the main
    snapshot's (with the phases CSV's), or the phases CSV's alone where there is no snapshot, and the rank imbalance
    of ``overview`` (:func:`rank_overview`) right after the peak."""
    if source.main is not None:
        findings = compute_findings(source.main.replay, source.phases)
    else:
        assert source.phases is not None  # a source is a snapshot, a phases CSV or both
        findings = compute_findings_phases_only(source.phases)
    return add_rank_finding(findings, overview)


def add_rank_finding(findings: list[Finding], overview: RankOverview | None) -> list[Finding]:
    """Put the rank-imbalance warning (when there is one) right after the ``peak`` finding."""
    finding = rank_imbalance_finding(overview.imbalance, overview.imbalance_parts) if overview is not None else None
    if finding is not None:
        at = 1 if findings and findings[0].code in ("peak", "empty") else 0
        findings.insert(at, finding)
    return findings
