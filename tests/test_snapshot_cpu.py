"""Snapshots written on CPU open in torch's own readers and add up to the tracker's counters."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch.cuda import _memory_viz

import pytest
from lm_helpers import record_plain_loop

from lightning_memtrace import MemoryRecorder
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay


def _train_with_recorder(tmp_path, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    optimizer = torch.optim.AdamW(model.parameters())
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history_skip_steps=1, history_steps=2) as recorder:
        for step in range(steps):
            x = torch.randn(32, 128)
            recorder.begin_batch(x, step=step)
            loss = model(x).square().mean()
            recorder.mark_forward_done()
            loss.backward()
            recorder.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            recorder.end_batch()
            if step == 2:
                allocated_at_window_end = recorder.tracker.allocated
    return recorder, allocated_at_window_end


def test_snapshot_passes_torch_readers_and_adds_up(tmp_path):
    recorder, allocated_at_end = _train_with_recorder(tmp_path)
    path = tmp_path / "snapshot_rank0_steps1-2.pickle"
    assert path.is_file()
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)

    summary = _memory_viz.segsum(snapshot)  # raises if the segment accounting does not add up
    assert "total_reserved" in summary
    text = _memory_viz.trace(snapshot)
    assert text.startswith("Device 0")
    html = _memory_viz.trace_plot(snapshot)
    assert "alloc" in html or len(html) > 1000

    # MemoryViz.js (pytorch.org/memory_viz) unpickles protocols 2-4 only
    assert path.read_bytes()[:2] == b"\x80\x04"
    trace = snapshot["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert actions == {"alloc", "free_requested", "free_completed", "snapshot"}
    # MemoryViz.js crashes on categories without "unknown" among them (a typo in its code): it must be there
    assert trace[-1]["action"] == "snapshot" and trace[-1]["category"] == "unknown"
    assert all({"addr", "size", "time_us", "frames", "stream"} <= set(e) for e in trace)
    assert all(e["frames"] for e in trace if e["action"] == "alloc")  # every allocation in the window has a stack
    assert any(f["filename"] == __file__ for e in trace if e["action"] == "alloc" for f in e["frames"])
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)

    meta = snapshot["memtrace"]
    live = meta["allocated_at_start_bytes"]
    for event in trace:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
    active = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert live == active == meta["allocated_bytes"] == allocated_at_end
    params = sum(p.numel() * 4 for p in recorder.model.parameters())
    assert meta["categories"]["parameters"] == params
    assert meta["categories"]["optimizer_state"] == 2 * params + 4 * 4
    categories = {b["category"] for s in snapshot["segments"] for b in s["blocks"]}
    assert categories <= {"parameters", "gradients", "optimizer_state", "inputs", "activations", "other", "unknown"}
    assert {"parameters", "optimizer_state"} <= categories
    alloc_categories = {e["category"] for e in trace if e["action"] == "alloc"}
    assert {"activations", "gradients", "inputs"} <= alloc_categories


def test_window_snapshot_is_bounded_by_max_entries(tmp_path):
    model = torch.nn.Linear(16, 16)
    with MemoryRecorder(model, [], output_dir=tmp_path, history_skip_steps=0, history_steps=1, max_entries=20) as rec:
        rec.begin_batch(None, step=0)
        for _ in range(100):
            model(torch.randn(4, 16))
        rec.end_batch(next_step=1)
    with open(tmp_path / "snapshot_rank0_steps0-0.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert len(snapshot["device_traces"][0]) <= 40


def test_category_rules_are_checked_at_construction():
    import pytest

    from lightning_memtrace import MemTrace
    from lightning_memtrace.capture.config import RecorderConfig

    with pytest.raises(ValueError, match=r"category_rules: rule 'kv_cache': bad regular expression 'cache_utils\('"):
        MemTrace(category_rules={"kv_cache": "cache_utils("})
    with pytest.raises(ValueError, match=r"category_rules: rule name 'a b'"):
        RecorderConfig(category_rules={"a b": "x"})
    callback = MemTrace(category_rules={"kv_cache": r"cache_utils\.py", "attention": "attn"})
    assert callback.config.category_rules == (("kv_cache", r"cache_utils\.py"), ("attention", "attn"))
    assert RecorderConfig().category_rules == () and "category_rules" in MemTrace.__doc__


def test_memtrace_category_rules_reach_the_header_summary_and_report(tmp_path, capsys):
    """A MemTrace CPU run with ``category_rules``: the snapshot's header holds them, ``memtrace summary`` applies them
    (to the allocations MemTrace left uncategorised: here the forward's temporaries made in ``linear.py``) and so does
    the end-of-fit report."""
    import gc
    import json
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lm_helpers import MLP, trainer

    from lightning_memtrace import MemTrace
    from lightning_memtrace.analysis.questions import Question, ask
    from lightning_memtrace.analysis.replay import replay
    from lightning_memtrace.cli import main

    rules = {"linear_out": r"/linear\.py:\d+ forward$"}
    callback = MemTrace(category_rules=rules)
    # the CPU allocator sees the whole process: garbage of earlier tests freed by a collection inside the first
    # forward would put that phase's peak before the linear layers run
    gc.collect()
    gc.disable()
    try:
        trainer(tmp_path, [callback], max_steps=3).fit(MLP())
    finally:
        gc.enable()
    (path,) = sorted(Path(callback.output_dir).glob("snapshot_rank0_*.pickle"))
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    assert snapshot["memtrace"]["category_rules"] == rules

    assert main(["summary", str(callback.output_dir), "--json", "--step", "2", "--phase", "forward", "--sites", "100000"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["category_rules"] == rules
    (device,) = obj["devices"]
    assert device["categories"]["linear_out"] > 0
    sums: dict[str, int] = {}
    for site in device["sites"]:
        sums[site["category"]] = sums.get(site["category"], 0) + site["bytes"]
    assert {c: b for c, b in sums.items() if b} == device["categories"]

    # independently: the allocations live at that moment that MemTrace left uncategorised and whose stack has a
    # frame matching the rule (read from the raw trace of a replay without the rules)
    del snapshot["memtrace"]["category_rules"]
    plain = replay(snapshot).main
    moment = ask(plain, Question(step=2, phase="forward")).moment
    al = plain.allocations
    live = al[(al["alloc_index"] <= moment.index) & (al["end_index"] > moment.index) & al["inferred"]]
    trace = snapshot["device_traces"][0]
    pattern = re.compile(rules["linear_out"])
    expected = sum(
        int(size)
        for row, size in zip(live["alloc_index"], live["size"])
        if row >= 0 and any(pattern.search(f"{f['filename']}:{f['line']} {f['name']}") for f in trace[row]["frames"])
    )
    assert device["peak_event"] == moment.index and device["categories"]["linear_out"] == expected
    # the recorded categories are untouched by the rule
    recorded = {c: b for c, b in moment.by_category.items() if c in ("parameters", "gradients", "optimizer_state")}
    assert {c: device["categories"][c] for c in recorded} == recorded

    html = (Path(callback.output_dir) / "report.html").read_text(encoding="utf-8")
    assert "<code>linear_out=" in html


def _steps_recorded(tmp_path, steps: int, last_step: int | None) -> list[str]:
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history_skip_steps=1, history_steps=2) as recorder:
        recorder.expect_last_step(last_step)
        for step in range(steps):
            recorder.begin_batch(None, step=step)
            model(torch.randn(4, 16)).sum().backward()
            recorder.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            recorder.end_batch(next_step=step + 1)
    return sorted(path.name for path in tmp_path.glob("snapshot_*.pickle"))


def test_a_run_that_ends_before_the_window_gets_one_over_its_last_steps(tmp_path):
    # a run of unknown length: the window waits for step 1
    assert _steps_recorded(tmp_path / "one", 1, last_step=None) == []
    assert _steps_recorded(tmp_path / "known", 1, last_step=0) == ["snapshot_rank0_steps0-0.pickle"]
    assert _steps_recorded(tmp_path / "two", 2, last_step=1) == ["snapshot_rank0_steps1-1.pickle"]
    assert _steps_recorded(tmp_path / "long", 5, last_step=4) == ["snapshot_rank0_steps1-2.pickle"]  # as before
    with open(tmp_path / "known" / "snapshot_rank0_steps0-0.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert snapshot["memtrace"]["steps"] == [0, 0]
    assert any(e["action"] == "alloc" for e in snapshot["device_traces"][0])


def test_a_callbacks_own_memory_is_blamed_on_its_code_not_on_the_fit_call(tmp_path, capsys):
    """Lightning's ``EMAWeightAveraging`` updates its averaged copy after each batch: torch's ``ema_update`` makes a
    temporary per weight there, the run's highest point. The site that holds them is that code, not the line that
    called ``trainer.fit``."""
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lm_helpers import MLP, trainer

    from lightning_memtrace import MemTrace
    from lightning_memtrace.cli import main

    callback = MemTrace(report=False)
    module = MLP(width=256)
    trainer(tmp_path, [callback, EMAWeightAveraging()], max_steps=4).fit(module)
    assert main(["summary", str(callback.output_dir), "--json", "--sites", "100000"]) == 0
    (device,) = json.loads(capsys.readouterr().out)["devices"]
    top = device["sites"][0]
    assert top["site"].endswith("torch/optim/swa_utils.py:" + top["site"].rsplit(":", 1)[1])
    assert top["function"] == "ema_update" and top["category"] == "other"
    # one temporary per weight matrix the update touches at a time (256 x 256 float32 at most), several of them
    assert top["bytes"] >= 256 * 256 * 4
    fit_call = [site for site in device["sites"] if site["site"].startswith(f"{__file__}:")]
    assert sum(site["bytes"] for site in fit_call) < top["bytes"]  # what Lightning's loops make themselves, no more
    # the peak is between two training passes (the callback's batch end), said as such
    from lightning_memtrace.analysis.findings import peak_finding
    from lightning_memtrace.analysis.loader import load_snapshot
    from lightning_memtrace.analysis.replay import replay

    (snapshot,) = sorted(Path(callback.output_dir).glob("snapshot_rank0_*.pickle"))
    (finding,) = peak_finding(replay(load_snapshot(snapshot)))
    assert " outside a training pass, in step " in finding.message and "in outside" not in finding.message


KEPT_BYTES = 16 * 1024  # made in the forward, kept by the step: neither saved for backward nor a named kind


def _keep_one_tensor_a_step(tmp_path: Path, **settings) -> tuple[Path, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    kept: list[torch.Tensor] = []

    def keep(step: int) -> None:
        kept.append(torch.full((KEPT_BYTES // 4,), float(step)))

    optimizer = torch.optim.AdamW(model.parameters())
    record_plain_loop(model, optimizer, tmp_path, 2, 8, in_forward=keep, history_skip_steps=0, **settings)
    (path,) = sorted(tmp_path.rglob("snapshot_*.pickle"))
    return path, kept


@pytest.mark.parametrize("backend", ["reports", "dispatch"])
def test_what_a_row_did_not_name_is_other_in_the_snapshot(tmp_path: Path, backend: str) -> None:
    """A tensor alive at the rows that none of them named is ``other``, as the rows count it, not an activation
    guessed from where it was made (saved activations stay activations)."""
    path, _ = _keep_one_tensor_a_step(tmp_path, history_steps=2, allocation_backend=backend)
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    kept = [e for e in trace if e["action"] == "alloc" and e["size"] == KEPT_BYTES]
    assert len(kept) == 2 and {e["category"] for e in kept} == {"other"}
    assert any(e["category"] == "activations" for e in trace if e["action"] == "alloc")
    allocations = replay(load_snapshot(path)).main.allocations
    rows = allocations[allocations["size"] == KEPT_BYTES]
    assert rows["category"].astype(str).tolist() == ["other", "other"] and not rows["inferred"].any()


def test_what_no_row_looked_at_is_still_inferred(tmp_path: Path) -> None:
    """Steps that take no row (``every_n_steps``) name nothing: there the kept tensor's category is inferred."""
    path, _ = _keep_one_tensor_a_step(tmp_path, history_steps=2, every_n_steps=5)
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    # step 0 takes rows (0 % 5 == 0): its tensor is other; step 1 takes none: unknown, inferred
    assert [e["category"] for e in trace if e["action"] == "alloc" and e["size"] == KEPT_BYTES] == ["other", "unknown"]
    allocations = replay(load_snapshot(path)).main.allocations
    rows = allocations[allocations["size"] == KEPT_BYTES].sort_values("alloc_index")
    assert rows["category"].astype(str).tolist() == ["other", "activations"]
    assert rows["inferred"].tolist() == [False, True]


def test_a_rule_names_what_memtrace_left_as_other(tmp_path: Path) -> None:
    path, _ = _keep_one_tensor_a_step(tmp_path, history_steps=2, category_rules={"kept": r"_keep_one_tensor_a_step$"})
    allocations = replay(load_snapshot(path)).main.allocations
    rows = allocations[allocations["size"] == KEPT_BYTES]
    assert rows["category"].astype(str).tolist() == ["kept", "kept"] and rows["inferred"].all()
    measured = allocations[~allocations["inferred"]]["category"].astype(str)
    assert "kept" not in set(measured) and "parameters" in set(measured)
