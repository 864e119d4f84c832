"""Steps that read a tensor value: logging ``loss.item()`` and NaN/infinity guards are estimated, other reads are not.

Before: ``self.log("loss", loss.item())`` or ``if torch.isnan(loss): ...`` in a training step stopped the estimate
("the training step needs tensor values"), and so ``MemTrace(estimate=True)`` and the post-mortem's what-if measured
nothing for such a module.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_memtrace import MemTrace
from lightning_memtrace.types import Category
from lightning_memtrace.estimator import estimate
from lm_helpers import MLP, trainer


def _plain(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _logs_item(model, batch):
    loss = _plain(model, batch)
    _logs_item.seen.append(loss.item())  # the line named
    return loss


def _math_isnan(model, batch):
    loss = _plain(model, batch)
    if math.isnan(loss.item()):
        return None
    return loss


def _isnan_guard(model, batch):
    loss = _plain(model, batch)
    if torch.isnan(loss):  # the line named
        return None
    return loss


def _isfinite_all(model, batch):
    loss = _plain(model, batch)
    if not torch.isfinite(loss).all():
        return None
    return loss


def _self_compare(model, batch):
    loss = _plain(model, batch)
    if loss != loss:
        return None
    return loss


def _count_of_bad_values(model, batch):
    out = model(batch[0])
    bad = (torch.isnan(out) | torch.isinf(out)).sum()
    if bad.item() > 0:
        return None
    return nn.functional.mse_loss(out, batch[1])


def _infinity_compare(model, batch):
    loss = _plain(model, batch)
    if (loss.abs() == math.inf).any() or not bool(loss < math.inf):
        return None
    return loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def _estimate(step):
    batch = (torch.randn(8, 32), torch.randn(8, 1))
    return estimate(_model(), batch, training_step=step, device="cpu")


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture(scope="module")
def plain():
    return _estimate(_plain)


@pytest.mark.parametrize(
    "step",
    [_logs_item, _math_isnan, _isnan_guard, _isfinite_all, _self_compare, _count_of_bad_values, _infinity_compare],
)
def test_value_reads_a_run_takes_the_usual_path_on_are_estimated_as_without_them(step, plain):
    _logs_item.seen = []
    result = _estimate(step)
    # the same rows to the byte as the step without the read, except the read's own one-element tensors
    assert [r.phase for r in result.records] == [r.phase for r in plain.records]
    for read, base in zip(result.records, plain.records):
        for category in ("parameters", "gradients", "optimizer_state", "inputs", "activations"):
            assert getattr(read, f"{category}_bytes") == getattr(base, f"{category}_bytes")
        assert 0 <= read.peak_bytes - base.peak_bytes <= 64 and 0 <= read.allocated_bytes - base.allocated_bytes <= 64
    assert result.values_read and all(__file__ in place for place in result.values_read)
    assert "tensor values read answered as in a usual run" in result.describe()
    assert result.as_dict()["values_read"] == list(result.values_read)


def test_autograds_anomaly_mode_checks_are_estimated_as_without_them(plain):
    """``Trainer(detect_anomaly=True)``: autograd checks every gradient with ``isnan(grad)._is_any_true()``, which
    stopped the estimate ("needs tensor values")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        with torch.autograd.detect_anomaly():
            result = _estimate(lambda model, batch: _plain(model, batch))  # not _plain: its estimates run once
    assert [r.phase for r in result.records] == [r.phase for r in plain.records]
    for checked, base in zip(result.records, plain.records):
        assert checked.allocated_bytes == base.allocated_bytes
        assert 0 <= checked.peak_bytes - base.peak_bytes <= 64  # the checks' one-byte results, as in a real run
    assert result.category_bytes() == plain.category_bytes()
    assert result.values_read  # the engine's checks are named (no line of the user's asked)


def test_the_places_read_are_named(plain):
    _logs_item.seen = []
    result = _estimate(_logs_item)
    assert result.values_read == (f"{__file__}:{_line_of(_logs_item, 'the line named')} in _logs_item",)
    assert len(_logs_item.seen) >= 2 and set(_logs_item.seen) == {0.0}  # one read a step, answered 0.0
    guarded = _estimate(_isnan_guard)
    assert guarded.values_read == (f"{__file__}:{_line_of(_isnan_guard, 'the line named')} in _isnan_guard",)
    assert plain.values_read == () and "tensor values" not in plain.describe()


def _threshold(model, batch):
    loss = _plain(model, batch)
    if loss > 1.0:  # a value the memory would follow: not answered
        return loss * 2
    return loss


def _size_from_value(model, batch):
    out = model(batch[0])
    n = int((out > 0).sum().item())
    return out.sum() + torch.zeros(n).sum()


def _overwritten_check(model, batch):
    loss = _plain(model, batch)
    bad = torch.isnan(loss)
    bad.copy_(loss > 1.0)  # no longer a NaN check: its value is not known
    if bad:
        return None
    return loss


def _into_numpy(model, batch):
    loss = _plain(model, batch)
    _into_numpy.accuracy = float((model(batch[0]).detach().numpy() > 0).mean())  # a metric computed in NumPy
    return loss


@pytest.mark.parametrize("step", [_threshold, _size_from_value, _overwritten_check, _into_numpy])
def test_other_reads_still_stop_the_estimate_in_one_line(step):
    with pytest.raises(ValueError) as raised:
        _estimate(step)
    message = str(raised.value)
    assert message.startswith("the training step needs tensor values") and "\n" not in message
    assert f"{__file__}:" in message and f"in {step.__name__}" in message
    if step is _into_numpy:  # torch's own words ("not supported for tensor subclasses") said which tensors nowhere
        assert "(Tensor.numpy(), at " in message and "values read into NumPy" in message


def test_a_read_in_the_optimizers_own_code_is_named_there():
    """LBFGS compares the gradient with its tolerance in ``torch/optim/lbfgs.py``: no line of the user's asked, and the
    line named is the optimizer's, not torch's fake-tensor machinery's."""
    with pytest.raises(ValueError) as raised:
        estimate(
            torch.nn.Linear(8, 1),
            torch.zeros(4, 8),
            optimizer_factory=lambda model: torch.optim.LBFGS(model.parameters()),
            device="cpu",
        )
    message = str(raised.value)
    assert message.startswith("the training step needs tensor values") and "\n" not in message
    place = message.split(", at ", 1)[1].split("): ", 1)[0]
    assert place.replace("\\", "/").split(":")[0].endswith("torch/optim/lbfgs.py") and place.endswith(" in step")


def test_a_float_read_in_the_optimizers_step_is_named_in_the_optimizer():
    """ASGD reads its step size with ``.item()``: the place named is in ``torch/optim``, not the line of this file
    that called ``estimate`` (which only started the step)."""
    estimated = estimate(
        torch.nn.Linear(8, 1),
        torch.zeros(4, 8),
        optimizer_factory=lambda model: torch.optim.ASGD(model.parameters(), foreach=False),
        device="cpu",
    )
    assert estimated.values_read
    assert all("/torch/optim/" in place.replace("\\", "/") for place in estimated.values_read), estimated.values_read
    assert not any(__file__ in place for place in estimated.values_read)


def test_other_fake_modes_keep_torchs_answer():
    """Only the estimate's fake mode answers reads: one of torch.compile's (or a user's) still raises."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    _estimate(_logs_item)  # the answering is installed
    with FakeTensorMode() as mode:
        value = mode.from_tensor(torch.randn(3)).sum()
        with pytest.raises(DataDependentOutputException):
            value.item()
        with pytest.raises(DataDependentOutputException):
            bool(torch.isnan(value))


class _LogsItem(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.item())
        if torch.isnan(loss):
            raise RuntimeError("nan loss")
        return loss


def test_the_callbacks_estimate_of_a_module_that_logs_item_matches_the_run(tmp_path):
    callback = MemTrace(estimate=True, report=False, what_if_budget_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=3).fit(_LogsItem())
    assert not [w for w in caught if "could not estimate" in str(w.message)]
    assert callback.estimated is not None and len(callback.estimated.values_read) == 2
    comparison = callback.estimate_comparison
    peak = comparison[comparison.category == "peak"].iloc[0]
    assert abs(peak.error_percent) < 0.1
    exact = comparison[comparison.category.isin(["parameters", "gradients", "optimizer_state", "activations"])]
    assert (exact.error_bytes == 0).all()


class _VAE(MLP):
    """A variational autoencoder: ``torch.distributions.Normal`` validates its scale (``scale > 0``, all true)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(32, 16)
        self.decoder = nn.Linear(8, 32)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        mu, log_var = self.encoder(x).chunk(2, dim=-1)
        posterior = torch.distributions.Normal(mu, torch.exp(0.5 * log_var))
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        kl = torch.distributions.kl_divergence(posterior, prior).sum(-1).mean()
        return nn.functional.mse_loss(self.decoder(posterior.rsample()), x) + kl


def test_a_distributions_argument_validation_is_answered_as_passing(tmp_path, monkeypatch):
    from estimate_checks import check_against_real, real_run
    from lightning_memtrace.estimator import estimate_for_module

    # on, as by default (a library imported by another test may have turned it off for the process)
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)
    torch.manual_seed(0)
    module = _VAE()
    result = estimate_for_module(module, next(iter(module.train_dataloader())), steps=3)
    assert result.values_read and all("in training_step" in place for place in result.values_read)
    check_against_real(result, real_run(tmp_path, _VAE()))


class _PrintsItsLoss(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        print(f"loss at step {self.global_step}: {loss.item():.4f}")
        self.print("self.print too")
        return loss


def test_the_estimates_run_of_the_step_prints_nothing(tmp_path, capsys):
    """The step's prints come from the real run only: the estimate's (a fake loss reads 0.0) would mislead."""
    callback = MemTrace(estimate=True, report=False, history=False)
    trainer(tmp_path, [callback], max_steps=2).fit(_PrintsItsLoss())
    assert callback.estimated and callback.estimated.values_read
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("loss at step", "self.print"))]
    assert len(lines) == 4 and "0.0000" not in out  # two real steps, two lines each; the what-if's steps print none


def test_other_threads_print_while_the_estimate_runs(capsys):
    import threading

    from lightning_memtrace.estimator.fake import own_prints_dropped

    with own_prints_dropped():
        print("dropped")
        worker = threading.Thread(target=print, args=("from another thread",))
        worker.start()
        worker.join()
    print("after")
    assert capsys.readouterr().out == "from another thread\nafter\n"


def test_a_step_with_checks_is_remembered_so_later_estimates_run_once(monkeypatch):
    from lightning_memtrace.estimator import run

    runs = []
    original = run._estimate

    def counting(*args, **kwargs):
        runs.append(kwargs["finite_checks"])
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "_estimate", counting)

    def guarded(model, batch):
        return _isnan_guard(model, batch)

    first, second = _estimate(guarded), _estimate(guarded)
    assert runs == [False, True, True]  # the first estimate stopped at the check once; the second ran once
    assert first.peak_bytes == second.peak_bytes and first.values_read == second.values_read
    _estimate(_plain)
    assert runs[-1] is False  # a step without checks still runs without following them


def _negated_in_place(model, batch):
    loss = _plain(model, batch)
    finite = torch.isnan(loss)
    finite.logical_not_()  # now True where the loss is finite
    if not finite.all():
        return None
    return loss


def test_a_check_written_in_place_is_followed(plain):
    result = _estimate(_negated_in_place)  # a stale "all False" would skip the backward and the optimizer step
    assert [r.phase for r in result.records] == [r.phase for r in plain.records]
    assert result.category_bytes()[Category.OPTIMIZER_STATE] == plain.category_bytes()[Category.OPTIMIZER_STATE] > 0


def _bitwise_not_of_a_count(model, batch):
    loss = _plain(model, batch)
    bad = torch.isnan(loss).long().sum()  # 0
    if (~bad).item() != -1:  # ~0 == -1: a flipped truth (True, read as 1) would skip the step
        return None
    return loss


def test_bitwise_not_of_an_integer_is_its_complement(plain):
    result = _estimate(_bitwise_not_of_a_count)
    assert result.category_bytes()[Category.OPTIMIZER_STATE] == plain.category_bytes()[Category.OPTIMIZER_STATE] > 0


class _CountsItsClasses(MLP):
    """Counts with ``bincount``: a class-balanced loss (``minlength`` given) and torchmetrics' accuracy and F1, whose
    confusion counts are ``bincount(target * C + preds, minlength=C ** 2)``, updated and logged in the step."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.net[-1] = nn.Linear(128, 10)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(10)
        self.f1 = torchmetrics.classification.MulticlassF1Score(10, average="macro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        target = (y.squeeze(-1).abs() * 5).long().clamp(max=9)
        logits = self(x)
        counts = torch.bincount(target, minlength=10)
        loss = nn.functional.cross_entropy(logits, target, weight=1.0 / (counts.float() + 1.0))
        self.accuracy(logits, target)
        self.f1(logits, target)
        self.log("accuracy", self.accuracy, on_step=True, on_epoch=True)
        self.log("f1", self.f1, on_epoch=True)
        return loss


def test_counts_with_a_minimum_length_are_estimated_as_a_run_with_values_in_range_takes_them(tmp_path):
    """torch's fake ``bincount`` refuses (its length follows the values), so a step that used torchmetrics'
    classification metrics could not be estimated. With ``minlength`` the estimate answers ``minlength`` bins."""
    callback = MemTrace(estimate=True, report=False, what_if_budget_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=3).fit(_CountsItsClasses())
    assert not [w for w in caught if "could not estimate" in str(w.message)]
    assert callback.estimated is not None and any(__file__ in place for place in callback.estimated.values_read)
    comparison = callback.estimate_comparison
    exact = comparison[comparison.category.isin(["parameters", "gradients", "optimizer_state", "activations"])]
    assert (exact.error_bytes == 0).all()
    assert abs(comparison[comparison.category == "peak"].iloc[0].error_percent) < 0.5


def _counts_without_minimum_length(model, batch):
    x, y = batch
    loss = _plain(model, batch)
    return loss * torch.bincount((y.squeeze(-1) > 0).long()).float().mean()


def test_counts_without_a_minimum_length_still_stop_the_estimate_in_one_line():
    with pytest.raises(ValueError) as raised:
        _estimate(_counts_without_minimum_length)
    message = str(raised.value)
    assert message.startswith("the training step needs tensor values") and "aten.bincount" in message
    assert "\n" not in message
