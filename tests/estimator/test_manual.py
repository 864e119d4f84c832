"""Manual optimization estimated: the module's own ``training_step`` steps its optimizers on the fake copy, with the
rows where the callback takes them, against MemTrace's measurement of real Lightning CPU runs."""

from __future__ import annotations

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from estimate_checks import EXACT, PHASES, check_against_real, real_run
from lm_helpers import MLP, TwoOptimizers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtrace.estimator import estimate_for_module

ROWS = ["step", "batch_idx", "phase", "allocated_bytes", "peak_bytes", *EXACT, "activations_bytes"]


def _rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[ROWS].reset_index(drop=True)


def _row_for_row(est, phases: pd.DataFrame) -> None:
    """The same rows in the same order (several backward and step rows a batch), categories exact, peaks within 3%."""
    real, estimated = _rows(phases[phases.phase.isin(PHASES)]), _rows(est.to_dataframe())
    assert list(real.phase) == list(estimated.phase) and list(real.step) == list(estimated.step)
    pd.testing.assert_frame_equal(real[EXACT], estimated[EXACT], check_dtype=False)
    assert ((estimated.peak_bytes - real.peak_bytes).abs() <= 0.03 * real.peak_bytes).all()


class ToggledGAN(pl.LightningModule):
    """What Lightning's GAN example does: each optimizer toggled, gradients clipped, its scheduler stepped."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.disc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        self.toggle_optimizer(opt_d)
        loss_d = self.disc(self.gen(x).detach()).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()
        sched_d.step()
        self.untoggle_optimizer(opt_d)
        with self.toggled_optimizer(opt_g):
            loss_g = (1 - self.disc(self.gen(x))).pow(2).mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
            sched_g.step()

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.gen.parameters(), lr=1e-3)
        opt_d = torch.optim.AdamW(self.disc.parameters(), lr=1e-3)
        steps = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_g, opt_d)]
        return [opt_g, opt_d], steps

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(0))), batch_size=8)


def test_one_optimizer_stepped_by_hand_matches_a_real_run(tmp_path):
    phases = real_run(tmp_path, MLP(manual=True), max_steps=3)
    module = MLP(manual=True)
    est = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3)
    check_against_real(est, phases)
    assert est.optimizer == "AdamW"


def test_two_optimizers_match_a_real_run_row_for_row(tmp_path):
    # two backward and two optimizer-step rows a batch; Lightning counts both steps in global_step
    phases = real_run(tmp_path, TwoOptimizers(), max_steps=6)
    module = TwoOptimizers()
    est = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3)
    real, estimated = _rows(phases[phases.phase.isin(PHASES)]), _rows(est.to_dataframe())
    assert list(estimated.phase[:7]) == ["batch_start", "after_forward", "after_backward", "after_optimizer_step",
                                         "after_backward", "after_optimizer_step", "batch_end"]  # fmt: skip
    assert list(estimated.step.unique()) == [0, 2, 4]
    pd.testing.assert_frame_equal(real, estimated, check_dtype=False)
    # Adam's two moments of the generator, SGD's momentum of the discriminator
    gen, disc = (sum(p.numel() * 4 for p in net.parameters()) for net in (module.gen, module.disc))
    assert est.closed_form.optimizer_state_bytes == 2 * gen + disc
    assert (est.optimizer, est.optimizer_detail) == ("Adam + SGD", "momentum 0.9")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_toggling_clipping_and_schedulers_reach_the_copy_only(tmp_path, precision):
    phases = real_run(tmp_path, ToggledGAN(), max_steps=6, precision=precision)
    module = ToggledGAN()
    state = {name: p.requires_grad for name, p in module.named_parameters()}
    est = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3, precision=precision)
    _row_for_row(est, phases)
    # the module's own parameters and its own (never built) optimizers are left alone
    assert {name: p.requires_grad for name, p in module.named_parameters()} == state
    assert module.__dict__.get("_trainer") is None


def test_a_run_with_a_trainer_keeps_its_own_optimizers_and_schedulers(tmp_path):
    """Estimated inside a fit (``MemTrace(estimate=True)``), the copy steps fake optimizers and schedulers: the run's
    learning rates, scheduler counters and Trainer are untouched."""
    from lm_helpers import trainer

    from lightning_memtrace import MemTrace

    module = ToggledGAN()
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen["strategy"] = trainer.strategy

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:  # after the estimate (made at the first batch's start) and one real batch
                seen["after"] = [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs]

    callback = MemTrace(estimate=True, history=False, report=False, what_if_budget_s=0)
    trainer(tmp_path, [callback, Probe()], max_steps=2).fit(module)
    assert callback.estimated and callback.estimated.optimizer == "Adam + AdamW"
    assert seen["after"] == [1, 1]  # one real step each: the estimate's steps went to its own schedulers
    assert module.trainer.strategy is seen["strategy"]


def test_accumulation_under_manual_optimization_is_refused_before_any_work(monkeypatch):
    """Lightning refuses it too; neither the fake copy nor ``configure_optimizers`` runs first."""
    module = TwoOptimizers()
    monkeypatch.setattr(module, "configure_optimizers", lambda: pytest.fail("configure_optimizers was called"))
    monkeypatch.setattr("lightning_memtrace.estimator.run.fake_copy", lambda *a, **k: pytest.fail("copied"))
    with pytest.raises(ValueError, match="^accumulate_grad_batches > 1 with manual optimization"):
        estimate_for_module(module, (torch.randn(8, 16),), accumulate_grad_batches=2)


class RetainedGraph(MLP):
    """Overrides Lightning's ``backward`` hook to keep the graph: its saved tensors outlive the backward."""

    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=True)


@pytest.mark.parametrize("manual", [False, True])
def test_a_modules_own_backward_hook_runs_as_lightning_runs_it(tmp_path, manual):
    phases = real_run(tmp_path, RetainedGraph(manual=manual), max_steps=3)
    module = RetainedGraph(manual=manual)
    est = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3)
    _row_for_row(est, phases)
    after_backward = est.to_dataframe().query("phase == 'after_backward'")
    assert (after_backward.activations_bytes > 16_000).all()  # the graph's saved tensors, alive past the backward


def test_the_steps_served_on_are_numbered_as_lightning_numbers_them():
    """Two optimizers stepped by hand: Lightning counts two steps a batch; the allocator's steps served on past the
    estimate are numbered so (the estimated batches start at steps 0, 2, 4; the first served on is step 6)."""
    module = TwoOptimizers()
    est = estimate_for_module(module, next(iter(module.train_dataloader())), device="cuda", steps=3)
    log = est.allocator_log
    assert list(log.step_numbers) == [0, 2, 4, 6]
    assert [log.step_number(k) for k in range(6)] == [0, 2, 4, 6, 8, 10]
    assert [log.served_step(n) for n in (0, 1, 2, 5, 6, 7, 10)] == [0, 0, 1, 2, 3, 3, 5]
    last = log.step_number(est.long_run.steps - 1)
    assert f"served on over steps 6-{last} (the steady step's requests again" in est.table()
    assert est.as_dict()["long_run_reserved_step"] == log.step_number(est.long_run.reserved_from_step)
