"""Replay a snapshot's trace into a timeline of live memory, with a category and a code site for every byte.

One row per trace event (time, action, address, size, live bytes, category, phase, step, top user frame). The live set
is seeded from ``segments`` when recording started after allocations existed (blocks active at dump time that the trace
never mentions, and addresses whose first event is a free), frees of unknown addresses are tolerated, and ``alloc`` is
counted by its requested size.

Categories come from the snapshot when MemTrace wrote it (per-event ``category``); otherwise they are inferred from the
stack frames and lifetimes of each allocation (see :func:`infer_category`) and the rows are marked ``inferred``.

The work is vectorised (numpy) except for one pass over the events to read their fields and one analysis per distinct
frame list, so a million-event trace replays in about a second.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import re
from collections.abc import Iterator, Sequence
from enum import Enum
from functools import cached_property
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.snapshot_loader import Snapshot, SnapshotError, normalize
from lightning_memtrace.types import Category


class InferredCategory(str, Enum):
    """Categories beyond :class:`~lightning_memtrace.types.Category` that only a replay can tell apart."""

    OPTIMIZER_INTERMEDIATES = "optimizer_intermediates"
    INTERMEDIATES = "intermediates"
    PRE_EXISTING = "pre_existing"

    def __str__(self) -> str:
        return self.value


#: Every category a replay can assign, in the stacking order of the charts (bottom first).
CATEGORIES: tuple[str, ...] = (
    InferredCategory.PRE_EXISTING.value,
    Category.PARAMETERS.value,
    Category.OPTIMIZER_STATE.value,
    Category.GRADIENTS.value,
    Category.INPUTS.value,
    Category.ACTIVATIONS.value,
    InferredCategory.INTERMEDIATES.value,
    InferredCategory.OPTIMIZER_INTERMEDIATES.value,
    Category.OTHER.value,
)
_CAT_CODE = {name: code for code, name in enumerate(CATEGORIES)}
_OTHER = _CAT_CODE["other"]

#: Readable names of categories, for reports.
CATEGORY_LABELS: dict[str, str] = {
    "pre_existing": "pre-existing",
    "parameters": "parameters",
    "optimizer_state": "optimizer state",
    "gradients": "gradients",
    "inputs": "inputs",
    "activations": "activations",
    "intermediates": "intermediates",
    "optimizer_intermediates": "optimizer intermediates",
    "other": "other",
}


class Stage(str, Enum):
    """Where in a training step an event happened, as far as the frames (or MemTrace's metadata) tell."""

    OUTSIDE = "outside"
    INIT = "init"
    FORWARD = "forward"
    BACKWARD = "backward"
    ZERO_GRAD = "zero_grad"
    OPTIMIZER_STEP = "optimizer_step"
    AFTER_STEP = "after_step"
    VALIDATION = "validation"

    def __str__(self) -> str:
        return self.value


STAGES: tuple[str, ...] = tuple(s.value for s in Stage)
_ST = {name: code for code, name in enumerate(STAGES)}
_S_OUT, _S_INIT, _S_FWD, _S_BWD, _S_ZG, _S_OPT, _S_AFTER, _S_VAL = (_ST[s] for s in STAGES)

# Actions.
_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "free",
    "other",
)
_A = {name: code for code, name in enumerate(_ACTIONS)}
_A_OTHER = _A["other"]
_ACTION_LOOKUP: collections.defaultdict[Any, int] = collections.defaultdict(lambda: _A_OTHER, _A)

_LIBRARY_PARTS = (
    "/torch/",
    "/lightning/",
    "/pytorch_lightning/",
    "/lightning_fabric/",
    "/lightning_memtrace/",
    "/lightning_utilities/",
    "/accelerate/",
)
_STDLIB_RE = re.compile(r"/lib/python3(\.\d+)?/(?!site-packages/|dist-packages/)")


@dataclasses.dataclass(frozen=True)
class Site:
    """A code location: the innermost user frame of an allocation (or the best stand-in)."""

    file: str
    line: int
    function: str

    @property
    def label(self) -> str:
        if self.line <= 0 and not self.file:
            return self.function
        return f"{self.file}:{self.line}"


_UNKNOWN_SITE = Site("", 0, "<no frames>")
_PRE_EXISTING_SITE = Site("", 0, "<allocated before recording>")


def _norm(filename: str) -> str:
    return filename.replace("\\", "/")


def _is_python(filename: str) -> bool:
    return filename.endswith(".py")


def _is_library(path: str) -> bool:
    if any(part in path for part in _LIBRARY_PARTS):
        return True
    return bool(_STDLIB_RE.search(path)) or path.startswith("<")


@dataclasses.dataclass(frozen=True)
class FrameInfo:
    """What one frame list says: the stage it ran in, the site to blame, and a category it forces (or -1)."""

    stage: int
    site: Site
    forced_category: int = -1


_F_BWD, _F_OPT, _F_ZG, _F_INIT, _F_FWD, _F_WORKSPACE = 1, 2, 4, 8, 16, 32
_ALLOCATOR_WORDS = (
    "unwind",
    "CapturedTraceback",
    "gather",
    "Allocator",
    "malloc",
    "empty_",
    "_empty",
    "create_out",
    "allocate",
    "Storage",
    "resize",
)

# One frame → (flags, user site, library site, autograd node name, C++ caller name)
_FrameFacts = tuple[int, "Site | None", "Site | None", "str | None", "str | None"]


def _as_int(value: Any) -> int:
    """``int(value)`` for the numbers of a snapshot; anything else (None, text, huge) is 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    try:
        number = int(value)
    except (ValueError, OverflowError):
        return 0
    return number if -(2**62) < number < 2**62 else 0


def _line_number(value: Any) -> int:
    try:
        line = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return line if 0 <= line < 2**31 else 0


def _frame_facts(frame: Any) -> _FrameFacts:
    if not isinstance(frame, dict):
        return (0, None, None, None, None)
    name = str(frame.get("name", ""))
    filename = _norm(str(frame.get("filename", "")))
    flags = 0
    if _is_python(filename):
        if name in ("backward", "_engine_run_backward", "_make_grads", "grad") and (
            "/torch/" in filename and ("autograd" in filename or filename.endswith("_tensor.py"))
        ):
            flags |= _F_BWD
        elif "/torch/optim/" in filename and "lr_scheduler" not in filename:
            flags |= _F_OPT
        elif name == "zero_grad":
            flags |= _F_ZG
        elif name in ("__init__", "reset_parameters") and "/nn/modules/" in filename:
            flags |= _F_INIT
        elif name in ("_apply", "load_state_dict", "_load_from_state_dict", "to_empty") and "/nn/modules/" in filename:
            flags |= _F_INIT
        elif name in ("_call_impl", "_wrapped_call_impl") and "/nn/modules/module.py" in filename:
            flags |= _F_FWD
        elif name == "forward":
            flags |= _F_FWD
        elif name == "step" and "optim" in filename.lower():
            flags |= _F_OPT
        line = _line_number(frame.get("line"))
        if _is_library(filename):
            return (flags, None, Site(filename, line, name), None, None)
        return (flags, Site(filename, line, name), None, None, None)
    if "autograd::Engine" in name or "PythonEngine" in name:
        flags |= _F_BWD
    if "Workspace" in name and "cuda" in name:
        flags |= _F_WORKSPACE
    node = name if ("Backward" in name and "::apply" in name) else None
    caller = None
    if name and not any(k in name for k in _ALLOCATOR_WORDS):
        caller = name.replace("(anonymous namespace)::", "").split("(")[0][:120] or None
    return (flags, None, None, node, caller)


def analyze_frames(frames: Sequence[dict[str, Any]] | None, cache: dict[int, _FrameFacts] | None = None) -> FrameInfo:
    """Classify a stack (innermost frame first) and pick its user frame.

    The stage is decided by priority: autograd engine or ``backward`` → backward; ``torch.optim`` or an optimizer
    ``step`` → optimizer step; ``zero_grad`` → zero_grad; a module's ``__init__``/``reset_parameters``/``_apply``/
    ``load_state_dict`` → init; a module call or ``forward`` → forward; otherwise outside. The site is the innermost
    Python frame outside torch, Lightning and the standard library, else the innermost library Python frame, else the
    autograd node or C++ function that allocated.

    Args:
        frames: The event's ``frames``.
        cache: Facts per frame dict (by ``id``), shared across calls; snapshots share frame dicts between events.

    Returns:
        The :class:`FrameInfo`.
    """
    if not frames:
        return FrameInfo(_S_OUT, _UNKNOWN_SITE)
    if cache is None:
        cache = {}
    flags = 0
    user: Site | None = None
    library_py: Site | None = None
    node: str | None = None
    caller: str | None = None
    get = cache.get
    for frame in frames:
        facts = get(id(frame))
        if facts is None:
            facts = cache[id(frame)] = _frame_facts(frame)
        flags |= facts[0]
        if user is None and facts[1] is not None:
            user = facts[1]
        if library_py is None and facts[2] is not None:
            library_py = facts[2]
        if node is None and facts[3] is not None:
            node = facts[3]
        if caller is None and facts[4] is not None:
            caller = facts[4]
    if flags & _F_BWD:
        stage = _S_BWD
    elif flags & _F_OPT:
        stage = _S_OPT
    elif flags & _F_ZG:
        stage = _S_ZG
    elif flags & _F_INIT:
        stage = _S_INIT
    elif flags & _F_FWD:
        stage = _S_FWD
    else:
        stage = _S_OUT
    site = user or library_py
    if site is None:
        if node is not None:
            short = node.split("(")[0].split("::")
            site = Site("", 0, f"autograd {short[-2] if len(short) > 1 else short[0]}")
        elif caller is not None:
            site = Site("", 0, caller)
        else:
            site = _UNKNOWN_SITE
    forced = _OTHER if flags & _F_WORKSPACE else -1
    return FrameInfo(stage, site, forced)


_META_RE = re.compile(r"(\w+)=([^\s,;]+)")


def parse_user_metadata(text: str) -> tuple[int | None, int | None]:
    """``"phase=forward step=3"`` → ``(stage code or None, step or None)``."""
    stage: int | None = None
    step: int | None = None
    for key, value in _META_RE.findall(text or ""):
        if key in ("phase", "stage"):
            stage = _ST.get(value)
            if stage is None and value in ("train", "training"):
                stage = _S_FWD
        elif key == "step":
            try:
                step = int(value)
            except ValueError:
                pass
    return stage, step


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
        sites: The live allocations there grouped by site: ``site, file, line, function, category, bytes, count``,
            largest first.
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
    """

    device: int
    timeline: pd.DataFrame
    allocations: pd.DataFrame
    seed_bytes: int
    has_time: bool
    reserved_known: bool
    unknown_frees: int
    oom_rows: list[int]

    @property
    def num_events(self) -> int:
        return len(self.timeline)

    @cached_property
    def peak(self) -> Peak:
        """The highest point of ``live_bytes`` (the first one if it is reached several times)."""
        tl = self.timeline
        if len(tl) == 0:
            return self.peak_at(-1)
        live = tl["live_bytes"].to_numpy()
        index = int(np.argmax(live))
        return self.peak_at(index)

    def allocations_reserved_end(self) -> int:
        return int(self.allocations.attrs.get("reserved_end", 0))

    def peak_at(self, index: int) -> Peak:
        """The state at row ``index`` as a :class:`Peak` (``-1``: before the first event)."""
        tl = self.timeline
        live = self.live_allocations(index)
        inferred_bytes = int(live["size"][live["inferred"]].sum())
        if index < 0 or len(tl) == 0:
            return Peak(
                self.device,
                -1,
                0,
                int(self.seed_bytes),
                self.allocations_reserved_end(),
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

    def _breakdown(self, index: int) -> dict[str, int]:
        live = self.live_allocations(index)
        sums = live.groupby("category", observed=True)["size"].sum()
        out = {str(k): int(v) for k, v in sums.items() if int(v) != 0}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _sites(self, index: int) -> pd.DataFrame:
        live = self.live_allocations(index)
        if len(live) == 0:
            return pd.DataFrame(columns=["site", "file", "line", "function", "category", "bytes", "count"])
        grouped = (
            live.groupby(["site", "file", "line", "function"], observed=True, sort=False)
            .agg(bytes=("size", "sum"), count=("size", "size"), category=("category", _mode))
            .reset_index()
            .sort_values(["bytes", "count"], ascending=[False, False], kind="stable")
            .reset_index(drop=True)
        )
        grouped["site"] = grouped["site"].astype(str)
        grouped["category"] = grouped["category"].astype(str)
        grouped["bytes"] = grouped["bytes"].astype("int64")
        grouped["count"] = grouped["count"].astype("int64")
        return grouped[["site", "file", "line", "function", "category", "bytes", "count"]]

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
            delta = _scatter_add(n, a[a >= 0], s[a >= 0]) - _scatter_add(n, e[e < n], s[e < n])
            series = seed + np.cumsum(delta)
            out[str(name)] = series[rows]
        ordered = {k: out[k] for k in CATEGORIES if k in out}
        ordered.update({k: v for k, v in out.items() if k not in ordered})
        return pd.DataFrame(ordered, index=rows)


def _scatter_add(n: int, index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[index] += values`` into ``n`` int64 zeros, exactly (float sums only while they cannot round)."""
    if len(values) == 0:
        return np.zeros(n, dtype=np.int64)
    if int(np.abs(values).max()) * len(values) < 2**53:
        return np.bincount(index, weights=values, minlength=n)[:n].astype(np.int64)
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, index, values)
    return out


def _mode(values: pd.Series) -> str:
    counts = values.astype(str).value_counts()
    return str(counts.index[0]) if len(counts) else ""


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
    """

    devices: dict[int, DeviceReplay]
    source: str
    is_memtrace: bool
    memtrace: dict[str, Any] | None
    allocator_settings: dict[str, Any]
    reserved_end_bytes: int
    num_segments: int

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


# ------------------------------------------------------------------------------------------------------ inference
def infer_categories(
    stage_alloc: np.ndarray,
    stage_end: np.ndarray,
    alloc_index: np.ndarray,
    end_index: np.ndarray,
    n: int,
    forward_rows: np.ndarray,
) -> np.ndarray:
    """Categories (codes into :data:`CATEGORIES`) of allocations from where they were made and freed.

    Rules: alive before the trace → pre-existing; made in ``optimizer.step`` and kept → optimizer state, freed inside
    it → optimizer intermediates; made in backward and kept past it → gradients, freed in it → intermediates; made in a
    module's construction or ``.to()`` → parameters; made in forward and kept past it → activations, freed within it →
    intermediates; made outside any pass: freed in backward → activations (a loss), alive across a later forward →
    inputs, else other.

    Args:
        stage_alloc: Stage code at the allocating event (``_S_OUT`` for pre-existing).
        stage_end: Stage code at the freeing event (``-1`` when alive at the end).
        alloc_index: Row of the allocation (``-1``: pre-existing).
        end_index: Row of the free (``n``: alive at the end).
        n: Number of rows.
        forward_rows: Sorted rows whose stage is forward.

    Returns:
        ``int16`` codes.
    """
    cat = np.full(len(stage_alloc), _OTHER, dtype=np.int16)
    kept = stage_end != stage_alloc
    sa = stage_alloc
    # Outside any pass: inputs if a forward ran while alive.
    if len(forward_rows):
        first_fwd_after = np.searchsorted(forward_rows, alloc_index, side="right")
        has_fwd = first_fwd_after < len(forward_rows)
        fwd_row = forward_rows[np.minimum(first_fwd_after, len(forward_rows) - 1)]
        alive_across_fwd = has_fwd & (fwd_row < end_index)
    else:
        alive_across_fwd = np.zeros(len(sa), dtype=bool)
    outside = (sa == _S_OUT) | (sa == _S_AFTER) | (sa == _S_VAL)
    cat[outside & alive_across_fwd] = _CAT_CODE["inputs"]
    cat[outside & (stage_end == _S_BWD)] = _CAT_CODE["activations"]
    cat[sa == _S_INIT] = _CAT_CODE["parameters"]
    cat[(sa == _S_FWD) & kept] = _CAT_CODE["activations"]
    cat[(sa == _S_FWD) & ~kept] = _CAT_CODE["intermediates"]
    cat[(sa == _S_BWD) & kept] = _CAT_CODE["gradients"]
    cat[(sa == _S_BWD) & ~kept] = _CAT_CODE["intermediates"]
    cat[(sa == _S_OPT) & kept] = _CAT_CODE["optimizer_state"]
    cat[(sa == _S_OPT) & ~kept] = _CAT_CODE["optimizer_intermediates"]
    cat[sa == _S_ZG] = _CAT_CODE["other"]
    cat[alloc_index < 0] = _CAT_CODE["pre_existing"]
    return cat


def _smooth_stages(stage: np.ndarray) -> np.ndarray:
    """Give ``outside`` events between two events of the same stage that stage (a loss between module calls...)."""
    if len(stage) == 0:
        return stage
    s = pd.Series(np.where(stage == _S_OUT, np.nan, stage.astype(float)))
    before = s.ffill().to_numpy()
    after = s.bfill().to_numpy()
    fill = (stage == _S_OUT) & (before == after) & ~np.isnan(before)
    out = stage.copy()
    out[fill] = before[fill].astype(stage.dtype)
    return out


def _annotation_ranges(annotations: list[dict[str, Any]], device: int, keyword: str) -> list[tuple[int, int]]:
    starts: dict[str, int] = {}
    ranges: list[tuple[int, int]] = []
    for a in sorted(annotations, key=lambda a: _as_int(a.get("time_us"))):
        name = str(a.get("name", ""))
        if keyword not in name:
            continue
        if "device" in a and a.get("device") not in (None, device):
            continue
        t = _as_int(a.get("time_us"))
        stage = str(a.get("stage", "")).upper()
        if stage == "START":
            starts[name] = t
        elif stage == "END" and name in starts:
            ranges.append((starts.pop(name), t))
    return ranges


_FIELDS = ["action", "addr", "size", "time_us", "frames"]


def _to_int64(values: Any, trace: list[dict[str, Any]]) -> np.ndarray:
    try:
        out = np.asarray(values).astype(np.int64)
        if len(out) == len(trace):
            return out
    except (TypeError, ValueError, OverflowError):
        pass
    return np.fromiter((_as_int(v) for v in values), dtype=np.int64, count=len(trace))


def _extract_columns(
    trace: list[dict[str, Any]],
) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray | None, Any]:
    """The ``action, addr, size, time_us, frames`` fields of every event, in one pass when possible.

    Returns:
        ``(actions, addrs, sizes, times or None when some event has no time, frames)``; actions and frames are
        sequences of the raw values (a missing one is NaN or None).
    """
    n = len(trace)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return [], empty, empty, None, []
    table = None
    try:
        # pandas' Cython loop over the dicts reads all five fields in one pass (3x faster than five passes)
        from pandas._libs import lib

        table = lib.dicts_to_array(trace, _FIELDS)
        if table.shape != (n, len(_FIELDS)):
            table = None
    except Exception:
        table = None
    if table is not None:
        actions, addr_col, size_col, time_col, frames = (table[:, k] for k in range(len(_FIELDS)))
    else:
        actions = _column(trace, "action", "other")
        addr_col = _column(trace, "addr", 0)
        size_col = _column(trace, "size", 0)
        time_col = _column(trace, "time_us", None)
        frames = _column(trace, "frames", None)
    addrs = _to_int64(addr_col, trace)
    sizes = _to_int64(size_col, trace)
    times: np.ndarray | None
    try:
        times = np.asarray(time_col).astype(np.int64)  # a missing time (None, NaN) raises
    except (TypeError, ValueError, OverflowError):
        times = None
    return actions, addrs, sizes, times, frames


def _column(trace: list[dict[str, Any]], key: str, default: Any) -> list[Any]:
    """``[e[key] for e in trace]`` at C speed, falling back to ``.get`` when some event lacks the key."""
    try:
        return list(map(itemgetter(key), trace))
    except (KeyError, TypeError, IndexError):
        return [e.get(key, default) if isinstance(e, dict) else default for e in trace]


def _factorize(values: list[Any]) -> tuple[np.ndarray, Any]:
    """``pd.factorize`` of untrusted values: anything unhashable (a dict where a string belongs) becomes its repr."""
    try:
        return pd.factorize(_objects(values))
    except TypeError:
        safe = [v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for v in values]
        return pd.factorize(_objects(safe))


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building a million small objects otherwise triggers it again and again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _intern_site(site: Site, site_codes_of: dict[Site, int], sites: list[Site]) -> int:
    code = site_codes_of.get(site)
    if code is None:
        code = site_codes_of[site] = len(sites)
        sites.append(site)
    return code


def _analyze_lists(
    lists: list[Any],
    cache: dict[int, _FrameFacts],
    site_codes_of: dict[Site, int],
    sites: list[Site],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`analyze_frames` for many frame lists at once, vectorised over their frames.

    Snapshots share frame dicts between events, so the facts of each distinct frame dict are computed once; the
    per-list reductions (OR of flags, first user frame) are numpy ``reduceat`` calls.

    Returns:
        ``(stage, site code, forced category)`` per list.
    """
    m = len(lists)
    clean = [f if isinstance(f, list) else (list(f) if isinstance(f, tuple) else []) for f in lists]
    lengths = np.fromiter(map(len, clean), dtype=np.int64, count=m)
    total = int(lengths.sum())
    stage = np.full(m, _S_OUT, dtype=np.int8)
    site = np.full(m, _intern_site(_UNKNOWN_SITE, site_codes_of, sites), dtype=np.int32)
    forced = np.full(m, -1, dtype=np.int16)
    if total == 0:
        return stage, site, forced
    all_frames = list(itertools.chain.from_iterable(clean))
    frame_codes, unique_ids = pd.factorize(np.fromiter(map(id, all_frames), dtype=np.int64, count=total))
    first = np.zeros(len(unique_ids), dtype=np.int64)
    first[frame_codes[::-1]] = np.arange(total - 1, -1, -1)
    u = len(unique_ids)
    u_flags = np.zeros(u, dtype=np.int64)
    u_sites = np.full((4, u), -1, dtype=np.int64)  # user, library, autograd node, C++ caller
    for k, pos in enumerate(first.tolist()):
        frame = all_frames[pos]
        facts = cache.get(id(frame))
        if facts is None:
            facts = cache[id(frame)] = _frame_facts(frame)
        u_flags[k] = facts[0]
        if facts[1] is not None:
            u_sites[0, k] = _intern_site(facts[1], site_codes_of, sites)
        if facts[2] is not None:
            u_sites[1, k] = _intern_site(facts[2], site_codes_of, sites)
        if facts[3] is not None:
            short = facts[3].split("(")[0].split("::")
            u_sites[2, k] = _intern_site(
                Site("", 0, f"autograd {short[-2] if len(short) > 1 else short[0]}"), site_codes_of, sites
            )
        if facts[4] is not None:
            u_sites[3, k] = _intern_site(Site("", 0, facts[4]), site_codes_of, sites)
    del all_frames
    nonempty = lengths > 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[nonempty]
    flags = np.zeros(m, dtype=np.int64)
    flags[nonempty] = np.bitwise_or.reduceat(u_flags[frame_codes], starts)
    stage = np.select(
        [flags & _F_BWD > 0, flags & _F_OPT > 0, flags & _F_ZG > 0, flags & _F_INIT > 0, flags & _F_FWD > 0],
        [_S_BWD, _S_OPT, _S_ZG, _S_INIT, _S_FWD],
        _S_OUT,
    ).astype(np.int8)
    forced = np.where(flags & _F_WORKSPACE > 0, _OTHER, -1).astype(np.int16)
    positions = np.arange(total, dtype=np.int64)
    big = np.int64(total + 1)
    chosen = np.full(m, -1, dtype=np.int64)
    for kind in range(4):
        per_frame = u_sites[kind][frame_codes]
        first_pos = np.full(m, big, dtype=np.int64)
        first_pos[nonempty] = np.minimum.reduceat(np.where(per_frame >= 0, positions, big), starts)
        take = (chosen < 0) & (first_pos < big)
        chosen[take] = per_frame[first_pos[take]]
    site = np.where(chosen >= 0, chosen, site).astype(np.int32)
    return stage, site, forced


# ------------------------------------------------------------------------------------------------------ replay
def _replay_device(
    device: int,
    trace: list[dict[str, Any]],
    segments: list[dict[str, Any]],
    annotations: list[dict[str, Any]],
    memtrace: dict[str, Any] | None,
) -> DeviceReplay:
    n = len(trace)
    # --- one pass per field (C-speed comprehensions)
    action_col, addrs, sizes, times_or_none, frames_col = _extract_columns(trace)
    try:
        action_codes = np.fromiter(map(_ACTION_LOOKUP.__getitem__, action_col), dtype=np.int8, count=n)
    except TypeError:  # an unhashable action (a list or dict) in an untrusted file
        action_codes = np.fromiter(
            (_ACTION_LOOKUP[a] if isinstance(a, str) else _A_OTHER for a in action_col), dtype=np.int8, count=n
        )
    del action_col
    has_time = times_or_none is not None and n > 0
    times = times_or_none if times_or_none is not None else np.arange(n, dtype=np.int64)

    # --- frames: analyse each distinct list once
    frame_key, unique_ids = pd.factorize(np.fromiter(map(id, frames_col), dtype=np.int64, count=n))
    first = np.zeros(len(unique_ids), dtype=np.int64)
    first[frame_key[::-1]] = np.arange(n - 1, -1, -1)
    unique_lists: list[Any] = [frames_col[i] for i in first.tolist()]
    del frames_col
    site_codes_of: dict[Site, int] = {}
    sites: list[Site] = []
    facts_cache: dict[int, _FrameFacts] = {}
    list_stage, list_site, list_forced = _analyze_lists(unique_lists, facts_cache, site_codes_of, sites)
    stage = list_stage[frame_key] if n else np.zeros(0, dtype=np.int8)
    site = list_site[frame_key] if n else np.zeros(0, dtype=np.int32)
    forced = list_forced[frame_key] if n else np.zeros(0, dtype=np.int16)
    del frame_key, unique_lists

    # --- MemTrace metadata and categories
    recorded_cat = np.full(n, -1, dtype=np.int16)
    step = np.full(n, -1, dtype=np.int64)
    meta_stage = np.full(n, -1, dtype=np.int8)
    has_meta = n > 0 and any(
        isinstance(e, dict) and ("user_metadata" in e or "category" in e) for e in trace[: min(n, 64)]
    )
    if has_meta:
        meta_col = _column(trace, "user_metadata", "")
        meta_codes, meta_uniques = _factorize(meta_col)
        del meta_col
        parsed = [parse_user_metadata(str(u) if u is not None else "") for u in meta_uniques]
        ms = np.array([p[0] if p[0] is not None else -1 for p in parsed] + [-1], dtype=np.int8)
        mstep = np.array([p[1] if p[1] is not None else -1 for p in parsed] + [-1], dtype=np.int64)
        meta_stage = ms[meta_codes]
        step = mstep[meta_codes]
        cat_col = _column(trace, "category", "")
        cat_codes, cat_uniques = _factorize(cat_col)
        del cat_col
        lookup16 = np.array([_CAT_CODE.get(str(c), -1) for c in cat_uniques] + [-1], dtype=np.int16)
        recorded_cat = lookup16[cat_codes]

    # --- stages: metadata wins, then external annotations, then frames (smoothed)
    stage = stage.astype(np.int8)
    if has_time:
        for keyword, code in (("zero_grad", _S_ZG), ("Optimizer.step", _S_OPT), ("optimizer_step", _S_OPT)):
            for start, end in _annotation_ranges(annotations, device, keyword):
                lo, hi = np.searchsorted(times, [start, end], side="left")
                hi = np.searchsorted(times, end, side="right")
                stage[lo:hi] = code
    use_meta = meta_stage >= 0
    stage = np.where(use_meta, meta_stage, stage).astype(np.int8)
    if memtrace and isinstance(memtrace.get("phases"), list) and has_time and not use_meta.any():
        _apply_phase_marks(memtrace["phases"], times, stage, step)
    # Steps when nothing recorded them: count optimizer steps (none seen: the step is unknown, -1).
    if not (step >= 0).any() and n:
        opt = stage == _S_OPT
        if opt.any():
            ends = np.zeros(n, dtype=np.int64)
            # an optimizer region ends where the next row is not optimizer
            end_rows = np.nonzero(opt[:-1] & ~opt[1:])[0] + 1
            ends[end_rows] = 1
            step = np.cumsum(ends)

    # --- pair allocations and frees by address
    is_alloc = action_codes == _A["alloc"]
    has_completed = bool((action_codes == _A["free_completed"]).any())
    free_code = _A["free_completed"] if has_completed else _A["free_requested"]
    is_free = (action_codes == free_code) | (action_codes == _A["free"])
    sel = np.nonzero(is_alloc | is_free)[0]
    order = np.argsort(addrs[sel], kind="stable")  # by address, then by position (sel is increasing)
    s = sel[order]
    a = addrs[s]
    s_is_alloc = is_alloc[s]
    same_next = np.zeros(len(s), dtype=bool)
    if len(s) > 1:
        same_next[:-1] = a[1:] == a[:-1]
    same_prev = np.zeros(len(s), dtype=bool)
    if len(s) > 1:
        same_prev[1:] = a[1:] == a[:-1]
    next_pos = np.full(len(s), n, dtype=np.int64)
    if len(s) > 1:
        next_pos[:-1] = s[1:]
    # allocations in the trace
    alloc_rows = s[s_is_alloc]
    alloc_end = np.where(same_next[s_is_alloc], next_pos[s_is_alloc], n)
    # frees whose previous same-address event is not an alloc: unknown; the first of an address is pre-existing
    prev_is_alloc = np.zeros(len(s), dtype=bool)
    if len(s) > 1:
        prev_is_alloc[1:] = s_is_alloc[:-1] & same_prev[1:]
    free_mask = ~s_is_alloc
    unknown = free_mask & ~prev_is_alloc
    pre_free_rows = s[unknown & ~same_prev]  # first event of its address is a free
    unknown_frees = int(unknown.sum())
    pre_sizes = sizes[pre_free_rows]

    # --- seed from segments: active blocks whose address the trace never mentions
    candidates: list[tuple[int, int, str, list[Any]]] = []  # (size, addr, category, frames)
    reserved_end = 0
    seg_known = False
    for seg in segments:
        if _as_int(seg.get("device", device)) != device:
            continue
        seg_known = True
        reserved_end += _as_int(seg.get("total_size"))
        blocks = seg.get("blocks")
        for block in blocks if isinstance(blocks, list) else []:
            if not isinstance(block, dict):
                continue
            state = str(block.get("state", ""))
            if not state.startswith("active"):
                continue
            addr = _as_int(block.get("address"))
            req = _as_int(block.get("requested_size"))
            size = req if req > 0 else _as_int(block.get("size"))
            candidates.append((size, addr, str(block.get("category", "") or ""), block.get("frames") or []))
    if candidates and len(a):
        block_addrs = np.array([c[1] for c in candidates], dtype=np.int64)
        pos = np.minimum(np.searchsorted(a, block_addrs), len(a) - 1)  # ``a`` is sorted by address
        mentioned = a[pos] == block_addrs
        seed_rows = [c for c, m in zip(candidates, mentioned.tolist()) if not m]
    else:
        seed_rows = candidates

    # --- allocation table
    n_pre = len(pre_free_rows)
    n_seed = len(seed_rows)
    a_index = np.concatenate([alloc_rows, np.full(n_pre + n_seed, -1, dtype=np.int64)])
    e_index = np.concatenate([alloc_end, pre_free_rows, np.full(n_seed, n, dtype=np.int64)])
    a_size = np.concatenate([sizes[alloc_rows], pre_sizes, np.array([r[0] for r in seed_rows], dtype=np.int64)])
    # sites: allocations use their own; pre-existing frees use the free's; seeded blocks their block frames
    seed_sites = np.empty(n_seed, dtype=np.int32)
    for k, (_, _, _, frames) in enumerate(seed_rows):
        info = analyze_frames(frames, facts_cache) if frames else FrameInfo(_S_OUT, _PRE_EXISTING_SITE)
        seed_sites[k] = _intern_site(info.site, site_codes_of, sites)
    pre_site_code = site_codes_of.get(_PRE_EXISTING_SITE)
    if pre_site_code is None and n_pre:
        pre_site_code = site_codes_of[_PRE_EXISTING_SITE] = len(sites)
        sites.append(_PRE_EXISTING_SITE)
    a_site = np.concatenate(
        [
            site[alloc_rows],
            np.full(n_pre, pre_site_code if pre_site_code is not None else 0, dtype=np.int32),
            seed_sites,
        ]
    ).astype(np.int32)
    a_stage = np.concatenate([stage[alloc_rows], np.full(n_pre + n_seed, _S_OUT, dtype=np.int8)])
    end_clip = np.minimum(e_index, max(n - 1, 0))
    a_stage_end = np.where(e_index < n, stage[end_clip] if n else 0, -1).astype(np.int8)
    a_step = np.concatenate([step[alloc_rows], np.full(n_pre + n_seed, -1, dtype=np.int64)])

    forward_rows = np.nonzero(stage == _S_FWD)[0]
    inferred_cat = infer_categories(a_stage, a_stage_end, a_index, e_index, n, forward_rows)
    a_forced = np.concatenate([forced[alloc_rows], np.full(n_pre + n_seed, -1, dtype=np.int16)])
    inferred_cat = np.where((a_forced >= 0) & (a_index >= 0), a_forced, inferred_cat).astype(np.int16)
    rec = np.concatenate(
        [
            recorded_cat[alloc_rows],
            recorded_cat[pre_free_rows],
            np.array([_CAT_CODE.get(r[2], -1) for r in seed_rows], dtype=np.int16),
        ]
    )
    a_inferred = rec < 0
    a_cat = np.where(a_inferred, inferred_cat, rec).astype(np.int16)

    # --- deltas and live bytes
    in_trace = a_index >= 0
    ends_in = e_index < n
    delta = _scatter_add(n, a_index[in_trace], a_size[in_trace]) - _scatter_add(n, e_index[ends_in], a_size[ends_in])
    seed_bytes = int(a_size[~in_trace].sum())
    live = seed_bytes + np.cumsum(delta)

    # --- reserved bytes: segment events, anchored on the dump-time total
    seg_delta = np.zeros(n, dtype=np.int64)
    for name, sign in (("segment_alloc", 1), ("segment_map", 1), ("segment_free", -1), ("segment_unmap", -1)):
        m = action_codes == _A[name]
        seg_delta[m] = sign * sizes[m]
    has_seg_events = bool(seg_delta.any())
    reserved_start = max(reserved_end - int(seg_delta.sum()), 0)
    reserved = reserved_start + np.cumsum(seg_delta)
    reserved_known = seg_known or has_seg_events
    if memtrace is not None and str(memtrace.get("device", "")).startswith("cpu"):
        reserved_known = False  # the CPU allocator caches nothing: reserved is allocated
    if not reserved_known:
        reserved = np.zeros(n, dtype=np.int64)

    # --- event-level category: that of the allocation the event touches
    ev_cat = np.full(n, -1, dtype=np.int16)
    ev_inf = np.zeros(n, dtype=bool)
    ev_cat[a_index[in_trace]] = a_cat[in_trace]
    ev_inf[a_index[in_trace]] = a_inferred[in_trace]
    ev_cat[e_index[ends_in]] = a_cat[ends_in]
    ev_inf[e_index[ends_in]] = a_inferred[ends_in]
    # events that touch no allocation keep a recorded category if any, else none
    untouched = ev_cat < 0
    ev_cat[untouched] = recorded_cat[untouched]

    site_labels = [x.label for x in sites]
    label_codes: dict[str, int] = {}
    remap = np.array([label_codes.setdefault(lb, len(label_codes)) for lb in site_labels] or [0], dtype=np.int64)
    site_cat = pd.Categorical.from_codes(
        remap[site] if n else np.zeros(0, dtype=np.int64), categories=list(label_codes) or ["<none>"]
    )
    cat_categories = list(CATEGORIES)
    timeline = pd.DataFrame(
        {
            "index": np.arange(n, dtype=np.int64),
            "time_us": times,
            "action": pd.Categorical.from_codes(action_codes.astype(np.int64), categories=list(_ACTIONS)),
            "addr": addrs,
            "size": sizes,
            "delta": delta,
            "live_bytes": live,
            "reserved_bytes": reserved,
            "category": pd.Categorical.from_codes(ev_cat.astype(np.int64), categories=cat_categories),
            "inferred": ev_inf,
            "phase": pd.Categorical.from_codes(_smooth_stages(stage).astype(np.int64), categories=list(STAGES)),
            "step": step,
            "site": site_cat,
        }
    )
    a_file = np.array([x.file for x in sites], dtype=object)
    a_line = np.array([x.line for x in sites], dtype=np.int64)
    a_func = np.array([x.function for x in sites], dtype=object)
    allocations = pd.DataFrame(
        {
            "alloc_index": a_index.astype(np.int64),
            "end_index": e_index.astype(np.int64),
            "size": a_size.astype(np.int64),
            "category": pd.Categorical.from_codes(a_cat.astype(np.int64), categories=cat_categories),
            "inferred": a_inferred,
            "stage_alloc": pd.Categorical.from_codes(a_stage.astype(np.int64), categories=list(STAGES)),
            "stage_end": pd.Categorical.from_codes(a_stage_end.astype(np.int64), categories=list(STAGES)),
            "step": a_step,
            "site": np.array(site_labels, dtype=object)[a_site] if len(a_site) else np.array([], dtype=object),
            "file": a_file[a_site] if len(a_site) else np.array([], dtype=object),
            "line": a_line[a_site] if len(a_site) else np.array([], dtype=np.int64),
            "function": a_func[a_site] if len(a_site) else np.array([], dtype=object),
        }
    )
    allocations.attrs["reserved_end"] = reserved_end
    oom_rows = np.nonzero(action_codes == _A["oom"])[0].tolist()
    return DeviceReplay(
        device=device,
        timeline=timeline,
        allocations=allocations,
        seed_bytes=seed_bytes,
        has_time=bool(has_time),
        reserved_known=reserved_known,
        unknown_frees=unknown_frees,
        oom_rows=oom_rows,
    )


def _apply_phase_marks(phases: list[Any], times: np.ndarray, stage: np.ndarray, step: np.ndarray) -> None:
    """Use MemTrace's ``phases`` marks (``{"step", "phase", "time_us"}``) to set stage and step by time."""
    from lightning_memtrace.types import STAGE_AFTER_PHASE, Phase

    marks = []
    for p in phases:
        if not isinstance(p, dict):
            continue
        try:
            phase = Phase(str(p.get("phase")))
            marks.append((int(p.get("time_us", 0)), _ST[STAGE_AFTER_PHASE[phase].value], int(p.get("step", -1))))
        except (ValueError, KeyError, TypeError):
            continue
    marks.sort()
    for k, (t, code, st) in enumerate(marks):
        t_next = marks[k + 1][0] if k + 1 < len(marks) else None
        lo = int(np.searchsorted(times, t, side="left"))
        hi = int(np.searchsorted(times, t_next, side="left")) if t_next is not None else len(times)
        stage[lo:hi] = code
        step[lo:hi] = st


def replay(snapshot: Snapshot | dict[str, Any] | list[Any], *, source: str | None = None) -> Replay:
    """Replay every device of a snapshot.

    Args:
        snapshot: A :class:`~lightning_memtrace.snapshot_loader.Snapshot`, or an already-unpickled snapshot (dict or
            old list format).
        source: Name to show for it (defaults to the file name).

    Returns:
        The :class:`Replay`.

    Raises:
        SnapshotError: The snapshot's content is malformed in a way the replay cannot read (a one-line message).
    """
    if not isinstance(snapshot, Snapshot):
        data, layout = normalize(snapshot)
        snapshot = Snapshot(data=data, layout=layout)
    try:
        return _replay(snapshot, source)
    except (SnapshotError, MemoryError, RecursionError):
        raise
    except Exception as error:  # untrusted content: one line, never a traceback from deep inside the replay
        message = " ".join(str(error).split())[:200]
        raise SnapshotError(
            f"{source or snapshot.name}: malformed snapshot ({type(error).__name__}: {message})"
        ) from None


def _replay(snapshot: Snapshot, source: str | None) -> Replay:
    traces = snapshot.device_traces
    segments = snapshot.segments
    devices: set[int] = {d for d, t in enumerate(traces) if t}
    for seg in segments:
        device = _as_int(seg.get("device"))
        if 0 <= device < 4096:
            devices.add(device)
    if not devices:
        devices = {0}
    annotations = snapshot.external_annotations
    memtrace = snapshot.memtrace
    result: dict[int, DeviceReplay] = {}
    with _gc_paused():
        for device in sorted(devices):
            trace = traces[device] if device < len(traces) else []
            result[device] = _replay_device(device, trace, segments, annotations, memtrace)
    return Replay(
        devices=result,
        source=source or snapshot.name,
        is_memtrace=memtrace is not None,
        memtrace=memtrace,
        allocator_settings=snapshot.allocator_settings,
        reserved_end_bytes=sum(_as_int(s.get("total_size")) for s in segments),
        num_segments=len(segments),
    )
