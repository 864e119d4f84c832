"""Plain-language findings from a replay (and MemTrace's phases table): where the peak is, what it is made of, what
to change. Every finding carries its numbers as integers (bytes) so that tests and tools can check them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from lightning_memtrace.analysis.growth import growth
from lightning_memtrace.analysis.model import Replay
from lightning_memtrace.capture.ddp_buckets import bucket_view_saving
from lightning_memtrace.schema import header_ddp_bucket_bytes, header_is_cpu, header_steps
from lightning_memtrace.types import ROW_CATEGORIES, STAGES, Stage, TextEnum, category_label
from lightning_memtrace.units import format_bytes, percent


class Severity(TextEnum):
    """How much a finding matters."""

    INFO = "info"
    WARNING = "warning"


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
    "optimizer_state": "a sharded optimizer (FSDP / ZeRO), an 8-bit optimizer or a stateless one (SGD without momentum) lowers it",
    "parameters": "bf16/fp16 weights, sharding (FSDP) or a smaller model lowers it",
    "gradients": "sharding gradients (FSDP / ZeRO-2), lower-precision gradients or freezing layers lowers it",
    "optimizer_intermediates": "a fused optimizer (fused=True) or foreach=False avoids these temporary copies",
    "intermediates": "fusing operations (torch.compile) or in-place ops lowers these temporaries",
    "unsharded_parameters": "reshard_after_forward=True on each fully_shard-ed block frees them after each block's "
    "forward (one more all-gather per block in backward)",
    "unsharded_gradients": "they are reduce-scattered into the sharded gradients as each block's backward ends; "
    "accumulating without gradient sync keeps them whole",
    "inputs": "a smaller batch, or moving data to the device one batch at a time, lowers it",
    "pre_existing": "it was allocated before recording began: start recording earlier to see what it is",
    "other": "look at the largest allocation sites below",
}


def _function_note(row: pd.Series) -> str:
    site, function = str(row["site"]), str(row["function"])
    return "" if site == function else f" ({function})"


def _where(stage: str, step: int) -> str:
    words = Stage(stage).words if stage in STAGES else stage
    if stage == Stage.OUTSIDE.value:  # not a part of the step: "outside a training pass, in step 3"
        return f"{words}, in step {step}" if step >= 0 else words
    return f"in {words} of step {step}" if step >= 0 else f"in {words}"


def _inferred_note(replay: Replay) -> str:
    peak = replay.main.peak
    total = peak.live_bytes
    if not replay.is_memtrace and replay.inferred:
        return " (categories inferred from stack frames)"
    if peak.inferred_bytes > 0 and total > 0:
        return f" ({percent(peak.inferred_bytes, total):.0f}% of these bytes categorised by inference)"
    return ""


def peak_finding(replay: Replay) -> list[Finding]:
    """Where the peak is, its three largest categories and what lowers the largest (``empty`` when nothing is live)."""
    peak = replay.main.peak
    total = peak.live_bytes
    if not peak.by_category:
        if total == 0:
            return [
                Finding("empty", "the snapshot holds no live allocation and no trace", Severity.INFO, {"peak_bytes": 0})
            ]
        return []
    top_cat, top_bytes = next(iter(peak.by_category.items()))
    parts = ", ".join(
        f"{category_label(c)} {percent(b, total):.0f}% ({format_bytes(b)})"
        for c, b in list(peak.by_category.items())[:3]
    )
    if peak.index >= 0:
        where = _where(peak.stage, peak.step)
    else:
        where = "before the first event" if len(replay.main.timeline) else "at dump time"
    message = (
        f"peak {format_bytes(total)} ({total:,} B) {where}: {parts}; "
        f"the largest share is {category_label(top_cat)}: "
        f"{_ADVICE.get(top_cat, _ADVICE['other'])}{_inferred_note(replay)}"
    )
    numbers = {
        "peak_bytes": total,
        "stage": peak.stage,
        "step": peak.step,
        "top_category": top_cat,
        "top_bytes": int(top_bytes),
        "by_category": dict(peak.by_category),
    }
    return [Finding("peak", message, Severity.INFO, numbers)]


def stale_gradients_finding(replay: Replay) -> list[Finding]:
    """The previous step's gradients alive during forward (over 1% of the peak)."""
    main = replay.main
    tl = main.timeline
    if not len(tl) or not main.allocations["category"].isin(["gradients"]).any():
        return []
    fwd_rows = (tl["phase"] == "forward").to_numpy().nonzero()[0]
    if not len(fwd_rows):
        return []
    series = main.category_series(fwd_rows, categories=["gradients"])
    if "gradients" not in series:
        return []
    grads = series["gradients"]
    best = int(grads.max())
    if best <= 0.01 * max(main.peak.live_bytes, 1):
        return []
    row = int(grads.idxmax())
    step = int(tl["step"].iat[row])
    peak = main.peak
    # zeroing them right after optimizer.step() frees them before the next forward: a peak in forward loses them
    at_peak = int(peak.by_category.get("gradients", 0)) if peak.stage == "forward" else 0
    saving = (
        f"the peak, in forward, would drop by up to {format_bytes(at_peak)} ({at_peak:,} B)"
        if at_peak > 0
        else f"the peak{f' (in {peak.stage})' if peak.stage not in ('', 'outside') else ''} would not change"
    )
    message = (
        f"the previous step's gradients, {format_bytes(best)} ({best:,} B), are alive during "
        f"forward{f' of step {step}' if step >= 0 else ''}: Lightning's automatic optimization zeroes them inside "
        "its closure, after training_step and before backward, so they live through every forward. To free them "
        "earlier, override optimizer_step in the LightningModule: call super().optimizer_step(...) and then "
        "optimizer.zero_grad(set_to_none=True) (correct with gradient accumulation too); in a plain PyTorch loop, "
        f"call it right after optimizer.step(). It frees {format_bytes(best)} during forward; {saving}"
    )
    numbers = {"gradients_bytes": best, "row": row, "step": step, "peak_saving_bytes": at_peak}
    return [Finding("stale_gradients", message, Severity.WARNING, numbers)]


def fragmentation_finding(replay: Replay) -> list[Finding]:
    """Reserved beyond allocated at the peak: a warning from 20%, a note from 5% (CUDA only)."""
    main = replay.main
    total = main.peak.live_bytes
    if not main.reserved_known or header_is_cpu(replay.memtrace) or total <= 0:
        return []
    reserved = max(main.peak.reserved_bytes, 0)
    if reserved <= total:
        return []
    extra = reserved - total
    ratio = extra / total
    numbers: dict[str, Any] = {
        "reserved_bytes": reserved, "allocated_bytes": total, "extra_bytes": extra, "ratio": ratio
    }
    expandable_on = bool(replay.allocator_settings.get("expandable_segments", False))
    modelled = "" if expandable_on or ratio < 0.05 else _expandable_note(replay, numbers)
    if ratio >= 0.2:
        hint = (
            "expandable_segments is already on: fewer distinct tensor sizes (padding, bucketing) helps"
            if expandable_on
            else "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
        message = (
            f"reserved exceeds allocated by {ratio * 100:.0f}% at the peak ({format_bytes(reserved)} "
            f"reserved, {format_bytes(total)} allocated, {format_bytes(extra)} cached but unused): {hint}{modelled}"
        )
        return [Finding("fragmentation", message, Severity.WARNING, numbers)]
    if ratio >= 0.05:
        message = (
            f"reserved exceeds allocated by {ratio * 100:.0f}% at the peak ({format_bytes(reserved)} "
            f"reserved for {format_bytes(total)} allocated): little fragmentation{modelled}"
        )
        return [Finding("reserved", message, Severity.INFO, numbers)]
    return []


#: The least an allocator setting must save (bytes, and share of what is reserved) for a finding to name it.
_SAVING_SHOWN_BYTES, _SAVING_SHOWN_SHARE = 64 * 1024**2, 0.01


def _expandable_note(replay: Replay, numbers: dict[str, Any]) -> str:
    """``"; served again with expandable_segments:True ..."`` where the caching allocator's model, serving the
    trace as the GPU did, would reserve clearly less with expandable segments (and that figure in ``numbers``)."""
    served = replay.expandable_what_if
    if served is None:
        return ""
    recorded, expandable = served.reserved_bytes, served.expandable_reserved_bytes
    saving = recorded - expandable
    numbers["expandable_reserved_bytes"] = expandable
    if saving < max(_SAVING_SHOWN_BYTES, _SAVING_SHOWN_SHARE * recorded):
        return ""
    return (
        f"; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the caching allocator's model, served this "
        f"trace, reserves at most {format_bytes(expandable)} where it reserved {format_bytes(recorded)} "
        f"({format_bytes(saving)} less)"
    )


def top_site_findings(replay: Replay, max_sites: int = 1) -> list[Finding]:
    """The largest allocation sites at the peak (pre-existing blocks have their own finding)."""
    peak = replay.main.peak
    total = peak.live_bytes
    sites = peak.sites
    if total <= 0 or not len(sites):
        return []
    sites = sites[sites["category"] != "pre_existing"]
    out = []
    for _, row in sites.head(max_sites).iterrows():
        b = int(row["bytes"])
        message = (
            f"{row['site']}{_function_note(row)} holds {format_bytes(b)} ({b:,} B) in {int(row['count']):,} "
            f"allocation(s) at the peak, {percent(b, total):.0f}% of it ({category_label(row['category'])})"
        )
        out.append(
            Finding(
                "top_site", message, Severity.INFO, {"site": str(row["site"]), "bytes": b, "count": int(row["count"])}
            )
        )
    return out


def pre_existing_finding(replay: Replay) -> list[Finding]:
    """Bytes already live when the trace (or MemTrace's window) began."""
    main = replay.main
    total = main.peak.live_bytes
    if main.seed_bytes <= 0 or total <= 0 or not len(main.timeline):
        return []
    share = (
        f"{format_bytes(main.seed_bytes)} ({main.seed_bytes:,} B, {percent(main.seed_bytes, total):.0f}% of the peak)"
    )
    if replay.is_memtrace:
        steps = header_steps(replay.memtrace)
        window = f" (steps {steps[0]}-{steps[1]})" if steps is not None else ""
        message = f"{share} was already allocated when this snapshot's window{window} began"
    else:
        message = (
            f"{share} was allocated before recording began (taken from the snapshot's segments); call "
            "torch.cuda.memory._record_memory_history() before building the model to see what it is"
        )
        grads = int(main.peak.by_category.get("gradients", 0))
        if grads and abs(grads - main.seed_bytes) <= 0.01 * grads:
            message += f" (it is the size of the gradients, {format_bytes(grads)}: most likely the parameters)"
    return [Finding("pre_existing", message, Severity.INFO, {"seed_bytes": main.seed_bytes})]


def unknown_frees_finding(replay: Replay) -> list[Finding]:
    """Frees of allocations the trace never saw."""
    count = replay.main.unknown_frees
    if not count:
        return []
    if replay.is_memtrace:
        # MemTrace chose the window: these are frees, inside it, of blocks allocated before it began
        steps = header_steps(replay.memtrace)
        window = f" (steps {steps[0]}-{steps[1]})" if steps is not None else ""
        message = (
            f"{count} free(s) in this snapshot's window{window} of blocks allocated before MemTrace opened it: "
            "counted as pre-existing (widen the window with history_skip_steps/history_steps to see where they were made)"
        )
        return [Finding("unknown_frees", message, Severity.INFO, {"unknown_frees": count})]
    message = (
        f"{count} free(s) of allocations made before the trace began (recording started late or "
        "its ring buffer dropped them): counted as pre-existing"
    )
    return [Finding("unknown_frees", message, Severity.INFO, {"unknown_frees": count})]


def oom_findings(replay: Replay) -> list[Finding]:
    """The first three out-of-memory events of the trace."""
    tl = replay.main.timeline
    out = []
    for index, row in enumerate(replay.main.oom_rows[:3]):
        size = int(tl["size"].iat[row])
        live = int(tl["live_bytes"].iat[row])
        message = (
            f"out of memory {_where(str(tl['phase'].iat[row]), int(tl['step'].iat[row]))}: {format_bytes(size)} "
            f"({size:,} B) requested with {format_bytes(live)} live"
        )
        numbers: dict[str, Any] = {"requested_bytes": size, "live_bytes": live, "row": row}
        if index == 0:
            message += _expandable_oom_note(replay, numbers)
        out.append(Finding("oom", message, Severity.WARNING, numbers))
    return out


def _expandable_oom_note(replay: Replay, numbers: dict[str, Any]) -> str:
    """Whether the caching allocator's model, serving the trace with expandable segments in the memory the GPU had,
    gets past the first out-of-memory error (and that in ``numbers``); empty where it cannot tell."""
    served = replay.expandable_what_if
    if served is None or served.oom_served is None:
        return ""
    numbers["expandable_serves"] = served.oom_served
    if served.oom_served:
        return (
            ": fragmentation; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the caching allocator's model, "
            "served this trace in the memory the GPU had, serves this request and every one before it"
        )
    return (
        "; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the caching allocator's model, served this trace in "
        "the memory the GPU had, runs out too: expandable segments would not have avoided this error"
    )


#: DDP's buckets below this share of the peak get no finding.
DDP_BUCKETS_MIN_SHARE = 0.05


def ddp_buckets_finding(replay: Replay) -> list[Finding]:
    """DDP's gradient buckets beside the gradients (MemTrace's header says their bytes), where they hold a real share
    of the peak: what ``gradient_as_bucket_view=True`` would save."""
    held = header_ddp_bucket_bytes(replay.memtrace) if replay.is_memtrace else 0
    peak = replay.main.peak.live_bytes
    if held <= 0 or peak <= 0 or held < DDP_BUCKETS_MIN_SHARE * peak:
        return []
    message = (
        f"DDP's gradient buckets hold {format_bytes(held)} ({held:,} B, {percent(held, peak):.0f}% of the peak), "
        "counted in other: with gradient_as_bucket_view=False (DDP's default) they are a second copy of the "
        f"gradients; {bucket_view_saving(held)}"
    )
    return [Finding("ddp_buckets", message, Severity.WARNING, {"ddp_bucket_bytes": held, "peak_bytes": peak})]


def devices_finding(replay: Replay) -> list[Finding]:
    """Several devices in one snapshot: their peaks, and which one the report shows."""
    if len(replay.devices) <= 1:
        return []
    peaks = ", ".join(f"device {d}: {format_bytes(r.peak.live_bytes)}" for d, r in sorted(replay.devices.items()))
    message = f"{len(replay.devices)} devices in the snapshot ({peaks}); the report shows device {replay.main.device}"
    return [Finding("devices", message, Severity.INFO, {"devices": sorted(replay.devices)})]


def compute_findings(replay: Replay, phases: pd.DataFrame | None = None, max_sites: int = 1) -> list[Finding]:
    """Findings for the main device of a replay, plus the per-phase table when given.

    Args:
        replay: The replay.
        phases: MemTrace's phases table (``load_phases``), or None.
        max_sites: How many allocation sites to name.

    Returns:
        Findings, most important first: each rule above in turn.
    """
    out: list[Finding] = []
    out += peak_finding(replay)
    out += stale_gradients_finding(replay)
    out += fragmentation_finding(replay)
    out += top_site_findings(replay, max_sites)
    out += ddp_buckets_finding(replay)
    out += pre_existing_finding(replay)
    out += unknown_frees_finding(replay)
    out += oom_findings(replay)
    out += devices_finding(replay)
    if phases is not None and len(phases):
        out += phase_findings(phases)
    return out


#: Gathered parameters below this share of a row's allocated bytes get no finding.
RESHARD_MIN_SHARE = 0.05


def reshard_finding(phases: pd.DataFrame) -> list[Finding]:
    """What ``reshard_after_forward`` would change, when gathered (unsharded) parameters hold a real share of a row."""
    column = "unsharded_parameters_bytes"
    if column not in phases or not len(phases) or int(phases[column].max()) <= 0:
        return []
    shares = phases[column] / phases["allocated_bytes"].clip(lower=1)
    row = phases.loc[shares.idxmax()]
    held, allocated = int(row[column]), int(row["allocated_bytes"])
    if held < RESHARD_MIN_SHARE * allocated:
        return []
    message = (
        f"gathered (unsharded) parameters hold {format_bytes(held)} ({held:,} B, {percent(held, allocated):.0f}% of "
        f"the {format_bytes(allocated)} allocated) at {row['phase']} of step {int(row['step'])} (rank "
        f"{int(row['rank'])}): they stay whole from forward to backward, as for a block fully_shard-ed with "
        "reshard_after_forward=False (and for the root module, which FSDP2 keeps gathered for backward); with "
        f"reshard_after_forward=True on each block they are freed after its forward, up to {format_bytes(held)} less "
        "from forward to backward, for one more all-gather per block in backward"
    )
    numbers = {"unsharded_parameters_bytes": held, "allocated_bytes": allocated, "phase": str(row["phase"])}
    return [Finding("reshard_after_forward", message, Severity.WARNING, numbers)]


def growth_finding(phases: pd.DataFrame) -> list[Finding]:
    """Memory held between training batches that rises batch after batch (see :mod:`~lightning_memtrace.analysis.
    growth`): a warning where it is still held at the latest row, else (freed at an epoch's end, say) for information.
    The largest rise of any rank and run; ``numbers`` also says on how many ranks and runs one was found."""
    found = growth(phases)
    if not found:
        return []
    top = found[0]
    numbers = {**top.as_dict(), "ranks_and_runs_growing": len(found)}
    return [Finding("growth", top.sentence(), Severity.INFO if top.freed else Severity.WARNING, numbers)]


def phase_findings(phases: pd.DataFrame) -> list[Finding]:
    """Findings from MemTrace's per-phase table: memory that grows batch after batch, the phase with the highest
    peak and its composition."""
    out: list[Finding] = []
    if "peak_bytes" not in phases or not len(phases):
        return out
    out += growth_finding(phases)
    row = phases.loc[phases["peak_bytes"].idxmax()]
    peak = int(row["peak_bytes"])
    cats = {c: int(row[f"{c}_bytes"]) for c in ROW_CATEGORIES if f"{c}_bytes" in row and int(row[f"{c}_bytes"]) > 0}
    allocated = int(row.get("allocated_bytes", 0))
    composition = ", ".join(
        f"{category_label(c)} {format_bytes(b)}" for c, b in sorted(cats.items(), key=lambda kv: -kv[1])[:3]
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
    return out + reshard_finding(phases)


def compute_findings_phases_only(phases: pd.DataFrame) -> list[Finding]:
    """Findings when a log folder has the phases CSV but no snapshot."""
    out = phase_findings(phases)
    out.append(
        Finding(
            "no_snapshot",
            "no snapshot in the folder: the timeline is drawn from the phases table only",
            Severity.INFO,
            {},
        )
    )
    return out
