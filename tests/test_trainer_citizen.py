"""MemTrace is a good citizen of the Trainer: it logs on Lightning's cadence and path, lets a logger's error through,
lets go of everything at the end of fit, and leaves validate/test alone."""

from __future__ import annotations

import copy
import csv
import gc
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.profilers import SimpleProfiler
from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture.torch_private import can_tell_saved_tensors_hooks
from lightning_memtrace.trainer.folder import TEMP_RUNS_KEPT
from lightning_memtrace.types import COUNTERS
from lm_helpers import MLP, UnbackpropagatedGraphMLP, trainer

MIB = 1024**2
TRAIN_PHASES = ("batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end")
TRAIN_KEYS = {f"memtrace/{phase}/{counter}" for phase in TRAIN_PHASES for counter in COUNTERS}
VAL_KEYS = {f"memtrace/{phase}/{counter}" for phase in ("val_batch_start", "val_batch_end") for counter in COUNTERS}


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call as it came: positional arguments and keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict]] = []
        self.saves = 0

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, *args, **kwargs) -> None:
        self.calls.append((args, {k: (dict(v) if isinstance(v, dict) else v) for k, v in kwargs.items()}))

    def save(self) -> None:
        self.saves += 1

    def memtrace_calls(self, prefix: str = "memtrace/") -> list[dict]:
        return [kw for _, kw in self.calls if any(k.startswith(prefix) for k in kw["metrics"])]

    def steps_with(self, key: str) -> list[int]:
        return [kw["step"] for _, kw in self.calls if key in kw["metrics"]]


class Boom(Exception):
    """The user's logger's own error."""


class FailingLogger(RecordingLogger):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def log_metrics(self, *args, **kwargs) -> None:
        metrics = kwargs.get("metrics", args[0] if args else {})
        if any(k.startswith(self.prefix) for k in metrics):
            raise Boom(f"the user's logger refuses {self.prefix}")
        super().log_metrics(*args, **kwargs)


class LoggedMLP(MLP):
    """The MLP, logging its loss at every step as a user would; a test loop too."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def test_dataloader(self):
        return self.val_dataloader()


def _memtrace_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*")) if p.is_file()} if folder.is_dir() else {}


# ------------------------------------------------------------------------------------------------ training cadence
@pytest.mark.parametrize(
    ("every", "accumulate", "manual"),
    [(1, 2, False), (3, 2, False), (5, 2, False), (2, 1, True)],
)
def test_logged_at_the_steps_lightning_logs_its_own(tmp_path, every, accumulate, manual):
    logger = RecordingLogger()
    callback = MemTrace(dirpath=tmp_path / "mt")
    max_steps = 10
    trainer(
        tmp_path, [callback], max_steps=max_steps, logger=logger, log_every_n_steps=every,
        accumulate_grad_batches=accumulate,
    ).fit(LoggedMLP(manual=manual))

    # metrics always by keyword, as Lightning passes them
    assert logger.calls and all(args == () and set(kw) == {"metrics", "step"} for args, kw in logger.calls)
    lightning_steps = logger.steps_with("loss")
    assert lightning_steps == [s for s in range(max_steps) if (s + 1) % every == 0]
    ours = logger.memtrace_calls()
    # one call per step Lightning logs at, none elsewhere, each with every training key and nothing else
    assert [kw["step"] for kw in ours] == lightning_steps
    assert all(set(kw["metrics"]) == TRAIN_KEYS for kw in ours)
    # each logged value is the maximum over the rows of that optimizer step (its micro-batches)
    phases = load_phases(tmp_path / "mt")
    assert len(phases) == max_steps * (5 * accumulate - (accumulate - 1))  # the CSV keeps every row
    for kw in ours:
        rows = phases[phases.step == kw["step"]]
        assert rows.batch_idx.nunique() == accumulate
        for phase in TRAIN_PHASES:
            of_phase = rows[rows.phase == phase]
            for counter in COUNTERS:
                expected = of_phase[f"{counter}_bytes"].max() / MIB
                assert kw["metrics"][f"memtrace/{phase}/{counter}"] == pytest.approx(expected), (phase, counter)
    assert logger.saves >= len(ours)  # saved after each call, as Lightning's path does


def test_tensorboard_and_csv_loggers_get_memtrace_at_lightnings_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    tb_logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = MemTrace(report=False)
    trainer(
        tmp_path, [callback], max_steps=9, logger=[tb_logger, csv_logger], log_every_n_steps=3, accumulate_grad_batches=2
    ).fit(LoggedMLP())

    with open(Path(csv_logger.log_dir) / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    key = "memtrace/after_forward/activations"
    assert [int(r["step"]) for r in rows if r.get(key)] == [int(r["step"]) for r in rows if r.get("loss")] == [2, 5, 8]

    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars(key)] == [e.step for e in events.Scalars("loss")] == [2, 5, 8]


def test_log_metrics_false_logs_nothing(tmp_path):
    logger = RecordingLogger()
    trainer(tmp_path, [MemTrace(log_metrics=False, report=False)], max_steps=3, logger=logger,
            log_every_n_steps=1).fit(LoggedMLP())
    assert logger.steps_with("loss") == [0, 1, 2]
    assert logger.memtrace_calls() == []


def test_trainer_logged_metrics_are_as_without_memtrace(tmp_path):
    """The loggers get MemTrace's metrics; ``trainer.logged_metrics`` holds what it holds without MemTrace."""
    logged = {}
    for name, callbacks in (("plain", []), ("memtrace", [MemTrace(dirpath=tmp_path / "mt", report=False)])):
        logger = RecordingLogger()
        fitted = trainer(tmp_path / name, callbacks, max_steps=4, logger=logger, log_every_n_steps=1)
        fitted.fit(LoggedMLP())
        logged[name] = (set(fitted.logged_metrics), len(logger.memtrace_calls()), logger.steps_with("loss"))
    assert logged["plain"][0] == logged["memtrace"][0] == {"loss"}
    assert logged["plain"][1] == 0 and logged["memtrace"][1] == 4
    assert logged["plain"][2] == logged["memtrace"][2] == [0, 1, 2, 3]


class WarningMLP(LoggedMLP):
    def training_step(self, batch, batch_idx):
        warnings.warn("the user's own warning, shown once by Python's default filter")
        return super().training_step(batch, batch_idx)


def test_a_warning_python_shows_once_is_shown_once(tmp_path):
    """MemTrace reads the allocator's reports several times a step without touching the warning filters (a change to
    them makes Python forget which warnings it showed once, and the user's would show at every step)."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        trainer(tmp_path, [MemTrace(dirpath=tmp_path / "mt", report=False)], max_steps=6).fit(WarningMLP())
    ours = [w for w in shown if "the user's own warning" in str(w.message)]
    assert len(ours) == 1
    assert len(load_phases(tmp_path / "mt")) == 6 * 5  # MemTrace recorded every step meanwhile


class StartWarningMLP(LoggedMLP):
    def on_train_start(self):
        warnings.warn("the user's warning at every fit's start, shown once by Python's default filter")


def test_the_report_at_fit_end_keeps_warnings_shown_once_shown_once(tmp_path):
    """The report (pandas, matplotlib: they change the warning filters inside their calls) makes Python forget no
    warning it showed once: the next fit's shows not again."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for fit in range(2):
            callback = MemTrace(dirpath=tmp_path / f"mt{fit}")
            trainer(tmp_path / str(fit), [callback], max_steps=2).fit(StartWarningMLP())
            assert callback.report_path is not None and callback.report_path.is_file()
    assert len([w for w in shown if "at every fit's start" in str(w.message)]) == 1


# ------------------------------------------------------------------------------------------------ validation
class CountValidationRuns(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.fit_loop.epoch_loop._batches_that_stepped)


def test_validation_logged_once_per_run(tmp_path):
    logger = RecordingLogger()
    callback = MemTrace(dirpath=tmp_path / "mt", report=False)
    runs = CountValidationRuns()
    trainer(
        tmp_path, [callback, runs], max_steps=8, logger=logger, log_every_n_steps=1, limit_val_batches=2,
        val_check_interval=3, num_sanity_val_steps=2,
    ).fit(LoggedMLP())
    assert len(runs.steps) == 2  # after batches 3 and 6; the sanity check is not a run

    val_calls = logger.memtrace_calls("memtrace/val_")
    assert len(val_calls) == len(runs.steps)
    assert all(set(kw["metrics"]) == VAL_KEYS for kw in val_calls)
    # at the step Lightning logs the run's own metrics at
    assert [kw["step"] for kw in val_calls] == logger.steps_with("val_loss") == runs.steps
    # training calls carry no validation keys; one per training step still
    train_calls = [kw for kw in logger.memtrace_calls() if kw not in val_calls]
    assert [kw["step"] for kw in train_calls] == list(range(8))
    assert not any(VAL_KEYS & set(kw["metrics"]) for kw in train_calls)
    # the maximum over the run's rows (2 batches each)
    phases = load_phases(tmp_path / "mt")
    val_rows = phases[phases.phase.str.startswith("val_")]
    assert len(val_rows) == 2 * 2 * 2
    for kw, (_, run) in zip(val_calls, val_rows.groupby("step", sort=True)):
        assert run.batch_idx.nunique() == 2
        for phase in ("val_batch_start", "val_batch_end"):
            for counter in COUNTERS:
                expected = run[run.phase == phase][f"{counter}_bytes"].max() / MIB
                assert kw["metrics"][f"memtrace/{phase}/{counter}"] == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("prefix", ["memtrace/batch_end/", "memtrace/val_batch_end/", "memtrace/estimate/"])
def test_an_exception_from_the_users_logger_reaches_the_user(tmp_path, prefix):
    logger = FailingLogger(prefix)
    callback = MemTrace(estimate=prefix == "memtrace/estimate/", report=False)
    run = trainer(tmp_path, [callback], max_steps=4, logger=logger, log_every_n_steps=1, limit_val_batches=1,
                  val_check_interval=2)
    with pytest.raises(Boom, match="the user's logger refuses"):
        run.fit(LoggedMLP())
    assert not callback._disabled  # not taken for a failure of MemTrace's own
    assert callback.recorder is None  # and it let go on the way out
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


# ------------------------------------------------------------------------------------------------ end of stage
def _pickle_error(obj) -> str | None:
    try:
        pickle.dumps(obj)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _checkpointing_trainer(tmp_path, callbacks) -> pl.Trainer:
    return trainer(
        tmp_path, callbacks, max_steps=3, logger=CSVLogger(str(tmp_path), name="csv"), log_every_n_steps=1,
        enable_checkpointing=True, limit_val_batches=1, val_check_interval=3,
    )


def test_trainer_pickles_after_fit_as_without_memtrace(tmp_path):
    bare = _checkpointing_trainer(tmp_path / "bare", [ModelCheckpoint(dirpath=tmp_path / "bare" / "ckpt")])
    bare.fit(LoggedMLP())
    baseline = _pickle_error(bare)

    callback = MemTrace(estimate=True)
    traced = _checkpointing_trainer(tmp_path / "mt", [callback, ModelCheckpoint(dirpath=tmp_path / "mt" / "ckpt")])
    traced.fit(LoggedMLP())
    assert _pickle_error(traced) == baseline
    assert baseline is None  # Lightning 2.6's own Trainer pickles: so must ours
    # MemTrace kept plain data only, and the copy still knows what was written
    assert callback.recorder is None
    copy = pickle.loads(pickle.dumps(callback))
    assert copy.state_dict() == callback.state_dict() == {"version": 1, "rows": 3 * 5 + 2, "last_step": 3, "run": callback.run_id}
    assert copy.files == callback.files and copy.report_path == callback.report_path is not None
    # the checkpoint was saved, with MemTrace's state in it, which loads back
    (ckpt,) = (tmp_path / "mt" / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("MemTrace"))
    assert state["rows"] == 3 * 5 + 2
    fresh = MemTrace()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


class CopiesMidFit(pl.Callback):
    """At the second training batch's end, what pickling the Trainer and deep-copying its callbacks raise (None: ok)."""

    def __init__(self) -> None:
        self.errors: dict[str, str | None] = {}
        self.copies: list[pl.Callback] = []

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2 and not self.errors:
            self.errors["pickle"] = _pickle_error(trainer)
            try:
                self.copies = copy.deepcopy(trainer.callbacks)
                self.errors["deepcopy"] = None
            except Exception as error:
                self.errors["deepcopy"] = f"{type(error).__name__}: {error}"


def test_trainer_pickles_and_callbacks_deep_copy_mid_fit_as_without_memtrace(tmp_path):
    bare = CopiesMidFit()
    trainer(tmp_path / "bare", [bare], max_steps=4).fit(MLP())
    assert bare.errors == {"pickle": None, "deepcopy": None}  # Lightning 2.6's own Trainer and callbacks do
    mid_fit = CopiesMidFit()
    callback = MemTrace(dirpath=tmp_path / "mt")
    trainer(tmp_path / "mt", [mid_fit, callback], max_steps=4).fit(MLP())
    assert mid_fit.errors == bare.errors
    # the copy is MemTrace as after a fit (the live recorder stays with the original), which measured on
    (copied,) = [c for c in mid_fit.copies if isinstance(c, MemTrace)]
    assert copied.recorder is None and copied.run_id == callback.run_id
    assert len(load_phases(tmp_path / "mt")) == 4 * 5


@pytest.mark.parametrize(
    "state", [{"rows": "many"}, {"rows": 3, "last_step": [2]}, {"run": 7}, ["not", "a", "dict"]]
)
def test_a_checkpoint_state_memtrace_cannot_read_is_one_warning(state):
    callback = MemTrace()
    run_id = callback.run_id
    with pytest.warns(UserWarning, match="MemTrace could not read its state in the checkpoint"):
        callback.load_state_dict(state)
    assert callback.state_dict() == {"version": 1, "rows": 0, "last_step": None, "run": run_id}


def test_trainer_pickles_after_a_failed_fit(tmp_path):
    callback = MemTrace()
    run = trainer(tmp_path, [callback], max_steps=3)
    with pytest.raises(ValueError, match="boom"):
        run.fit(MLP(fail_at=1))
    assert callback.recorder is None
    assert _pickle_error(run) is None


def test_validate_and_test_after_fit_do_nothing(tmp_path):
    logger = RecordingLogger()
    callback = MemTrace(dirpath=tmp_path / "mt")
    run = trainer(tmp_path, [callback], max_steps=3, logger=logger, log_every_n_steps=1, limit_val_batches=2)
    module = LoggedMLP()
    run.fit(module)
    files = _memtrace_files(tmp_path / "mt")
    assert "phases_rank0.csv" in files
    calls, state = len(logger.memtrace_calls()), callback.state_dict()

    run.validate(module)
    run.test(module)
    assert logger.steps_with("val_loss") and logger.steps_with("test_loss")  # Lightning logged its own
    assert len(logger.memtrace_calls()) == calls  # MemTrace nothing
    assert _memtrace_files(tmp_path / "mt") == files  # the CSV and every file unchanged
    assert callback.state_dict() == state and callback.recorder is None
    assert _pickle_error(run) is None


def test_validate_and_test_alone_do_nothing(tmp_path):
    logger = RecordingLogger()
    callback = MemTrace(dirpath=tmp_path / "mt")
    run = trainer(tmp_path, [callback], logger=logger, limit_val_batches=2, limit_test_batches=2)
    module = LoggedMLP()
    run.validate(module)
    run.test(module)
    assert logger.steps_with("val_loss") and logger.steps_with("test_loss")
    assert logger.memtrace_calls() == []
    assert not (tmp_path / "mt").exists()
    assert callback.recorder is None and callback.state_dict()["rows"] == 0


class KeepRecorders(pl.Callback):
    """Placed after MemTrace: sees the recorder each fit starts."""

    def __init__(self, memtrace: MemTrace) -> None:
        self.memtrace, self.recorders = memtrace, []

    def on_train_start(self, trainer, pl_module):
        self.recorders.append(self.memtrace.recorder)


def test_a_second_fit_starts_clean(tmp_path):
    logger = RecordingLogger()
    callback = MemTrace(dirpath=tmp_path / "mt", report=False)
    spy = KeepRecorders(callback)
    run = trainer(tmp_path, [callback, spy], max_steps=2, logger=logger, log_every_n_steps=1)
    module = LoggedMLP()
    run.fit(module)
    run.validate(module)  # in between: nothing
    run.fit_loop.epoch_loop.max_steps = 4
    run.fit(module)
    assert run.global_step == 4

    first, second = spy.recorders
    assert first is not None and second is not None and first is not second
    assert not first.started and not second.started and callback.recorder is None
    phases = load_phases(tmp_path / "mt")
    assert list(phases.groupby("step").size()) == [5, 5, 5, 5]
    with open(tmp_path / "mt" / "phases_rank0.csv") as handle:
        assert sum(1 for line in handle if line.startswith("step,")) == 1
    assert [kw["step"] for kw in logger.memtrace_calls()] == logger.steps_with("loss") == [0, 1, 2, 3]
    assert callback.state_dict() == {"version": 1, "rows": 20, "last_step": 3, "run": callback.run_id}
    spy.recorders.clear()  # the spy's own references: MemTrace keeps none
    assert _pickle_error(run) is None


def test_before_torch_2_8_the_users_saved_tensor_hooks_around_the_fit_are_left_alone(tmp_path, monkeypatch):
    """A torch that cannot tell which hooks are in force: MemTrace cannot hand tensors on to the user's hooks, so it
    pushes none of its own over them (their packs are those of the run without MemTrace) and says once that
    activations are not measured; without hooks of the user's it measures them as ever."""
    from lightning_memtrace.capture import torch_private

    monkeypatch.setattr(torch_private, "_top_saved_tensors_hooks", lambda: None)
    packs = {}
    for with_memtrace in (False, True):
        packed = []

        def pack(tensor):
            packed.append(tuple(tensor.shape))
            return tensor

        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer(tmp_path / str(with_memtrace), callbacks, max_steps=3).fit(MLP())
        packs[with_memtrace] = packed
        mine = [str(w.message) for w in seen if "MemTrace" in str(w.message)]
        if with_memtrace:
            assert len(mine) == 1 and "activations are not measured" in mine[0] and "before 2.8" in mine[0]
            phases = load_phases(callbacks[0].output_dir)
            assert (phases.activations_bytes == 0).all()
    assert packs[True] == packs[False] and len(packs[True]) > 0
    callback = MemTrace(history=False, report=False)
    trainer(tmp_path / "alone", [callback], max_steps=2).fit(MLP())
    phases = load_phases(callback.output_dir)
    assert (phases[phases.phase == "after_forward"].activations_bytes > 0).all()


@pytest.mark.skipif(not can_tell_saved_tensors_hooks(), reason="torch before 2.8 cannot tell which hooks are in force")
def test_the_users_saved_tensor_hooks_around_the_fit_still_apply(tmp_path):
    """Saved-tensor hooks of the user's around the fit (``save_on_cpu`` offloading, say) go on packing every saved
    tensor: autograd applies only the innermost hooks, and MemTrace's, pushed inside, hand each tensor on to them."""
    seen = {}
    for with_memtrace in (False, True):
        packed, unpacked = [], []

        def pack(tensor):
            packed.append(tuple(tensor.shape))
            return ("theirs", tensor)

        def unpack(box):
            assert box[0] == "theirs"
            unpacked.append(1)
            return box[1]

        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        torch.manual_seed(0)
        module = MLP()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            trainer(tmp_path / str(with_memtrace), callbacks, max_steps=3).fit(module)
        seen[with_memtrace] = (packed, len(unpacked), [p.detach().clone() for p in module.parameters()])
        if with_memtrace:
            phases = load_phases(callbacks[0].output_dir)
            assert (phases[phases.phase == "after_forward"].activations_bytes > 0).all()  # still measured
    (plain_packed, plain_unpacked, plain_params), (packed, unpacked, params) = seen[False], seen[True]
    assert packed == plain_packed and len(packed) > 0
    assert unpacked == plain_unpacked == len(packed)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params))


@pytest.mark.parametrize("mode", ["side", "skip"])
def test_a_graph_that_no_backward_goes_through_is_freed_as_without_memtrace(tmp_path, mode):
    """Autograd keeps what MemTrace's pack hook returns. Returning the tensor itself made a saved output (ReLU's)
    hold its own node: a cycle that only a backward through the node breaks, outside Python's garbage collector, so
    every step leaked the memory of the graph that was not backpropagated (16 x 64 x 4 B here; on a GPU over a long
    run, an out-of-memory error MemTrace caused)."""
    module = UnbackpropagatedGraphMLP(mode)
    callback = MemTrace(history=False, report=False)
    trainer(tmp_path, [callback], max_steps=-1, limit_train_batches=8, max_epochs=1).fit(module)
    gc.collect()
    assert len(module.relu_outputs) == (16 if mode == "side" else 8)
    assert [i for i, ref in enumerate(module.relu_outputs) if ref() is not None] == []
    phases = load_phases(callback.output_dir)
    starts = phases[phases.phase == "batch_start"]
    assert len(starts) == 8
    # from the second batch on (the optimizer state exists) every batch starts with the same bytes alive, beside the
    # gradients (none after a skipped step: Lightning set them to None before the backward it then skipped)
    without_gradients = (starts.allocated_bytes - starts.gradients_bytes).iloc[1:]
    assert without_gradients.nunique() == 1, without_gradients.tolist()
    assert starts.other_bytes.iloc[1:].nunique() == 1, starts.other_bytes.tolist()


class BatchNormMLP(MLP):
    def __init__(self) -> None:
        super().__init__(width=64)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))


def test_stochastic_weight_averagings_batch_norm_epoch_keeps_memory_flat(tmp_path):
    """Lightning's ``StochasticWeightAveraging`` ends with an epoch of forwards only (its batch-norm update, no
    backward): with MemTrace every one of its batches kept the last one's graph alive (10.5 KiB a batch here)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callback = MemTrace(history=False, report=False)
    averaging = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)
    trainer(tmp_path, [averaging, callback], max_steps=-1, max_epochs=2, limit_train_batches=6).fit(BatchNormMLP())
    phases = load_phases(callback.output_dir)
    update_epoch = phases[(phases.epoch == 2) & (phases.phase == "batch_start")]
    assert len(update_epoch) == 6  # SWA's extra epoch ran, and MemTrace took its rows
    assert update_epoch.allocated_bytes.nunique() == 1, update_epoch.allocated_bytes.tolist()


class InPlaceOnSavedMLP(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        scaled = self.net[0](x).exp()  # exp saves its output for backward
        scaled.add_(1)  # ... which this modifies in place: autograd refuses the backward
        return nn.functional.mse_loss(self.net[1:](scaled), y)


def test_a_saved_tensor_modified_in_place_still_fails_the_backward(tmp_path):
    """Under saved-tensor hooks autograd no longer checks saved tensors' versions: a saved tensor modified in place
    silently gave wrong gradients with MemTrace, where without it the backward fails. MemTrace's unpack hook checks the
    version as autograd would, and the error reaches the user as autograd's does (the same type and message, bar the
    name of the node)."""
    errors = {}
    for with_memtrace in (False, True):
        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        with pytest.raises(RuntimeError) as raised:
            trainer(tmp_path / str(with_memtrace), callbacks, max_steps=2).fit(InPlaceOnSavedMLP())
        errors[with_memtrace] = str(raised.value)
    prefix = (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "[torch.FloatTensor [16, 128]], "
    )
    assert errors[False].startswith(prefix) and errors[True].startswith(prefix)
    assert errors[True].endswith(errors[False][errors[False].index("is at version 1; expected version 0 instead."):])


class PhysicsInformedMLP(MLP):
    """A training step that differentiates the network with ``torch.func`` (a physics-informed loss): torch.func's
    gradient transforms refuse to run where any saved-tensor hooks are pushed."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        per_sample_slope = torch.func.vmap(torch.func.grad(lambda row: self.net(row).sum()))(x)
        _, pullback = torch.func.vjp(lambda inputs: self.net(inputs), x)
        (input_grad,) = pullback(torch.ones_like(out))
        jacobian = torch.func.jacrev(lambda row: self.net(row))(x[0])
        penalty = per_sample_slope.pow(2).mean() + input_grad.abs().mean() + jacobian.mean()
        return nn.functional.mse_loss(out, y) + penalty


@pytest.fixture(params=["this torch", "torch before 2.8"])
def hooks_reader(request, monkeypatch):
    """This torch, and one that cannot tell which saved-tensor hooks are in force (none before torch 2.8): MemTrace
    then goes by its own pushes and asks only whether any hooks are pushed."""
    from lightning_memtrace.capture import torch_private

    if request.param != "this torch":
        monkeypatch.setattr(torch_private, "_top_saved_tensors_hooks", lambda: None)
        assert not torch_private.can_tell_saved_tensors_hooks()
    return request.param


def test_torch_func_gradient_transforms_run_in_the_training_step(tmp_path, hooks_reader):
    """``torch.func.grad``/``vjp``/``jacrev`` inside the training step run as without MemTrace (its hooks step aside
    for them), the activations of the rest of the forward are still measured, and torch's function is back after fit;
    under a user's own hooks around the fit they fail exactly as they would without MemTrace."""
    torch_disable = torch.autograd.graph.disable_saved_tensors_hooks
    params = {}
    for with_memtrace in (False, True):
        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        torch.manual_seed(0)
        module = PhysicsInformedMLP()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", category=FutureWarning)  # Lightning's own, about torch's _pytree
            trainer(tmp_path / str(with_memtrace), callbacks, max_steps=3).fit(module)
        params[with_memtrace] = [p.detach().clone() for p in module.parameters()]
        assert torch.autograd.graph.disable_saved_tensors_hooks is torch_disable
        if with_memtrace:
            phases = load_phases(callbacks[0].output_dir)
            after_forward = phases[phases.phase == "after_forward"]
            assert len(after_forward) == 3
            assert (after_forward.activations_bytes > 0).all()
    assert all(torch.equal(a, b) for a, b in zip(params[False], params[True]))

    errors = {}
    for with_memtrace in (False, True):
        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        with torch.autograd.graph.save_on_cpu(), pytest.raises(RuntimeError) as raised, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # before torch 2.8: MemTrace says it leaves the user's hooks alone
            trainer(tmp_path / f"hooks{with_memtrace}", callbacks, max_steps=1).fit(PhysicsInformedMLP())
        errors[with_memtrace] = str(raised.value)
        assert torch.autograd.graph.disable_saved_tensors_hooks is torch_disable
    assert errors[True] == errors[False] and "saved tensor hooks" in errors[True]


class CompiledSlopeMLP(MLP):
    """A training step with ``torch.func.grad`` inside a function compiled as one graph."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        slope = torch.compile(
            lambda row: torch.func.grad(lambda r: self.net(r).sum())(row), backend="aot_eager", fullgraph=True
        )
        return nn.functional.mse_loss(self(x), y) + slope(x[0]).pow(2).mean()


def test_a_compiled_torch_func_gradient_transform_stays_one_graph(tmp_path):
    """Dynamo knows torch's ``disable_saved_tensors_hooks`` by identity: while MemTrace's stands in for it, a compiled
    ``torch.func.grad`` still compiles as one graph (``fullgraph=True`` raises on any break) and trains the same."""
    params = {}
    for with_memtrace in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        module = CompiledSlopeMLP()
        callbacks = [MemTrace(history=False, report=False)] if with_memtrace else []
        try:
            trainer(tmp_path / str(with_memtrace), callbacks, max_steps=2).fit(module)
        except torch._dynamo.exc.Unsupported as error:
            if with_memtrace:
                raise
            pytest.skip(f"this torch cannot compile torch.func.grad as one graph: {str(error).splitlines()[0]}")
        params[with_memtrace] = [p.detach().clone() for p in module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params[False], params[True]))


class DropoutMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net.insert(1, nn.Dropout(0.3))


def test_random_streams_and_weights_are_those_of_the_run_without_memtrace(tmp_path):
    """MemTrace draws no random numbers (the estimate's fake forward included): a run with dropout ends with the same
    torch, Python and numpy random states, and the same weights, as without it."""
    import random

    import numpy as np

    ends = {}
    for variant in ("plain", "defaults", "estimate"):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        module = DropoutMLP()
        callbacks = [] if variant == "plain" else [MemTrace(estimate=variant == "estimate", report=False)]
        trainer(tmp_path / variant, callbacks, max_steps=3).fit(module)
        rng_states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        ends[variant] = (*rng_states, list(module.parameters()))
    plain = ends["plain"]
    for variant in ("defaults", "estimate"):
        state, py_state, np_state, params = ends[variant]
        assert torch.equal(state, plain[0]) and py_state == plain[1] and (np_state == plain[2]).all()
        assert all(torch.equal(a, b) for a, b in zip(plain[3], params))


class WorkerStateDataset(torch.utils.data.Dataset):
    """Each sample carries what its DataLoader worker inherited from the training process: a profiling session
    enabled, dispatch modes on the stack, the CPU allocator noting every block."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index):
        from lightning_memtrace.capture import torch_private

        native = torch_private.native_logging()
        inherited = (
            int(torch._C._autograd._profiler_enabled()),
            torch._C._len_torch_dispatch_stack(),
            int(native is not None and bool(native._report_cpu.value)),
        )
        return torch.randn(32), torch.randn(1), torch.tensor(inherited)


class WorkerStateMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.inherited: list[list[int]] = []

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            WorkerStateDataset(), batch_size=4, num_workers=2, multiprocessing_context="fork"
        )

    def training_step(self, batch, batch_idx):
        x, y, inherited = batch
        self.inherited.extend(inherited.tolist())  # as ints: the run keeps no tensor of its own
        return super().training_step((x, y), batch_idx)


def _worker_batch_storages_end() -> bool:
    """Whether a weak reference to the storage of a batch from a DataLoader worker ends with the batch (not on torch
    2.5 to 2.8, at least)."""
    import weakref

    loader = torch.utils.data.DataLoader(torch.zeros(8, 4), batch_size=4, num_workers=1, multiprocessing_context="fork")
    refs = [weakref.ref(batch.untyped_storage()) for batch in loader]
    return all(ref() is None for ref in refs)


@pytest.mark.parametrize("backend", ["reports", "dispatch"])
def test_dataloader_workers_forked_mid_run_inherit_nothing(tmp_path, backend):
    """A DataLoader forks its workers again at every epoch, while MemTrace measures: they must not inherit its
    profiling session (every allocation of theirs would be kept, for nobody), its dispatch mode (every operator of
    theirs through MemTrace's Python) or the allocator's noting of every block. The run's rows stay steady across the
    forks: at the end of every epoch, the same bytes."""
    from lightning_memtrace.capture import fork_guard

    module = WorkerStateMLP()
    callback = MemTrace(report=False, allocation_backend=backend, history_steps=100)  # window open all along
    trainer(tmp_path, [callback], max_steps=-1, max_epochs=3).fit(module)
    assert len(module.inherited) == 48
    assert [sum(column) for column in zip(*module.inherited)] == [0, 0, 0]
    assert not any(type(guarded).__name__ in ("AllocatorReports", "DispatchBackend") for guarded in fork_guard._guarded)
    phases = load_phases(callback.output_dir)
    batch_end = phases[phases.phase == "batch_end"].allocated_bytes.tolist()
    assert len(batch_end) == 12
    if backend == "dispatch" and not _worker_batch_storages_end():
        pytest.xfail("this torch keeps the Python objects of a worker batch's storages after their memory is freed "
                     "(weak references to them never end): the dispatch backend counts the batches prefetched at each "
                     "epoch's end")
    # Batches the workers prefetched come and go within an epoch; at its last batch none is left, in every epoch.
    assert batch_end[3::4] == [min(batch_end)] * 3, batch_end


@pytest.mark.parametrize("checkpoints_into_root", [True, False])
def test_a_checkpoint_folder_holds_checkpoints_only(tmp_path, monkeypatch, checkpoints_into_root):
    """With ``logger=False`` MemTrace writes into ``<default_root_dir>/memtrace``; but where a ModelCheckpoint saves
    into ``default_root_dir`` itself (Lightning's own checkpoint tests list that folder), into a folder of its own in
    the temporary folder, and says so once."""
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "temp"))
    root = tmp_path / "run"
    checkpoint = ModelCheckpoint(dirpath=root if checkpoints_into_root else None, filename="{step}", save_top_k=-1,
                                 every_n_train_steps=1)
    callback = MemTrace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, [checkpoint, callback], max_steps=2, enable_checkpointing=True).fit(MLP())
    said = [str(w.message) for w in caught if "not into" in str(w.message)]
    if checkpoints_into_root:
        assert sorted(p.name for p in root.iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
        assert callback.output_dir == tmp_path / "temp" / "lightning_memtrace" / callback.run_id
        assert said == [f"MemTrace writes into {callback.output_dir}, not into {root}: a ModelCheckpoint saves there "
                        "(pass MemTrace(dirpath=...) to choose the folder)."]
    else:
        assert sorted(p.name for p in root.iterdir()) == ["checkpoints", "memtrace"]
        assert callback.output_dir == root / "memtrace" and said == []
    assert len(load_phases(callback.output_dir)) == 2 * 5


def test_the_temporary_folder_keeps_the_newest_runs_only(tmp_path, monkeypatch):
    """Runs kept out of a checkpoint folder pile up in one temporary folder: as a run starts there, the oldest runs'
    folders beyond ``TEMP_RUNS_KEPT`` go; anything else in it (a file, a folder of another name) stays."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    runs = tmp_path / "lightning_memtrace"
    old_runs = [f"202601{day:02d}T000000-abcdef" for day in range(1, 26)]
    for name in old_runs:
        (runs / name).mkdir(parents=True)
        (runs / name / "phases_rank0.csv").write_text("step\n")
    (runs / "mine").mkdir()
    (runs / "notes.txt").write_text("kept")
    root = tmp_path / "run"
    callback = MemTrace()
    checkpoint = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(root, [checkpoint, callback], max_steps=1, enable_checkpointing=True).fit(MLP())
    assert callback.output_dir == runs / callback.run_id
    kept = sorted(p.name for p in runs.iterdir())
    assert kept == sorted(old_runs[-(TEMP_RUNS_KEPT - 1):] + [callback.run_id, "mine", "notes.txt"])
    assert len(load_phases(callback.output_dir)) == 5


@pytest.mark.parametrize("case", ["profiler_into_root", "profiler_into_log_folder", "profiler_without_file"])
def test_a_profiler_folder_holds_its_reports_only(tmp_path, monkeypatch, case):
    """A profiler told to write a file into ``default_root_dir`` with ``logger=False`` (Lightning's profiler tests list
    that folder) keeps MemTrace out as a ModelCheckpoint does; a logger's folder, where the profiler writes by default,
    is shared by design, and a profiler that writes no file owns no folder."""
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "temp"))
    root = tmp_path / "run"
    filename = None if case == "profiler_without_file" else "perf"
    profiler = SimpleProfiler(dirpath=None if case == "profiler_into_log_folder" else root, filename=filename)
    logger = CSVLogger(root, name="logs", version=0) if case == "profiler_into_log_folder" else False
    callback = MemTrace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, [callback], max_steps=2, profiler=profiler, logger=logger).fit(MLP())
    said = [str(w.message) for w in caught if "not into" in str(w.message)]
    if case == "profiler_into_root":
        assert sorted(p.name for p in root.iterdir()) == ["fit-perf.txt"]
        assert callback.output_dir == tmp_path / "temp" / "lightning_memtrace" / callback.run_id
        assert said == [f"MemTrace writes into {callback.output_dir}, not into {root}: the Trainer's profiler saves "
                        "there (pass MemTrace(dirpath=...) to choose the folder)."]
    elif case == "profiler_into_log_folder":
        log_dir = root / "logs" / "version_0"
        assert sorted(p.name for p in log_dir.iterdir()) == ["fit-perf.txt", "memtrace"]
        assert callback.output_dir == log_dir / "memtrace" and said == []
    else:
        assert sorted(p.name for p in root.iterdir()) == ["memtrace"]
        assert callback.output_dir == root / "memtrace" and said == []
    assert len(load_phases(callback.output_dir)) == 2 * 5
