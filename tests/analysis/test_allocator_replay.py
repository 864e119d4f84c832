"""Real GPUs' snapshots served again by the caching allocator's model: the same blocks at the same addresses, and what
expandable segments would have reserved."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_memtrace.analysis.allocator_replay import (
    expandable_segments_serve_the_oom,
    expandable_segments_what_if,
    replay_allocator,
)
from lightning_memtrace.analysis.findings import fragmentation_finding, oom_findings
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis import replay as replay_module
from lightning_memtrace.analysis.replay import replay
from allocator_snapshots import snapshot_of_an_oom
from shared_files import fixture_path

MIB = 1 << 20
KKAITLYN = "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle"


#: file -> (allocations in the trace, segments it makes)
TRACES = {
    "shreyansh26_profile_grad.pkl": (12, 7),
    "drisspg_mini_snapshot.pickle": (28, 14),
    "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle": (6771, 783),
    "MAGMA27_assignment2_memory_snapshot.pickle": (1721, 0),
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_real_gpus_trace_is_served_at_the_same_addresses(name):
    snapshot = load_snapshot(fixture_path(name)).data
    replay = replay_allocator(snapshot)
    assert (replay.allocations, replay.new_segments) == TRACES[name]
    assert replay.misplaced == 0  # every block where the GPU's allocator put it
    real = snapshot["segments"]
    model = replay.model.segments()
    assert [(s["address"], s["total_size"]) for s in model] == sorted((s["address"], s["total_size"]) for s in real)
    assert replay.model.reserved == sum(s["total_size"] for s in real)
    if name != "drisspg_mini_snapshot.pickle":  # its trace stops before the frees its segments show
        blocks = {(b["address"], b["size"], b["state"]) for s in model for b in s["blocks"]}
        assert blocks == {(b["address"], b["size"], b["state"]) for s in real for b in s["blocks"]}
        assert replay.model.allocated == sum(s["allocated_size"] for s in real)


def test_a_trace_the_model_cannot_explain_is_refused():
    segment = {"address": 1 << 30, "total_size": 20 * MIB, "segment_type": "large", "blocks": []}
    trace = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 * MIB},
        {"action": "alloc", "addr": 1 << 30, "size": 4 * MIB},
        {"action": "free_completed", "addr": (1 << 30) + 4 * MIB, "size": 4 * MIB},
    ]
    with pytest.raises(ValueError, match="which the model does not hold"):
        replay_allocator({"segments": [segment], "device_traces": [trace]})
    wrong_size = [{"action": "segment_alloc", "addr": 1 << 30, "size": 2 * MIB}, trace[1]]
    with pytest.raises(ValueError, match="segment of 20,971,520 B where the trace made one of 2,097,152 B"):
        replay_allocator({"segments": [segment], "device_traces": [wrong_size]})
    with pytest.raises(ValueError, match="no trace"):
        replay_allocator({"segments": [segment], "device_traces": []})


def test_what_expandable_segments_would_have_reserved_for_a_real_training_step():
    snapshot = load_snapshot(fixture_path(KKAITLYN)).data
    served = expandable_segments_what_if(snapshot)
    # its peak reserved is at the dump
    assert served.reserved_bytes == sum(s["total_size"] for s in snapshot["segments"]) == 61_111_009_280
    # the same requests, from the blocks alive when the trace began, in one growing segment per pool
    assert served.expandable_reserved_bytes == 55_511_613_440
    assert (served.oom_requested_bytes, served.oom_served) == (None, None)  # the step did not run out
    shreyansh = load_snapshot(fixture_path("shreyansh26_profile_grad.pkl")).data
    served = expandable_segments_what_if(shreyansh)
    assert (served.reserved_bytes, served.expandable_reserved_bytes) == (4_439_670_784, 4_448_059_392)  # no saving


def test_the_fragmentation_findings_name_what_expandable_segments_would_save():
    replay_of = replay(load_snapshot(fixture_path(KKAITLYN)))
    (finding,) = fragmentation_finding(replay_of)
    assert finding.numbers["expandable_reserved_bytes"] == 55_511_613_440
    assert finding.message.endswith(
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the caching allocator's model, served this trace, "
        "reserves at most 51.7 GiB where it reserved 56.9 GiB (5.2 GiB less)"
    )
    without = dataclasses.replace(replay_of, snapshot=None)  # made without the snapshot's data: the finding as it was
    (plain,) = fragmentation_finding(without)
    assert plain.message.endswith("little fragmentation") and "expandable_reserved_bytes" not in plain.numbers


@pytest.mark.parametrize(
    "trace",
    [
        [{"action": "alloc"}],  # no address, no size
        [{"action": "free_completed", "addr": 4096, "size": 512}],  # frees what nothing allocated
        [{"action": "alloc", "addr": "x", "size": 512}],
        [],
    ],
)
def test_a_trace_that_cannot_be_served_gives_no_figure(trace):
    assert expandable_segments_what_if({"segments": [], "device_traces": [trace]}) is None
    assert expandable_segments_serve_the_oom({"segments": [], "device_traces": [trace]}) is None


def test_an_out_of_memory_error_expandable_segments_would_have_avoided():
    # six blocks in three segments, 60 MiB: 24 MiB live and 36 MiB free, in pieces of 8 and 4 MiB
    snapshot = snapshot_of_an_oom(blocks=6, limit=60 * MIB)
    served = expandable_segments_what_if(snapshot)
    assert (served.reserved_bytes, served.oom_requested_bytes, served.oom_served) == (60 * MIB, 12 * MIB, True)
    # with expandable segments the six blocks lie end to end in one segment: the freed ones and its 12 MiB tail
    assert served.expandable_reserved_bytes == 60 * MIB
    assert expandable_segments_serve_the_oom(snapshot) is True  # what the post-mortem asks, alone
    (finding,) = oom_findings(replay(snapshot))
    assert finding.numbers["expandable_serves"] is True
    assert finding.message.endswith(
        ": fragmentation; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the caching allocator's model, served "
        "this trace in the memory the GPU had, serves this request and every one before it"
    )


def test_an_out_of_memory_error_no_allocator_setting_avoids():
    # four blocks in two segments, 40 MiB: 16 MiB live; end to end in one segment the free pieces are 8 MiB each,
    # and no 20 MiB page is wholly free to map again past the last block
    snapshot = snapshot_of_an_oom(blocks=4, limit=40 * MIB)
    served = expandable_segments_what_if(snapshot)
    assert (served.oom_requested_bytes, served.oom_served) == (12 * MIB, False)
    assert expandable_segments_serve_the_oom(snapshot) is False
    (finding,) = oom_findings(replay(snapshot))
    assert finding.numbers["expandable_serves"] is False
    assert finding.message.endswith("runs out too: expandable segments would not have avoided this error")


def test_a_trace_the_model_places_otherwise_or_too_long_a_one_gives_no_figure(monkeypatch):
    snapshot = snapshot_of_an_oom(blocks=6, limit=60 * MIB)
    moved = [dict(event) for event in snapshot["device_traces"][0]]
    second = [i for i, event in enumerate(moved) if event["action"] == "alloc"][1]
    moved[second]["addr"] += 4096  # not where the model puts it; its frees follow it there
    for event in moved[second + 1:]:
        if event.get("addr") == moved[second]["addr"] - 4096:
            event["addr"] += 4096
    assert replay_allocator({**snapshot, "device_traces": [moved]}).misplaced == 1
    assert expandable_segments_what_if({**snapshot, "device_traces": [moved]}) is None
    assert expandable_segments_serve_the_oom({**snapshot, "device_traces": [moved]}) is None
    monkeypatch.setattr(replay_module, "MAX_EVENTS", len(snapshot["device_traces"][0]) - 1)
    assert replay(snapshot).snapshot is None  # not kept where the trace is too long to serve again
    assert replay(snapshot).expandable_what_if is None
