"""Replay a snapshot's trace into a timeline of live memory, with a category and a code site for every byte.

One row per trace event (time, action, address, size, live bytes, category, phase, step, top user frame). The live set
is seeded from ``segments`` when recording started after allocations existed (blocks active at dump time that the trace
never mentions, and addresses whose first event is a free), frees of unknown addresses are tolerated, and ``alloc`` is
counted by its requested size.

Categories come from the snapshot when MemTrace wrote it (per-event ``category``); otherwise the user's rules name them
(:mod:`~lightning_memtrace.analysis.rules`: ``--rule``, the header's ``category_rules``), else they are inferred from
the stack frames and lifetimes of each allocation (see :func:`infer_category`); both are marked ``inferred`` (not
recorded). Category codes index the replay's own ``categories`` (the built-in ones, then the rule names).

The work is vectorised (numpy) except for one pass over the events to read their fields and one analysis per distinct
frame list, so a million-event trace replays in about a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from lightning_memtrace.analysis.allocator_replay import MAX_EVENTS
from lightning_memtrace.analysis.categories import CAT_CODE, infer_categories
from lightning_memtrace.analysis.events import (
    ACTIONS,
    A,
    action_codes,
    as_int,
    column,
    extract_columns,
    factorize,
    first_positions,
    scatter_add,
)
from lightning_memtrace.analysis.loader import Snapshot, SnapshotError, normalize
from lightning_memtrace.collector import gc_paused
from lightning_memtrace.analysis.model import DeviceReplay, Replay
from lightning_memtrace.analysis.rules import NO_RULES, CategoryRules, RuleError, RulesLike
from lightning_memtrace.analysis.stacks import (
    PRE_EXISTING_SITE,
    S_FWD,
    S_OUT,
    Site,
    SiteTable,
    analyze_frames,
    analyze_lists,
    group_stacks,
)
from lightning_memtrace.analysis.stages import event_stages, read_tags, smooth_stages
from lightning_memtrace.schema import header_category_rules, header_is_cpu, header_phase_marks
from lightning_memtrace.types import CATEGORIES, STAGES, InferredCategory, category_label

PRE_EXISTING_CATEGORY = InferredCategory.PRE_EXISTING.value


@dataclasses.dataclass
class Events:
    """A device's trace as columns, one entry per event."""

    action: np.ndarray  # codes into ACTIONS
    addr: np.ndarray
    size: np.ndarray
    time: np.ndarray  # time_us, or the event position when the trace has no times
    has_time: bool
    stage: np.ndarray  # stage codes (not smoothed)
    step: np.ndarray
    site: np.ndarray  # codes into the site table
    forced: np.ndarray  # category a stack forces, or -1
    recorded: np.ndarray  # category code MemTrace recorded, or -1
    #: The category code a user rule gives the event's stack, or -1.
    rule: np.ndarray | None = None
    #: The ``compile_context`` of each event (codes into ``contexts``; -1: none), where torch recorded it.
    context: np.ndarray | None = None
    contexts: list[str] = dataclasses.field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.action)


@dataclasses.dataclass
class Pairing:
    """Allocations and frees paired by address.

    Attributes:
        sorted_addrs: Addresses of the alloc/free events, sorted.
        alloc_rows: Rows of allocations; ``alloc_end``: the row of their free (``n``: alive at the end).
        pre_free_rows: Frees that are the first event of their address (the block existed before the trace).
        unknown_frees: Frees whose previous event at that address is not an allocation.
    """

    sorted_addrs: np.ndarray
    alloc_rows: np.ndarray
    alloc_end: np.ndarray
    pre_free_rows: np.ndarray
    unknown_frees: int


@dataclasses.dataclass
class Segments:
    """What the dump-time segments say about one device: live blocks the trace never mentions, reserved bytes."""

    seed_blocks: list[tuple[int, int, str, list[Any]]]  # (size, addr, category, frames)
    reserved_end: int
    known: bool


@dataclasses.dataclass
class Allocations:
    """One entry per allocation: those of the trace, then pre-existing frees, then seeded blocks."""

    alloc_index: np.ndarray  # -1: before the trace
    end_index: np.ndarray  # n: alive at the end
    size: np.ndarray
    site: np.ndarray
    stage: np.ndarray
    stage_end: np.ndarray
    step: np.ndarray
    category: np.ndarray
    inferred: np.ndarray
    context: np.ndarray | None = None  # codes into Events.contexts, -1: none


#: The field torch adds to each event when recording was started with ``compile_context=True``: the torch.compile
#: frame (``"[0/0]"``...) the allocation was made in, ``"N/A"`` outside compiled code.
COMPILE_CONTEXT_FIELD = "compile_context"
#: What the allocations table holds for an allocation without a compile context.
NO_COMPILE_CONTEXT = ""


def compile_contexts(trace: list[dict[str, Any]]) -> tuple[np.ndarray | None, list[str]]:
    """Each event's compile context (codes, -1 for none or ``"N/A"``) and the distinct contexts; ``(None, [])`` when the
    trace's events carry none."""
    n = len(trace)
    if not n or not any(isinstance(e, dict) and COMPILE_CONTEXT_FIELD in e for e in trace[:64]):
        return None, []
    codes, uniques = factorize(column(trace, COMPILE_CONTEXT_FIELD, None))
    names = [str(u) if u is not None else "" for u in uniques]
    keep = np.array([bool(x) and x != "N/A" for x in names] + [False], dtype=bool)
    remap = np.cumsum(keep) - 1
    codes = np.where(keep[codes], remap[codes], -1).astype(np.int32)
    kept = [x for x, k in zip(names, keep[:-1].tolist()) if k]
    return (codes, kept) if kept else (None, [])


def read_events(
    trace: list[dict[str, Any]],
    device: int,
    snapshot_info: tuple[list, dict | None],
    table: SiteTable,
    rules: CategoryRules = NO_RULES,
) -> Events:
    """Step 1: the fields, stacks, tags, stages and steps of every event (and the category a rule gives its stack)."""
    annotations, header = snapshot_info
    n = len(trace)
    actions, addrs, sizes, times_or_none, frames = extract_columns(trace)
    codes = action_codes(actions, n)
    del actions
    has_time = times_or_none is not None and n > 0
    times = times_or_none if times_or_none is not None else np.arange(n, dtype=np.int64)
    frame_stage, site, forced, rule = classify_stacks_with_rules(frames, n, table, rules)
    del frames
    tag_stage, tag_step, recorded = read_tags(trace)
    stage, step = event_stages(
        frame_stage, (tag_stage, tag_step), times, has_time, annotations, device, header_phase_marks(header)
    )
    context, contexts = compile_contexts(trace)
    return Events(codes, addrs, sizes, times, has_time, stage, step, site, forced, recorded, rule, context, contexts)


def classify_stacks(frames: Any, n: int, table: SiteTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 2 without rules: stage, site and forced category per event (see :func:`classify_stacks_with_rules`)."""
    stage, site, forced, _ = classify_stacks_with_rules(frames, n, table)
    return stage, site, forced


def classify_stacks_with_rules(
    frames: Any, n: int, table: SiteTable, rules: CategoryRules = NO_RULES
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 2: stage, site, forced category and rule category (-1: none) per event; each frame list object is looked
    at once (events share them) and each distinct stack analysed once, the rules included (list objects of equal
    content share the analysis)."""
    if not n:
        empty = np.zeros(0, dtype=np.int16)
        return np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int32), empty, empty
    frame_key, unique_ids = pd.factorize(np.fromiter(map(id, frames), dtype=np.int64, count=n))
    unique_lists: list[Any] = [frames[i] for i in first_positions(frame_key, len(unique_ids)).tolist()]
    stack_of_list, stacks = group_stacks(unique_lists)
    del unique_lists
    stack_stage, stack_site, stack_forced = analyze_lists(stacks, table)
    stack_rule = rules.stack_codes(stacks)
    stack_key = stack_of_list[frame_key]
    return stack_stage[stack_key], stack_site[stack_key], stack_forced[stack_key], stack_rule[stack_key]


def _shifted_equal(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(same address as the next entry, same as the previous) for sorted addresses."""
    same_next = np.zeros(len(a), dtype=bool)
    same_prev = np.zeros(len(a), dtype=bool)
    if len(a) > 1:
        same_next[:-1] = a[1:] == a[:-1]
        same_prev[1:] = same_next[:-1]
    return same_next, same_prev


def pair_by_address(action: np.ndarray, addrs: np.ndarray) -> Pairing:
    """Step 3: each allocation's free (the next event at its address), frees of blocks older than the trace."""
    n = len(action)
    is_alloc = action == A["alloc"]
    free_code = A["free_completed"] if bool((action == A["free_completed"]).any()) else A["free_requested"]
    is_free = (action == free_code) | (action == A["free"])
    sel = np.nonzero(is_alloc | is_free)[0]
    s = sel[np.argsort(addrs[sel], kind="stable")]  # by address, then by position (sel is increasing)
    a = addrs[s]
    s_is_alloc = is_alloc[s]
    same_next, same_prev = _shifted_equal(a)
    next_pos = np.full(len(s), n, dtype=np.int64)
    next_pos[:-1] = s[1:]
    prev_is_alloc = np.zeros(len(s), dtype=bool)
    prev_is_alloc[1:] = s_is_alloc[:-1] & same_prev[1:]
    unknown = ~s_is_alloc & ~prev_is_alloc
    return Pairing(
        sorted_addrs=a,
        alloc_rows=s[s_is_alloc],
        alloc_end=np.where(same_next[s_is_alloc], next_pos[s_is_alloc], n),
        pre_free_rows=s[unknown & ~same_prev],  # first event of its address is a free
        unknown_frees=int(unknown.sum()),
    )


def _active_blocks(segment: dict[str, Any]) -> Iterator[tuple[int, int, str, list[Any]]]:
    blocks = segment.get("blocks")
    for block in blocks if isinstance(blocks, list) else []:
        if not isinstance(block, dict) or not str(block.get("state", "")).startswith("active"):
            continue
        req = as_int(block.get("requested_size"))
        size = req if req > 0 else as_int(block.get("size"))
        yield (size, as_int(block.get("address")), str(block.get("category", "") or ""), block.get("frames") or [])


def read_segments(segments: list[dict[str, Any]], device: int, sorted_addrs: np.ndarray) -> Segments:
    """Step 4: this device's reserved bytes at dump time, and its active blocks the trace never mentions."""
    candidates: list[tuple[int, int, str, list[Any]]] = []
    reserved_end = 0
    known = False
    for seg in segments:
        if as_int(seg.get("device", device)) != device:
            continue
        known = True
        reserved_end += as_int(seg.get("total_size"))
        candidates.extend(_active_blocks(seg))
    if candidates and len(sorted_addrs):
        block_addrs = np.array([c[1] for c in candidates], dtype=np.int64)
        pos = np.minimum(np.searchsorted(sorted_addrs, block_addrs), len(sorted_addrs) - 1)
        mentioned = sorted_addrs[pos] == block_addrs
        candidates = [c for c, m in zip(candidates, mentioned.tolist()) if not m]
    return Segments(candidates, reserved_end, known)


def _seed_sites(blocks: list[tuple[int, int, str, list[Any]]], table: SiteTable) -> np.ndarray:
    """Site codes of seeded blocks from their block frames; -1 for those without frames (see :func:`pre_existing_sites`)."""
    seed = np.full(len(blocks), -1, dtype=np.int32)
    for k, (_, _, _, frames) in enumerate(blocks):
        if frames:
            seed[k] = table.intern(analyze_frames(frames, table).site)
    return seed


def pre_existing_site(category: int, categories: tuple[str, ...] = CATEGORIES) -> Site:
    """The stand-in site of allocations older than the trace without a stack, one per category (``<allocated before
    recording> · parameters``) so that the sites table splits them as the category table does; plain
    ``<allocated before recording>`` when the category is pre-existing itself (inferred). ``category`` is a code into
    ``categories``."""
    name = categories[category] if 0 <= category < len(categories) else "other"
    if name == PRE_EXISTING_CATEGORY:
        return PRE_EXISTING_SITE
    return dataclasses.replace(PRE_EXISTING_SITE, function=f"{PRE_EXISTING_SITE.function} · {category_label(name)}")


def _fill_pre_existing_sites(
    site: np.ndarray, category: np.ndarray, table: SiteTable, categories: tuple[str, ...] = CATEGORIES
) -> None:
    """Give the allocations marked -1 in ``site`` their category's stand-in site (in place)."""
    missing = site < 0
    if not missing.any():
        return
    codes = {
        int(c): table.intern(pre_existing_site(int(c), categories)) for c in np.unique(category[missing]).tolist()
    }
    lookup = np.zeros(max(codes) + 1, dtype=np.int32)
    for c, code in codes.items():
        lookup[c] = code
    site[missing] = lookup[category[missing]]


def build_allocations(
    ev: Events, pairing: Pairing, segs: Segments, table: SiteTable, rules: CategoryRules = NO_RULES
) -> Allocations:
    """Step 5: the allocation table, with stages at both ends and a category: recorded, else a user rule's (from the
    allocation's stack: its event's, or a live block's frames), else inferred. Frees of blocks older than the trace
    have no allocation stack: no rule applies to them."""
    n = ev.n
    rows, pre, blocks = pairing.alloc_rows, pairing.pre_free_rows, segs.seed_blocks
    n_old = len(pre) + len(blocks)
    a_index = np.concatenate([rows, np.full(n_old, -1, dtype=np.int64)])
    e_index = np.concatenate([pairing.alloc_end, pre, np.full(len(blocks), n, dtype=np.int64)])
    a_size = np.concatenate([ev.size[rows], ev.size[pre], np.array([b[0] for b in blocks], dtype=np.int64)])
    seed_sites = _seed_sites(blocks, table)
    a_site = np.concatenate([ev.site[rows], np.full(len(pre), -1, dtype=np.int32), seed_sites]).astype(np.int32)
    a_stage = np.concatenate([ev.stage[rows], np.full(n_old, S_OUT, dtype=np.int8)])
    end_clip = np.minimum(e_index, max(n - 1, 0))
    a_stage_end = np.where(e_index < n, ev.stage[end_clip] if n else 0, -1).astype(np.int8)
    a_step = np.concatenate([ev.step[rows], np.full(n_old, -1, dtype=np.int64)])
    inferred = infer_categories(a_stage, a_stage_end, a_index, e_index, n, np.nonzero(ev.stage == S_FWD)[0])
    a_forced = np.concatenate([ev.forced[rows], np.full(n_old, -1, dtype=np.int16)])
    inferred = np.where((a_forced >= 0) & (a_index >= 0), a_forced, inferred).astype(np.int16)
    recorded = np.concatenate(
        [ev.recorded[rows], ev.recorded[pre], np.array([CAT_CODE.get(b[2], -1) for b in blocks], dtype=np.int16)]
    )
    a_inferred = recorded < 0
    if rules and ev.rule is not None:
        seed_rules = rules.stack_codes([b[3] for b in blocks])
        a_rule = np.concatenate([ev.rule[rows], np.full(len(pre), -1, dtype=np.int16), seed_rules])
        # "other" as MemTrace records it is what it did not name: a rule may name it, as it names guesses
        a_inferred |= (a_rule >= 0) & (recorded == CAT_CODE["other"])
        inferred = np.where(a_rule >= 0, a_rule, inferred).astype(np.int16)
    a_cat = np.where(a_inferred, inferred, recorded).astype(np.int16)
    _fill_pre_existing_sites(a_site, a_cat, table, rules.categories if rules else CATEGORIES)
    a_context = None
    if ev.context is not None:
        a_context = np.concatenate([ev.context[rows], np.full(n_old, -1, dtype=np.int32)])
    return Allocations(a_index, e_index, a_size, a_site, a_stage, a_stage_end, a_step, a_cat, a_inferred, a_context)


def live_bytes(al: Allocations, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Step 6: per event, the change of live bytes and live bytes after it; and the bytes live before the trace."""
    in_trace = al.alloc_index >= 0
    ends_in = al.end_index < n
    delta = scatter_add(n, al.alloc_index[in_trace], al.size[in_trace]) - scatter_add(
        n, al.end_index[ends_in], al.size[ends_in]
    )
    seed_bytes = int(al.size[~in_trace].sum())
    return delta, seed_bytes + np.cumsum(delta), seed_bytes


def _segment_delta(ev: Events) -> np.ndarray:
    """The change of reserved bytes at each event (segment events only)."""
    seg_delta = np.zeros(ev.n, dtype=np.int64)
    for name, sign in (("segment_alloc", 1), ("segment_map", 1), ("segment_free", -1), ("segment_unmap", -1)):
        m = ev.action == A[name]
        seg_delta[m] = sign * ev.size[m]
    return seg_delta


def reserved_bytes(ev: Events, segs: Segments, header: dict[str, Any] | None) -> tuple[np.ndarray, bool]:
    """Step 7: reserved bytes per event from segment events, anchored on the dump-time total; and whether known."""
    seg_delta = _segment_delta(ev)
    known = (segs.known or bool(seg_delta.any())) and not header_is_cpu(header)  # the CPU allocator caches nothing
    if not known:
        return np.zeros(ev.n, dtype=np.int64), False
    start = max(segs.reserved_end - int(seg_delta.sum()), 0)
    return start + np.cumsum(seg_delta), True


def reserved_before(ev: Events, reserved: np.ndarray, known: bool) -> int:
    """Reserved bytes before the first event (0 when unknown or when there is no event)."""
    if not known or ev.n == 0:
        return 0
    return int(reserved[0]) - int(_segment_delta(ev)[0])


def event_categories(ev: Events, al: Allocations) -> tuple[np.ndarray, np.ndarray]:
    """Step 8: each event's category, that of the allocation it touches (else the recorded one), and if inferred."""
    n = ev.n
    in_trace = al.alloc_index >= 0
    ends_in = al.end_index < n
    cat = np.full(n, -1, dtype=np.int16)
    inferred = np.zeros(n, dtype=bool)
    cat[al.alloc_index[in_trace]] = al.category[in_trace]
    inferred[al.alloc_index[in_trace]] = al.inferred[in_trace]
    cat[al.end_index[ends_in]] = al.category[ends_in]
    inferred[al.end_index[ends_in]] = al.inferred[ends_in]
    untouched = cat < 0
    cat[untouched] = ev.recorded[untouched]
    return cat, inferred


def _categorical(codes: np.ndarray, names: Any) -> pd.Categorical:
    return pd.Categorical.from_codes(codes.astype(np.int64), categories=list(names))


def timeline_frame(
    ev: Events,
    al: Allocations,
    segs: Segments,
    header: dict[str, Any] | None,
    table: SiteTable,
    categories: tuple[str, ...] = CATEGORIES,
) -> tuple[pd.DataFrame, int, bool]:
    """Step 9: the timeline table (one row per event; ``attrs["reserved_start"]``: reserved bytes before the first
    event); with the seed bytes and whether reserved bytes are known."""
    n = ev.n
    delta, live, seed_bytes = live_bytes(al, n)
    reserved, reserved_known = reserved_bytes(ev, segs, header)
    cat, inferred = event_categories(ev, al)
    label_codes: dict[str, int] = {}
    remap = np.array([label_codes.setdefault(x.label, len(label_codes)) for x in table.sites] or [0], dtype=np.int64)
    site = pd.Categorical.from_codes(
        remap[ev.site] if n else np.zeros(0, dtype=np.int64), categories=list(label_codes) or ["<none>"]
    )
    timeline = pd.DataFrame(
        {
            "index": np.arange(n, dtype=np.int64),
            "time_us": ev.time,
            "action": _categorical(ev.action, ACTIONS),
            "addr": ev.addr,
            "size": ev.size,
            "delta": delta,
            "live_bytes": live,
            "reserved_bytes": reserved,
            "category": _categorical(cat, categories),
            "inferred": inferred,
            "phase": _categorical(smooth_stages(ev.stage), STAGES),
            "step": ev.step,
            "site": site,
        },
        copy=False,  # one block per column: stacking the int64 columns into one block copies them all (~1 s at 1M)
    )
    timeline.attrs["reserved_start"] = reserved_before(ev, reserved, reserved_known)
    return timeline, seed_bytes, reserved_known


def allocations_frame(
    al: Allocations,
    segs: Segments,
    table: SiteTable,
    contexts: list[str] | None = None,
    categories: tuple[str, ...] = CATEGORIES,
) -> pd.DataFrame:
    """Step 10: the allocation table as a DataFrame (``attrs["reserved_end"]``: reserved bytes at dump time); with a
    ``compile_context`` column where the trace's events carry one."""
    empty = len(al.site) == 0

    def per_site(values: list[Any], dtype: Any) -> np.ndarray:
        return np.array([], dtype=dtype) if empty else np.array(values, dtype=dtype)[al.site]

    frame = pd.DataFrame(
        {
            "alloc_index": al.alloc_index.astype(np.int64),
            "end_index": al.end_index.astype(np.int64),
            "size": al.size.astype(np.int64),
            "category": _categorical(al.category, categories),
            "inferred": al.inferred,
            "stage_alloc": _categorical(al.stage, STAGES),
            "stage_end": _categorical(al.stage_end, STAGES),
            "step": al.step,
            "site": per_site([x.label for x in table.sites], object),
            "file": per_site([x.file for x in table.sites], object),
            "line": per_site([x.line for x in table.sites], np.int64),
            "function": per_site([x.function for x in table.sites], object),
        },
        copy=False,
    )
    if al.context is not None and contexts:
        frame["compile_context"] = pd.Categorical.from_codes(
            np.where(al.context >= 0, al.context + 1, 0).astype(np.int64), categories=[NO_COMPILE_CONTEXT, *contexts]
        )
    frame.attrs["reserved_end"] = segs.reserved_end
    return frame


def replay_device(
    device: int,
    trace: list[dict[str, Any]],
    segments: list[dict[str, Any]],
    annotations: list[dict[str, Any]],
    header: dict[str, Any] | None,
    rules: CategoryRules = NO_RULES,
) -> DeviceReplay:
    """Replay one device's trace: the steps above, in order."""
    table = SiteTable()
    categories = rules.categories
    ev = read_events(trace, device, (annotations, header), table, rules)
    pairing = pair_by_address(ev.action, ev.addr)
    segs = read_segments(segments, device, pairing.sorted_addrs)
    al = build_allocations(ev, pairing, segs, table, rules)
    timeline, seed_bytes, reserved_known = timeline_frame(ev, al, segs, header, table, categories)
    return DeviceReplay(
        device=device,
        categories=categories,
        timeline=timeline,
        allocations=allocations_frame(al, segs, table, ev.contexts, categories),
        seed_bytes=seed_bytes,
        has_time=bool(ev.has_time),
        reserved_known=reserved_known,
        unknown_frees=pairing.unknown_frees,
        oom_rows=np.nonzero(ev.action == A["oom"])[0].tolist(),
        annotations=device_annotations(annotations, device),
    )


def device_annotations(annotations: list[dict[str, Any]], device: int) -> list[dict[str, Any]]:
    """The annotations of ``device`` (those without a device go with every device) that have a name, a stage and a
    time, ordered by time (stable: entries at equal times keep the file's order)."""
    kept = []
    for a in annotations:
        where = a.get("device")
        if isinstance(where, (int, np.integer)) and not isinstance(where, bool) and int(where) != device:
            continue
        t = a.get("time_us")
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or as_int(t) != t:
            continue
        kept.append(a)
    return sorted(kept, key=lambda a: int(a["time_us"]))


def replay(
    snapshot: Snapshot | dict[str, Any] | list[Any], *, source: str | None = None, rules: RulesLike = None
) -> Replay:
    """Replay every device of a snapshot.

    Args:
        snapshot: A :class:`~lightning_memtrace.analysis.loader.Snapshot`, or an already-unpickled snapshot (dict or
            old list format).
        source: Name to show for it (defaults to the file name).
        rules: User rules for categories (``{name: regex}``, ``["NAME=REGEX", ...]`` or
            :class:`~lightning_memtrace.analysis.rules.CategoryRules`), applied before the header's
            ``category_rules`` (a rule of the same name replaces the header's); see
            :mod:`~lightning_memtrace.analysis.rules`.

    Returns:
        The :class:`Replay`.

    Raises:
        RuleError: A rule given is not usable (a ``ValueError``; its one-line message names it).
        SnapshotError: The snapshot's content is malformed in a way the replay cannot read (a one-line message), a
            bad rule in its header included.
    """
    if not isinstance(snapshot, Snapshot):
        data, layout = normalize(snapshot)
        snapshot = Snapshot(data=data, layout=layout)
    given = CategoryRules.of(rules)
    try:
        combined = CategoryRules.combine(given, header_category_rules(snapshot.memtrace))
    except RuleError as error:
        raise SnapshotError(f"{source or snapshot.name}: the header's category_rules: {error}") from None
    try:
        return _replay(snapshot, source, combined)
    except (SnapshotError, MemoryError, RecursionError):
        raise
    except Exception as error:  # untrusted content: one line, never a traceback from deep inside the replay
        message = " ".join(str(error).split())[:200]
        raise SnapshotError(
            f"{source or snapshot.name}: malformed snapshot ({type(error).__name__}: {message})"
        ) from None


def _replay(snapshot: Snapshot, source: str | None, rules: CategoryRules = NO_RULES) -> Replay:
    traces = snapshot.device_traces
    segments = snapshot.segments
    devices: set[int] = {d for d, t in enumerate(traces) if t}
    for seg in segments:
        device = as_int(seg.get("device"))
        if 0 <= device < 4096:
            devices.add(device)
    if not devices:
        devices = {0}
    annotations = snapshot.external_annotations
    memtrace = snapshot.memtrace
    result: dict[int, DeviceReplay] = {}
    with gc_paused():
        for device in sorted(devices):
            trace = traces[device] if device < len(traces) else []
            result[device] = replay_device(device, trace, segments, annotations, memtrace, rules)
    return Replay(
        devices=result,
        source=source or snapshot.name,
        is_memtrace=memtrace is not None,
        memtrace=memtrace,
        allocator_settings=snapshot.allocator_settings,
        reserved_end_bytes=sum(as_int(s.get("total_size")) for s in segments),
        num_segments=len(segments),
        categories=rules.categories,
        category_rules=rules.as_dict(),
        # kept to serve the trace again for a finding (:mod:`.allocator_replay`), where it is short enough to be
        snapshot=snapshot.data if sum(len(t) for t in traces) <= MAX_EVENTS else None,
    )


