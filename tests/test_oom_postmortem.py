"""A real CPU out-of-memory error in a training step: post-mortem written, the error propagates unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from lightning_memtrace import MemoryRecorder, MemTrace, load_phases, what_if
from lightning_memtrace.capture.storages import unique_storage_bytes
from lightning_memtrace.estimator.budget import device_memory_bytes
from lightning_memtrace.units import format_bytes
from lm_helpers import MLP, record_plain_loop, trainer


def test_cpu_oom_in_training_step_writes_post_mortem(tmp_path):
    callback = MemTrace()
    module = MLP(oom_at=1)
    raised = []
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        try:
            trainer(tmp_path, [callback], max_steps=3).fit(module)
        except RuntimeError as error:
            raised.append(error)
            raise
    assert "10000000000000" in str(info.value) or "1000000000000000" in str(info.value)
    assert type(info.value) is RuntimeError and info.value is raised[0]

    folder = callback.output_dir
    text = (folder / "oom_rank0_step1.txt").read_text()
    pbytes = unique_storage_bytes(module.parameters())
    assert "requested:     909.5 TiB (1,000,000,000,000,000 B)" in text
    assert "raised as:" not in text  # the error raised is the out-of-memory error itself
    assert "died in:       the forward pass" in text
    assert "step:          1 (epoch 0, batch_idx 1)" in text
    param_line = next(line for line in text.splitlines() if line.strip().startswith("parameters"))
    assert f"({pbytes:,} B)" in param_line
    grad_line = next(line for line in text.splitlines() if line.strip().startswith("gradients"))
    assert f"({pbytes:,} B)" in grad_line  # last step's gradients are alive during this forward
    assert "10 largest live allocations:" in text
    assert "failed at:     " in text and "lm_helpers.py:" in text and "in training_step" in text
    assert "made before MemTrace started" in text  # the parameters were adopted, not allocated under tracking

    with open(folder / "oom_rank0_step1.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    ooms = [e for e in snapshot["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == 10**15
    post = snapshot["memtrace"]["post_mortem"]
    assert post["requested_bytes"] == 10**15 and post["stage"] == "forward"
    assert post["categories"]["parameters"] == pbytes
    # the run's CSV is whole: every row of step 0 and the batch_start of step 1
    phases = load_phases(folder)
    assert list(phases.phase) == ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end", "batch_start"]


class _NumpyOom(MLP):
    """Host memory runs out in numpy, not in torch's allocator: a ``MemoryError`` (numpy's ``_ArrayMemoryError``)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            np.empty(2**60, dtype=np.uint8)
        return super().training_step(batch, batch_idx)


def test_a_memory_error_on_cpu_writes_the_post_mortem_and_propagates_unchanged(tmp_path):
    callback = MemTrace()
    module = _NumpyOom()
    raised = []
    with pytest.raises(MemoryError, match="Unable to allocate 1.00 EiB") as info:
        try:
            trainer(tmp_path, [callback], max_steps=3).fit(module)
        except MemoryError as error:
            raised.append(error)
            raise
    assert info.value is raised[0]
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    assert "requested:     1.0 EiB (1,152,921,504,606,846,976 B)" in text
    assert "died in:       the forward pass" in text
    assert "failed at:     " in text and "test_oom_postmortem.py:" in text and "in training_step" in text
    pbytes = unique_storage_bytes(module.parameters())
    param_line = next(line for line in text.splitlines() if line.strip().startswith("parameters"))
    assert f"({pbytes:,} B)" in param_line
    with open(callback.output_dir / "oom_rank0_step1.pickle", "rb") as handle:
        assert pickle.load(handle)["memtrace"]["post_mortem"]["requested_bytes"] == 2**60


def test_plain_loop_recorder_writes_post_mortem_and_reraises(tmp_path):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryRecorder(model, [optimizer], output_dir=tmp_path) as recorder:
            recorder.begin_batch(torch.randn(8, 64), step=0)
            model(torch.randn(8, 64)).sum().backward()
            recorder.mark_backward_done()
            torch.empty(10**15, dtype=torch.uint8)
    text = (tmp_path / "oom_rank0_step0.txt").read_text()
    assert "died in:       the optimizer step" in text
    assert "(1,000,000,000,000,000 B)" in text
    assert not recorder.started and recorder.batch is None
    # the plain loop's what-if: the model, the batch of begin_batch, the optimizer's class and defaults, fp32
    table = _section(text, "what would fit (estimated on fake tensors")
    assert table[0].startswith("  what if (today: peak ") and any(line.split()[0] == "bf16-true" for line in table)


def test_oom_names_its_post_mortem_and_report_in_one_line(tmp_path, capsys):
    callback = MemTrace()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=3).fit(MLP(oom_at=1))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("MemTrace: out of memory")]
    folder = callback.output_dir
    assert lines == [
        # said first: the traceback waits for the what-if
        "MemTrace: out of memory; estimating what would fit for the post-mortem, for up to 60 s "
        "(MemTrace(what_if_budget_s=0) skips this)",
        f"MemTrace: out of memory at step 1 (forward); post-mortem: {folder / 'oom_rank0_step1.txt'}; "
        f"report: {folder / 'report.html'}",
    ]
    assert (folder / "report.html").is_file() and callback.report_path == folder / "report.html"


def test_plain_loop_oom_names_its_post_mortem(tmp_path, capsys):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryRecorder(model, [], output_dir=tmp_path, rank=2) as recorder:
            recorder.begin_batch(torch.randn(2, 8), step=4)
            torch.empty(10**15, dtype=torch.uint8)
    err = capsys.readouterr().err.splitlines()
    assert f"[rank 2] MemTrace: out of memory at step 4 (forward); post-mortem: {tmp_path / 'oom_rank2_step4.txt'}" in err
    assert not [line for line in err if "estimating what would fit" in line]  # no optimizer given: no what-if runs


def test_plain_loop_oom_says_the_what_if_runs_before_it_does(tmp_path, capsys):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryRecorder(model, [optimizer], output_dir=tmp_path, rank=2, what_if_budget_s=20) as recorder:
            recorder.begin_batch(torch.randn(2, 8), step=4)
            torch.empty(10**15, dtype=torch.uint8)
    err = [line for line in capsys.readouterr().err.splitlines() if "MemTrace: out of memory" in line]
    assert err[0] == (
        "[rank 2] MemTrace: out of memory; estimating what would fit for the post-mortem, for up to 20 s "
        "(MemoryRecorder(what_if_budget_s=0) skips this)"
    )
    assert err[1].startswith("[rank 2] MemTrace: out of memory at step 4 (forward); post-mortem: ") and len(err) == 2
    assert "what would fit" in (tmp_path / "oom_rank2_step4.txt").read_text()


#: The phrase each category's advice line starts with (analysis.postmortem.advice).
ADVICE_PHRASES = {
    "activations": "Activations saved for backward",
    "optimizer_state": "Optimizer state holds",
    "gradients": "Gradients (",
    "unsharded_parameters": "Gathered (unsharded) parameters",
}


def _section(text: str, title: str) -> list[str]:
    """The indented lines under ``title`` up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    out = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        out.append(line)
    return out


def test_cpu_oom_post_mortem_shows_what_would_fit(tmp_path):
    callback = MemTrace()
    module = MLP(oom_at=1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    folder = callback.output_dir
    text = (folder / "oom_rank0_step1.txt").read_text()
    with open(folder / "oom_rank0_step1.pickle", "rb") as handle:
        post = pickle.load(handle)["memtrace"]["post_mortem"]

    # the batch it died on (batch_idx 1: the same shapes as every batch of this loader), the run's settings
    batch = list(module.train_dataloader())[1]
    direct = what_if(module, batch, device_memory=device_memory_bytes("cpu"), precision="32-true")
    assert post["what_if"]["made"] and post["what_if"]["note"] is None
    rows = post["what_if"]["what_if"]
    assert [r["remedy"] for r in rows] == list(direct.remedy) and len(rows) >= 5
    for row, (_, expected) in zip(rows, direct.iterrows()):
        assert row["peak_bytes"] == expected.peak_bytes and row["saved_bytes"] == expected.saved_bytes
        assert row["max_micro_batch"] == expected.max_micro_batch and row["kind"] == expected.kind
    assert post["what_if"]["peak_bytes"] == direct.attrs["peak_bytes"]
    assert post["what_if"]["combination"] == direct.attrs["combination"]  # None: the 1 PB request fits nowhere

    table = _section(text, "what would fit (estimated on fake tensors")
    assert table[0].startswith("  what if (today: peak 909.5 TiB, does not fit in")
    for row in rows:  # one line per remedy that ran, with its predicted peak
        line = next(line for line in table if line.split()[0] == row["remedy"])
        assert format_bytes(row["peak_bytes"]) in line and row["price"] in line
    assert any(line.strip().startswith("no combination of these remedies fits") for line in table)

    # advice: never a category below 5% of live memory; no word-only tip beside the table
    total = sum(post["categories"].values())
    advice = " ".join(_section(text, "what to change:"))
    for category, phrase in ADVICE_PHRASES.items():
        if post["categories"].get(category, 0) < 0.05 * total:
            assert phrase not in advice, category
    assert "Lower the micro-batch size or use a precision" not in advice
    assert "The failed request alone (909.5 TiB)" in advice


def test_cpu_oom_what_if_past_its_budget_is_one_line(tmp_path):
    callback = MemTrace(what_if_budget_s=0.001, report=False)
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        trainer(tmp_path, [callback], max_steps=3).fit(MLP(oom_at=1))
    assert type(info.value) is RuntimeError
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    section = _section(text, "what would fit (estimated on fake tensors")
    assert len(section) == 1 and section[0].startswith("  what-if: stopped after ")
    assert "(budget 0.001 s); not estimated: " in section[0]
    assert section[0].endswith("(raise MemTrace(what_if_budget_s=...))")
    assert "what to change:" in text  # no table: the advice stays


def test_what_if_budget_zero_leaves_the_post_mortem_as_it_was(tmp_path, capsys):
    callback = MemTrace(what_if_budget_s=0, report=False)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=3).fit(MLP(oom_at=1))
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    assert "what would fit" not in text and "what to change:" in text
    assert "estimating what would fit" not in capsys.readouterr().err


def test_a_second_fit_into_the_same_folder_keeps_the_first_fits_files(tmp_path):
    """With ``logger=False`` every fit of a root folder writes into ``<root>/memtrace``: the second fit appends its rows
    to the CSV under its own run id and writes its snapshot and post-mortem beside the first fit's, never over them."""
    first = MemTrace()
    trainer(tmp_path, [first], max_steps=3).fit(MLP())
    folder = first.output_dir
    window = folder / "snapshot_rank0_steps1-2.pickle"
    window_bytes = window.read_bytes()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [MemTrace()], max_steps=3).fit(MLP(oom_at=1))
    oom_bytes = {suffix: (folder / f"oom_rank0_step1{suffix}").read_bytes() for suffix in (".pickle", ".txt")}
    third = MemTrace()
    trainer(tmp_path, [third], max_steps=3).fit(MLP())
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [MemTrace()], max_steps=3).fit(MLP(oom_at=1))
    assert third.output_dir == folder
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".pickle", ".txt"))
    assert names == [
        "oom_rank0_step1.1.pickle",
        "oom_rank0_step1.1.txt",
        "oom_rank0_step1.pickle",
        "oom_rank0_step1.txt",
        "snapshot_rank0_steps1-1.1.pickle",  # the window a fit that dies at step 1 ends with
        "snapshot_rank0_steps1-1.pickle",
        "snapshot_rank0_steps1-2.1.pickle",
        "snapshot_rank0_steps1-2.pickle",
    ]
    assert window.read_bytes() == window_bytes
    assert {s: (folder / f"oom_rank0_step1{s}").read_bytes() for s in (".pickle", ".txt")} == oom_bytes
    runs = list(dict.fromkeys(load_phases(folder)["run"]))
    assert len(runs) == 4 and runs[0] == first.run_id and runs[2] == third.run_id
    headers = {}
    for name in names:
        if name.endswith(".pickle"):
            with open(folder / name, "rb") as handle:
                headers[name] = pickle.load(handle)["memtrace"]["run"]
    assert headers == {
        "snapshot_rank0_steps1-2.pickle": runs[0],
        "oom_rank0_step1.pickle": runs[1],
        "snapshot_rank0_steps1-1.pickle": runs[1],
        "snapshot_rank0_steps1-2.1.pickle": runs[2],
        "oom_rank0_step1.1.pickle": runs[3],
        "snapshot_rank0_steps1-1.1.pickle": runs[3],
    }
    assert "step:          1 (epoch 0, batch_idx 1)" in (folder / "oom_rank0_step1.1.txt").read_text()


class _OomInSecondValidationLoader(MLP):
    """Two validation dataloaders; the second one's second batch runs out of memory."""

    def val_dataloader(self):
        loader = super().val_dataloader()
        return [loader, loader]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if (dataloader_idx, batch_idx) == (1, 1):
            torch.empty(10**15, dtype=torch.uint8)
        return super().validation_step(batch, batch_idx)


def test_oom_in_validation_says_which_dataloader(tmp_path):
    """``batch_idx`` starts again in each validation dataloader: the post-mortem names the dataloader too."""
    callback = MemTrace(what_if_budget_s=0)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=2, limit_val_batches=2, val_check_interval=2).fit(
            _OomInSecondValidationLoader(batch_size=16)
        )
    text = (callback.output_dir / "oom_rank0_step2.txt").read_text()
    assert "step:          2 (epoch 0, batch_idx 1, dataloader_idx 1)" in text
    assert "died in:       a validation batch [phase: validation]" in text
    with open(callback.output_dir / "oom_rank0_step2.pickle", "rb") as handle:
        post = pickle.load(handle)["memtrace"]["post_mortem"]
    assert (post["batch_idx"], post["dataloader_idx"], post["stage"]) == (1, 1, "validation")
    val = load_phases(callback.output_dir).query("phase == 'val_batch_start'")
    assert list(zip(val.dataloader_idx, val.batch_idx)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


class _CaughtThenRealOom(MLP):
    """Catches an out-of-memory error of its own at batch 1 (and goes on, as code that skips a too-large batch does),
    then dies of one at batch 3 that no allocation of torch's raised (numpy's)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            try:
                torch.empty(10**15, dtype=torch.uint8)
            except RuntimeError:
                pass
        if batch_idx == 3:
            np.empty(2**60, dtype=np.uint8)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("backend", ["auto", "dispatch"])
def test_an_out_of_memory_error_the_user_caught_is_not_the_post_mortems(tmp_path, backend):
    """The state kept where an allocation failed (the dispatch mode's listener; on CUDA the allocator's observer) is
    the post-mortem's only for an error of the same batch: one the user's code caught earlier is forgotten when the
    next batch starts (with its snapshot, on CUDA), so the post-mortem of the error that ends the run tells that one."""
    callback = MemTrace(allocation_backend=backend, what_if_budget_s=0)
    with pytest.raises(MemoryError):
        trainer(tmp_path, [callback], max_steps=5).fit(_CaughtThenRealOom())
    written = sorted(p.name for p in callback.output_dir.glob("oom_*"))
    assert written == ["oom_rank0_step3.pickle", "oom_rank0_step3.txt"]
    text = (callback.output_dir / "oom_rank0_step3.txt").read_text()
    assert "requested:     1.0 EiB (1,152,921,504,606,846,976 B)" in text
    assert "step:          3 (epoch 0, batch_idx 3)" in text
    with open(callback.output_dir / "oom_rank0_step3.pickle", "rb") as handle:
        assert pickle.load(handle)["memtrace"]["post_mortem"]["requested_bytes"] == 2**60


class _OomRaisedAsAnotherError(MLP):
    """A library turns the out-of-memory error of batch 1 into an error of its own: raised from it (``cause``), while
    handling it (``context``), or hiding it (``hidden``: ``raise ... from None``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            try:
                torch.empty(10**15, dtype=torch.uint8)
            except RuntimeError as error:
                if self.how == "cause":
                    raise ValueError("the backend failed to compile the step") from error
                if self.how == "context":
                    raise ValueError("the step failed")
                raise ValueError("the step failed") from None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("how", ["cause", "context", "hidden"])
def test_an_out_of_memory_error_raised_as_another_error_gets_its_post_mortem(tmp_path, how):
    callback = MemTrace(what_if_budget_s=0)
    with pytest.raises(ValueError, match="the step failed|failed to compile") as info:
        trainer(tmp_path, [callback], max_steps=3).fit(_OomRaisedAsAnotherError(how))
    assert type(info.value) is ValueError  # unchanged
    written = sorted(p.name for p in callback.output_dir.glob("oom_*"))
    if how == "hidden":
        assert written == []
        return
    assert written == ["oom_rank0_step1.pickle", "oom_rank0_step1.txt"]
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    assert "requested:     909.5 TiB (1,000,000,000,000,000 B)" in text
    raised_as = "ValueError: " + ("the backend failed to compile the step" if how == "cause" else "the step failed")
    lines = text.splitlines()
    error_line = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    assert lines[error_line].startswith("error:         RuntimeError: ")
    assert "can't allocate memory" in lines[error_line]
    assert lines[error_line + 1] == f"raised as:     {raised_as}"
    with open(callback.output_dir / "oom_rank0_step1.pickle", "rb") as handle:
        post = pickle.load(handle)["memtrace"]["post_mortem"]
    assert post["requested_bytes"] == 10**15 and post["raised_as"] == raised_as
    assert post["exception_type"] == "RuntimeError"


def test_a_plain_loop_recorder_writes_the_post_mortem_of_an_oom_raised_as_another_error(tmp_path):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="wrapped"):
        with MemoryRecorder(model, [], output_dir=tmp_path, what_if_budget_s=0) as recorder:
            recorder.begin_batch(torch.randn(2, 8), step=0)
            try:
                torch.empty(10**15, dtype=torch.uint8)
            except RuntimeError as error:
                raise ValueError("wrapped") from error
    assert sorted(p.name for p in tmp_path.glob("oom_*")) == ["oom_rank0_step0.pickle", "oom_rank0_step0.txt"]
    assert "raised as:     ValueError: wrapped\n" in (tmp_path / "oom_rank0_step0.txt").read_text()


def test_the_oom_snapshot_counts_categories_as_the_post_mortem_does(tmp_path):
    """A tensor the forward made and did not save, alive at the error: ``other`` in the text and in the pickle
    (whose replay once guessed "activations" from where it was made, and advised checkpointing)."""
    from lightning_memtrace.analysis.loader import load_snapshot
    from lightning_memtrace.analysis.replay import replay

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scratch_bytes = 4 * 1024**2
    scratch = []

    def die_in_the_second_forward(step: int) -> None:
        if step == 1:
            scratch.append(torch.zeros(scratch_bytes // 4))  # alive at the error
            torch.empty(10**15, dtype=torch.uint8)

    with pytest.raises(RuntimeError, match="can't allocate memory"):
        record_plain_loop(model, optimizer, tmp_path, 2, 8, in_forward=die_in_the_second_forward, what_if_budget_s=0)
    text = (tmp_path / "oom_rank0_step1.txt").read_text()
    in_text = {
        line.split()[0]: int(line.split("(")[-1].rstrip(" B)").replace(",", ""))
        for line in _section(text, "live memory by category:")
    }
    dev = replay(load_snapshot(tmp_path / "oom_rank0_step1.pickle")).main
    live = dev.allocations[dev.allocations["end_index"] >= dev.num_events]
    in_pickle = live.groupby(live["category"].astype(str), observed=True)["size"].sum()
    assert in_text["other"] >= scratch_bytes and in_pickle["other"] >= scratch_bytes
    # saved for backward: GELU's and the second Linear's inputs (8 x 256 float32 each), the loss's square's input
    # (8 x 64); x is the batch
    assert int(in_pickle["activations"]) == in_text["activations"] == 2 * 8 * 256 * 4 + 8 * 64 * 4
    assert int(in_pickle["parameters"]) == in_text["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    largest = _section(text, "10 largest live allocations:")
    assert f"({scratch_bytes:,} B) other " in largest[0]
