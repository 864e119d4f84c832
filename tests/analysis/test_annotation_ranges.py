"""Reading a snapshot's annotations (torch's ``external_annotations``): live bytes at each START/END, and the peak
and categories inside each range; the compile-context grouping of CUDA events."""

from __future__ import annotations

import pickle

from shared_files import fixture_path

from lightning_memtrace.analysis.annotations import annotated_ranges, annotation_rows, compile_context_sites
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay


def _alloc(addr, size, t, category=None):
    event = {"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}
    if category is not None:
        event["category"] = category
    return event


def _free(addr, size, t):
    return {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def _note(name, stage, t, device=0):
    return {"name": name, "stage": stage, "time_us": t, "device": device}


def _synthetic():
    # One block alive before the trace (1000 B, seeded from the segments), then:
    trace = [
        _alloc(0x100, 300, 10, "activations"),  # live 1300
        _alloc(0x200, 500, 20, "activations"),  # live 1800  <- peak of "outer" and of the first "block"
        _free(0x200, 500, 30),  # live 1300
        _alloc(0x300, 4000, 40, "gradients"),  # live 5300  <- peak of "late" and of the second "block"
        _free(0x300, 4000, 50),  # live 1300
        _free(0x100, 300, 60),  # live 1000
        _alloc(0x400, 200, 70, "other"),  # live 1200
    ]
    segments = [
        {
            "device": 0,
            "address": 0x10000,
            "total_size": 1000,
            "blocks": [{"address": 0x10000, "size": 1000, "requested_size": 1000, "state": "active_allocated"}],
        },
        {
            "device": 0,
            "address": 0x400,
            "total_size": 200,
            "blocks": [{"address": 0x400, "size": 200, "requested_size": 200, "state": "active_allocated"}],
        },
    ]
    annotations = [
        _note("early", "END", 5),  # no START in the file: from the trace's beginning
        _note("outer", "START", 10),  # at the time of the first event: the state after it (1300)
        _note("block", "START", 15),
        _note("block", "START", 18),  # nested in the first "block"
        _note("block", "END", 25),  # closes the inner one (18..25)
        _note("outer", "END", 35),
        _note("block", "END", 45),  # closes the outer "block" (15..45)
        _note("late", "START", 38),  # crosses "block"; still open at the end of the file
        _note("other device", "START", 20, device=1),
        _note("other device", "END", 30, device=1),
    ]
    return {"segments": segments, "device_traces": [trace], "external_annotations": annotations}


def test_live_bytes_at_each_annotation_are_the_state_after_every_event_up_to_its_time():
    dev = replay(_synthetic()).devices[0]
    rows = annotation_rows(dev)
    assert [(r["name"], r["stage"], r["time_us"], r["live_bytes"]) for r in rows] == [
        ("early", "END", 5, 1000),
        ("outer", "START", 10, 1300),
        ("block", "START", 15, 1300),
        ("block", "START", 18, 1300),
        ("block", "END", 25, 1800),
        ("outer", "END", 35, 1300),
        ("late", "START", 38, 1300),
        ("block", "END", 45, 5300),
    ]
    assert rows[0]["index"] == -1 and rows[1]["index"] == 0
    assert set(rows[0]) >= {"name", "stage", "time_us", "live_bytes"}


def test_range_peaks_and_categories_are_exact():
    dev = replay(_synthetic()).devices[0]
    ranges = {(r.name, r.start_us): r for r in annotated_ranges(dev)}
    assert set(ranges) == {("early", None), ("outer", 10), ("block", 15), ("block", 18), ("late", 38)}

    early = ranges[("early", None)]
    assert (early.start_live_bytes, early.end_live_bytes, early.peak_bytes, early.peak_index) == (1000, 1000, 1000, -1)
    assert early.by_category == {"pre_existing": 1000} and not early.complete

    outer = ranges[("outer", 10)]
    assert (outer.start_live_bytes, outer.end_live_bytes, outer.peak_bytes, outer.peak_time_us) == (1300, 1300, 1800, 20)
    assert outer.by_category == {"pre_existing": 1000, "activations": 800}
    assert outer.events == 2 and outer.duration_us == 25 and outer.depth == 0

    inner = ranges[("block", 18)]
    assert (inner.end_us, inner.peak_bytes, inner.depth) == (25, 1800, 2)
    first_block = ranges[("block", 15)]
    assert (first_block.end_us, first_block.peak_bytes, first_block.peak_time_us) == (45, 5300, 40)
    assert first_block.by_category == {"gradients": 4000, "pre_existing": 1000, "activations": 300}

    late = ranges[("late", 38)]
    assert late.end_us is None and late.end_live_bytes == 1200 and late.peak_bytes == 5300
    assert late.as_dict()["peak_by_category"] == {"gradients": 4000, "pre_existing": 1000, "activations": 300}


def test_a_peak_at_the_range_start_is_the_start_state():
    snap = _synthetic()
    snap["external_annotations"] = [_note("after", "START", 55), _note("after", "END", 65)]
    (after,) = annotated_ranges(replay(snap).devices[0])
    assert (after.start_live_bytes, after.peak_bytes, after.peak_time_us, after.end_live_bytes) == (1300, 1300, 55, 1000)


def test_annotations_go_with_their_device():
    rep = replay(_synthetic())
    assert [a["name"] for a in rep.devices[0].annotations].count("other device") == 0
    no_device = _synthetic()
    no_device["external_annotations"] = [{"name": "x", "stage": "START", "time_us": 12}, {"name": "x", "stage": "END", "time_us": 22}]
    (x,) = annotated_ranges(replay(no_device).devices[0])
    assert x.peak_bytes == 1800


def test_untimed_or_malformed_annotations_are_left_out():
    snap = _synthetic()
    snap["external_annotations"] = [{"name": "x", "stage": "START"}, {"name": "x", "stage": "END", "time_us": "soon"}, 7]
    dev = replay(snap).devices[0]
    assert annotation_rows(dev) == [] and annotated_ranges(dev) == []


def test_real_snapshot_annotations_match_a_brute_force_replay():
    path = fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")
    dev = replay(load_snapshot(path)).main
    timeline = dev.timeline
    rows = annotation_rows(dev)
    assert [(r["name"], r["stage"]) for r in rows] == [
        ("Optimizer.zero_grad#AdamW.zero_grad", "START"),
        ("Optimizer.zero_grad#AdamW.zero_grad", "END"),
        ("Optimizer.step#AdamW.step", "START"),
        ("Optimizer.step#AdamW.step", "END"),
    ]
    times, live = timeline["time_us"].tolist(), timeline["live_bytes"].tolist()
    for row in rows:
        before = [b for t, b in zip(times, live) if t <= row["time_us"]]
        assert row["live_bytes"] == (before[-1] if before else dev.seed_bytes)
    step = next(r for r in annotated_ranges(dev) if r.name.startswith("Optimizer.step"))
    inside = [b for t, b in zip(times, live) if step.start_us <= t <= step.end_us]
    assert step.peak_bytes == max(inside) == 54_802_667_524
    assert sum(step.by_category.values()) == step.peak_bytes


def test_compile_context_groups_live_allocations():
    trace = [
        {**_alloc(1, 100, 1), "compile_context": "[0/0]"},
        {**_alloc(2, 50, 2), "compile_context": "N/A"},
        {**_alloc(3, 70, 3), "compile_context": "[1/0]"},
        {**_alloc(4, 30, 4), "compile_context": "[0/0]"},
        {**_free(3, 70, 5), "compile_context": "[1/0]"},
    ]
    dev = replay({"segments": [], "device_traces": [trace]}).devices[0]
    groups = compile_context_sites(dev)  # at the peak: every allocation alive (after the 4th event)
    assert [(g["compile_context"], g["bytes"], g["count"]) for g in groups] == [("[0/0]", 130, 2), ("[1/0]", 70, 1), ("", 50, 1)]
    after = compile_context_sites(dev, index=4)
    assert [(g["compile_context"], g["bytes"]) for g in after] == [("[0/0]", 130), ("", 50)]
    plain = replay({"segments": [], "device_traces": [[_alloc(1, 100, 1)]]}).devices[0]
    assert compile_context_sites(plain) == [] and "compile_context" not in plain.allocations.columns


def test_real_snapshots_with_compile_context_fields_but_no_context(fixtures_dir):
    with open(fixture_path("MAGMA27_assignment2_memory_snapshot.pickle"), "rb") as handle:
        assert "compile_context" in pickle.load(handle)["device_traces"][0][0]
    dev = replay(load_snapshot(fixture_path("MAGMA27_assignment2_memory_snapshot.pickle"))).main
    assert compile_context_sites(dev) == []  # every event says "N/A"


def test_summary_prints_annotations_and_compile_contexts(tmp_path, capsys, monkeypatch):
    from lightning_memtrace.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    snap = _synthetic()
    for event in snap["device_traces"][0]:
        event["compile_context"] = "[0/0]" if event["addr"] == 0x300 else "N/A"
    path = tmp_path / "annotated.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["summary", str(path)]) == 0
    text = capsys.readouterr().out
    assert "annotations (annotated ranges)" in text and "late" in text and "(started before)" in text
    assert "5,300" in text  # the peak inside "block" and "late"
    assert "live at the peak, by compile context" in text and "[0/0]" in text
    plain = tmp_path / "plain.pickle"
    plain.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_alloc(1, 100, 1)]]}))
    assert main(["summary", str(plain)]) == 0
    text = capsys.readouterr().out
    assert "annotations" not in text and "compile context" not in text
