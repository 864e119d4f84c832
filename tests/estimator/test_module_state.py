"""Tensors a module keeps as plain attributes (torchmetrics' states, a cached mask) are copied onto fake tensors too.

Before: the estimate copied parameters and buffers only, so a LightningModule that updates a torchmetrics metric in
``training_step`` (as Lightning's documentation shows) stopped with "Please convert all Tensors to FakeTensors first",
and ``MemTrace(estimate=True)`` measured without an estimate.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import lightning.pytorch as pl
import torchmetrics
from torch import nn

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.estimator import estimate
from lightning_memtrace.estimator.fake import fake_copy, fake_mode, is_fake
from lightning_memtrace.types import Category
from estimate_checks import MLP_PARAM_BYTES
from lm_helpers import MLP, trainer


class _WithAccuracy(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net[-1] = nn.Linear(128, 4)
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        target = (y.squeeze(-1) > 0).long()
        logits = self(x)
        self.accuracy(logits, target)
        self.log("train_acc", self.accuracy)
        return nn.functional.cross_entropy(logits, target)


def test_a_module_updating_a_torchmetrics_metric_is_estimated_as_it_runs(tmp_path):
    callback = MemTrace(estimate=True, report=False, what_if_budget_s=0)
    module = _WithAccuracy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert not [w for w in caught if "could not estimate" in str(w.message)]
    comparison = callback.estimate_comparison
    assert comparison is not None
    exact = comparison[comparison.category.isin(["parameters", "gradients", "optimizer_state", "activations"])]
    assert (exact.error_bytes == 0).all()
    assert abs(comparison[comparison.category == "peak"].iloc[0].error_percent) < 0.1
    # the real metric kept its real states and defaults
    assert not any(is_fake(t) for t in (module.accuracy.tp, *module.accuracy._defaults.values()))


class _CachedMask(nn.Module):
    """A causal mask kept as a plain attribute (not a buffer), with a list and a dict of tensors beside it."""

    def __init__(self, length: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.mask = torch.tril(torch.ones(length, length, dtype=torch.bool))
        self.history = [torch.zeros(4)]
        self.defaults = {"scale": torch.ones(())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.linear(x) @ self.linear(x).transpose(-1, -2)
        return scores.masked_fill(~self.mask, 0.0).sum() * self.defaults["scale"] + self.history[0].sum()


def test_plain_attribute_tensors_become_fake_in_the_copy_and_stay_real_in_the_module():
    module = _CachedMask()
    result = estimate(module, torch.randn(2, 16, 8), training_step=lambda m, b: m(b), device="cpu")
    assert result.peak_bytes > 0
    assert not is_fake(module.mask) and module.mask.dtype == torch.bool  # the user's module is unchanged
    copy = fake_copy(module, fake_mode(), torch.device("cpu"), None, in_place=False)
    assert is_fake(copy.mask) and copy.mask.shape == (16, 16) and copy.mask.dtype == torch.bool
    assert is_fake(copy.history[0]) and is_fake(copy.defaults["scale"])


def test_in_place_copies_replace_attribute_tensors_too():
    module = _CachedMask()
    history = module.history
    fake_copy(module, fake_mode(), torch.device("cpu"), torch.bfloat16, in_place=True)
    assert is_fake(module.mask) and module.mask.dtype == torch.bool  # not cast: not a parameter or buffer
    assert module.history is history and is_fake(history[0]) and is_fake(module.defaults["scale"])
    assert module.linear.weight.dtype == torch.bfloat16


class _ReadsItsTrainer(MLP):
    """A scheduler sized by ``self.trainer.estimated_stepping_batches``, and a step that reads the Trainer and logs."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        scheduler = self.lr_schedulers()
        self.log("lr", scheduler.get_last_lr()[0])
        self.log_dict({"step_seen": float(self.trainer.global_step), "loss": loss})
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit_logging(tmp_path, estimate_run: bool):
    from lightning.pytorch.loggers import CSVLogger

    callback = MemTrace(estimate=estimate_run, report=False, history=False, what_if_budget_s=0)
    logger = CSVLogger(tmp_path, name="logs")
    torch.manual_seed(0)
    module = _ReadsItsTrainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=4, logger=logger, log_every_n_steps=1).fit(module)
    said = [str(w.message) for w in caught if "could not estimate" in str(w.message)]
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    return callback, said, rows


def test_a_module_that_reads_its_trainer_is_estimated_and_logs_only_what_it_logs_without_the_estimate(tmp_path):
    """The copy is attached to the real Trainer (reads of it see the real run), and its ``self.log`` does nothing:
    the run's logged metrics are those of the same fit without the estimate."""
    callback, said, rows = _fit_logging(tmp_path / "with", estimate_run=True)
    assert said == [] and callback.estimated
    comparison = callback.estimate_comparison
    exact = comparison[comparison.category.isin(["parameters", "gradients", "optimizer_state", "activations"])]
    assert (exact.error_bytes == 0).all()
    _, _, rows_without = _fit_logging(tmp_path / "without", estimate_run=False)

    def logged_by_the_module(lines):
        header = lines[0].split(",")
        assert {"lr", "step_seen", "loss"} <= set(header)
        cells = [dict(zip(header, line.split(","))) for line in lines[1:]]
        # the estimate's own row (memtrace/estimate/*, once) aside, each row as the module logged it
        return [(c["step"], c["lr"], c["step_seen"], c["loss"]) for c in cells if c["lr"]]

    logged = logged_by_the_module(rows)
    assert len(logged) == 4 and [step for step, *_ in logged] == ["0", "1", "2", "3"]
    assert logged == logged_by_the_module(rows_without)


class _OptimizesTrainerModel(MLP):
    def configure_optimizers(self):  # as Lightning's FSDP documentation writes it
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-3)


def test_an_optimizer_built_on_the_trainers_model_is_estimated_on_the_copy(tmp_path):
    """The copy's Trainer gives the real run's parameters: the estimate's optimizer holds the copy's instead (without
    that, it would skip every parameter, having no gradients for them, and estimate no optimizer state)."""
    callback = MemTrace(estimate=True, report=False, history=False, what_if_budget_s=0)
    trainer(tmp_path, [callback], max_steps=3).fit(_OptimizesTrainerModel())
    comparison = callback.estimate_comparison.set_index("category")
    adamw = 2 * MLP_PARAM_BYTES + 4 * 6  # exp_avg, exp_avg_sq, a float32 step per parameter tensor
    assert comparison.loc["optimizer_state", "estimated_bytes"] == adamw
    for category in ("parameters", "gradients", "optimizer_state", "activations"):
        assert comparison.loc[category, "error_bytes"] == 0, category


class _WritesToItsLoggers(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for logger in self.loggers:  # straight to the loggers, around self.log
            logger.log_metrics({"probe": loss.item() + 1.0}, step=self.global_step)
        # as steps log images and histograms: the logger's own experiment object
        self.logger.experiment.log_metrics({"experiment_probe": loss.item() + 2.0}, step=self.global_step)
        self.seen_log_dir = self.logger.log_dir
        return loss


def test_the_copys_loggers_write_nothing_and_its_trainer_takes_no_settings(tmp_path):
    """The estimate's step must not write into the run's loggers (its values are not the run's) nor change the run,
    and a step that writes to them (``self.logger.experiment...``) is still estimated."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_memtrace.estimator.trainer_view import DROPPED, TrainerView

    callback = MemTrace(estimate=True, report=False, history=False, what_if_budget_s=0)
    logger = CSVLogger(tmp_path, name="logs")
    fit = trainer(tmp_path, [callback], max_steps=3, logger=logger, log_every_n_steps=1)
    fit.fit(_WritesToItsLoggers())
    assert callback.estimated  # the step ran in the estimate, whose loggers took its values and wrote none
    lines = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    for name, added in (("probe", 1.0), ("experiment_probe", 2.0)):
        column = header.index(name)
        probes = [float(cells[column]) for cells in (line.split(",") for line in lines[1:]) if cells[column]]
        # the real steps' losses only: none of the estimate's 0.0 + 1.0 (or + 2.0)
        assert len(probes) == 3 and added not in probes, name

    view = TrainerView(fit)
    assert view.global_step == fit.global_step == 3 and len(view.loggers) == 1
    assert view.logger.log_dir == logger.log_dir and view.logger.name == "logs"
    assert view.logger.log_metrics({"x": 1.0}) is DROPPED and view.logger.experiment.add_image("x", 0) is DROPPED
    view.should_stop = True
    assert fit.should_stop is False  # the copy's setting went nowhere
    assert TrainerView(pl.Trainer(logger=False)).logger is None


def test_an_optimizer_made_beforehand_is_left_to_the_run(tmp_path):
    """``configure_optimizers`` returning an optimizer and scheduler made beforehand (a closure, as Lightning's own
    tests write it) hands the estimate the run's own optimizer. The estimate builds its own of the same class: the
    run's keeps its parameters (so its checkpoint pickles), takes exactly the run's steps, and its hooks see only
    those."""
    module = MLP()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    module.configure_optimizers = lambda: {"optimizer": optimizer, "lr_scheduler": scheduler}
    steps = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    real_params = [id(p) for p in module.parameters()]
    callback = MemTrace(estimate=True, report=False, history=False, what_if_budget_s=0)
    fit = trainer(tmp_path, [callback], max_steps=3, enable_checkpointing=True)
    fit.fit(module)
    assert len(steps) == 3 and [id(p) for p in optimizer.param_groups[0]["params"]] == real_params
    assert not any(is_fake(t) for state in optimizer.state.values() for t in state.values())
    assert list((tmp_path / "checkpoints").glob("*.ckpt")) or list(tmp_path.rglob("*.ckpt"))
    comparison = callback.estimate_comparison.set_index("category")
    assert comparison.loc["optimizer_state", "estimated_bytes"] == 2 * MLP_PARAM_BYTES + 4 * 6
    assert comparison.loc["optimizer_state", "error_bytes"] == 0


def test_an_attribute_tensor_on_another_device_is_shared_not_counted():
    """A host-side table beside a model on another device (meta here, standing for CUDA) is not the device's memory:
    the copy shares it (no real copy is made) and the estimate does not count it."""
    module = nn.Linear(8, 8, device="meta")
    module.host_table = torch.zeros(256, 1024)  # 1 MiB on the host
    copy = fake_copy(module, fake_mode(), torch.device("cpu"), None, in_place=False)
    assert copy.host_table is module.host_table and not is_fake(copy.host_table)
    result = estimate(module, torch.randn(4, 8, device="meta"), training_step=lambda m, b: m(b).sum(), device="cuda")
    # the 1 MiB table is not in other: only the caching allocator's rounding of small blocks to 512 B is
    assert result.category_bytes()[Category.OTHER] - result.blas_workspace_bytes < 16 * 1024


class _KeepsItsDataset(MLP):
    """A module that keeps its training data (``self.ds``, as quick scripts do): 2 MiB of real tensors in an object
    the estimate does not enter (not a dict, list or tuple)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randn(8192, 64, generator=generator))


def test_the_copy_shares_tensors_that_are_not_the_modules_state(tmp_path):
    """A deep copy of the dataset's tensors was real memory inside the run: the first ``batch_start`` row measured
    2 MiB more with the estimate than without it (on a GPU run, a copy on the GPU)."""
    module = _KeepsItsDataset()
    copy = fake_copy(module, fake_mode(), torch.device("cpu"), None, in_place=False)
    assert copy.ds.tensors[0] is module.ds.tensors[0] and is_fake(copy.net[0].weight)

    def first_batch_start_peak(estimate_run: bool, folder) -> int:
        callback = MemTrace(estimate=estimate_run, report=False, history=False, what_if_budget_s=0)
        torch.manual_seed(0)
        trainer(folder, [callback], max_steps=2).fit(_KeepsItsDataset())
        assert bool(callback.estimated) is estimate_run
        rows = load_phases(callback.output_dir)
        return int(rows[(rows.step == 0) & (rows.phase == "batch_start")].peak_bytes.iloc[0])

    assert abs(first_batch_start_peak(True, tmp_path / "with") - first_batch_start_peak(False, tmp_path / "no")) <= 128


class _HooksItsActivations(MLP):
    """A forward hook registered as a closure over the module (``lambda ...: self.acts.append(out)``), read in the
    step, as activation statistics are logged."""

    def __init__(self) -> None:
        super().__init__()
        self.acts: list[torch.Tensor] = []
        self.kinds: list[str] = []
        self.net[1].register_forward_hook(lambda module, args, out: self._keep(out))

    def _keep(self, out: torch.Tensor) -> None:
        self.acts.append(out)
        self.kinds.append(type(out).__name__)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("act_mean", self.acts[-1].mean())
        self.acts.clear()
        return loss


def test_a_hook_closing_over_the_module_works_on_the_copy(tmp_path):
    """The hook's closure held the run's module: the estimate's fake activations went into the run's list (and the
    copy's step found its own list empty: "IndexError: list index out of range", measured only)."""
    callback = MemTrace(estimate=True, report=False, history=False, what_if_budget_s=0)
    module = _HooksItsActivations()
    trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert callback.estimated
    assert module.kinds == ["Tensor"] * 3  # the run's three forwards, none of the estimate's
    comparison = callback.estimate_comparison.set_index("category")
    for category in ("parameters", "gradients", "optimizer_state", "activations"):
        assert comparison.loc[category, "error_bytes"] == 0, category
