"""The compat smoke subset: what `make compat` runs in one venv per torch / Lightning / transformers combination.

A Lightning fit of the tiny LM (CSV rows and exact byte columns, the window snapshot, the end-of-fit report), a real
CPU out-of-memory error (post-mortem files), and the ``memtrace report`` command on the run's folder. It checks
behaviour that must hold on every supported version, not figures of one version; the full suite (``make test``)
checks the figures. Not collected by ``make test`` (``pytest tests``): it repeats parts of the suite.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture.reports_backend import unavailable_reason
from lm_helpers import MLP, TinyLM, trainer

PHASES = ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]
STEPS = 4


def _bytes(tensors) -> int:
    """Bytes of distinct storages (tied weights once), counted here without lightning_memtrace's helpers."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _memtrace_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "MemTrace" in str(w.message)]


def test_versions_in_use():
    import lightning
    import transformers

    # printed with -s / in the log: which versions this venv really runs
    print(f"torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}")
    print(f"allocator reports: {unavailable_reason() or 'available'}")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    torch.manual_seed(0)
    module = TinyLM(batch_size=4, seq_len=64)
    callback = MemTrace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp, [callback], max_steps=STEPS).fit(module)
    return module, callback, load_phases(callback.output_dir), _memtrace_warnings(caught)


def test_fit_warns_nothing_and_uses_the_expected_tracker(lm_run):
    module, callback, phases, said = lm_run
    reason = unavailable_reason()
    assert callback.tracker_backend == ("reports" if reason is None else "dispatch"), reason
    # where the reports cannot run, MemTrace counts with the dispatch mode and says so once
    assert said == ([] if reason is None else [said[0]]), said
    if reason is not None:
        assert "dispatch mode" in said[0] and reason in said[0]


def test_csv_rows_and_byte_columns(lm_run):
    module, callback, phases, _ = lm_run
    assert (callback.output_dir / "phases_rank0.csv").is_file()
    assert len(phases) == STEPS * len(PHASES)
    assert list(phases.phase[: len(PHASES)]) == PHASES
    assert sorted(phases.step.unique()) == list(range(STEPS))
    byte_columns = [c for c in phases.columns if c.endswith("_bytes")]
    assert byte_columns == [
        "allocated_bytes",
        "reserved_bytes",
        "peak_bytes",
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "inputs_bytes",
        "other_bytes",
        "unsharded_parameters_bytes",  # FSDP2's gathered parameters and gradients: 0 on an unsharded run
        "unsharded_gradients_bytes",
    ]
    assert all(str(phases[c].dtype) == "int64" for c in byte_columns)

    params = list(module.parameters())
    param_bytes = _bytes(params)
    assert param_bytes == 13_714_432  # the tiny Qwen2 in float32, tied embeddings once
    assert (phases.parameters_bytes == param_bytes).all()
    first = phases[phases.step == 0].set_index("phase")
    assert first.loc["batch_start", "gradients_bytes"] == 0
    assert first.loc["after_backward", "gradients_bytes"] == _bytes(p.grad for p in params if p.grad is not None)
    state = [v for s in module.trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
    assert first.loc["after_optimizer_step", "optimizer_state_bytes"] == _bytes(state) > 2 * param_bytes - 1
    assert first.loc["after_forward", "optimizer_state_bytes"] == 0
    assert (phases.inputs_bytes == 4 * 64 * 8).all()  # int64 input_ids, batch 4 x 64
    assert (phases[phases.phase == "after_forward"].activations_bytes > 1_000_000).all()
    assert (phases[phases.phase != "after_forward"].activations_bytes == 0).all()
    assert (phases.unsharded_parameters_bytes == 0).all() and (phases.unsharded_gradients_bytes == 0).all()
    categories = phases[
        ["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes"]
    ].sum(axis=1)
    assert (phases.allocated_bytes >= categories).all()
    assert (categories + phases.other_bytes == phases.allocated_bytes).all()
    assert (phases.peak_bytes >= phases.allocated_bytes).all()


def test_window_snapshot_written(lm_run):
    _, callback, _, _ = lm_run
    snapshots = sorted(p.name for p in callback.output_dir.glob("snapshot_rank0_steps*.pickle"))
    assert snapshots == ["snapshot_rank0_steps1-2.pickle"]
    with open(callback.output_dir / snapshots[0], "rb") as handle:
        snapshot = pickle.load(handle)
    trace = snapshot["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert len(allocs) > 100 and all(e["size"] > 0 for e in allocs)
    stages = {e["user_metadata"].split()[0] for e in allocs}
    assert {"phase=forward", "phase=backward", "phase=optimizer_step"} <= stages
    assert any(e["frames"] for e in allocs)


def test_report_written_at_end_of_fit(lm_run):
    _, callback, _, _ = lm_run
    html = (callback.output_dir / "report.html").read_text(encoding="utf-8")
    assert len(html) > 10_000 and "<html" in html.lower()
    assert (callback.output_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memtrace_report_command(lm_run, tmp_path):
    _, callback, _, _ = lm_run
    out = tmp_path / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_memtrace.cli", "report", str(callback.output_dir), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.stat().st_size > 10_000


def test_cpu_out_of_memory_post_mortem(tmp_path):
    callback = MemTrace()
    module = MLP(oom_at=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert _memtrace_warnings(caught) == []
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    assert "(1,000,000,000,000,000 B)" in text
    assert "died in:       the forward pass" in text
    assert f"({_bytes(module.parameters()):,} B)" in text
    with open(callback.output_dir / "oom_rank0_step1.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    ooms = [e for e in snapshot["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == 10**15
    assert snapshot["memtrace"]["post_mortem"]["requested_bytes"] == 10**15
    assert list(load_phases(callback.output_dir).phase) == PHASES + ["batch_start"]
