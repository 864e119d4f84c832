"""The snapshot loader: every real variant loads, every bad input is refused with one line, no pickle runs code."""

from __future__ import annotations

import base64
import gzip
import json
import os
import pickle
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_memtrace.analysis.loader import Snapshot, SnapshotError, load_snapshot, normalize

SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "snapshots"


def snapshot_fixture(name: str) -> Path:
    """A file of ../shared/fixtures/snapshots, or skip when the folder (or file) is absent."""
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"shared fixture {name} is absent")
    return path


# name -> (layout, segments, events, reserved bytes at dump time)
FIXTURE_FACTS = {
    "shreyansh26_profile_grad.pkl": ("dict", 7, 33, None),
    "shreyansh26_profile_no_grad.pkl": ("dict", 7, 33, None),
    "drisspg_mini_snapshot.pickle": ("dict", 14, 50, None),
    "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle": ("dict", 1010, 19_342, 58_280 * 1024**2),
    "MAGMA27_assignment2_memory_snapshot.pickle": ("dict", 216, 5_163, None),
    "Muduard_memory_snapshot.pkl": ("segment-list", 255, 0, None),
}


@pytest.mark.parametrize("name", sorted(FIXTURE_FACTS))
def test_every_fixture_loads(name: str) -> None:
    layout, segments, events, reserved = FIXTURE_FACTS[name]
    snap = load_snapshot(snapshot_fixture(name))
    assert isinstance(snap, Snapshot)
    assert snap.layout == layout
    assert snap.container == "pickle"
    assert len(snap.segments) == segments
    assert snap.num_events == events
    if reserved is not None:
        assert sum(s["total_size"] for s in snap.segments) == reserved


def test_fixture_details_from_readme() -> None:
    grad = load_snapshot(snapshot_fixture("shreyansh26_profile_grad.pkl"))
    sizes = {e["size"] for e in grad.device_traces[0] if e["action"] == "alloc"}
    assert sizes == {2_000_000_000, 200_000, 200_000_000, 1_000_000_000, 33_554_432, 1_048_576}
    # the 2e9 request sits in a 2,000,683,008 B block
    blocks = {b["requested_size"]: b["size"] for s in grad.segments for b in s["blocks"]}
    assert blocks[2_000_000_000] == 2_000_683_008

    magma = load_snapshot(snapshot_fixture("MAGMA27_assignment2_memory_snapshot.pickle"))
    assert not any(e["action"] == "segment_alloc" for e in magma.device_traces[0])
    assert set(magma.allocator_settings) >= {"expandable_segments"}
    assert any("\\" in f["filename"] for e in magma.device_traces[0][:50] for f in e.get("frames", []))

    kk = load_snapshot(snapshot_fixture("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle"))
    names = {a["name"] for a in kk.external_annotations}
    assert "Optimizer.step#AdamW.step" in names
    assert "Optimizer.zero_grad#AdamW.zero_grad" in names

    mud = load_snapshot(snapshot_fixture("Muduard_memory_snapshot.pkl"))
    assert mud.device_traces == []
    assert {s["device"] for s in mud.segments} == {1}


def test_gzip_and_bytes(tmp_path: Path) -> None:
    source = snapshot_fixture("drisspg_mini_snapshot.pickle")
    raw = source.read_bytes()
    gz = tmp_path / "snap.pickle.gz"
    gz.write_bytes(gzip.compress(raw))
    snap = load_snapshot(gz)
    assert snap.container == "gzip"
    assert snap.num_events == 50
    assert len(snap.segments) == 14
    assert load_snapshot(raw).num_events == 50


def test_memory_viz_html(tmp_path: Path) -> None:
    from torch.cuda import _memory_viz

    data = pickle.loads(snapshot_fixture("shreyansh26_profile_grad.pkl").read_bytes())
    page = tmp_path / "viz.html"
    page.write_text(_memory_viz.trace_plot(data))
    snap = load_snapshot(page)
    assert snap.container == "html"
    assert snap.num_events == 33
    assert len(snap.segments) == 7


def test_html_handwritten_variant(tmp_path: Path) -> None:
    payload = pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 5}]]})
    files = json.dumps([{"name": "x.pickle", "base64": base64.b64encode(payload).decode()}])
    page = tmp_path / "v.html"
    page.write_text(f"<!DOCTYPE html><html><body><script>const local_files = {files}</script></body></html>")
    assert load_snapshot(page).num_events == 1


def test_older_formats_and_devices() -> None:
    # no time_us, several devices, traces keyed by device, lone free_completed
    old = {
        "segments": [{"device": 1, "address": 10, "total_size": 100, "blocks": []}],
        "device_traces": {1: [{"action": "free_completed", "addr": 5, "size": 3}]},
    }
    data, layout = normalize(old)
    assert layout == "dict"
    assert data["device_traces"] == [[], [{"action": "free_completed", "addr": 5, "size": 3}]]
    data, layout = normalize([{"address": 1, "total_size": 8, "blocks": [{"address": 1, "size": 8, "state": "x"}]}])
    assert layout == "segment-list"
    assert data["device_traces"] == []


@pytest.mark.parametrize("key", ["999999999", 10**9, "-5", -5, 1.5, "1e3", True])
def test_traces_keyed_by_anything_but_a_device_number_are_refused(key: Any) -> None:
    """A key of a billion made a list of a billion traces: 18 GB and no end, from a 55-byte file."""
    started = time.perf_counter()
    with pytest.raises(SnapshotError, match=r"keyed by something other than device numbers \(0 to 1023\)"):
        normalize({"segments": [], "device_traces": {key: []}})
    assert time.perf_counter() - started < 1.0
    data, _ = normalize({"segments": [], "device_traces": {"2": [], 0: [{"action": "alloc"}]}})
    assert data["device_traces"] == [[{"action": "alloc"}], [], []]


def test_sizes_and_times_that_are_no_whole_numbers_load_quietly(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """NaN, infinity or a float beyond int64 in a hostile trace: no numpy warning on the console, and no garbage
    (numpy casts NaN to the lowest int64): such a size counts as 0."""
    from lightning_memtrace.analysis.replay import replay

    trace = [
        {"action": "alloc", "addr": 16, "size": 512.0, "time_us": 1.0, "frames": []},
        {"action": "alloc", "addr": 32, "size": float("nan"), "time_us": float("nan"), "frames": []},
        {"action": "alloc", "addr": 48, "size": float("inf"), "time_us": 3.0, "frames": []},
        7,  # not an event: the columns are read one by one, as plain lists of floats
        {"action": "alloc", "addr": 64, "size": 1e30, "time_us": 4.0, "frames": []},
    ]
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replayed = replay(load_snapshot(path))
    assert replayed.devices[0].peak.live_bytes == 512
    assert capfd.readouterr().err == ""


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": _Evil(marker)}))
    with pytest.raises(SnapshotError) as info:
        load_snapshot(evil)
    message = str(info.value)
    assert "\n" not in message
    assert "refused" in message and "system" in message
    assert not marker.exists()
    # gzip-wrapped and HTML-embedded variants are refused the same way
    gz = tmp_path / "evil.pickle.gz"
    gz.write_bytes(gzip.compress(evil.read_bytes()))
    with pytest.raises(SnapshotError, match="refused"):
        load_snapshot(gz)
    assert not marker.exists()


class Foreign:
    """A class no snapshot holds."""

    def __init__(self) -> None:
        self.value = 1


#: A 9-byte pickle whose LONG_BINPUT names memo index 2**30: CPython's C unpickler would allocate and zero a memo of
#: 2**31 pointers (16 GiB) for it before reading on.
MEMO_BOMB = b"\x80\x02]r" + (2**30).to_bytes(4, "little") + b"."


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory cap is Linux's RLIMIT_DATA")
@pytest.mark.parametrize("as_file", [False, True])
def test_memo_bomb_is_refused_at_once_and_the_limit_restored(tmp_path: Path, as_file: bool) -> None:
    import resource
    import time

    before = resource.getrlimit(resource.RLIMIT_DATA)
    source: bytes | Path = MEMO_BOMB
    if as_file:
        source = tmp_path / "bomb.pickle"
        source.write_bytes(MEMO_BOMB)
    started = time.monotonic()
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(source)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "\n" not in message and "corrupt or hostile pickle" in message and "9 B" in message
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    # a real snapshot still loads in the same process afterwards, under the same cap
    assert load_snapshot(pickle.dumps({"segments": [], "device_traces": [[]]})).num_events == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory cap is Linux's RLIMIT_DATA")
def test_while_capped_only_cpythons_exported_buffers_error_is_kept_off_the_console(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_memtrace.analysis.data_limit import data_growth_capped

    user_hook = sys.excepthook
    with data_growth_capped(2**30):
        # what CPython's bytearray_dealloc hands to sys.excepthook (through PyErr_Print) when the cap strikes
        sys.excepthook(SystemError, SystemError("deallocated bytearray object has exported buffers"), None)
        sys.excepthook(SystemError, SystemError("something else"), None)
        sys.excepthook(ValueError, ValueError("deallocated bytearray object has exported buffers"), None)
    assert sys.excepthook is user_hook
    err = capsys.readouterr().err
    assert "exported buffers" in err and "something else" in err  # the ValueError's and the other SystemError's
    assert err.count("SystemError") == 1 and err.count("ValueError") == 1


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_a_device_is_refused_without_reading_it() -> None:
    with pytest.raises(SnapshotError, match=r"^/dev/zero: not a regular file \(a device or socket\), not a snapshot"):
        load_snapshot("/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize("head", [b"\x00", b"name,value\n"])
def test_a_pipe_that_never_ends_is_refused_from_its_first_bytes(tmp_path: Path, head: bytes) -> None:
    """``memtrace summary <(cat /dev/zero)``: the loader reads the head, sees no snapshot container, and stops."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    written = [0]

    def endless_writer() -> None:
        with open(pipe, "wb") as handle:
            chunk = head * (65536 // len(head))
            try:
                while written[0] < 256 * 1024**2:
                    handle.write(chunk)
                    handle.flush()
                    written[0] += len(chunk)
            except BrokenPipeError:  # the loader closed its end
                pass

    writer = threading.Thread(target=endless_writer, daemon=True)
    writer.start()
    with pytest.raises(SnapshotError, match="not a pickle"):
        _load_within(pipe, seconds=60)
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert written[0] < 1024**2  # the pipe's buffer and the head, not the 8 GiB the size limit would allow


def _load_within(pipe: Path, seconds: float) -> Any:
    """``load_snapshot(pipe)``, failing (never hanging) where the loader waits on the pipe longer than ``seconds``:
    an open of a pipe with no writer left waits for ever; a writer opened here and closed at once releases it."""
    outcome: dict[str, Any] = {}

    def load() -> None:
        try:
            outcome["value"] = load_snapshot(pipe)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = error

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(timeout=seconds)
    if loader.is_alive():
        with open(pipe, "wb"):
            pass
        loader.join(timeout=10)
        pytest.fail(f"load_snapshot waited on the pipe for over {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_pipe_is_opened_once_and_its_snapshot_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second open of a named pipe waits for a writer that already left: the loader opens it once."""
    import builtins
    from lightning_memtrace.analysis import loader as loader_module

    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "frames": []}]]}
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    opened: list[str] = []

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(loader_module, "open", counting_open, raising=False)

    def writer() -> None:
        with open(pipe, "wb") as handle:
            handle.write(pickle.dumps(snapshot, protocol=4))

    threading.Thread(target=writer, daemon=True).start()
    loaded = _load_within(pipe, seconds=60)
    assert loaded.num_events == 1 and loaded.device_traces[0][0]["size"] == 512
    assert len(opened) == 1  # on Linux the descriptor opened without waiting, elsewhere the path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipes are watched with poll on Linux only")
def test_a_pipe_nothing_is_written_into_is_refused_after_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``memtrace summary`` on a stray ``mkfifo`` used to wait for ever in ``open``; a writer that comes late (within
    the wait) is still read."""
    from lightning_memtrace.analysis import loader as loader_module
    from lightning_memtrace.cli import main

    monkeypatch.setattr(loader_module, "PIPE_WAIT_SECONDS", 0.5)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(SnapshotError, match=r"pipe: a pipe with nothing written into it for 0.5 s$"):
        _load_within(pipe, seconds=30)
    with pytest.raises(SystemExit) as exited:
        main(["summary", str(pipe)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"memtrace: error: {pipe}: a pipe with nothing written into it for 0.5 s\n"

    monkeypatch.setattr(loader_module, "PIPE_WAIT_SECONDS", 30.0)
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "frames": []}]]}

    def late_writer() -> None:
        time.sleep(1.0)
        with open(pipe, "wb") as handle:
            handle.write(pickle.dumps(snapshot, protocol=4))

    threading.Thread(target=late_writer, daemon=True).start()
    assert _load_within(pipe, seconds=60).num_events == 1


def test_a_snapshot_saved_with_torch_save_loads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import zipfile

    snapshot = {
        "segments": [{"address": 4096, "total_size": 2048, "stream": 0, "device": 0, "blocks": []}],
        "device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1, "frames": []}]],
    }
    saved = tmp_path / "snapshot.pt"
    torch.save(snapshot, saved)
    loaded = load_snapshot(saved)
    assert loaded.container == "torch.save" and loaded.num_events == 1
    assert loaded.segments[0]["total_size"] == 2048 and loaded.device_traces[0][0]["size"] == 512
    assert load_snapshot(saved.read_bytes()).num_events == 1
    # a torch.save file with a tensor in it names torch's tensor rebuilder: refused, nothing restored
    with_tensor = tmp_path / "checkpoint.pt"
    torch.save({"segments": [], "weight": torch.zeros(3)}, with_tensor)
    with pytest.raises(SnapshotError, match="asks for the Python object torch._utils._rebuild_tensor_v2"):
        load_snapshot(with_tensor)
    # any other zip archive, and a data.pkl that inflates past the size limit, are one line each
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(SnapshotError, match=r": a zip archive, not a memory snapshot \(nor a torch.save file\)$"):
        load_snapshot(other)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", bytes(4 * 1024**2))
    assert bomb.stat().st_size < 64 * 1024
    with pytest.raises(SnapshotError, match=r": its data.pkl is 4.0 MiB, over the size limit of 1.0 MiB \(raise it"):
        load_snapshot(bomb, max_bytes=1024**2)


def test_foreign_object_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "foreign.pkl"
    path.write_bytes(pickle.dumps({"segments": [Foreign()], "device_traces": []}))
    with pytest.raises(SnapshotError, match=r"refused.*Foreign"):
        load_snapshot(path)


def test_plain_sets_and_tuples_are_fine(tmp_path: Path) -> None:
    for protocol in (2, 4, 5):
        path = tmp_path / f"p{protocol}.pkl"
        value = {"segments": [], "device_traces": [[]], "extra": {1, 2}, "t": (1, 2), "f": frozenset({3})}
        path.write_bytes(pickle.dumps(value, protocol=protocol))
        assert load_snapshot(path).data["extra"] == {1, 2}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty file"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "PNG image"),
        (b"hello, this is text", "not a pickle"),
        (pickle.dumps(12345), "not a memory snapshot"),
        (pickle.dumps({"a": 1}), "without 'segments'"),
        (pickle.dumps([1, 2, 3]), "not of memory segments"),
    ],
)
def test_bad_inputs_one_line(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.pkl"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match=match) as info:
        load_snapshot(path)
    assert "\n" not in str(info.value)


def test_truncated_directory_missing_and_size_limit(tmp_path: Path) -> None:
    raw = snapshot_fixture("shreyansh26_profile_grad.pkl").read_bytes()
    cut = tmp_path / "cut.pkl"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(SnapshotError, match="truncated") as info:
        load_snapshot(cut)
    assert "\n" not in str(info.value)
    cut_gz = tmp_path / "cut.pkl.gz"
    cut_gz.write_bytes(gzip.compress(raw)[:200])
    with pytest.raises(SnapshotError, match="truncated"):
        load_snapshot(cut_gz)
    with pytest.raises(SnapshotError, match="is a directory"):
        load_snapshot(tmp_path)
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "missing.pkl")
    whole = tmp_path / "whole.pkl"
    whole.write_bytes(raw)
    with pytest.raises(SnapshotError, match="size limit") as info:
        load_snapshot(whole, max_bytes=1000)
    assert f"{len(raw)}" not in str(info.value) or "limit" in str(info.value)
    bomb = tmp_path / "bomb.pkl.gz"
    bomb.write_bytes(gzip.compress(b"\x80\x04" + b"N" * 5_000_000))
    with pytest.raises(SnapshotError, match="decompresses to over the size limit"):
        load_snapshot(bomb, max_bytes=1_000_000)


def test_progress_callback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_memtrace.analysis import loader

    monkeypatch.setattr(loader, "PROGRESS_THRESHOLD_BYTES", 1)
    monkeypatch.setattr(loader, "_CHUNK", 4096)
    seen: list[tuple[int, int]] = []
    path = snapshot_fixture("drisspg_mini_snapshot.pickle")
    load_snapshot(path, progress=lambda done, total: seen.append((done, total)))
    size = path.stat().st_size
    assert seen[-1] == (size, size)
    assert len(seen) == -(-size // 4096)
