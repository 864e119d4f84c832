"""Replay: exact live bytes from the fixtures, seeding from segments, category inference and MemTrace categories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.stacks import analyze_frames
from lightning_memtrace.types import CATEGORIES

SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "snapshots"


def snapshot_fixture(name: str) -> Path:
    """A file of ../shared/fixtures/snapshots, or skip when the folder (or file) is absent."""
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"shared fixture {name} is absent")
    return path


def _replay(name: str):
    return replay(load_snapshot(snapshot_fixture(name)))


# ------------------------------------------------------------------------------------------------ fixture figures
def test_shreyansh_peaks_exact() -> None:
    grad = _replay("shreyansh26_profile_grad.pkl")
    no_grad = _replay("shreyansh26_profile_no_grad.pkl")
    assert grad.peak.live_bytes == 4_434_803_008
    assert no_grad.peak.live_bytes == 4_234_803_008
    assert grad.peak.live_bytes - no_grad.peak.live_bytes == 200_000_000
    assert grad.main.seed_bytes == 0
    tl = grad.main.timeline
    assert len(tl) == 33
    assert int(tl["live_bytes"].max()) == 4_434_803_008
    assert list(tl.columns) == [
        "index",
        "time_us",
        "action",
        "addr",
        "size",
        "delta",
        "live_bytes",
        "reserved_bytes",
        "category",
        "inferred",
        "phase",
        "step",
        "site",
    ]
    # live bytes are the running sum of the deltas; alloc is counted by its requested size
    assert (np.cumsum(tl["delta"].to_numpy()) == tl["live_bytes"].to_numpy()).all()
    allocs = tl[tl["action"] == "alloc"]
    assert (allocs["delta"] == allocs["size"]).all()


def test_shreyansh_categories_inferred() -> None:
    grad = _replay("shreyansh26_profile_grad.pkl")
    no_grad = _replay("shreyansh26_profile_no_grad.pkl")
    al = grad.main.allocations
    by_size = {int(s): set(al[al["size"] == s]["category"].astype(str)) for s in al["size"].unique()}
    assert by_size[2_000_000_000] == {"parameters"}  # the weight
    assert by_size[200_000] == {"parameters"}  # the bias
    assert by_size[200_000_000] == {"inputs"}
    assert by_size[1_000_000_000] == {"activations"}  # the outputs
    assert by_size[33_554_432] == {"other"}  # cuBLAS workspace
    assert by_size[1_048_576] == {"intermediates"}
    assert grad.inferred and al["inferred"].all()
    # at the peak: the weight, two inputs (one kept alive by autograd), two outputs
    assert grad.peak.by_category["parameters"] == 2_000_200_000
    assert grad.peak.by_category["inputs"] == 400_000_000
    assert grad.peak.by_category["activations"] == 2_000_000_000
    assert no_grad.peak.by_category["inputs"] == 200_000_000
    assert no_grad.peak.by_category["activations"] == 2_000_000_000
    assert sum(grad.peak.by_category.values()) == grad.peak.live_bytes
    assert grad.peak.stage == "forward"
    sites = grad.peak.sites
    # line 11 holds 2,001,048,576 B: the outputs and a temporary, a row per category; cuBLAS's workspace, made under
    # its first product, is a site of its own
    line11 = sites[sites["line"] == 11].set_index("category")["bytes"].astype(int).to_dict()
    assert line11 == {"activations": 2_000_000_000, "intermediates": 1_048_576}
    assert sites[sites["function"] == "cuBLAS workspace"][["category", "bytes"]].values.tolist() == [
        ["other", 33_554_432]
    ]
    top = sites.iloc[0]
    assert top["file"].endswith("profile_grad.py") and int(top["line"]) == 8 and top["category"] == "parameters"
    assert int(sites["bytes"].sum()) == grad.peak.live_bytes
    inputs_site = sites[sites["line"] == 10].iloc[0]
    assert int(inputs_site["bytes"]) == 400_000_000 and int(inputs_site["count"]) == 2


def test_kkaitlyn_seeded_from_segments() -> None:
    snap = load_snapshot(snapshot_fixture("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle"))
    rep = replay(snap)
    dev = rep.main
    trace_addrs = {e["addr"] for e in snap.device_traces[0] if e["action"] in ("alloc", "free_completed")}
    expected_seed = sum(
        (b["requested_size"] or b["size"])
        for s in snap.segments
        for b in s["blocks"]
        if b["state"].startswith("active") and b["address"] not in trace_addrs
    )
    assert expected_seed > 10 * 1024**3
    assert dev.seed_bytes == expected_seed == 13_628_553_216
    assert dev.unknown_frees == 0
    peak = rep.peak
    assert peak.live_bytes == 54_802_667_524
    assert peak.stage == "optimizer_step"
    assert peak.by_category["optimizer_state"] == 27_254_476_800
    assert peak.by_category["gradients"] == 13_627_238_400
    assert peak.by_category["pre_existing"] == expected_seed
    assert sum(peak.by_category.values()) == peak.live_bytes
    assert rep.reserved_end_bytes == 58_280 * 1024**2
    tl = dev.timeline
    assert int(tl["reserved_bytes"].iloc[-1]) == 58_280 * 1024**2
    assert (tl["live_bytes"] >= 0).all()
    # the category series add up to the live bytes at every row
    series = dev.category_series()
    assert (series.sum(axis=1).to_numpy() == tl["live_bytes"].to_numpy()).all()
    # phases seen: forward, backward, optimizer step
    assert {"forward", "backward", "optimizer_step"} <= set(tl["phase"].astype(str))


def test_other_fixtures_replay() -> None:
    driss = _replay("drisspg_mini_snapshot.pickle")
    assert driss.main.seed_bytes == 0  # every block inactive at dump time
    assert len(driss.main.timeline) == 50
    assert driss.peak.live_bytes == 402_752_512
    magma = _replay("MAGMA27_assignment2_memory_snapshot.pickle")
    assert len(magma.main.timeline) == 5_163
    assert magma.peak.live_bytes == 13_923_997_700
    assert magma.main.unknown_frees == 2  # frees of addresses never allocated: tolerated, counted as pre-existing
    assert (magma.main.timeline["live_bytes"] >= 0).all()
    assert any("/" in str(f) and "\\" not in str(f) for f in magma.peak.sites["file"] if f)
    snap = load_snapshot(snapshot_fixture("Muduard_memory_snapshot.pkl"))
    mud = replay(snap)
    expected = sum(
        (b["requested_size"] or b["size"])
        for s in snap.segments
        for b in s["blocks"]
        if b["state"].startswith("active")
    )
    assert list(mud.devices) == [1]
    assert mud.peak.live_bytes == expected == 3_308_174_782
    assert mud.peak.index == -1


def _two_device_dump_beginning_with_frees() -> dict[str, Any]:
    """A 2-device dump made of real ones: device 0 is shreyansh26's grad run; device 1 is kkaitlyn111's fullstep
    whose trace starts two events after its peak (as a ring buffer that dropped the older events would), so it
    begins with the ``free_completed`` of a 102,400,000 B block allocated before the trace."""
    grad = load_snapshot(snapshot_fixture("shreyansh26_profile_grad.pkl")).data
    kk = load_snapshot(snapshot_fixture("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")).data
    peak_row = 19_335  # the fullstep's peak (54,802,667,524 B), an alloc followed by its free_requested
    segments = [dict(s, device=0) for s in grad["segments"]] + [dict(s, device=1) for s in kk["segments"]]
    return {
        **kk,
        "segments": segments,
        "device_traces": [grad["device_traces"][0], kk["device_traces"][0][peak_row + 2 :]],
    }


def test_peak_before_the_first_event_is_counted() -> None:
    """Issue 16, point 1: live bytes before the first event include blocks freed in the trace without an alloc and
    active blocks of the segments without one; a trace that begins by freeing them peaks before its first event."""
    data = _two_device_dump_beginning_with_frees()
    first = data["device_traces"][1][0]
    assert (first["action"], first["size"]) == ("free_completed", 102_400_000)
    rep = replay(data)
    assert sorted(rep.devices) == [0, 1]
    assert rep.devices[0].peak.live_bytes == 4_434_803_008
    dev = rep.devices[1]
    live = dev.timeline["live_bytes"].to_numpy()
    assert int(live.max()) == 54_700_267_524  # the events alone: 102,400,000 B short
    assert dev.seed_bytes == 54_802_667_524  # the full run's peak: everything alive two events before the cut
    assert rep.main.device == 1
    peak = rep.peak
    assert peak.live_bytes == 54_802_667_524 and peak.index == -1
    assert peak.time_us == int(dev.timeline["time_us"].iloc[0])
    assert sum(peak.by_category.values()) == peak.live_bytes == int(peak.sites["bytes"].sum())
    # reserved before the first event: the dump-time total less the segments the trace maps
    assert peak.reserved_bytes == int(dev.timeline["reserved_bytes"].iloc[0]) == 58_280 * 1024**2


def test_peak_of_a_trace_that_only_frees() -> None:
    snap = {
        "segments": [
            {
                "device": 0,
                "address": 0,
                "total_size": 8_388_608,
                "blocks": [
                    {"address": 0, "size": 3_276_800, "requested_size": 3_276_800, "state": "active_allocated"},
                    {"address": 4_194_304, "size": 2_097_152, "requested_size": 1_000, "state": "active_allocated"},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "free_completed", "addr": 8_000_000, "size": 500, "time_us": 5},
                {"action": "alloc", "addr": 8_000_000, "size": 200, "time_us": 6},
            ]
        ],
    }
    rep = replay(snap)
    assert rep.main.seed_bytes == 3_276_800 + 1_000 + 500
    assert list(rep.main.timeline["live_bytes"]) == [3_277_800, 3_278_000]
    assert rep.peak.live_bytes == 3_278_300 and rep.peak.index == -1 and rep.peak.time_us == 5


def test_torch_2_0_blocks_without_addresses() -> None:
    """torch 2.0 wrote blocks without ``address`` (torch's viewer adds up the sizes from the segment's address) and with
    the requested size and stack in ``history``. A block the trace allocated is counted once, a block from before the
    recording is seeded with its requested size and its own stack."""
    base = 139_900_000_000_000
    in_trace = _frames(("forward", "train.py"))
    before = _frames(("__init__", "model.py"))
    segment = {
        "device": 0,
        "address": base,
        "total_size": 4_194_304,
        "stream": 0,
        "blocks": [
            {"size": size, "state": state, "history": [{"addr": base + offset, "real_size": real, "frames": frames}]}
            for size, state, offset, real, frames in [
                (1_048_576, "active_allocated", 0, 1_000_000, in_trace),
                (1_048_576, "inactive", 1_048_576, 4_096, in_trace),
                (2_097_152, "active_allocated", 2_097_152, 2_000_000, before),
            ]
        ],
    }
    trace = [
        {"action": "alloc", "addr": base, "size": 1_000_000, "stream": 0, "frames": in_trace},
        {"action": "alloc", "addr": base + 1_048_576, "size": 4_096, "stream": 0, "frames": in_trace},
        {"action": "free_completed", "addr": base + 1_048_576, "size": 4_096, "stream": 0, "frames": in_trace},
    ]
    rep = replay({"segments": [segment], "device_traces": [trace]})
    assert rep.main.seed_bytes == 2_000_000  # the block from before the recording, by its requested size
    assert list(rep.main.timeline["live_bytes"]) == [3_000_000, 3_004_096, 3_000_000]
    assert rep.peak.live_bytes == 3_004_096
    assert rep.peak.sites.groupby("file")["bytes"].sum().to_dict() == {"train.py": 1_004_096, "model.py": 2_000_000}


# ------------------------------------------------------------------------------------------------ synthetic
def _frames(*names: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"name": n, "filename": f, "line": i + 1} for i, (n, f) in enumerate(names)]


def test_memtrace_categories_and_phases_are_used() -> None:
    user = ("train", "/home/u/train.py")
    snap = {
        "segments": [],
        "device_traces": [
            [
                {
                    "action": "alloc",
                    "addr": 1,
                    "size": 100,
                    "time_us": 1,
                    "user_metadata": "phase=forward step=3",
                    "category": "activations",
                    "frames": _frames(user),
                },
                {
                    "action": "alloc",
                    "addr": 2,
                    "size": 50,
                    "time_us": 2,
                    "user_metadata": "phase=backward step=3",
                    "category": "gradients",
                    "frames": _frames(user),
                },
                {
                    "action": "free_requested",
                    "addr": 1,
                    "size": 100,
                    "time_us": 3,
                    "user_metadata": "phase=backward step=3",
                    "category": "activations",
                    "frames": [],
                },
                {
                    "action": "free_completed",
                    "addr": 1,
                    "size": 100,
                    "time_us": 3,
                    "user_metadata": "phase=backward step=3",
                    "category": "activations",
                    "frames": [],
                },
                {
                    "action": "alloc",
                    "addr": 3,
                    "size": 7,
                    "time_us": 4,
                    "user_metadata": "phase=optimizer_step step=3",
                    "category": "",
                    "frames": _frames(user),
                },
                {
                    "action": "oom",
                    "addr": 0,
                    "size": 1000,
                    "time_us": 5,
                    "user_metadata": "phase=forward step=4",
                    "device_free": 0,
                    "frames": [],
                },
            ]
        ],
        "memtrace": {
            "format": 1,
            "device": "cpu",
            "rank": 0,
            "steps": [3, 4],
            "allocated_bytes": 57,
            "phases": [{"step": 3, "phase": "batch_start", "time_us": 0}],
        },
    }
    rep = replay(snap)
    assert rep.is_memtrace
    al = rep.main.allocations
    assert list(al["category"].astype(str)) == ["activations", "gradients", "optimizer_state"]
    # recorded categories are not inferred; the empty one is
    assert list(al["inferred"]) == [False, False, True]
    tl = rep.main.timeline
    assert list(tl["phase"].astype(str)) == ["forward", "backward", "backward", "backward", "optimizer_step", "forward"]
    assert list(tl["step"]) == [3, 3, 3, 3, 3, 4]
    assert list(tl["live_bytes"]) == [100, 150, 150, 50, 57, 57]
    assert rep.peak.live_bytes == 150 and rep.peak.step == 3 and rep.peak.stage == "backward"
    assert rep.main.oom_rows == [5]


def test_inference_rules_on_a_training_step() -> None:
    fwd = _frames(
        ("forward", "/home/u/model.py"), ("_call_impl", "/x/torch/nn/modules/module.py"), ("main", "/home/u/train.py")
    )
    bwd = [
        {"name": "torch::autograd::generated::MmBackward0::apply(std::vector)", "filename": "??", "line": 0},
        {"name": "torch::autograd::Engine::evaluate_function()", "filename": "??", "line": 0},
    ]
    opt = _frames(("_init_group", "/x/torch/optim/adamw.py"), ("main", "/home/u/train.py"))
    data = _frames(("main", "/home/u/train.py"))
    ev = [
        {"action": "free_completed", "addr": 99, "size": 11, "frames": data},  # pre-existing, freed
        {"action": "alloc", "addr": 1, "size": 1000, "frames": data},  # inputs (alive across forward)
        {"action": "alloc", "addr": 2, "size": 200, "frames": fwd},  # activation (freed in backward)
        {"action": "alloc", "addr": 3, "size": 5, "frames": fwd},  # forward temporary
        {"action": "free_completed", "addr": 3, "size": 5, "frames": fwd},
        {"action": "alloc", "addr": 4, "size": 300, "frames": bwd},  # gradient (kept)
        {"action": "alloc", "addr": 5, "size": 7, "frames": bwd},  # backward temporary
        {"action": "free_completed", "addr": 5, "size": 7, "frames": bwd},
        {"action": "free_completed", "addr": 2, "size": 200, "frames": bwd},
        {"action": "alloc", "addr": 6, "size": 600, "frames": opt},  # optimizer state (kept)
        {"action": "alloc", "addr": 7, "size": 40, "frames": opt},  # optimizer intermediate
        {"action": "free_completed", "addr": 7, "size": 40, "frames": opt},
        {"action": "free_completed", "addr": 123456, "size": 3, "frames": []},  # unknown and first: pre-existing
    ]
    snap = {
        "segments": [
            {
                "device": 0,
                "address": 500,
                "total_size": 4096,
                "blocks": [
                    {"address": 500, "size": 512, "requested_size": 500, "state": "active_allocated"},
                    {"address": 1012, "size": 512, "requested_size": 0, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [ev],
    }
    rep = replay(snap)
    dev = rep.main
    al = dev.allocations
    cats = dict(zip(al["size"].astype(int), al["category"].astype(str)))
    assert cats == {
        1000: "inputs",
        200: "activations",
        5: "intermediates",
        300: "gradients",
        7: "intermediates",
        600: "optimizer_state",
        40: "optimizer_intermediates",
        11: "pre_existing",
        3: "pre_existing",
        500: "pre_existing",
    }
    assert dev.seed_bytes == 11 + 3 + 500
    assert dev.unknown_frees == 2
    live = dev.timeline["live_bytes"].tolist()
    assert live[0] == 514 - 11 + 0  # 11 was alive before, freed at row 0
    assert live[-1] == 500 + 1000 + 300 + 600
    assert rep.peak.live_bytes == max(live)
    assert not dev.reserved_known or dev.timeline["reserved_bytes"].iloc[-1] == 4096


def test_ddp_buckets_are_other_not_activations() -> None:
    """DDP makes its gradient buckets again in the second forward (``_pre_forward``), and keeps them: by the rule for
    the forward they would be activations; DDP's own frames make them "other". The model's own forward under DDP's
    ``forward`` stays activations."""
    ddp = "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py"
    call = ("_call_impl", "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py")
    rebuild = _frames(("_pre_forward", ddp), ("forward", ddp), call, ("training_step", "/home/u/train.py"))
    model = _frames(("forward", "/home/u/model.py"), call, ("_run_ddp_forward", ddp), ("forward", ddp), call)
    bwd = [{"name": "torch::autograd::Engine::evaluate_function()", "filename": "??", "line": 0}]
    ev = [
        {"action": "alloc", "addr": 1, "size": 4000, "frames": rebuild},  # the buckets, kept
        {"action": "alloc", "addr": 2, "size": 200, "frames": model},  # an activation, kept past the forward
        {"action": "free_completed", "addr": 2, "size": 200, "frames": bwd},
    ]
    categories = replay({"segments": [], "device_traces": [ev]}).main.allocations
    assert dict(zip(categories["size"].astype(int), categories["category"].astype(str))) == {
        4000: "other",
        200: "activations",
    }
    assert analyze_frames(rebuild).forced_category == CATEGORIES.index("other")
    assert analyze_frames(model).forced_category == -1


def test_several_devices_and_no_times() -> None:
    snap = {
        "segments": [],
        "device_traces": [
            [{"action": "alloc", "addr": 1, "size": 10}],
            [
                {"action": "alloc", "addr": 1, "size": 30},
                {"action": "alloc", "addr": 2, "size": 5},
                {"action": "free_requested", "addr": 2, "size": 5},
            ],  # no free_completed at all: use free_requested
        ],
    }
    rep = replay(snap)
    assert sorted(rep.devices) == [0, 1]
    assert rep.main.device == 1
    assert rep.peak.live_bytes == 35
    assert not rep.main.has_time
    assert list(rep.main.timeline["time_us"]) == [0, 1, 2]
    assert list(rep.main.timeline["live_bytes"]) == [30, 35, 30]
    assert list(rep.timeline["device"]) == [0, 1, 1, 1]


def test_analyze_frames_picks_user_line() -> None:
    frames = [
        {"name": "at::empty", "filename": "??", "line": 0},
        {"name": "forward", "filename": "/site-packages/torch/nn/modules/linear.py", "line": 117},
        {"name": "_call_impl", "filename": "C:\\env\\Lib\\site-packages\\torch\\nn\\modules\\module.py", "line": 1},
        {"name": "step", "filename": "/home/me/train.py", "line": 42},
    ]
    info = analyze_frames(frames)
    assert info.site.file == "/home/me/train.py" and info.site.line == 42 and info.site.function == "step"
    assert info.stage == 2  # forward
    assert analyze_frames([]).site.function == "<no frames>"


# ------------------------------------------------------------------------------------------------ property
@st.composite
def _traces(draw: st.DrawFn) -> list[dict[str, Any]]:
    ops = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 1000)), max_size=60))
    return [
        {"action": "alloc" if is_alloc else "free_completed", "addr": addr, "size": size, "time_us": i}
        for i, (is_alloc, addr, size) in enumerate(ops)
    ]


@settings(max_examples=150, deadline=None)
@given(_traces())
def test_replay_matches_reference(trace: list[dict[str, Any]]) -> None:
    """Against a plain dict simulation: first-event frees are pre-existing, re-allocs of a live address free it."""
    live: dict[int, int] = {}
    seen: set[int] = set()
    seed = 0
    pre: list[int] = []
    for e in trace:
        addr = e["addr"]
        if e["action"] == "free_completed" and addr not in seen:
            seed += e["size"]
            pre.append(e["size"])
        seen.add(addr)
    total = seed
    expected = []
    seen.clear()
    for e in trace:
        addr = e["addr"]
        if e["action"] == "alloc":
            total -= live.pop(addr, 0)
            live[addr] = e["size"]
            total += e["size"]
        else:
            if addr not in seen:
                total -= e["size"]
            else:
                total -= live.pop(addr, 0)
        seen.add(addr)
        expected.append(total)
    rep = replay({"segments": [], "device_traces": [trace]})
    dev = rep.main
    assert dev.seed_bytes == seed
    assert dev.timeline["live_bytes"].tolist() == expected
    assert dev.peak.live_bytes == max([seed, *expected])
    series = dev.category_series()
    if len(trace):
        assert (series.sum(axis=1).to_numpy() == np.asarray(expected)).all()
        assert set(series.columns) <= set(CATEGORIES)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=8),
    st.floats(allow_nan=True),
    st.binary(max_size=4),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_event = st.fixed_dictionaries(
    {},
    optional={
        "action": st.sampled_from(
            ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot", "weird"]
        )
        | _scalars,
        "addr": st.integers(0, 20) | _scalars,
        "size": st.integers(0, 10_000) | _scalars,
        "time_us": st.integers(0, 100) | _scalars,
        "frames": st.lists(
            st.fixed_dictionaries(
                {
                    "name": _scalars,
                    "filename": st.sampled_from(["/torch/optim/adam.py", "x.py", "??", "/torch/nn/modules/module.py"])
                    | _scalars,
                    "line": _scalars,
                }
            ),
            max_size=3,
        )
        | _values,
        "user_metadata": st.sampled_from(["phase=forward step=2", "phase=bogus step=x", ""]) | _scalars,
        "category": st.sampled_from(["parameters", "gradients", "", "unknown"]) | _scalars,
    },
)
_block = st.fixed_dictionaries(
    {},
    optional={
        "address": st.integers(0, 20) | _scalars,
        "size": _scalars,
        "requested_size": st.integers(0, 100) | _scalars,
        "state": st.sampled_from(["active_allocated", "inactive"]) | _scalars,
    },
)
_segment = st.fixed_dictionaries(
    {"address": st.integers(0, 20), "total_size": st.integers(0, 1000) | _scalars},
    optional={"device": st.integers(0, 2) | _scalars, "blocks": st.lists(_block | _scalars, max_size=3)},
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_segment, max_size=3),
    st.lists(st.lists(_event | _scalars, max_size=12), max_size=3),
    st.lists(st.dictionaries(st.sampled_from(["name", "stage", "time_us", "device"]), _scalars), max_size=3),
)
def test_replay_never_crashes_on_odd_snapshots(segments: list[Any], traces: list[Any], annotations: list[Any]) -> None:
    from lightning_memtrace.analysis.loader import SnapshotError, normalize

    try:
        data, _ = normalize({"segments": segments, "device_traces": traces, "external_annotations": annotations})
    except SnapshotError:
        return
    try:
        rep = replay(data)
    except SnapshotError as error:  # refused with the one-line error, never another exception
        assert "\n" not in str(error)
        return
    for dev in rep.devices.values():
        tl = dev.timeline
        assert (tl["live_bytes"].to_numpy() == dev.seed_bytes + np.cumsum(tl["delta"].to_numpy())).all()
        assert sum(dev.peak.by_category.values()) == dev.peak.live_bytes


def test_site_bytes_never_exceed_their_category_total() -> None:
    """kkaitlyn111 fullstep: the einsum site was labelled activations with 51.5 MiB beside an activations total of
    19.5 MiB; sites are split by category so that every table adds up (issue 13, point 5)."""
    from shared_files import fixture_path

    from lightning_memtrace.analysis.loader import load_snapshot

    rep = replay(load_snapshot(fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")))
    peak = rep.peak
    per_category = peak.sites.groupby("category")["bytes"].sum()
    assert per_category.to_dict() == peak.by_category
    for _, site in peak.sites.iterrows():
        assert site["bytes"] <= peak.by_category[site["category"]], site["site"]
    einsum = peak.sites[peak.sites["function"] == "einsum"]
    # its "other" row was cuBLAS's workspace, made under the first product: a site of its own now
    assert set(einsum["category"]) == {"activations"}


def test_pre_existing_sites_split_by_category(tmp_path: Path) -> None:
    """Issue 16, point 2: allocations older than a MemTrace window are parameters, optimizer state, inputs...; the sites
    table has one ``<allocated before recording> · <category>`` row per category, so it adds up like the category
    table."""
    torch = pytest.importorskip("torch")
    from lm_helpers import record_plain_loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    record_plain_loop(model, optimizer, tmp_path, 4, 16, history_skip_steps=1, history_steps=2)
    rep = replay(load_snapshot(tmp_path / "snapshot_rank0_steps1-2.pickle"))
    params = (64 * 128 + 128 + 128 * 64 + 64) * 4
    assert params == 66_304
    peak = rep.peak
    assert peak.stage == "optimizer_step"
    sites = peak.sites
    pre = sites[sites["function"].str.startswith("<allocated before recording>")]
    rows = {r["function"]: (r["category"], int(r["bytes"]), int(r["count"])) for _, r in pre.iterrows()}
    assert rows == {
        "<allocated before recording> · optimizer state": ("optimizer_state", 2 * params + 4 * 4, 12),
        "<allocated before recording> · parameters": ("parameters", params, 4),
        "<allocated before recording> · inputs": ("inputs", 16 * 64 * 4, 1),
    }
    live_old = rep.main.live_allocations(peak.index).query("alloc_index < 0")
    assert int(pre["bytes"].sum()) == int(live_old["size"].sum()) == 203_024
    # every table adds up: per category, the sites hold exactly the category's bytes
    assert sites.groupby("category")["bytes"].sum().to_dict() == peak.by_category
    assert int(sites["bytes"].sum()) == peak.live_bytes


def test_pre_existing_site_stays_plain_when_inferred() -> None:
    rep = replay({"segments": [], "device_traces": [[{"action": "free_completed", "addr": 1, "size": 7}]]})
    assert list(rep.main.allocations["function"]) == ["<allocated before recording>"]
    assert list(rep.main.allocations["category"].astype(str)) == ["pre_existing"]


_POOL = [
    {"name": "at::empty", "filename": "??", "line": 0},
    {"name": "forward", "filename": "/site-packages/torch/nn/modules/linear.py", "line": 117},
    {"name": "_call_impl", "filename": "/site-packages/torch/nn/modules/module.py", "line": 1},
    {"name": "step", "filename": "/home/me/train.py", "line": 42},
    {"name": "backward", "filename": "/site-packages/torch/_tensor.py", "line": 5},
    {"name": "torch::autograd::Engine::evaluate_function", "filename": "", "line": 0},
    {"name": "MmBackward0::apply", "filename": "", "line": 0},
    {"name": "step", "filename": "/site-packages/torch/optim/adamw.py", "line": 9},
    {"name": 1, "filename": 1.0, "line": True},  # odd values: equal dicts must still say the same
    {"name": "_pre_forward", "filename": "/site-packages/torch/nn/parallel/distributed.py", "line": 1775},
    {"name": "forward", "filename": "/site-packages/torch/nn/parallel/distributed.py", "line": 1886},
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2 * len(_POOL) - 1), max_size=7), max_size=40),
    st.lists(st.integers(0, 39), max_size=60),
)
def test_stacks_analysed_once_say_what_each_says(stacks: list[list[int]], events: list[int]) -> None:
    """Issue 16, point 3: frame lists are analysed once per distinct content (distinct list objects, and distinct but
    equal frame dicts, share the analysis); every event still gets what its own stack says."""
    from lightning_memtrace.analysis.replay import classify_stacks
    from lightning_memtrace.analysis.stacks import SiteTable, group_stacks

    copies = [dict(f) for f in _POOL]  # equal to the pool's dicts, other objects
    lists = [[(_POOL + copies)[k] for k in stack] for stack in stacks]
    lists += [list(x) for x in lists]  # the same stacks again, as other list objects
    lists.append(tuple(lists[0]) if lists else ())
    lists.append(None)
    frames = [lists[k % len(lists)] for k in events]
    table = SiteTable()
    stage, site, forced = classify_stacks(frames, len(frames), table)
    for k, f in enumerate(frames):
        info = analyze_frames(f if isinstance(f, (list, tuple)) else None)
        assert (int(stage[k]), table.sites[int(site[k])], int(forced[k])) == (
            info.stage,
            info.site,
            info.forced_category,
        )
    group, representatives = group_stacks(lists)
    n = len(stacks)
    assert len(group) == len(lists) and (group >= 0).all() and len(representatives) == int(group.max()) + 1
    for k in range(n):  # a stack and its copy (another list of the same frame dicts) share one analysis
        assert group[k] == group[k + n]
        assert representatives[group[k]] == lists[k]
    if n:
        assert group[2 * n] == group[0]  # the tuple of the first stack's frames


def test_stacks_nested_too_deeply_to_compare_are_analysed_apart() -> None:
    def nested() -> list[Any]:
        outer: list[Any] = []
        inner = outer
        for _ in range(100_000):
            inner.append([])
            inner = inner[0]
        return outer

    user = {"name": "train", "filename": "/u/t.py", "line": 1}
    stacks = [[user, user, user, {"name": nested()}, user] for _ in range(2)]  # alike but at the 4th frame
    trace = [{"action": "alloc", "addr": k, "size": 5, "frames": f} for k, f in enumerate(stacks)]
    rep = replay({"segments": [], "device_traces": [trace]})
    assert rep.peak.live_bytes == 10
    assert list(rep.main.allocations["site"]) == ["/u/t.py:1", "/u/t.py:1"]


def test_torch_2_15_annotate_events_change_no_figure() -> None:
    """torch 2.15 records ``torch.cuda.memory._annotate_tensor`` as an ``annotate`` event on a live allocation's address
    (size 0 where present, the annotation in ``user_metadata``): the live bytes, the peak and its sites stay as they
    are without it."""
    plain = load_snapshot(snapshot_fixture("drisspg_mini_snapshot.pickle"))
    annotated = load_snapshot(snapshot_fixture("drisspg_mini_snapshot.pickle"))
    trace = annotated.data["device_traces"][0]
    allocs = [index for index, event in enumerate(trace) if event["action"] == "alloc"]
    for index in reversed(allocs[:5]):
        event = trace[index]
        annotation = {"action": "annotate", "addr": event["addr"], "size": 0, "stream": 0, "user_metadata": "saved"}
        trace.insert(index + 1, dict(annotation, time_us=event.get("time_us", 0), frames=event.get("frames", [])))
    before, after = replay(plain), replay(annotated)
    assert len(trace) == len(plain.data["device_traces"][0]) + 5
    assert after.peak.live_bytes == before.peak.live_bytes == 402_752_512
    live = [list(r.main.timeline["live_bytes"].drop_duplicates()) for r in (before, after)]
    assert live[0] == live[1]
    assert after.peak.sites["bytes"].sum() == before.peak.sites["bytes"].sum()
