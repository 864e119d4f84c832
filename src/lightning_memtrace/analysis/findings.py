"""Plain-language findings from a replay (and MemTrace's phases table): where the peak is, what it is made of, what
to change. Every finding carries its numbers as integers (bytes) so that tests and tools can check them."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import pandas as pd

from lightning_memtrace.analysis.model import Replay
from lightning_memtrace.types import CATEGORY_LABELS
from lightning_memtrace.units import format_bytes


class Severity(str, Enum):
    """How much a finding matters."""

    INFO = "info"
    WARNING = "warning"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding.

    Attributes:
        code: Stable identifier (``peak``, ``stale_gradients``, ``fragmentation``...).
        message: The sentence shown to the user, with numbers.
        severity: ``info`` or ``warning``.
        numbers: The figures behind the message (bytes as ints, ratios as floats).
    """

    code: str
    message: str
    severity: Severity = Severity.INFO
    numbers: dict[str, Any] = dataclasses.field(default_factory=dict)


_ADVICE = {
    "activations": "gradient checkpointing, a smaller micro-batch (with gradient accumulation) or mixed precision "
    "lowers it",
    "optimizer_state": "a sharded optimizer (FSDP / ZeRO), an 8-bit optimizer or a stateless one (SGD) lowers it",
    "parameters": "bf16/fp16 weights, sharding (FSDP) or a smaller model lowers it",
    "gradients": "sharding gradients (FSDP / ZeRO-2), lower-precision gradients or freezing layers lowers it",
    "optimizer_intermediates": "a fused optimizer (fused=True) or foreach=False avoids these temporary copies",
    "intermediates": "fusing operations (torch.compile) or in-place ops lowers these temporaries",
    "inputs": "a smaller batch, or moving data to the device one batch at a time, lowers it",
    "pre_existing": "it was allocated before recording began: start recording earlier to see what it is",
    "other": "look at the largest allocation sites below",
}

_STAGE_WORDS = {
    "forward": "forward",
    "backward": "backward",
    "optimizer_step": "the optimizer step",
    "zero_grad": "zero_grad",
    "init": "model set-up",
    "after_step": "the end of the step",
    "validation": "validation",
    "outside": "outside a training pass",
}


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def _function_note(row: pd.Series) -> str:
    site, function = str(row["site"]), str(row["function"])
    return "" if site == function else f" ({function})"


def _where(stage: str, step: int) -> str:
    words = _STAGE_WORDS.get(stage, stage)
    return f"in {words} of step {step}" if step >= 0 else f"in {words}"


def compute_findings(replay: Replay, phases: pd.DataFrame | None = None, max_sites: int = 1) -> list[Finding]:
    """Findings for the main device of a replay, plus the per-phase table when given.

    Args:
        replay: The replay.
        phases: MemTrace's phases table (``load_phases``), or None.
        max_sites: How many allocation sites to name.

    Returns:
        Findings, most important first.
    """
    out: list[Finding] = []
    main = replay.main
    peak = main.peak
    total = peak.live_bytes
    if not replay.is_memtrace and replay.inferred:
        inferred = " (categories inferred from stack frames)"
    elif peak.inferred_bytes > 0 and total > 0:
        inferred = f" ({_pct(peak.inferred_bytes, total):.0f}% of these bytes categorised by inference)"
    else:
        inferred = ""
    if peak.by_category:
        top_cat, top_bytes = next(iter(peak.by_category.items()))
        parts = ", ".join(
            f"{CATEGORY_LABELS.get(c, c)} {_pct(b, total):.0f}% ({format_bytes(b)})"
            for c, b in list(peak.by_category.items())[:3]
        )
        where = _where(peak.stage, peak.step) if peak.index >= 0 else "at dump time"
        message = (
            f"peak {format_bytes(total)} ({total:,} B) {where}: {parts}; "
            f"the largest share is {CATEGORY_LABELS.get(top_cat, top_cat)}: "
            f"{_ADVICE.get(top_cat, _ADVICE['other'])}{inferred}"
        )
        out.append(
            Finding(
                "peak",
                message,
                Severity.INFO,
                {
                    "peak_bytes": total,
                    "stage": peak.stage,
                    "step": peak.step,
                    "top_category": top_cat,
                    "top_bytes": int(top_bytes),
                    "by_category": dict(peak.by_category),
                },
            )
        )
    elif total == 0:
        out.append(
            Finding("empty", "the snapshot holds no live allocation and no trace", Severity.INFO, {"peak_bytes": 0})
        )

    # Gradients of the previous step alive during forward.
    tl = main.timeline
    if len(tl) and main.allocations["category"].isin(["gradients"]).any():
        fwd_rows = (tl["phase"] == "forward").to_numpy().nonzero()[0]
        if len(fwd_rows):
            series = main.category_series(fwd_rows, categories=["gradients"])
            if "gradients" in series:
                grads = series["gradients"]
                best = int(grads.max())
                if best > 0.01 * max(total, 1):
                    row = int(grads.idxmax())
                    step = int(tl["step"].iat[row])
                    out.append(
                        Finding(
                            "stale_gradients",
                            f"the previous step's gradients, {format_bytes(best)} ({best:,} B), are alive during "
                            f"forward{f' of step {step}' if step >= 0 else ''}: call "
                            "optimizer.zero_grad(set_to_none=True) right after optimizer.step() (Lightning does by "
                            "default) to free them before the next forward",
                            Severity.WARNING,
                            {"gradients_bytes": best, "row": row, "step": step},
                        )
                    )

    # Fragmentation: reserved beyond allocated at the peak.
    device_kind = str((replay.memtrace or {}).get("device", "cuda"))
    if main.reserved_known and not device_kind.startswith("cpu") and total > 0:
        reserved = max(peak.reserved_bytes, 0)
        if reserved > total:
            extra = reserved - total
            ratio = extra / total
            expandable = bool(replay.allocator_settings.get("expandable_segments", False))
            if ratio >= 0.2:
                hint = (
                    "expandable_segments is already on: fewer distinct tensor sizes (padding, bucketing) helps"
                    if expandable
                    else "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
                )
                out.append(
                    Finding(
                        "fragmentation",
                        f"reserved exceeds allocated by {ratio * 100:.0f}% at the peak ({format_bytes(reserved)} "
                        f"reserved, {format_bytes(total)} allocated, {format_bytes(extra)} cached but unused): {hint}",
                        Severity.WARNING,
                        {"reserved_bytes": reserved, "allocated_bytes": total, "extra_bytes": extra, "ratio": ratio},
                    )
                )
            elif ratio >= 0.05:
                out.append(
                    Finding(
                        "reserved",
                        f"reserved exceeds allocated by {ratio * 100:.0f}% at the peak ({format_bytes(reserved)} "
                        f"reserved for {format_bytes(total)} allocated): little fragmentation",
                        Severity.INFO,
                        {"reserved_bytes": reserved, "allocated_bytes": total, "extra_bytes": extra, "ratio": ratio},
                    )
                )

    # Largest sites.
    sites = peak.sites
    if len(sites):
        sites = sites[sites["category"] != "pre_existing"]  # covered by the pre_existing finding
    for _, row in sites.head(max_sites).iterrows():
        if total <= 0:
            break
        b = int(row["bytes"])
        out.append(
            Finding(
                "top_site",
                f"{row['site']}{_function_note(row)} holds "
                f"{format_bytes(b)} ({b:,} B) in {int(row['count']):,} "
                f"allocation(s) at the peak, {_pct(b, total):.0f}% of it "
                f"({CATEGORY_LABELS.get(str(row['category']), row['category'])})",
                Severity.INFO,
                {"site": str(row["site"]), "bytes": b, "count": int(row["count"])},
            )
        )

    # Recording started late.
    if main.seed_bytes > 0 and total > 0 and len(tl):
        share = (
            f"{format_bytes(main.seed_bytes)} ({main.seed_bytes:,} B, {_pct(main.seed_bytes, total):.0f}% of the peak)"
        )
        if replay.is_memtrace:
            steps = (replay.memtrace or {}).get("steps")
            window = f" (steps {steps[0]}-{steps[1]})" if isinstance(steps, list) and len(steps) == 2 else ""
            message = f"{share} was already allocated when this snapshot's window{window} began"
        else:
            message = (
                f"{share} was allocated before recording began (taken from the snapshot's segments); call "
                "torch.cuda.memory._record_memory_history() before building the model to see what it is"
            )
            grads = int(peak.by_category.get("gradients", 0))
            if grads and abs(grads - main.seed_bytes) <= 0.01 * grads:
                message += f" (it is the size of the gradients, {format_bytes(grads)}: most likely the parameters)"
        out.append(Finding("pre_existing", message, Severity.INFO, {"seed_bytes": main.seed_bytes}))
    if main.unknown_frees:
        out.append(
            Finding(
                "unknown_frees",
                f"{main.unknown_frees} free(s) of allocations made before the trace began (recording started late or "
                "its ring buffer dropped them): counted as pre-existing",
                Severity.INFO,
                {"unknown_frees": main.unknown_frees},
            )
        )

    # Out-of-memory events.
    for row in main.oom_rows[:3]:
        size = int(tl["size"].iat[row])
        live = int(tl["live_bytes"].iat[row])
        stage = str(tl["phase"].iat[row])
        step = int(tl["step"].iat[row])
        out.append(
            Finding(
                "oom",
                f"out of memory {_where(stage, step)}: {format_bytes(size)} ({size:,} B) requested with "
                f"{format_bytes(live)} live",
                Severity.WARNING,
                {"requested_bytes": size, "live_bytes": live, "row": row},
            )
        )

    if len(replay.devices) > 1:
        peaks = ", ".join(f"device {d}: {format_bytes(r.peak.live_bytes)}" for d, r in sorted(replay.devices.items()))
        out.append(
            Finding(
                "devices",
                f"{len(replay.devices)} devices in the snapshot ({peaks}); the report shows device {main.device}",
                Severity.INFO,
                {"devices": sorted(replay.devices)},
            )
        )

    if phases is not None and len(phases):
        out.extend(phase_findings(phases))
    return out


def phase_findings(phases: pd.DataFrame) -> list[Finding]:
    """Findings from MemTrace's per-phase table: the phase with the highest peak and its composition."""
    out: list[Finding] = []
    if "peak_bytes" not in phases or not len(phases):
        return out
    row = phases.loc[phases["peak_bytes"].idxmax()]
    peak = int(row["peak_bytes"])
    cats = {
        c: int(row[f"{c}_bytes"])
        for c in ("parameters", "gradients", "optimizer_state", "activations", "inputs", "other")
        if f"{c}_bytes" in row and int(row[f"{c}_bytes"]) > 0
    }
    allocated = int(row.get("allocated_bytes", 0))
    composition = ", ".join(
        f"{CATEGORY_LABELS.get(c, c)} {format_bytes(b)}" for c, b in sorted(cats.items(), key=lambda kv: -kv[1])[:3]
    )
    out.append(
        Finding(
            "phase_peak",
            f"highest peak in the phases table: {format_bytes(peak)} ({peak:,} B) by {row['phase']} of step "
            f"{int(row['step'])} (rank {int(row['rank'])}); at that row {format_bytes(allocated)} was allocated"
            + (f": {composition}" if composition else ""),
            Severity.INFO,
            {"peak_bytes": peak, "step": int(row["step"]), "phase": str(row["phase"]), "rank": int(row["rank"])},
        )
    )
    return out


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
    percent = _pct(diff, low) if low > 0 else (0.0 if diff == 0 else None)
    return RankImbalance(dict(sorted(clean.items())), basis, high_rank, low_rank, high, low, diff, percent)


def rank_imbalance_finding(imbalance: RankImbalance | None) -> Finding | None:
    """A warning when one rank peaks more than :data:`RANK_IMBALANCE_PERCENT` above another; None otherwise."""
    if imbalance is None or not imbalance.exceeds:
        return None
    return Finding(
        "rank_imbalance",
        f"ranks are imbalanced ({imbalance.basis}, {len(imbalance.peaks)} ranks): {imbalance.sentence()}; every rank "
        "must fit in the same memory, so the highest one sets the limit: uneven batches or sequence lengths, work "
        "done on one rank only (logging, metrics, checkpointing, validation) or uneven sharding are the usual causes",
        Severity.WARNING,
        {
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
