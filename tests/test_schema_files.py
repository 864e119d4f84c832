"""The snapshot header and allocation tag (schema.py) and every file name (files.py): written and read in one place."""

from __future__ import annotations

from lightning_memtrace import files, schema
from lightning_memtrace.types import COUNTERS, PHASE_ORDER, STAGES, Phase, Stage


def test_tag_round_trip() -> None:
    for stage in Stage:
        assert schema.parse_tag(schema.format_tag(stage, 12)) == (stage, 12)
    assert schema.format_tag("forward", 3) == "phase=forward step=3"
    assert schema.parse_tag("") == (None, None)
    assert schema.parse_tag("phase=nonsense step=x") == (None, None)
    assert schema.parse_tag("stage=train, step=2") == (Stage.FORWARD, 2)


def test_header_round_trip() -> None:
    header = schema.build_header(
        device="cuda:0",
        rank=1,
        steps=(3, 5),
        allocated_bytes=10,
        allocated_at_start_bytes=None,
        categories={"parameters": 4},
        phases=[{"step": 3, "phase": "batch_start", "time_us": 1}],
    )
    snapshot = {"segments": [], "device_traces": [], schema.HEADER_KEY: header}
    read = schema.read_header(snapshot)
    assert read is header and read["format"] == schema.SNAPSHOT_FORMAT and read["producer"] == "lightning_memtrace"
    assert schema.header_steps(read) == (3, 5) and schema.header_device(read) == "cuda:0"
    assert schema.header_phase_marks(read) == [{"step": 3, "phase": "batch_start", "time_us": 1}]
    assert not schema.header_is_cpu(read) and schema.header_is_cpu({"device": "cpu"})
    assert schema.read_header({"memtrace": "not a dict"}) is None and schema.header_steps(None) is None


def test_file_names_and_rank_of() -> None:
    assert files.phases_filename(2) == "phases_rank2.csv"
    assert files.window_snapshot_filename(0, 3, 5) == "snapshot_rank0_steps3-5.pickle"
    assert files.step_snapshot_filename(1, 7) == "snapshot_rank1_step7.pickle"
    assert files.oom_basename(3, 9) == "oom_rank3_step9" and files.is_oom_file("oom_rank3_step9.pickle")
    for name in ("phases_rank2.csv", "snapshot_rank2_steps3-5.pickle", "oom_rank2_step9.pickle"):
        assert files.rank_of(name) == 2
    assert files.rank_of("memory.pickle") is None
    import fnmatch

    assert fnmatch.fnmatch(files.phases_filename(4), files.PHASES_GLOB)
    assert any(fnmatch.fnmatch(files.window_snapshot_filename(0, 1, 2), p) for p in files.SNAPSHOT_PATTERNS)
    assert any(fnmatch.fnmatch(files.oom_basename(0, 1) + ".pickle", p) for p in files.SNAPSHOT_PATTERNS)


def test_orders() -> None:
    assert [p.value for p in PHASE_ORDER] == [p.value for p in Phase]
    assert STAGES == (
        "outside",
        "init",
        "forward",
        "backward",
        "zero_grad",
        "optimizer_step",
        "after_step",
        "validation",
    )
    assert COUNTERS[:3] == ("allocated", "reserved", "peak")
    assert Stage.INIT.description and Stage.ZERO_GRAD.words == "zero_grad"
