"""Every file MemTrace writes gets the mode a plain open() would give under the process umask (atomic writes too)."""

from __future__ import annotations

import os
import pickle
import stat
import threading

import pytest

from lightning_memtrace import MemTrace
from lightning_memtrace.atomic import atomic_write_bytes
from lm_helpers import MLP, trainer


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_gets_plain_open_mode(tmp_path, umask):
    with open(tmp_path / "plain", "wb") as handle:
        handle.write(b"x")
    atomic_write_bytes(tmp_path / "atomic", b"x")
    assert _mode(tmp_path / "atomic") == _mode(tmp_path / "plain") == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic", "plain"]  # no temporary left behind


def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path, umask):
    """``chmod 600 report.html`` stays: a plain ``open`` of an existing file keeps its mode."""
    (tmp_path / "private").write_bytes(b"old")
    os.chmod(tmp_path / "private", 0o600)
    (tmp_path / "shared").write_bytes(b"old")
    os.chmod(tmp_path / "shared", 0o664)
    atomic_write_bytes(tmp_path / "private", b"new")
    atomic_write_bytes(tmp_path / "shared", b"new")
    assert _mode(tmp_path / "private") == 0o600 and (tmp_path / "private").read_bytes() == b"new"
    assert _mode(tmp_path / "shared") == 0o664 and (tmp_path / "shared").read_bytes() == b"new"


def test_atomic_write_goes_where_a_plain_open_would_through_a_link(tmp_path):
    """A link is followed (its target gets the bytes, atomically), as ``open`` follows it; the link stays a link."""
    (tmp_path / "real.html").write_bytes(b"old")
    (tmp_path / "link.html").symlink_to("real.html")
    assert atomic_write_bytes(tmp_path / "link.html", b"new") == tmp_path / "link.html"
    assert (tmp_path / "link.html").is_symlink() and (tmp_path / "real.html").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "real.html"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_atomic_write_into_a_pipe_writes_in_place_and_leaves_the_pipe(tmp_path):
    """``memtrace report ... -o /dev/stdout`` (or a named pipe): a rename would put a regular file where the pipe or
    device was (as root, in /dev); the bytes go into it instead."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_bytes()), daemon=True)
    reader.start()
    atomic_write_bytes(pipe, b"x" * 100_000)
    reader.join(timeout=30)
    assert received == [b"x" * 100_000]
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_a_report_to_dev_null_leaves_the_device(tmp_path, capsys):
    from lightning_memtrace.cli import main

    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "frames": []}]]}
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    assert main(["report", str(path), "-o", "/dev/null"]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.endswith("wrote /dev/null\n")


def test_every_file_of_a_run_and_its_post_mortem_has_the_plain_mode(tmp_path, umask):
    callback = MemTrace(history_skip_steps=0, history_steps=1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=4).fit(MLP(oom_at=2))
    report = MemTrace(history_skip_steps=0, history_steps=1)
    trainer(tmp_path / "ok", [report], max_steps=2).fit(MLP())
    written = sorted(callback.output_dir.iterdir()) + sorted(report.output_dir.iterdir())
    names = {p.name for p in written}
    assert {"phases_rank0.csv", "snapshot_rank0_steps0-0.pickle", "oom_rank0_step2.pickle", "oom_rank0_step2.txt",
            "report.html", "timeline.png"} <= names
    assert {p.name: oct(_mode(p)) for p in written} == {p.name: oct(0o666 & ~umask) for p in written}
