"""Each findings rule on its own, on small hand-made snapshots."""

from __future__ import annotations

import pandas as pd

from lightning_memtrace.analysis.findings import (
    compute_findings,
    compute_findings_phases_only,
    ddp_buckets_finding,
    devices_finding,
    fragmentation_finding,
    oom_findings,
    peak_finding,
    phase_findings,
    pre_existing_finding,
    stale_gradients_finding,
    top_site_findings,
    unknown_frees_finding,
)
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.types import PHASE_COLUMNS

USER = "/home/me/train.py"


def _ev(action: str, addr: int, size: int, t: int, line: int = 5, **extra: object) -> dict:
    frames = [{"filename": USER, "line": line, "name": "main"}]
    return {"action": action, "addr": addr, "size": size, "time_us": t, "frames": frames, **extra}


def _snap(trace: list[dict], segments: list[dict] | None = None, **extra: object) -> dict:
    return {"segments": segments or [], "device_traces": [trace], **extra}


def _tagged(action: str, addr: int, size: int, t: int, phase: str, step: int, category: str, line: int = 5) -> dict:
    return _ev(action, addr, size, t, line, user_metadata=f"phase={phase} step={step}", category=category)


def test_peak_and_empty() -> None:
    rep = replay(_snap([_ev("alloc", 16, 1000, 1)]))
    (finding,) = peak_finding(rep)
    assert finding.code == "peak" and finding.numbers["peak_bytes"] == 1000
    assert finding.numbers["top_category"] == "other" and "categories inferred" in finding.message
    (empty,) = peak_finding(replay(_snap([])))
    assert empty.code == "empty" and empty.numbers == {"peak_bytes": 0}


def test_stale_gradients() -> None:
    header = {"device": "cuda:0", "steps": [1, 2]}
    trace = [
        _tagged("alloc", 16, 4000, 1, "backward", 1, "gradients"),
        _tagged("alloc", 32, 1000, 2, "forward", 2, "activations"),
        _tagged("free_completed", 32, 1000, 3, "forward", 2, "activations"),
    ]
    (finding,) = stale_gradients_finding(replay(_snap(trace, memtrace=header)))
    assert finding.code == "stale_gradients" and finding.numbers["gradients_bytes"] == 4000
    assert finding.numbers["step"] == 2
    assert stale_gradients_finding(replay(_snap([_ev("alloc", 16, 10, 1)]))) == []


def test_stale_gradients_advice_is_true_for_lightning() -> None:
    """Lightning zeroes gradients inside its closure, after forward: the advice must not say it does so after
    optimizer.step(); it names what frees them earlier in Lightning and what that saves."""
    header = {"device": "cuda:0", "steps": [1, 2]}
    trace = [
        _tagged("alloc", 16, 4000, 1, "backward", 1, "gradients"),
        _tagged("alloc", 32, 1000, 2, "forward", 2, "activations"),
        _tagged("free_completed", 32, 1000, 3, "forward", 2, "activations"),
    ]
    (finding,) = stale_gradients_finding(replay(_snap(trace, memtrace=header)))
    assert "Lightning does" not in finding.message
    assert "after training_step and before backward" in finding.message
    assert "override optimizer_step" in finding.message and "zero_grad(set_to_none=True)" in finding.message
    assert finding.numbers["peak_saving_bytes"] == 4000  # the peak is in forward, with the gradients live
    assert "would drop by up to 3.9 KiB (4,000 B)" in finding.message
    # a peak in backward: freeing them during forward does not lower it, and the finding says so
    later = trace + [_tagged("alloc", 48, 9000, 4, "backward", 2, "gradients")]
    (finding,) = stale_gradients_finding(replay(_snap(later, memtrace=header)))
    assert finding.numbers["peak_saving_bytes"] == 0
    assert "the peak (in backward) would not change" in finding.message


def test_fragmentation_and_reserved() -> None:
    trace = [_ev("alloc", 16, 1000, 1)]
    wide = replay(_snap(trace, [{"device": 0, "total_size": 2000, "blocks": []}]))
    (finding,) = fragmentation_finding(wide)
    assert finding.code == "fragmentation" and finding.numbers["extra_bytes"] == 1000
    slight = replay(_snap(trace, [{"device": 0, "total_size": 1100, "blocks": []}]))
    assert [f.code for f in fragmentation_finding(slight)] == ["reserved"]
    tight = replay(_snap(trace, [{"device": 0, "total_size": 1010, "blocks": []}]))
    assert fragmentation_finding(tight) == []
    cpu = replay(_snap(trace, [{"device": 0, "total_size": 2000, "blocks": []}], memtrace={"device": "cpu"}))
    assert fragmentation_finding(cpu) == []


def test_top_sites() -> None:
    rep = replay(_snap([_ev("alloc", 16, 1000, 1, line=7), _ev("alloc", 32, 10, 2, line=8)]))
    (finding,) = top_site_findings(rep)
    assert finding.numbers == {"site": f"{USER}:7", "bytes": 1000, "count": 1}
    assert len(top_site_findings(rep, max_sites=2)) == 2


def test_pre_existing_and_unknown_frees() -> None:
    segments = [
        {"device": 0, "total_size": 4096, "blocks": [{"state": "active_allocated", "address": 99, "size": 500}]}
    ]
    trace = [_ev("alloc", 16, 100, 1), _ev("free_completed", 64, 30, 2)]
    rep = replay(_snap(trace, segments))
    (pre,) = pre_existing_finding(rep)
    assert pre.code == "pre_existing" and pre.numbers["seed_bytes"] == 530
    assert "before recording began" in pre.message
    (unknown,) = unknown_frees_finding(rep)
    assert unknown.numbers == {"unknown_frees": 1}
    window = replay(_snap(trace, segments, memtrace={"device": "cuda:0", "steps": [3, 4]}))
    assert "window (steps 3-4) began" in pre_existing_finding(window)[0].message


def test_oom_and_devices() -> None:
    trace = [_ev("alloc", 16, 100, 1), {"action": "oom", "addr": 0, "size": 9999, "time_us": 2, "frames": []}]
    (oom,) = oom_findings(replay(_snap(trace)))
    assert oom.numbers == {"requested_bytes": 9999, "live_bytes": 100, "row": 1}
    two = replay({"segments": [], "device_traces": [[_ev("alloc", 16, 100, 1)], [_ev("alloc", 16, 300, 1)]]})
    (devices,) = devices_finding(two)
    assert devices.numbers == {"devices": [0, 1]} and "the report shows device 1" in devices.message


def _phases() -> pd.DataFrame:
    row = {c: 0 for c in PHASE_COLUMNS}
    rows = [
        {
            **row,
            "step": 1,
            "phase": "after_forward",
            "peak_bytes": 500,
            "allocated_bytes": 400,
            "activations_bytes": 300,
        },
        {
            **row,
            "step": 2,
            "phase": "after_backward",
            "peak_bytes": 900,
            "allocated_bytes": 700,
            "gradients_bytes": 600,
        },
    ]
    return pd.DataFrame(rows)


def test_phase_findings_and_compute_findings_order() -> None:
    (finding,) = phase_findings(_phases())
    assert finding.numbers == {"peak_bytes": 900, "step": 2, "phase": "after_backward", "rank": 0}
    assert [f.code for f in compute_findings_phases_only(_phases())] == ["phase_peak", "no_snapshot"]
    rep = replay(_snap([_ev("alloc", 16, 100, 1), _ev("free_completed", 64, 30, 2)]))
    codes = [f.code for f in compute_findings(rep, _phases())]
    assert codes == ["peak", "top_site", "pre_existing", "unknown_frees", "phase_peak"]


def test_unknown_frees_on_memtrace_snapshots_name_the_window() -> None:
    """MemTrace chose the window: the finding must not blame a late start or a dropped ring buffer (issue 13, point 10)."""
    header = {"producer": "lightning_memtrace", "device": "cpu", "steps": [1, 2]}
    trace = [_tagged("alloc", 16, 100, 1, "forward", 1, "activations")]
    trace.append(_tagged("free_completed", 64, 30, 2, "forward", 1, "activations"))
    (finding,) = unknown_frees_finding(replay(_snap(trace, memtrace=header)))
    assert finding.numbers == {"unknown_frees": 1}
    assert "ring buffer" not in finding.message and "started late" not in finding.message
    assert "window (steps 1-2)" in finding.message and "before MemTrace opened it" in finding.message
    plain = unknown_frees_finding(replay(_snap(trace)))[0]
    assert "ring buffer" in plain.message  # a snapshot from elsewhere: the trace may really have been cut


def test_ddp_buckets_from_memtraces_header() -> None:
    """The header's DDP bucket bytes, where they hold 5% of the peak or more: the bytes and what saves them."""
    trace = [_tagged("alloc", 16, 9000, 1, "forward", 1, "other"), _tagged("alloc", 32, 1000, 2, "forward", 1, "other")]
    header = {"device": "cuda:0", "steps": [1, 1], "ddp_bucket_bytes": 2000}
    (finding,) = ddp_buckets_finding(replay(_snap(trace, memtrace=header)))
    assert finding.code == "ddp_buckets" and finding.numbers == {"ddp_bucket_bytes": 2000, "peak_bytes": 10000}
    assert finding.message == (
        "DDP's gradient buckets hold 2.0 KiB (2,000 B, 20% of the peak), counted in other: with "
        "gradient_as_bucket_view=False (DDP's default) they are a second copy of the gradients; "
        "Trainer(strategy=DDPStrategy(gradient_as_bucket_view=True)) makes the gradients views of the buckets and "
        "saves 2.0 KiB on every rank"
    )
    assert "ddp_buckets" in [f.code for f in compute_findings(replay(_snap(trace, memtrace=header)))]
    for ignored in (499, 0, -5, True, "2000", None, 10**400, 1 << 63):  # under 5% of the peak, or not a byte count (untrusted header)
        assert ddp_buckets_finding(replay(_snap(trace, memtrace={**header, "ddp_bucket_bytes": ignored}))) == []
    assert ddp_buckets_finding(replay(_snap(trace, ddp_bucket_bytes=2000))) == []  # not MemTrace's header
