"""The stage (and step) of every event of a trace: MemTrace's tags win, then profiler annotations, then MemTrace's
phase marks by time, then what the stacks say (smoothed); steps nobody recorded are counted from optimizer steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.categories import CAT_CODE
from lightning_memtrace.analysis.events import as_int, column, factorize
from lightning_memtrace.analysis.stacks import S_OPT, S_OUT, S_ZG
from lightning_memtrace.schema import CATEGORY_FIELD, TAG_FIELD, parse_tag
from lightning_memtrace.types import STAGE_AFTER_PHASE, STAGES, Phase

_STAGE_CODE = {name: code for code, name in enumerate(STAGES)}
_ANNOTATION_STAGES = (("zero_grad", S_ZG), ("Optimizer.step", S_OPT), ("optimizer_step", S_OPT))


def parse_user_metadata(text: str) -> tuple[int | None, int | None]:
    """``"phase=forward step=3"`` → ``(stage code or None, step or None)`` (the tag of :mod:`~lightning_memtrace.schema`)."""
    stage, step = parse_tag(text)
    return (_STAGE_CODE[stage.value] if stage is not None else None), step


def has_tags(trace: list[Any]) -> bool:
    """Whether the first events carry MemTrace's tag or category."""
    return any(isinstance(e, dict) and (TAG_FIELD in e or CATEGORY_FIELD in e) for e in trace[:64])


def read_tags(trace: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per event: stage code from the tag (-1: none), step (-1), recorded category code (-1)."""
    n = len(trace)
    if not n or not has_tags(trace):
        return np.full(n, -1, dtype=np.int8), np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int16)
    meta_codes, meta_uniques = factorize(column(trace, TAG_FIELD, ""))
    parsed = [parse_user_metadata(str(u) if u is not None else "") for u in meta_uniques]
    stage_of = np.array([p[0] if p[0] is not None else -1 for p in parsed] + [-1], dtype=np.int8)
    step_of = np.array([p[1] if p[1] is not None else -1 for p in parsed] + [-1], dtype=np.int64)
    cat_codes, cat_uniques = factorize(column(trace, CATEGORY_FIELD, ""))
    cat_of = np.array([CAT_CODE.get(str(c), -1) for c in cat_uniques] + [-1], dtype=np.int16)
    return stage_of[meta_codes], step_of[meta_codes], cat_of[cat_codes]


def annotation_ranges(annotations: list[dict[str, Any]], device: int, keyword: str) -> list[tuple[int, int]]:
    """``(start, end)`` times of the profiler annotations (``START``/``END`` pairs) whose name holds ``keyword``."""
    starts: dict[str, int] = {}
    ranges: list[tuple[int, int]] = []
    for a in sorted(annotations, key=lambda a: as_int(a.get("time_us"))):
        name = str(a.get("name", ""))
        if keyword not in name or ("device" in a and a.get("device") not in (None, device)):
            continue
        t = as_int(a.get("time_us"))
        stage = str(a.get("stage", "")).upper()
        if stage == "START":
            starts[name] = t
        elif stage == "END" and name in starts:
            ranges.append((starts.pop(name), t))
    return ranges


def apply_annotations(stage: np.ndarray, times: np.ndarray, annotations: list[dict[str, Any]], device: int) -> None:
    """Events inside ``zero_grad`` / optimizer-step annotations get that stage (in place)."""
    for keyword, code in _ANNOTATION_STAGES:
        for start, end in annotation_ranges(annotations, device, keyword):
            lo = np.searchsorted(times, start, side="left")
            hi = np.searchsorted(times, end, side="right")
            stage[lo:hi] = code


def apply_phase_marks(phases: list[Any], times: np.ndarray, stage: np.ndarray, step: np.ndarray) -> None:
    """Use MemTrace's ``phases`` marks (``{"step", "phase", "time_us"}``) to set stage and step by time (in place)."""
    marks = []
    for p in phases:
        if not isinstance(p, dict):
            continue
        try:
            phase = Phase(str(p.get("phase")))
            marks.append(
                (int(p.get("time_us", 0)), _STAGE_CODE[STAGE_AFTER_PHASE[phase].value], int(p.get("step", -1)))
            )
        except (ValueError, KeyError, TypeError):
            continue
    marks.sort()
    for k, (t, code, st) in enumerate(marks):
        t_next = marks[k + 1][0] if k + 1 < len(marks) else None
        lo = int(np.searchsorted(times, t, side="left"))
        hi = int(np.searchsorted(times, t_next, side="left")) if t_next is not None else len(times)
        stage[lo:hi] = code
        step[lo:hi] = st


def count_optimizer_steps(stage: np.ndarray) -> np.ndarray:
    """Steps when nothing recorded them: a new step after each optimizer region; -1 everywhere when none."""
    n = len(stage)
    opt = stage == S_OPT
    if not opt.any():
        return np.full(n, -1, dtype=np.int64)
    ends = np.zeros(n, dtype=np.int64)
    ends[np.nonzero(opt[:-1] & ~opt[1:])[0] + 1] = 1  # an optimizer region ends where the next row is not optimizer
    return np.cumsum(ends)


def smooth_stages(stage: np.ndarray) -> np.ndarray:
    """Give ``outside`` events between two events of the same stage that stage (a loss between module calls...)."""
    if len(stage) == 0:
        return stage
    s = pd.Series(np.where(stage == S_OUT, np.nan, stage.astype(float)))
    before = s.ffill().to_numpy()
    after = s.bfill().to_numpy()
    fill = (stage == S_OUT) & (before == after) & ~np.isnan(before)
    out = stage.copy()
    out[fill] = before[fill].astype(stage.dtype)
    return out


def event_stages(
    frame_stage: np.ndarray,
    tags: tuple[np.ndarray, np.ndarray],
    times: np.ndarray,
    has_time: bool,
    annotations: list[dict[str, Any]],
    device: int,
    phase_marks: list[Any] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Stage and step per event (stages not yet smoothed): tags, then annotations, phase marks, stacks."""
    tag_stage, step = tags
    stage = frame_stage.astype(np.int8)
    if has_time:
        apply_annotations(stage, times, annotations, device)
    use_tag = tag_stage >= 0
    stage = np.where(use_tag, tag_stage, stage).astype(np.int8)
    step = step.copy()
    if phase_marks is not None and has_time and not use_tag.any():
        apply_phase_marks(phase_marks, times, stage, step)
    if not (step >= 0).any() and len(stage):
        step = count_optimizer_steps(stage)
    return stage, step
