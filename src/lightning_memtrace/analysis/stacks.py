"""What a stack (an allocation's frame list) says: the stage it ran in, the code site to blame, a category it forces.

The site is the innermost user frame by the one rule of :mod:`lightning_memtrace.analysis.frames`. Snapshots share
frame dicts between events, so each distinct frame dict is looked at once (:class:`SiteTable`) and many frame lists
are reduced together with numpy (:func:`analyze_lists`).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.events import first_positions
from lightning_memtrace.analysis.frames import is_driver_file, is_library_file, is_machinery_file, normalize_path
from lightning_memtrace.types import CATEGORIES, Category, Stage

#: Stage codes: positions in :class:`~lightning_memtrace.types.Stage`.
S_OUT, S_INIT, S_FWD, S_BWD, S_ZG, S_OPT, S_AFTER, S_VAL = range(len(Stage))
_OTHER_CODE = CATEGORIES.index(Category.OTHER.value)


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


UNKNOWN_SITE = Site("", 0, "<no frames>")
PRE_EXISTING_SITE = Site("", 0, "<allocated before recording>")
#: torch keeps one cuBLAS workspace per thread that runs products (and per stream) until the process ends.
CUBLAS_WORKSPACE_SITE = Site("", 0, "cuBLAS workspace")
CUDA_WORKSPACE_SITE = Site("", 0, "CUDA library workspace")


@dataclasses.dataclass(frozen=True)
class FrameInfo:
    """What one frame list says: the stage it ran in, the site to blame, and a category it forces (or -1)."""

    stage: int
    site: Site
    forced_category: int = -1


#: F_OTHER: memory of no category, by where it is made: a CUDA library's workspace, DDP's gradient buckets.
F_BWD, F_OPT, F_ZG, F_INIT, F_FWD, F_OTHER = 1, 2, 4, 8, 16, 32
#: Not a stage: the frame drives the training step (Lightning's, see :func:`~.frames.is_driver_file`).
F_DRIVER = 64
#: DDP's methods that make its gradient buckets: when it wraps the model, and again before the second forward.
_DDP_FILE = "/torch/nn/parallel/distributed.py"
_DDP_BUCKET_MAKERS = frozenset({"__init__", "_ddp_init_helper", "_pre_forward", "_rebuild_buckets"})
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

#: One frame → (flags, user site, library site, autograd node name, C++ caller name, step library site: a library
#: Python frame outside torch's machinery, what :func:`~.frames.user_frame` picks inside a step of library code alone)
FrameFacts = tuple[int, "Site | None", "Site | None", "str | None", "str | None", "Site | None"]
_NO_FACTS: FrameFacts = (0, None, None, None, None, None)


def _line_number(value: Any) -> int:
    try:
        line = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return line if 0 <= line < 2**31 else 0


def _python_flags(name: str, filename: str) -> int:
    """The flag a Python frame raises (a stage's, or :data:`F_OTHER`; 0: none), first match wins."""
    in_modules = "/nn/modules/" in filename
    rules = (
        (name in _DDP_BUCKET_MAKERS and filename.endswith(_DDP_FILE), F_OTHER),
        (
            name in ("backward", "_engine_run_backward", "_make_grads", "grad")
            and "/torch/" in filename
            and ("autograd" in filename or filename.endswith("_tensor.py")),
            F_BWD,
        ),
        ("/torch/optim/" in filename and "lr_scheduler" not in filename, F_OPT),
        (name == "zero_grad", F_ZG),
        (name in ("__init__", "reset_parameters") and in_modules, F_INIT),
        (name in ("_apply", "load_state_dict", "_load_from_state_dict", "to_empty") and in_modules, F_INIT),
        (name in ("_call_impl", "_wrapped_call_impl") and "/nn/modules/module.py" in filename, F_FWD),
        (name == "forward", F_FWD),
        (name == "step" and "optim" in filename.lower(), F_OPT),
    )
    return next((flag for matched, flag in rules if matched), 0)


def _native_facts(name: str) -> FrameFacts:
    """Facts of a C++ frame: backward engine / workspace flags, an autograd node, a caller name; a CUDA library's
    workspace is its own site (the innermost frame of its stack, so the one shown), whatever Python line ran first."""
    flags = 0
    if "autograd::Engine" in name or "PythonEngine" in name:
        flags |= F_BWD
    if "Workspace" in name and "cuda" in name:
        cublas = "blas" in name.lower() or "getNewWorkspace" in name  # torch's cuBLAS workspace maker
        site = CUBLAS_WORKSPACE_SITE if cublas else CUDA_WORKSPACE_SITE
        return (flags | F_OTHER, site, None, None, None, None)
    node = name if ("Backward" in name and "::apply" in name) else None
    caller = None
    if name and not any(k in name for k in _ALLOCATOR_WORDS):
        caller = name.replace("(anonymous namespace)::", "").split("(")[0][:120] or None
    return (flags, None, None, node, caller, None)


def _text(value: Any) -> str:
    """A frame's name or file name: text as it is, anything else (None, a number in an odd file) as empty.

    Only text is read so that two equal frame dicts always say the same (``1 == 1.0`` but ``"1" != "1.0"``): equal
    stacks are then analysed once (:func:`group_stacks`)."""
    return value if isinstance(value, str) else ""


def frame_facts(frame: Any) -> FrameFacts:
    """What one frame says (see :data:`FrameFacts`); a Python frame is a user or a library site by the one rule."""
    if not isinstance(frame, dict):
        return _NO_FACTS
    name = _text(frame.get("name", ""))
    filename = normalize_path(_text(frame.get("filename", "")))
    if not filename.endswith(".py"):
        return _native_facts(name)
    site = Site(filename, _line_number(frame.get("line")), name)
    flags = _python_flags(name, filename)
    if is_driver_file(filename):
        flags |= F_DRIVER
    if is_library_file(filename):
        return (flags, None, site, None, None, None if is_machinery_file(filename) else site)
    return (flags, site, None, None, None, None)


def stage_of_flags(flags: int) -> int:
    """The stage code the OR of a stack's flags means: backward > optimizer step > zero_grad > init > forward."""
    for flag, stage in ((F_BWD, S_BWD), (F_OPT, S_OPT), (F_ZG, S_ZG), (F_INIT, S_INIT), (F_FWD, S_FWD)):
        if flags & flag:
            return stage
    return S_OUT


def node_site(node: str) -> Site:
    """The stand-in site of an autograd node (``autograd MmBackward0``)."""
    short = node.split("(")[0].split("::")
    return Site("", 0, f"autograd {short[-2] if len(short) > 1 else short[0]}")


class SiteTable:
    """Sites numbered in order of first sight, and the facts of each frame dict seen (by ``id``; the dicts are kept
    alive with the table, so an ``id`` is never reused while it is in use)."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self.codes: dict[Site, int] = {}
        self.facts: dict[int, FrameFacts] = {}
        self._alive: list[Any] = []

    def intern(self, site: Site) -> int:
        code = self.codes.get(site)
        if code is None:
            code = self.codes[site] = len(self.sites)
            self.sites.append(site)
        return code

    def facts_of(self, frame: Any) -> FrameFacts:
        facts = self.facts.get(id(frame))
        if facts is None:
            facts = self.facts[id(frame)] = frame_facts(frame)
            self._alive.append(frame)
        return facts


def analyze_frames(frames: Sequence[dict[str, Any]] | None, table: SiteTable | None = None) -> FrameInfo:
    """Classify a stack (innermost frame first) and pick its user frame.

    The stage is decided by priority (:func:`stage_of_flags`): autograd engine or ``backward`` → backward;
    ``torch.optim`` or an optimizer ``step`` → optimizer step; ``zero_grad``; a module's ``__init__``/
    ``reset_parameters``/``_apply``/``load_state_dict`` → init; a module call or ``forward`` → forward; otherwise
    outside. The site is the innermost user Python frame, else the innermost library Python frame, else the autograd
    node or C++ function that allocated.

    Args:
        frames: The event's ``frames``.
        table: Shared facts per frame dict; snapshots share frame dicts between events.
    """
    if not frames:
        return FrameInfo(S_OUT, UNKNOWN_SITE)
    table = table if table is not None else SiteTable()
    flags = 0
    found: list[Any] = [None, None, None, None, None]  # user site, library site, node, caller, step library site
    in_step: list[Any] = [None, None]  # user site, step library site, before the first driver frame
    for frame in frames:
        facts = table.facts_of(frame)
        if facts[0] & F_DRIVER and not flags & F_DRIVER:
            in_step = [found[0], found[4]]
        flags |= facts[0]
        for k in range(5):
            if found[k] is None:
                found[k] = facts[k + 1]
    user, library_py, node, caller, _ = found
    if flags & F_DRIVER:  # the frame user_frame picks: a user line inside the step, else its library code's
        site = in_step[0] or in_step[1] or user or library_py
    else:
        site = user or library_py
    if site is None:
        site = node_site(node) if node is not None else (Site("", 0, caller) if caller is not None else UNKNOWN_SITE)
    return FrameInfo(stage_of_flags(flags & ~F_DRIVER), site, _OTHER_CODE if flags & F_OTHER else -1)


def _unique_frame_facts(
    all_frames: list[Any], frame_codes: np.ndarray, count: int, table: SiteTable
) -> tuple[np.ndarray, np.ndarray]:
    """Flags and the five candidate site codes (user, library, node, caller, step library; -1: none) of each distinct
    frame."""
    first = first_positions(frame_codes, count)
    u_flags = np.zeros(count, dtype=np.int64)
    u_sites = np.full((5, count), -1, dtype=np.int64)
    for k, pos in enumerate(first.tolist()):
        flags, user, library, node, caller, step_library = table.facts_of(all_frames[pos])
        u_flags[k] = flags
        candidates = (
            user,
            library,
            node_site(node) if node is not None else None,
            Site("", 0, caller) if caller else None,
            step_library,
        )
        for kind, candidate in enumerate(candidates):
            if candidate is not None:
                u_sites[kind, k] = table.intern(candidate)
    return u_flags, u_sites


def _as_stack(frames: Any) -> list[Any]:
    """A frame list as :func:`analyze_lists` reads it: a list as it is, a tuple as a list, anything else empty."""
    if type(frames) is list:
        return frames
    return list(frames) if isinstance(frames, (list, tuple)) else []


_FP_MUL = np.uint64(0x9E3779B97F4A7C15)


def _object_array(values: list[Any]) -> np.ndarray:
    """A 1-d object array of ``values`` (lists stay list objects, never broadcast)."""
    return np.fromiter(values, dtype=object, count=len(values))


def _fingerprints(stacks: list[list[Any]]) -> np.ndarray:
    """A code per stack from its length and its middle frame object: equal stacks get equal codes; different ones
    often different codes (:func:`group_stacks` compares the stacks anyway). One look into each list: more frames in
    the code cost more passes over every list than the rounds of comparisons they save (measured at 1M events)."""
    m = len(stacks)
    lengths = np.fromiter(map(len, stacks), dtype=np.int64, count=m)
    nonempty = np.nonzero(lengths > 0)[0]
    full = [stacks[i] for i in nonempty.tolist()] if len(nonempty) < m else stacks
    middle = np.zeros(m, dtype=np.uint64)
    middle[nonempty] = np.fromiter(
        map(id, map(operator.getitem, full, (lengths[nonempty] // 2).tolist())), dtype=np.uint64, count=len(full)
    )
    return pd.factorize((lengths.astype(np.uint64) * _FP_MUL) ^ middle)[0].astype(np.int64)


def _safe_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except RecursionError:  # frames nested deeper than Python compares (a crafted file): taken as different
        return False


def _equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a[k] == b[k]`` for each ``k``: one C loop, or one comparison at a time where some nest too deeply."""
    try:
        return np.fromiter(map(operator.eq, a, b), dtype=bool, count=len(a))
    except RecursionError:
        return np.fromiter(map(_safe_equal, a, b), dtype=bool, count=len(a))


#: Rounds of comparisons :func:`group_stacks` makes before it gives each stack still unmatched a group of its own.
_MAX_ROUNDS = 16


def group_stacks(lists: list[Any]) -> tuple[np.ndarray, list[list[Any]]]:
    """Group frame lists of equal content (distinct list objects often hold the same frame dicts in the same order).

    Lists with the same fingerprint (:func:`_fingerprints`) are compared with ``==`` (a C loop that matches identical
    frame dicts at once) to the first of them; those that differ are compared among themselves the same way, round
    after round (at most :data:`_MAX_ROUNDS`, then each left is a group of its own). So equal stacks are analysed once
    however many list objects hold them; equal frame dicts say the same by construction (:func:`frame_facts` reads
    only text).

    Args:
        lists: Distinct frame lists (each distinct by identity).

    Returns:
        ``(group of each list, one representative stack per group)``, groups numbered in order of first list.
    """
    m = len(lists)
    stack_list = lists if set(map(type, lists)) <= {list} else list(map(_as_stack, lists))
    key = _fingerprints(stack_list) if m else np.zeros(0, dtype=np.int64)
    stacks = _object_array(stack_list)
    del stack_list
    group = np.full(m, -1, dtype=np.int64)
    pending = np.arange(m, dtype=np.int64)
    heads_found: list[np.ndarray] = []
    for _ in range(_MAX_ROUNDS):
        if not len(pending):
            break
        codes, uniques = pd.factorize(key[pending])
        heads = pending[first_positions(codes, len(uniques))]
        head_of = heads[codes]
        same = _equal(stacks[pending], stacks[head_of])
        same[np.searchsorted(pending, heads)] = True  # a stack is its own group's head (even if it holds a NaN)
        group[pending[same]] = head_of[same]
        heads_found.append(heads)
        pending = pending[~same]
    if len(pending):  # many different stacks alike at both ends and the middle (a crafted file): one by one
        group[pending] = pending
        heads_found.append(pending)
    heads_all = np.sort(np.concatenate(heads_found)) if heads_found else np.zeros(0, dtype=np.int64)
    number = np.full(m, -1, dtype=np.int64)
    number[heads_all] = np.arange(len(heads_all))
    return number[group], stacks[heads_all].tolist()


def analyze_lists(lists: list[Any], table: SiteTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`analyze_frames` for many frame lists at once, vectorised over their frames.

    The per-list reductions (OR of flags, first candidate site) are numpy ``reduceat`` calls.

    Returns:
        ``(stage, site code, forced category)`` per list.
    """
    m = len(lists)
    clean = [f if isinstance(f, list) else (list(f) if isinstance(f, tuple) else []) for f in lists]
    lengths = np.fromiter(map(len, clean), dtype=np.int64, count=m)
    total = int(lengths.sum())
    stage = np.full(m, S_OUT, dtype=np.int8)
    site = np.full(m, table.intern(UNKNOWN_SITE), dtype=np.int32)
    forced = np.full(m, -1, dtype=np.int16)
    if total == 0:
        return stage, site, forced
    all_frames = list(itertools.chain.from_iterable(clean))
    frame_codes, unique_ids = pd.factorize(np.fromiter(map(id, all_frames), dtype=np.int64, count=total))
    u_flags, u_sites = _unique_frame_facts(all_frames, frame_codes, len(unique_ids), table)
    del all_frames
    nonempty = lengths > 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[nonempty]
    flags = np.zeros(m, dtype=np.int64)
    flags[nonempty] = np.bitwise_or.reduceat(u_flags[frame_codes], starts)
    stage = np.select(
        [flags & F_BWD > 0, flags & F_OPT > 0, flags & F_ZG > 0, flags & F_INIT > 0, flags & F_FWD > 0],
        [S_BWD, S_OPT, S_ZG, S_INIT, S_FWD],
        S_OUT,
    ).astype(np.int8)
    forced = np.where(flags & F_OTHER > 0, _OTHER_CODE, -1).astype(np.int16)
    positions = np.arange(total, dtype=np.int64)
    big = np.int64(total + 1)

    def first_where(present: np.ndarray) -> np.ndarray:
        """Per list, the position (in all frames) of its first frame where ``present``; ``big`` where none is."""
        first_pos = np.full(m, big, dtype=np.int64)
        first_pos[nonempty] = np.minimum.reduceat(np.where(present, positions, big), starts)
        return first_pos

    chosen = np.full(m, -1, dtype=np.int64)
    # Inside the step (before the first driver frame, where there is one): a user line, else its library code's.
    driver_pos = first_where(u_flags[frame_codes] & F_DRIVER > 0)
    driven = driver_pos < big
    for kind in (0, 4):
        per_frame = u_sites[kind][frame_codes]
        first_pos = first_where(per_frame >= 0)
        take = driven & (chosen < 0) & (first_pos < driver_pos)
        chosen[take] = per_frame[first_pos[take]]
    for kind in range(4):
        per_frame = u_sites[kind][frame_codes]
        first_pos = first_where(per_frame >= 0)
        take = (chosen < 0) & (first_pos < big)
        chosen[take] = per_frame[first_pos[take]]
    site = np.where(chosen >= 0, chosen, site).astype(np.int32)
    return stage, site, forced
