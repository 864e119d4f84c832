"""Each step of the replay, tested on its own (the whole replay is tests/analysis/test_replay.py)."""

from __future__ import annotations

import numpy as np

from lightning_memtrace.analysis.categories import CAT_CODE, infer_categories
from lightning_memtrace.analysis.events import A, action_codes, as_int, extract_columns, scatter_add
from lightning_memtrace.analysis.replay import (
    build_allocations,
    classify_stacks,
    event_categories,
    live_bytes,
    pair_by_address,
    read_events,
    read_segments,
    replay_device,
    reserved_bytes,
)
from lightning_memtrace.analysis.stacks import S_BWD, S_FWD, S_INIT, S_OPT, S_OUT, S_ZG, SiteTable, analyze_lists
from lightning_memtrace.analysis.stages import (
    annotation_ranges,
    count_optimizer_steps,
    event_stages,
    parse_user_metadata,
    read_tags,
    smooth_stages,
)

USER = "/home/me/train.py"
FWD = [
    {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
    {"filename": USER, "line": 7, "name": "main"},
]
OPT = [
    {"filename": "/x/site-packages/torch/optim/adam.py", "line": 3, "name": "step"},
    {"filename": USER, "line": 9, "name": "main"},
]


def _ev(action: str, addr: int, size: int, t: int, frames: list | None = None, **extra: object) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": t, "frames": frames or [], **extra}


def test_extract_columns_and_action_codes() -> None:
    trace = [_ev("alloc", 16, 8, 1), {"action": "free_completed", "addr": 16, "size": 8}, {"action": ["odd"]}]
    actions, addrs, sizes, times, _ = extract_columns(trace)
    assert addrs.tolist() == [16, 16, 0] and sizes.tolist() == [8, 8, 0]
    assert times is None  # an event without time: positions are used instead
    assert action_codes(actions, 3).tolist() == [A["alloc"], A["free_completed"], A["other"]]
    assert as_int("12") == 0 and as_int(True) == 0 and as_int(7.0) == 7 and as_int(2**70) == 0


def test_scatter_add_is_exact() -> None:
    out = scatter_add(4, np.array([0, 2, 2]), np.array([1, 2**60, 3]))
    assert out.tolist() == [1, 0, 2**60 + 3, 0]


def test_classify_stacks_analyses_each_list_once() -> None:
    table = SiteTable()
    frames = [FWD, OPT, FWD, []]
    stage, site, forced = classify_stacks(frames, 4, table)
    assert stage.tolist() == [S_FWD, S_OPT, S_FWD, S_OUT]
    labels = [table.sites[c].label for c in site]
    assert labels == [f"{USER}:7", f"{USER}:9", f"{USER}:7", "<no frames>"]
    assert forced.tolist() == [-1, -1, -1, -1]
    list_stage, _, _ = analyze_lists([FWD], SiteTable())
    assert list_stage.tolist() == [S_FWD]


def test_read_tags_and_parse() -> None:
    trace = [_ev("alloc", 1, 8, 1, user_metadata="phase=backward step=4", category="gradients"), _ev("alloc", 2, 8, 2)]
    stage, step, cat = read_tags(trace)
    assert stage.tolist() == [S_BWD, -1] and step.tolist() == [4, -1]
    assert cat.tolist() == [CAT_CODE["gradients"], -1]
    assert parse_user_metadata("stage=training step=x") == (S_FWD, None)
    untagged = read_tags([_ev("alloc", 1, 8, 1)])
    assert [a.tolist() for a in untagged] == [[-1], [-1], [-1]]


def test_event_stages_priorities() -> None:
    times = np.arange(6, dtype=np.int64)
    frame_stage = np.array([S_FWD, S_FWD, S_OUT, S_OUT, S_OUT, S_OUT], dtype=np.int8)
    tags = (np.array([-1, S_BWD, -1, -1, -1, -1], dtype=np.int8), np.full(6, -1, dtype=np.int64))
    annotations = [
        {"name": "Optimizer.step#Adam.step", "stage": "START", "time_us": 3},
        {"name": "Optimizer.step#Adam.step", "stage": "END", "time_us": 4},
    ]
    stage, step = event_stages(frame_stage, tags, times, True, annotations, 0, None)
    assert stage.tolist() == [S_FWD, S_BWD, S_OUT, S_OPT, S_OPT, S_OUT]
    assert step.tolist() == [0, 0, 0, 0, 0, 1]  # counted from the optimizer region
    assert annotation_ranges(annotations, 0, "Optimizer.step") == [(3, 4)]
    marks = [{"step": 7, "phase": "batch_start", "time_us": 0}, {"step": 7, "phase": "after_forward", "time_us": 2}]
    no_tags = (np.full(6, -1, dtype=np.int8), np.full(6, -1, dtype=np.int64))
    stage, step = event_stages(frame_stage, no_tags, times, True, [], 0, marks)
    assert stage.tolist() == [S_FWD, S_FWD, S_BWD, S_BWD, S_BWD, S_BWD]
    assert step.tolist() == [7] * 6


def test_count_and_smooth() -> None:
    assert count_optimizer_steps(np.array([S_OUT, S_OUT], dtype=np.int8)).tolist() == [-1, -1]
    assert count_optimizer_steps(np.array([S_OPT, S_FWD, S_OPT], dtype=np.int8)).tolist() == [0, 1, 1]
    smoothed = smooth_stages(np.array([S_FWD, S_OUT, S_FWD, S_OUT, S_ZG], dtype=np.int8))
    assert smoothed.tolist() == [S_FWD, S_FWD, S_FWD, S_OUT, S_ZG]


def test_pair_by_address() -> None:
    action = np.array([A["alloc"], A["free_completed"], A["free_completed"], A["alloc"]], dtype=np.int8)
    addrs = np.array([16, 16, 32, 48], dtype=np.int64)
    pairing = pair_by_address(action, addrs)
    assert pairing.alloc_rows.tolist() == [0, 3]
    assert pairing.alloc_end.tolist() == [1, 4]  # 48 is alive at the end (n = 4)
    assert pairing.pre_free_rows.tolist() == [2]  # 32 was allocated before the trace
    assert pairing.unknown_frees == 1


def test_read_segments_seeds_unmentioned_blocks() -> None:
    segments = [
        {
            "device": 0,
            "total_size": 100,
            "blocks": [
                {"state": "active_allocated", "address": 16, "size": 8, "requested_size": 6},
                {"state": "active_allocated", "address": 64, "size": 8, "category": "parameters"},
                {"state": "inactive", "address": 80, "size": 8},
            ],
        },
        {"device": 1, "total_size": 50, "blocks": []},
    ]
    segs = read_segments(segments, 0, np.array([16], dtype=np.int64))
    assert segs.reserved_end == 100 and segs.known
    assert [(b[0], b[1], b[2]) for b in segs.seed_blocks] == [(8, 64, "parameters")]


def _small_trace() -> list[dict]:
    return [
        _ev("alloc", 16, 100, 1, FWD),
        _ev("alloc", 32, 10, 2, FWD),
        _ev("free_completed", 32, 10, 3, FWD),
        _ev("segment_alloc", 0, 1000, 4),
        _ev("alloc", 48, 5, 5, OPT),
    ]


def test_allocations_live_reserved_and_event_categories() -> None:
    table = SiteTable()
    ev = read_events(_small_trace(), 0, ([], None), table)
    pairing = pair_by_address(ev.action, ev.addr)
    segs = read_segments([{"device": 0, "total_size": 2000, "blocks": []}], 0, pairing.sorted_addrs)
    al = build_allocations(ev, pairing, segs, table)
    assert al.size.tolist() == [100, 10, 5]
    assert al.category.tolist() == [CAT_CODE["activations"], CAT_CODE["intermediates"], CAT_CODE["optimizer_state"]]
    assert al.inferred.all()
    delta, live, seed = live_bytes(al, ev.n)
    assert delta.tolist() == [100, 10, -10, 0, 5] and live.tolist() == [100, 110, 100, 100, 105] and seed == 0
    reserved, known = reserved_bytes(ev, segs, None)
    assert known and reserved.tolist() == [1000, 1000, 1000, 2000, 2000]
    cpu_reserved, cpu_known = reserved_bytes(ev, segs, {"device": "cpu"})  # the CPU allocator caches nothing
    assert not cpu_known and not cpu_reserved.any()
    cat, inferred = event_categories(ev, al)
    assert cat.tolist()[:3] == [CAT_CODE["activations"], CAT_CODE["intermediates"], CAT_CODE["intermediates"]]
    assert cat[3] == -1 and inferred[0]


def test_infer_categories_rules() -> None:
    stage_alloc = np.array([S_FWD, S_FWD, S_BWD, S_OPT, S_INIT, S_OUT, S_OUT, S_ZG], dtype=np.int8)
    stage_end = np.array([S_BWD, S_FWD, -1, -1, -1, S_BWD, -1, -1], dtype=np.int8)
    alloc_index = np.array([1, 2, 3, 4, 0, 0, -1, 5])
    end_index = np.array([3, 2, 9, 9, 9, 3, 9, 9])
    cats = infer_categories(stage_alloc, stage_end, alloc_index, end_index, 9, np.array([1, 2]))
    names = [
        "activations",
        "intermediates",
        "gradients",
        "optimizer_state",
        "parameters",
        "activations",
        "pre_existing",
        "other",
    ]
    assert cats.tolist() == [CAT_CODE[n] for n in names]


def test_replay_device_puts_the_steps_together() -> None:
    rep = replay_device(0, _small_trace(), [], [], None)
    assert rep.timeline["live_bytes"].tolist() == [100, 110, 100, 100, 105]
    assert rep.peak.live_bytes == 110 and rep.peak.stage == "forward"
    assert rep.oom_rows == [] and rep.unknown_frees == 0 and rep.has_time
