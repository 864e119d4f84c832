"""Issue 16, point 6: live bytes and the peak are exact, always. MemTrace's replay is checked against a replay written
independently of it (``tests/replay_oracle.py``, plain Python from torch's snapshot format) on every shared snapshot,
on a snapshot MemTrace wrote in a real Lightning run, and on a synthetic snapshot built to trip each rule; the numbers
of the synthetic one are also written out by hand."""

from __future__ import annotations

import gc
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import replay_oracle as oracle
from shared_files import ALL_FIXTURES, fixture_path

from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.cli import main

PRE_TRACE_SITE = "<allocated before recording>"


def _summary(capsys: pytest.CaptureFixture[str], path: Path, *options: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["summary", str(path), "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def _assert_product_agrees(snapshot: Any, summary: dict[str, Any]) -> dict[int, oracle.OracleDevice]:
    """Per device: seed, live bytes after every event, peak bytes and index, from replay() and `summary --json`."""
    expected = oracle.replay(snapshot)
    rep = replay(snapshot)
    assert sorted(rep.devices) == sorted(expected)
    for device, want in expected.items():
        got = rep.devices[device]
        assert got.seed_bytes == want.seed_bytes, f"device {device}: seed"
        live = [int(x) for x in got.timeline["live_bytes"]]
        assert len(live) == len(want.live), f"device {device}: events"
        first_bad = next((i for i, (a, b) in enumerate(zip(live, want.live)) if a != b), None)
        assert first_bad is None, (
            f"device {device}, event {first_bad}: product {live[first_bad]} B, oracle {want.live[first_bad]} B"
        )
        assert (got.peak.live_bytes, got.peak.index) == want.peak, f"device {device}: peak"
    by_device = {d["device"]: d for d in summary["devices"]}
    assert sorted(by_device) == sorted(expected)
    for device, want in expected.items():
        assert (by_device[device]["peak_bytes"], by_device[device]["peak_event"]) == want.peak, f"device {device}"
    return expected


# ------------------------------------------------------------------------------------------------ shared snapshots
#: Peaks of the trace the fixtures' README states (bytes), and where they fall.
KNOWN_PEAKS = {
    "shreyansh26_profile_grad.pkl": {0: (4_434_803_008, 17)},
    "shreyansh26_profile_no_grad.pkl": {0: (4_234_803_008, 19)},
}


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_shared_snapshot_matches_independent_replay(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = fixture_path(name)
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)  # trusted test data
    expected = _assert_product_agrees(snapshot, _summary(capsys, path, "--sites", "1"))
    for device, peak in KNOWN_PEAKS.get(name, {}).items():
        assert expected[device].peak == peak
    if name == "Muduard_memory_snapshot.pkl":  # no trace: the peak is the dump, on device 1
        assert sorted(expected) == [1] and expected[1].live == []
        assert expected[1].peak == (3_308_174_782, -1)
    if name.startswith("kkaitlyn111"):  # recording began after the model existed
        assert expected[0].seed_bytes == 13_628_553_216
        assert expected[0].peak == (54_802_667_524, 19_335)


# ------------------------------------------------------------------------------------------------ synthetic
MB = 1_000_000
X1, X2, X3, X4, X5 = 0x1020_0000, 0x2000_0000, 0x1030_0000, 0x1040_0000, 0x1050_0000
Y1, Y2, Y3 = 0x9000_0000, 0x9010_0000, 0x9020_0000


def _ev(action: str, addr: int, size: int, time_us: int | None) -> dict[str, Any]:
    event: dict[str, Any] = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}
    if time_us is not None:
        event["time_us"] = time_us
    return event


def _block(addr: int, size: int, state: str, requested: int | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"address": addr, "size": size, "state": state, "frames": []}
    if requested is not None:
        block["requested_size"] = requested
    return block


def synthetic_snapshot() -> dict[str, Any]:
    """Device 0: the trace begins by freeing blocks made before recording (X1: its segment still holds it, inactive;
    X2: its segment was released, no block left; X3: freed without a free_requested, then re-allocated and alive at
    the dump), re-allocates X4, frees X1 twice, leaves X5 pending (free_requested, no free_completed); the segments
    hold active blocks the trace never mentions (one without requested_size). Device 1: no event, one live block.
    Device 2: no time_us, no free_completed (free_requested ends), its peak is the state before its first event.
    Device 3: empty."""
    t = 1_700_000_000_000_000
    dev0 = [
        _ev("free_requested", X1, 3 * MB, t),  # 0
        _ev("free_completed", X1, 3 * MB, t + 1),  # 1: allocated before recording
        _ev("free_requested", X2, 5 * MB, t + 2),  # 2
        _ev("free_completed", X2, 5 * MB, t + 3),  # 3: allocated before recording, no segment block
        _ev("segment_free", X2, 8_388_608, t + 4),  # 4
        _ev("free_completed", X3, 700_000, t + 5),  # 5: allocated before recording
        _ev("alloc", X3, 600_000, t + 6),  # 6: the address re-allocated, alive at the dump
        _ev("alloc", X4, 2 * MB, t + 7),  # 7
        _ev("free_requested", X5, 4_000, t + 8),  # 8: pending at the dump (active_pending_free)
        _ev("free_requested", X4, 2 * MB, t + 9),  # 9
        _ev("free_completed", X4, 2 * MB, t + 10),  # 10
        _ev("alloc", X4, 1_500_000, t + 11),  # 11: re-allocated
        _ev("snapshot", 0, 0, t + 12),  # 12
        {**_ev("oom", 0, 10**12, t + 13), "device_free": 0},  # 13
        _ev("free_completed", X4, 1_500_000, t + 14),  # 14
        _ev("free_completed", X1, 3 * MB, t + 15),  # 15: X1 again, no alloc between: nothing to remove
    ]
    dev2 = [
        _ev("free_requested", Y1, 300, None),  # 0: allocated before recording (ends it: no free_completed here)
        _ev("alloc", Y2, 100, None),  # 1
        _ev("alloc", Y3, 150, None),  # 2
        _ev("free_requested", Y2, 100, None),  # 3
        _ev("alloc", Y2, 50, None),  # 4: re-allocated
        _ev("segment_alloc", Y1 + 0x100_0000, 2_097_152, None),  # 5
    ]
    segments = [
        {
            "device": 0,
            "address": 0x1000_0000,
            "total_size": 0x60_0000,
            "blocks": [
                _block(0x1000_0000, 1_048_576, "active_allocated", MB),  # never in the trace
                _block(0x1010_0000, 524_288, "active_allocated"),  # no requested_size: its size
                _block(X1, 0x10_0000, "inactive", 0),
                _block(X3, 0x10_0000, "active_allocated", 600_000),  # the trace's alloc 6, not a seed
                _block(X4, 0x10_0000, "inactive", 0),
                _block(X5, 0x10_0000, "active_pending_free", 4_000),
            ],
        },
        {
            "device": 1,
            "address": 0x5000_0000,
            "total_size": 4_194_304,
            "blocks": [
                _block(0x5000_0000, 2_097_152, "active_allocated", 2 * MB),
                _block(0x5020_0000, 2_097_152, "inactive", 0),
            ],
        },
    ]
    return {"segments": segments, "device_traces": [dev0, [], dev2, []], "allocator_settings": {}}


#: Device 0's seed: blocks never mentioned (1,000,000 + 524,288 + 4,000 pending) and blocks freed before being
#: allocated in the trace (X1 3,000,000 + X2 5,000,000 + X3 700,000).
SEED_0 = 1_000_000 + 524_288 + 4_000 + 3_000_000 + 5_000_000 + 700_000
LIVE_0 = [
    7_228_288 + 3_000_000,  # free_requested does not end an allocation when the trace has free_completed
    7_228_288,
    7_228_288,
    2_228_288,
    2_228_288,
    1_528_288,
    2_128_288,
    4_128_288,
    4_128_288,
    4_128_288,
    2_128_288,
    3_628_288,
    3_628_288,
    3_628_288,
    2_128_288,
    2_128_288,
]


def test_oracle_on_the_synthetic_snapshot_by_hand() -> None:
    result = oracle.replay(synthetic_snapshot())
    assert sorted(result) == [0, 1, 2]
    dev0 = result[0]
    assert dev0.seed_bytes == SEED_0 == 10_228_288
    assert dev0.live == LIVE_0
    # the seed is the most ever live, but event 0 (a free_requested, which removes nothing) holds as much: it wins
    assert dev0.peak == (10_228_288, 0)
    # at the end: the never-mentioned blocks, the pending one and X3's new allocation, as the dump's active blocks say
    assert dev0.live[-1] == 1_000_000 + 524_288 + 4_000 + 600_000
    assert result[1].seed_bytes == 2_000_000 and result[1].live == [] and result[1].peak == (2_000_000, -1)
    dev2 = result[2]
    assert dev2.seed_bytes == 300
    assert dev2.live == [0, 100, 250, 150, 200, 200]
    assert dev2.peak == (300, -1)  # strictly more than after any event


def test_product_agrees_on_the_synthetic_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = synthetic_snapshot()
    path = tmp_path / "synthetic.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    _assert_product_agrees(snapshot, _summary(capsys, path, "--sites", "1"))
    rep = replay(snapshot)
    assert [int(x) for x in rep.devices[0].timeline["live_bytes"]] == LIVE_0
    assert rep.devices[0].seed_bytes == SEED_0
    assert (rep.peak.device, rep.peak.index, rep.peak.live_bytes) == (0, 0, 10_228_288)
    assert rep.peak.time_us == 1_700_000_000_000_000
    assert [int(x) for x in rep.devices[2].timeline["live_bytes"]] == [0, 100, 250, 150, 200, 200]
    assert not rep.devices[2].has_time
    assert (rep.devices[2].peak.live_bytes, rep.devices[2].peak.index) == (300, -1)
    assert (rep.devices[1].peak.live_bytes, rep.devices[1].peak.index) == (2_000_000, -1)
    assert rep.devices[0].unknown_frees >= 1  # X1's second free


# ------------------------------------------------------------------------------------------------ MemTrace's own
def _memtrace_snapshot(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    from lm_helpers import MLP, trainer

    from lightning_memtrace import MemTrace

    callback = MemTrace()
    gc.collect()  # the CPU allocator sees the whole process: no garbage of earlier tests freed inside the run
    trainer(tmp_path, [callback], max_steps=3).fit(MLP())
    (path,) = sorted(Path(callback.output_dir).glob("snapshot_rank0_*.pickle"))
    with open(path, "rb") as handle:
        return path, pickle.load(handle)


def test_memtrace_snapshot_matches_independent_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, snapshot = _memtrace_snapshot(tmp_path)
    summary = _summary(capsys, path, "--sites", "100000")
    expected = _assert_product_agrees(snapshot, summary)
    assert list(expected) == [0]
    want = expected[0]
    header = snapshot["memtrace"]
    assert want.seed_bytes == header["allocated_at_start_bytes"] > 0
    assert want.live[-1] == header["allocated_bytes"]
    peak_bytes, peak_index = want.peak
    assert peak_index >= 0

    # categories at the peak: the ones MemTrace recorded (alloc events, freeing events of blocks made before the
    # window, live blocks) are kept; "unknown" ones are inferred by the product, so only their total is known here
    live = want.live_at(peak_index)
    recorded: dict[str, int] = {}
    unknown = 0
    for a in live:
        if a.category in ("", "unknown"):
            unknown += a.size
        else:
            recorded[a.category] = recorded.get(a.category, 0) + a.size
    assert sum(recorded.values()) + unknown == peak_bytes
    assert recorded.get("parameters", 0) > 0 and recorded.get("optimizer_state", 0) > 0

    (device,) = summary["devices"]
    categories = device["categories"]
    assert sum(categories.values()) == peak_bytes
    dev = replay(snapshot).devices[0]
    assert dev.peak.inferred_bytes == unknown
    al = dev.live_allocations(peak_index)
    kept = al[~al["inferred"]].groupby("category", observed=True)["size"].sum()
    assert {str(c): int(b) for c, b in kept.items() if int(b)} == recorded
    inferred = al[al["inferred"]].groupby("category", observed=True)["size"].sum()
    inferred_by = {str(c): int(b) for c, b in inferred.items() if int(b)}
    assert {c: categories.get(c, 0) - recorded.get(c, 0) for c in set(categories) | set(recorded)} == {
        c: inferred_by.get(c, 0) for c in set(categories) | set(recorded)
    }

    # every site has one category, and a category's sites add up to its bytes
    sites = device["sites"]
    assert device["site_count"] == len(sites)
    assert len({(s["site"], s["function"], s["category"]) for s in sites}) == len(sites)
    sums: dict[str, int] = {}
    for s in sites:
        sums[s["category"]] = sums.get(s["category"], 0) + s["bytes"]
    assert sums == categories
    # allocations older than the window without a stack sit in one stand-in site per category
    pre: dict[str, int] = {}
    for a in live:
        if a.start < 0 and not a.has_stack:
            name = "pre_existing" if a.category in ("", "unknown") else a.category
            pre[name] = pre.get(name, 0) + a.size
    assert pre.get("parameters", 0) > 0 and pre.get("optimizer_state", 0) > 0
    shown = {s["category"]: s["bytes"] for s in sites if s["site"].startswith(PRE_TRACE_SITE)}
    assert shown == pre
    for s in sites:
        if s["site"].startswith(PRE_TRACE_SITE) and s["category"] != "pre_existing":
            assert s["site"] == f"{PRE_TRACE_SITE} · {s['category'].replace('_', ' ')}"
