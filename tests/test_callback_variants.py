"""Accumulation, manual optimization, two optimizers, loggers, resume, and MemTrace's own failures."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning_memtrace import MemoryRecorder, MemTrace, MemTraceWarning, load_phases
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import MLP, SparseEmbedding, TwoOptimizers, trainer


def _param_bytes(module) -> int:
    return unique_storage_bytes(module.parameters())


def test_accumulation_two_batches_per_step(tmp_path):
    callback = MemTrace()
    module = MLP()
    trainer(tmp_path, [callback], max_steps=2, accumulate_grad_batches=2).fit(module)
    phases = load_phases(callback.output_dir)
    assert list(phases.batch_idx.unique()) == [0, 1, 2, 3]
    per_batch = phases.groupby("batch_idx").phase.apply(list)
    # the accumulating batch has no optimizer step row, the stepping batch has one
    assert per_batch[0] == ["batch_start", "after_forward", "after_backward", "batch_end"]
    assert per_batch[1] == ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]
    assert per_batch[2] == per_batch[0] and per_batch[3] == per_batch[1]
    # both micro-batches of a step carry the step at which they started
    assert list(phases.groupby("batch_idx").step.first()) == [0, 0, 1, 1]
    # gradients accumulate into the same storages: after the second backward they are still one copy
    grads = phases[phases.phase == "after_backward"].gradients_bytes
    assert (grads == _param_bytes(module)).all()
    # step 1's first micro-batch starts with step 0's gradients, which Lightning zeroes after its forward
    first_of_step1 = phases[(phases.batch_idx == 2)]
    assert first_of_step1.iloc[0].gradients_bytes == _param_bytes(module)


def test_manual_optimization(tmp_path):
    callback = MemTrace()
    module = MLP(manual=True)
    trainer(tmp_path, [callback], max_steps=3).fit(module)
    phases = load_phases(callback.output_dir)
    assert len(phases) == 3 * 5
    for _, rows in phases.groupby("step"):
        assert list(rows.phase) == ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]
    pbytes = _param_bytes(module)
    step_bytes = len(list(module.parameters())) * 4
    after_step = phases[phases.phase == "after_optimizer_step"]
    assert (after_step.optimizer_state_bytes == 2 * pbytes + step_bytes).all()
    assert (after_step.gradients_bytes == pbytes).all()
    # the user's zero_grad ran before backward: no gradients at after_forward (it fires before zero_grad? no:
    # on_before_backward fires after the user's zero_grad, so gradients are gone)
    assert (phases[phases.phase == "after_forward"].gradients_bytes == 0).all()


def test_two_optimizers(tmp_path):
    callback = MemTrace()
    module = TwoOptimizers()
    trainer(tmp_path, [callback], max_steps=4).fit(module)
    phases = load_phases(callback.output_dir)
    # Lightning counts each optimizer's step: 4 global steps = 2 batches with two updates each
    assert phases.batch_idx.nunique() == 2
    first = phases[phases.batch_idx == 0]
    assert list(first.phase) == [
        "batch_start", "after_forward", "after_backward", "after_optimizer_step",
        "after_backward", "after_optimizer_step", "batch_end",
    ]
    gen_bytes = unique_storage_bytes(module.gen.parameters())
    disc_bytes = unique_storage_bytes(module.disc.parameters())
    # Adam on the generator: 2 states + 2 step scalars; SGD with momentum on the discriminator: 1 buffer
    final = phases.iloc[-1]
    assert final.optimizer_state_bytes == 2 * gen_bytes + 2 * 4 + disc_bytes
    assert first.iloc[3].optimizer_state_bytes == disc_bytes  # after the discriminator's first step only


def test_metrics_reach_every_logger(tmp_path):
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    tb_logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = MemTrace()
    trainer(tmp_path, [callback], max_steps=2, logger=[tb_logger, csv_logger], log_every_n_steps=1).fit(MLP())
    # files go into the first logger's log_dir
    assert callback.output_dir == Path(tb_logger.log_dir) / "memtrace"
    phases = load_phases(callback.output_dir)
    with open(Path(csv_logger.log_dir) / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    key = "memtrace/after_optimizer_step/optimizer_state"
    logged = [float(r[key]) for r in rows if r.get(key)]
    expected = phases[phases.phase == "after_optimizer_step"].optimizer_state_bytes / 1024**2
    assert logged == pytest.approx(list(expected))
    assert {"memtrace/batch_start/allocated", "memtrace/after_forward/activations", "memtrace/after_backward/peak"} <= set(rows[0])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "memtrace/after_forward/allocated" in tags
    assert "memtrace/timeline" in events.Tags()["images"]  # the report's PNG, logged at the end of fit
    values = [e.value for e in events.Scalars("memtrace/after_backward/gradients")]
    assert values == pytest.approx([unique_storage_bytes(MLP().parameters()) / 1024**2] * 2)


def test_unwritable_directory_one_warning_and_training_finishes(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    callback = MemTrace(dirpath=blocker / "memtrace")
    fit_trainer = trainer(tmp_path, [callback], max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer.fit(MLP())
    ours = [w for w in caught if issubclass(w.category, MemTraceWarning) or "MemTrace" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "could not write" in str(ours[0].message)
    assert fit_trainer.global_step == 3
    assert len(callback.recorder.records) == 15 if callback.recorder else True


def test_training_exception_propagates_unchanged(tmp_path):
    callback = MemTrace()
    module = MLP(fail_at=1)
    with pytest.raises(ValueError, match="boom from training_step"):
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert not list(callback.output_dir.glob("oom_*"))  # not an OOM: no post-mortem
    phases = load_phases(callback.output_dir)
    assert list(phases.step.unique()) == [0, 1]
    # hooks are gone: a later forward/step outside the trainer is not measured
    assert callback.recorder is None or not callback.recorder.started
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_odd_optimizer_state_is_tolerated(tmp_path):
    class OddOptimizer(torch.optim.SGD):
        def step(self, closure=None):
            loss = super().step(closure)
            for p in self.param_groups[0]["params"]:
                self.state[p]["notes"] = ["a", {"nested": torch.zeros(3)}, None, 1.5]
            return loss

    class OddModule(MLP):
        def configure_optimizers(self):
            return OddOptimizer(self.parameters(), lr=0.01)

    callback = MemTrace()
    module = OddModule()
    trainer(tmp_path, [callback], max_steps=2).fit(module)
    phases = load_phases(callback.output_dir)
    n = len(list(module.parameters()))
    assert phases[phases.phase == "after_optimizer_step"].optimizer_state_bytes.tolist() == [n * 12, n * 12]


def test_resume_continues_steps_and_appends(tmp_path):
    callback = MemTrace(dirpath=tmp_path / "mt")
    first = trainer(tmp_path, [callback], max_steps=2, enable_checkpointing=False)
    first.fit(MLP())
    ckpt = tmp_path / "c.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("MemTrace"))
    assert state["rows"] == 10 and state["last_step"] == 1 and state["run"] == callback.run_id

    resumed = MemTrace(dirpath=tmp_path / "mt")
    trainer(tmp_path, [resumed], max_steps=4).fit(MLP(), ckpt_path=str(ckpt))
    phases = load_phases(tmp_path / "mt")
    assert list(phases.groupby("step").size()) == [5, 5, 5, 5]
    assert list(phases.step.unique()) == [0, 1, 2, 3]
    assert list(phases.run.unique()) == [callback.run_id]  # the resumed rows belong to the run they resume
    with open(tmp_path / "mt" / "phases_rank0.csv") as handle:
        assert sum(1 for line in handle if line.startswith("step,")) == 1
    # each fit records its own window: steps 1-2 of the first (cut at 1), 3 of the second
    names = sorted(p.name for p in (tmp_path / "mt").glob("snapshot_*.pickle"))
    assert names == ["snapshot_rank0_steps1-1.pickle", "snapshot_rank0_steps3-3.pickle"]


def test_two_runs_into_one_folder_are_told_apart(tmp_path):
    runs = []
    for _ in range(2):
        callback = MemTrace(dirpath=tmp_path / "mt", report=False)
        trainer(tmp_path, [callback], max_steps=2, enable_checkpointing=False, logger=False).fit(MLP())
        runs.append(callback.run_id)
    assert runs[0] != runs[1]
    phases = load_phases(tmp_path / "mt")
    # the second run's rows are appended with the same steps, and the run column tells them apart
    assert phases.groupby("run").size().to_dict() == {runs[0]: 10, runs[1]: 10}
    assert (phases[phases.run == runs[1]].step.tolist()) == [0] * 5 + [1] * 5
    with open(tmp_path / "mt" / "phases_rank0.csv") as handle:
        assert handle.readline().rstrip("\n").split(",")[-4:] == [
            "run", "unsharded_parameters_bytes", "unsharded_gradients_bytes", "dataloader_idx"
        ]


def test_plain_loop_recorders_get_their_own_run(tmp_path):
    model = torch.nn.Linear(4, 4)
    ids = []
    for _ in range(2):
        with MemoryRecorder(model, [], output_dir=tmp_path, history=False) as recorder:
            recorder.begin_batch(torch.randn(2, 4), step=0)
            recorder.end_batch()
            ids.append(recorder.run_id)
    assert ids[0] != ids[1]
    assert load_phases(tmp_path).groupby("run").size().to_dict() == {ids[0]: 2, ids[1]: 2}


@pytest.mark.parametrize("track_allocations", [True, False])
def test_validation_rows_name_the_model_states_once_and_each_batch_inputs(tmp_path, track_allocations):
    """Validation rows: the parameters and AdamW's state as in training, no gradients (Lightning set them to None), no
    activations, and the inputs of each batch (the third holds the last 8 of the 32 validation rows)."""
    module = MLP(batch_size=12)
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False, track_allocations=track_allocations)
    trainer(tmp_path, [callback], max_steps=2, limit_val_batches=3, val_check_interval=2).fit(module)
    phases = load_phases(tmp_path / "mt")
    val = phases[phases.phase.str.startswith("val")]
    assert list(val.phase) == ["val_batch_start", "val_batch_end"] * 3
    params = _param_bytes(module)
    adamw = 2 * params + 4 * len(list(module.parameters()))  # exp_avg, exp_avg_sq, a float32 step per parameter
    assert (val.parameters_bytes == params).all() and (val.optimizer_state_bytes == adamw).all()
    assert (val.gradients_bytes == 0).all() and (val.activations_bytes == 0).all()
    rows = [12, 12, 12, 12, 8, 8]  # x (32 float32 each) and y (1 float32 each)
    assert list(val.inputs_bytes) == [n * 33 * 4 for n in rows]
    if not track_allocations:  # allocated is the sum of the categories
        assert list(val.allocated_bytes) == [params + adamw + n * 33 * 4 for n in rows]


class TwoValidationLoaders(MLP):
    """Two validation dataloaders of 32 and 20 samples (batches of 12): 3 and 2 batches, inputs of 33 floats a row."""

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        sizes = (32, 20)
        return [
            torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(n, 32, generator=g), torch.randn(n, 1, generator=g)),
                batch_size=self.batch_size,
            )
            for n in sizes
        ]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))


def test_validation_rows_say_which_dataloader(tmp_path):
    """With two validation dataloaders ``batch_idx`` starts again at 0 in the second; ``dataloader_idx`` tells them
    apart (and is 0 on training rows)."""
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False)
    trainer(tmp_path, [callback], max_steps=2, limit_val_batches=5, val_check_interval=2).fit(
        TwoValidationLoaders(batch_size=12)
    )
    phases = load_phases(tmp_path / "mt")
    val = phases[phases.phase == "val_batch_start"]
    assert list(zip(val.dataloader_idx, val.batch_idx)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert list(val.inputs_bytes) == [n * 33 * 4 for n in (12, 12, 8, 12, 8)]
    assert (phases[~phases.phase.str.startswith("val")].dataloader_idx == 0).all()
    assert phases.dataloader_idx.dtype == "int64"


def test_phases_csv_from_before_dataloader_idx_reads_as_zero(tmp_path):
    """A CSV written before the column existed reads with ``dataloader_idx`` 0."""
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False)
    trainer(tmp_path, [callback], max_steps=1).fit(MLP())
    path = tmp_path / "mt" / "phases_rank0.csv"
    lines = path.read_text().splitlines()
    path.write_text("".join(line.rsplit(",", 1)[0] + "\n" for line in lines))
    phases = load_phases(path)
    assert len(phases) == 5 and (phases.dataloader_idx == 0).all()


def test_a_step_the_grad_scaler_skips_has_no_after_optimizer_step_row(tmp_path):
    """A GradScaler that finds inf gradients skips ``optimizer.step``, and the step post-hook does not fire: that batch
    has no ``after_optimizer_step`` row, and its ``batch_end`` row's peak covers the unscaling."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history=False) as recorder:
        for step in range(3):
            x = torch.randn(8, 64)
            recorder.begin_batch(x, step=step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean() * (float("inf") if step == 1 else 1.0)
            recorder.mark_forward_done()
            scaler.scale(loss).backward()
            recorder.mark_backward_done()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            recorder.end_batch(next_step=step + 1)
    assert scaler.get_scale() == 65536.0 / 2  # one step skipped
    phases = load_phases(tmp_path)
    assert phases.groupby("step").phase.apply(list).to_dict() == {
        0: ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"],
        1: ["batch_start", "after_forward", "after_backward", "batch_end"],
        2: ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"],
    }
    params = _param_bytes(model)
    assert (phases[phases.step > 0].optimizer_state_bytes == 2 * params + 2 * 4).all()  # state made at step 0 only
    skipped_end = phases[(phases.step == 1) & (phases.phase == "batch_end")].iloc[0]
    assert skipped_end.peak_bytes >= phases[(phases.step == 1) & (phases.phase == "after_backward")].allocated_bytes.iloc[0]


class _WithBufferAndCache(MLP):
    """A 4 MiB buffer and a 1 MiB tensor kept as a plain attribute, both made before MemTrace starts."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(1024, 1024))
        self.cache = {"mask": torch.ones(1024, 256)}


@pytest.mark.parametrize("allocation_backend", ["auto", "dispatch"])
def test_buffers_and_attribute_tensors_count_as_allocated_from_the_start(tmp_path, allocation_backend):
    """A CUDA allocator's counters include the module's buffers and other tensors; the CPU tracker counts them too
    (as ``other``), though they were made before it started."""
    module = _WithBufferAndCache()
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False, allocation_backend=allocation_backend)
    trainer(tmp_path, [callback], max_steps=2).fit(module)
    phases = load_phases(tmp_path / "mt")
    held = 4 * 1024**2 + 1024**2
    start = phases[phases.phase == "batch_start"].iloc[0]
    params = _param_bytes(module)
    assert start.parameters_bytes == params and start.other_bytes == held
    assert start.allocated_bytes == params + held + start.inputs_bytes
    assert (phases.other_bytes >= held).all()


def test_the_estimate_counts_buffers_and_attribute_tensors_as_the_run_does(tmp_path):
    from lightning_memtrace.estimator import compare_estimate, estimate_for_module

    module = _WithBufferAndCache()
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False)
    trainer(tmp_path, [callback], max_steps=3).fit(module)
    estimated = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3)
    comparison = compare_estimate(estimated, load_phases(tmp_path / "mt")).set_index("category")
    assert comparison.loc["other", "estimated_bytes"] >= 5 * 1024**2
    assert abs(comparison.loc["other", "error_bytes"]) <= 64
    assert abs(comparison.loc["peak", "error_percent"]) < 0.1


@pytest.mark.parametrize("allocation_backend", ["auto", "dispatch"])
def test_sparse_gradients_are_measured_as_gradients(tmp_path, allocation_backend):
    """A sparse gradient has no storage of its own (``untyped_storage()`` raises): its indices and values are its
    memory. Training used to stop in MemTrace's dispatch mode at the first backward; the gradient is counted now."""
    module = SparseEmbedding()
    callback = MemTrace(dirpath=tmp_path / "mt", report=False, allocation_backend=allocation_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert not [w for w in caught if issubclass(w.category, MemTraceWarning)]
    phases = load_phases(tmp_path / "mt")
    assert list(phases.step.unique()) == [0, 1, 2]
    looked_up = module.batch * module.tokens
    # the uncoalesced gradient: one int64 index and one row of values per token looked up
    sparse_grad = looked_up * 8 + looked_up * module.width * 4
    head_grad = _param_bytes(module.head)
    after_backward = phases[phases.phase == "after_backward"]
    assert (after_backward.gradients_bytes == sparse_grad + head_grad).all()
    after_step = phases[phases.phase == "after_optimizer_step"]
    assert after_step.optimizer_state_bytes.iloc[0] == sparse_grad + head_grad  # the momentum buffers, cloned
    assert (phases.parameters_bytes == _param_bytes(module)).all()
    assert list(Path(tmp_path / "mt").glob("snapshot_rank0_steps*.pickle"))


def test_the_estimate_says_it_counts_sparse_gradients_as_empty():
    from lightning_memtrace import estimate

    module = SparseEmbedding()
    dense = estimate(module.head, torch.zeros(8, module.width), device="cpu")
    assert not dense.sparse_gradients and "sparse" not in dense.describe()
    sparse = estimate(module, next(iter(module.train_dataloader())), device="cpu")
    assert sparse.sparse_gradients and sparse.as_dict()["sparse_gradients"] is True
    assert "sparse gradients (Embedding(sparse=True)) counted as empty" in sparse.describe()


def test_a_failure_counting_an_operators_output_leaves_training_as_it_was(tmp_path, monkeypatch):
    """The dispatch mode counts inside the user's operators: where the counting fails (an output of a kind it cannot
    read), the operator's result still goes back, counting stops, and the next row switches MemTrace off with one
    warning. Training ends with the same weights as without MemTrace."""
    from lightning_memtrace.capture.dispatch_backend import DispatchBackend

    def final_weights(callbacks, folder):
        torch.manual_seed(0)
        module = MLP()
        trainer(folder, callbacks, max_steps=3).fit(module)
        return [p.detach().clone() for p in module.parameters()]

    plain = final_weights([], tmp_path / "plain")
    counted = 0
    track_output = DispatchBackend._track_output

    def fails_at_the_fortieth(self, tensor):
        nonlocal counted
        counted += 1
        if counted == 40:
            raise NotImplementedError("Cannot access storage of SomeTensorImpl")
        track_output(self, tensor)

    monkeypatch.setattr(DispatchBackend, "_track_output", fails_at_the_fortieth)
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False, allocation_backend="dispatch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured = final_weights([callback], tmp_path / "measured")
    assert counted == 40  # nothing was counted after the failure
    assert all(torch.equal(a, b) for a, b in zip(plain, measured))
    switched_off = [str(w.message) for w in caught if "MemTrace switched itself off" in str(w.message)]
    assert len(switched_off) == 1
    assert "counting the allocations of an operator failed" in switched_off[0]
    assert "Cannot access storage of SomeTensorImpl" in switched_off[0]


@pytest.mark.parametrize(
    ("trainer_kwargs", "snapshot"),
    [
        ({"fast_dev_run": True}, "snapshot_rank0_steps0-0.pickle"),
        ({"max_steps": 1}, "snapshot_rank0_steps0-0.pickle"),
        ({"max_epochs": 1, "limit_train_batches": 2}, "snapshot_rank0_steps1-1.pickle"),
        ({"max_steps": 4}, "snapshot_rank0_steps1-2.pickle"),
        # validation after the last step takes rows at the next step's number: the window still ends at step 1
        ({"max_steps": 2, "limit_val_batches": 2, "val_check_interval": 2}, "snapshot_rank0_steps1-1.pickle"),
    ],
)
def test_a_fit_shorter_than_the_history_window_still_writes_a_snapshot(tmp_path, trainer_kwargs, snapshot):
    """The window skips the first step; a fit of one step (``fast_dev_run``, a smoke test) used to end without any
    snapshot. The Trainer says how many steps the fit will take: the window takes its last steps then."""
    callback = MemTrace(dirpath=tmp_path / "mt", report=False)
    kwargs = {"max_steps": -1, **trainer_kwargs}
    trainer(tmp_path, [callback], **kwargs).fit(MLP())
    assert sorted(p.name for p in (tmp_path / "mt").glob("snapshot_*.pickle")) == [snapshot]


@pytest.mark.parametrize("allocation_backend", ["auto", "dispatch"])
def test_tensors_other_callbacks_made_before_the_fit_are_counted(tmp_path, allocation_backend):
    """Lightning's ``WeightAveraging`` makes its averaged copy of the model in ``setup``, before MemTrace starts: a CUDA
    allocator counts it, so the CPU tracker counts it too, as ``other``, from the first row."""
    from itertools import chain

    from lightning.pytorch.callbacks import WeightAveraging

    averaging = WeightAveraging()
    callback = MemTrace(report=False, allocation_backend=allocation_backend)
    module = MLP(width=512)
    trainer(tmp_path, [averaging, callback], max_steps=3).fit(module)
    average = averaging._average_model
    held = unique_storage_bytes(chain(average.parameters(), average.buffers()))
    assert held == 4 * (32 * 512 + 512 + 512 * 512 + 512 + 512 + 1) + 8  # the MLP's copy, and n_averaged (int64)
    phases = load_phases(callback.output_dir)
    assert (phases.other_bytes >= held).all()
    assert int(phases.other_bytes.iloc[0]) - held < 64  # the first row: the copy and nothing else of note
    assert (phases.parameters_bytes == 4 * (32 * 512 + 512 + 512 * 512 + 512 + 512 + 1)).all()  # the model's own only


@pytest.mark.parametrize("max_steps", [1, 2])
def test_the_window_closes_after_the_last_step_not_after_the_validation_that_follows(tmp_path, max_steps):
    """A window planned past the run's last step (two steps, a fit of one or two) was left open to the end of the fit:
    the validation after the last step ran with every allocation's stack recorded (3.5x the validation time of a
    1,000-batch validation) and ended up in the snapshot."""
    import pickle

    from lightning.pytorch import Callback

    class WindowDuringValidation(Callback):
        def __init__(self, memtrace: MemTrace) -> None:
            self.memtrace, self.open = memtrace, []

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self.open.append(self.memtrace.recorder.window.is_open)

    callback = MemTrace(dirpath=tmp_path / "mt", report=False)
    during = WindowDuringValidation(callback)
    trainer(tmp_path, [callback, during], max_steps=max_steps, limit_val_batches=3, val_check_interval=max_steps).fit(
        MLP()
    )
    assert len(during.open) == 2 and not any(during.open)  # MLP's validation set: two batches
    last = max_steps - 1
    path = tmp_path / "mt" / f"snapshot_rank0_steps{last}-{last}.pickle"
    with open(path, "rb") as handle:
        header = pickle.load(handle)["memtrace"]
    phases = [(mark["step"], mark["phase"]) for mark in header["phases"]]
    assert phases[0] == (last, "batch_start") and ("val_batch_start" not in {phase for _, phase in phases})


class _KeepsOutputsAfterBackward(MLP):
    """Batch norm (which saves its running statistics, buffers, for the backward), a hidden state kept on the module
    after the backward (saved by the last layer), and a graph no backward goes through (``exp`` saves its output)."""

    def __init__(self) -> None:
        super().__init__(width=64)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.hidden = self.net(x)
        self.pending = self.hidden.exp()
        return torch.nn.functional.mse_loss(self.head(self.hidden), y)


@pytest.mark.parametrize("allocation_backend", ["reports", "dispatch"])
def test_storages_stop_counting_as_activations_once_autograd_lets_go_of_them(tmp_path, allocation_backend):
    callback = MemTrace(allocation_backend=allocation_backend, history=False)
    module = _KeepsOutputsAfterBackward()
    trainer(tmp_path, [callback], max_steps=2).fit(module)
    rows = load_phases(callback.output_dir).set_index(["step", "phase"])
    hidden_bytes = 16 * 64 * 4
    # after the forward: the saved hidden states, the running statistics and the pending graph's output among them
    assert rows.loc[(1, "after_forward"), "activations_bytes"] >= 2 * hidden_bytes + 2 * 64 * 4
    for phase in ("after_backward", "after_optimizer_step", "batch_end"):
        # the backward let go of all it used: only the pending graph's saved output is held for a backward still
        # (the hidden state and the running statistics live on, as other)
        assert rows.loc[(1, phase), "activations_bytes"] == hidden_bytes
        assert rows.loc[(1, phase), "other_bytes"] >= hidden_bytes + 2 * 64 * 4
