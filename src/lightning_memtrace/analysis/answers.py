"""The machine-readable answers of ``memtrace summary --json`` and ``memtrace diff --json``: plain dicts of ints,
strings, lists and None, ready for :func:`json.dumps` (the schema is in the README, section "Machine-readable
answers", and held by ``tests/cli/test_json.py``).

Summary, one run::

    {"file", "run", "label", "snapshot", "is_memtrace", "categories_inferred", "category_rules", "question",
     "findings": [{"code", "severity", "message", "numbers"}...], "post_mortems": [post-mortem...],
     "devices": [device...]}

A folder holding several runs: ``{"file", "runs": [<one run's object>...]}``, oldest first. Each device::

    {"device", "events", "has_time", "scope", "scope_events", "peak_bytes", "peak_event", "peak_time_us",
     "stage", "step", "reserved_bytes", "live_bytes", "categories", "sites", "site_count", "file_lines",
     "annotations", "phases"}
"""

from __future__ import annotations

import enum
import math
from typing import Any

from lightning_memtrace.analysis.annotations import annotation_rows
from lightning_memtrace.analysis.diff import Diff
from lightning_memtrace.analysis.findings import Finding
from lightning_memtrace.analysis.frames import format_frame, user_frame
from lightning_memtrace.analysis.model import DeviceReplay, Peak
from lightning_memtrace.analysis.postmortem import PostMortem, advice, has_what_if_table, post_mortem_from_dict
from lightning_memtrace.analysis.questions import Answer, Question, ask, phase_peaks
from lightning_memtrace.analysis.ranks import rank_overview, source_findings
from lightning_memtrace.analysis.source import LoadedSnapshot, ReportSource

#: Version of the summary object's layout (``"schema"``); bumped when a key changes meaning or goes away.
SUMMARY_SCHEMA = "memtrace.summary/1"
#: Version of the diff object's layout.
DIFF_SCHEMA = "memtrace.diff/1"


def annotations_of(dev: DeviceReplay, loaded: LoadedSnapshot) -> list[dict[str, Any]]:
    """The snapshot's annotations on this device: ``{"name", "stage", "time_us", "live_bytes"}`` each, in time order
    (see :func:`~lightning_memtrace.analysis.annotations.annotation_rows`)."""
    return [
        {key: row[key] for key in ("name", "stage", "time_us", "live_bytes")} for row in annotation_rows(dev)
    ]


def site_rows(moment: Peak, max_sites: int | None) -> list[dict[str, Any]]:
    """The sites at a moment (one row per site and category), largest first, at most ``max_sites``."""
    sites = moment.sites if max_sites is None else moment.sites.head(max_sites)
    return [
        {
            "site": str(r["site"]),
            "function": str(r["function"]),
            "category": str(r["category"]),
            "bytes": int(r["bytes"]),
            "count": int(r["count"]),
        }
        for r in sites.to_dict("records")
    ]


def phase_rows(dev: DeviceReplay) -> list[dict[str, Any]]:
    """Every (step, phase) of the trace with its peak (see :func:`~.questions.phase_peaks`)."""
    return [
        {key: (str(value) if key == "phase" else int(value)) for key, value in row.items()}
        for row in phase_peaks(dev).to_dict("records")
    ]


def device_object(dev: DeviceReplay, answer: Answer, loaded: LoadedSnapshot, max_sites: int | None) -> dict[str, Any]:
    """One device's object: the scope's peak, the moment answered (categories, sites), annotations and phases."""
    moment, peak = answer.moment, answer.peak
    obj: dict[str, Any] = {
        "device": int(dev.device),
        "events": int(dev.num_events),
        "has_time": bool(dev.has_time),
        "scope": answer.scope,
        "scope_events": int(answer.events),
        "peak_bytes": int(peak.live_bytes),
        "peak_event": int(peak.index),
        "peak_time_us": int(peak.time_us),
        "stage": str(moment.stage),
        "step": int(moment.step),
        "reserved_bytes": int(moment.reserved_bytes) if dev.reserved_known else None,
        "live_bytes": int(moment.live_bytes) if answer.at is not None else None,
        "categories": {str(k): int(v) for k, v in moment.by_category.items()},
        "sites": site_rows(moment, max_sites),
        "site_count": len(moment.sites),
        "file_lines": None if answer.lines is None else [dict(vars(line)) for line in answer.lines],
        "annotations": annotations_of(dev, loaded),
        "phases": phase_rows(dev),
    }
    return obj


def plain_value(value: Any) -> Any:
    """``value`` as JSON has it: ints, floats (a NaN or infinity as None), strings, bools, None, lists and objects
    with string keys; enums and NumPy scalars become their Python values, anything else its ``str``."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, dict):
        return {str(plain_value(k)): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a NumPy scalar
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def finding_object(finding: Finding) -> dict[str, Any]:
    """One finding: its stable ``code``, ``severity`` (``info`` / ``warning``), the sentence shown to the user and
    the figures behind it (bytes as ints)."""
    return {
        "code": finding.code,
        "severity": str(finding.severity),
        "message": finding.message,
        "numbers": plain_value(finding.numbers),
    }


def post_mortem_object(loaded: LoadedSnapshot) -> dict[str, Any] | None:
    """The post-mortem an ``oom_*.pickle`` holds, as data: where and why the run died, live memory by category, the
    line that asked for the memory, what to change (the text's "what to change", one sentence each) and what would
    fit; None for a snapshot that holds none."""
    header = loaded.replay.memtrace or {}
    pm = post_mortem_from_dict(header.get("post_mortem"))
    if pm is None:
        return None
    failed_at = user_frame(pm.failing_frames) if pm.failing_frames else None
    return {
        "file": loaded.path.name,
        "rank": pm.rank,
        "device": pm.device,
        "step": pm.step,
        "epoch": pm.epoch,
        "batch_idx": pm.batch_idx,
        "dataloader_idx": pm.dataloader_idx,
        "stage": pm.stage,
        "exception_type": pm.exception_type,
        "message": pm.message,
        "raised_as": pm.raised_as,
        "requested_bytes": pm.requested_bytes,
        "allocated_bytes": pm.allocated_bytes,
        "reserved_bytes": pm.reserved_bytes,
        "device_free_bytes": pm.device_free_bytes,
        "categories": {name: int(value) for name, value in pm.categories.items()},
        "failed_at": format_frame(failed_at) if failed_at is not None else None,
        "advice": advice(pm),
        "what_if": _what_if_data(pm),
    }


def post_mortem_objects(source: ReportSource) -> list[dict[str, Any]]:
    """The post-mortem of each of the run's snapshots that holds one (:func:`post_mortem_object`), in their order."""
    return [pm for pm in map(post_mortem_object, source.snapshots) if pm is not None]


def _what_if_data(pm: PostMortem) -> dict[str, Any] | None:
    """The post-mortem's what-if as data (its rows, the combination that fits, the memory it fits in); its rendered
    text left out. None where it made none."""
    if not has_what_if_table(pm):
        return None
    assert pm.what_if is not None
    try:
        return plain_value({key: value for key, value in pm.what_if.items() if not key.endswith("text")})
    except RecursionError:  # nested deeper than any what-if MemTrace writes: the file is not what it says
        return None


def question_object(question: Question) -> dict[str, Any]:
    """The question as asked (None where not)."""
    return {
        "window_us": list(question.window) if question.window is not None else None,
        "at": question.at,
        "step": question.step,
        "phase": question.phase,
        "file": question.file,
    }


def run_object(
    source: ReportSource, question: Question, max_sites: int | None, device: int | None = None
) -> dict[str, Any]:
    """One run: its main snapshot (highest peak) and each of its devices (or only ``device``) answering ``question``.

    Raises:
        QuestionError: A device cannot answer (or ``device`` is not in the snapshot).
    """
    from lightning_memtrace.analysis.questions import QuestionError

    main = source.main
    obj: dict[str, Any] = {
        "run": source.run,
        "label": source.label,
        "snapshot": main.path.name if main is not None else None,
        "is_memtrace": bool(main is not None and main.replay.is_memtrace),
        "categories_inferred": bool(main is not None and main.replay.inferred),
        "category_rules": dict(main.replay.category_rules) if main is not None else {},
        "question": question_object(question),
        "findings": [finding_object(f) for f in source_findings(source, rank_overview(source))],
        "post_mortems": post_mortem_objects(source),
        "devices": [],
    }
    if main is None:
        if not question.empty:
            raise QuestionError(f"{source.label}: no snapshot to answer the question (only the phases CSV)")
        return obj
    devices = main.replay.devices
    if device is not None and device not in devices:
        raise QuestionError(f"--device {device}: the snapshot has devices {', '.join(map(str, sorted(devices)))}")
    for index in sorted(devices) if device is None else [device]:
        dev = devices[index]
        obj["devices"].append(device_object(dev, ask(dev, question), main, max_sites))
    return obj


def summary_object(
    path: str, sources: list[ReportSource], question: Question, max_sites: int | None, device: int | None = None
) -> dict[str, Any]:
    """``memtrace summary --json``: one run's object with ``"file"``, or ``{"file", "runs": [...]}`` for several."""
    runs = [run_object(source, question, max_sites, device) for source in sources]
    if len(runs) == 1:
        return {"schema": SUMMARY_SCHEMA, "file": str(path), **runs[0]}
    return {"schema": SUMMARY_SCHEMA, "file": str(path), "runs": runs}


def _side(name: str, loaded: LoadedSnapshot | None) -> dict[str, Any]:
    rep = loaded.replay if loaded is not None else None
    peak = rep.peak if rep is not None else None
    return {
        "name": name,
        "snapshot": str(loaded.path) if loaded is not None else None,
        "device": int(peak.device) if peak is not None else None,
        "peak_bytes": int(peak.live_bytes) if peak is not None else None,
        "peak_event": int(peak.index) if peak is not None else None,
        "categories": {str(k): int(v) for k, v in peak.by_category.items()} if peak is not None else {},
    }


def diff_object(result: Diff, a: ReportSource, b: ReportSource, max_sites: int | None) -> dict[str, Any]:
    """``memtrace diff --json``: both sides' peaks and categories, and B - A per figure, category and site."""

    def rows(frame: Any, key: str) -> list[dict[str, Any]]:
        return [
            {key: str(r[key]), "a": int(r["a"]), "b": int(r["b"]), "delta": int(r["delta"])}
            for r in frame.to_dict("records")
        ]

    by_site = result.by_site if max_sites is None else result.by_site.head(max_sites)
    return {
        "schema": DIFF_SCHEMA,
        "a": _side(result.a_name, a.main),
        "b": _side(result.b_name, b.main),
        "figures": rows(result.summary, "figure"),
        "categories": rows(result.by_category, "category"),
        "sites": rows(by_site, "site"),
        "site_count": len(result.by_site),
    }
