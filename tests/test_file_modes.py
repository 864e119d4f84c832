"""Every file MemTrace writes gets the mode a plain open() would give under the process umask (atomic writes too)."""

from __future__ import annotations

import os
import stat

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
