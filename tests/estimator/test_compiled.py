"""A module compiled with ``torch.compile`` is estimated as it runs eagerly, and says so.

Before: ``torch.compile(lightning_module)`` (which ``Trainer.fit`` takes) could not be estimated at all, neither from
Python (the wrapper is no LightningModule: ``model(**batch)`` failed) nor by ``MemTrace(estimate=True)`` (Lightning
puts compiled methods of the real module on the instance: the copy ran the real weights, and fake tensors refused
them). A compiled submodule was compiled again on fake tensors, for nothing, into the cache the real run uses.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from lm_helpers import TinyLM, trainer
from torch._dynamo.utils import counters

from lightning_memtrace import MemTrace
from lightning_memtrace.estimator import estimate


def _outer(module: TinyLM) -> torch.nn.Module:
    return torch.compile(module, backend="eager")


def _lightnings(module: TinyLM) -> torch.nn.Module:
    from lightning.pytorch.utilities.compile import from_compiled

    return from_compiled(torch.compile(module, backend="eager"))


def _inner(module: TinyLM) -> torch.nn.Module:
    module.model = torch.compile(module.model, backend="eager")
    return module


def _bytes(est) -> list[tuple]:
    """Each row's phase and byte counts (the time and the run's id differ between any two estimates)."""
    return [
        (r.step, r.phase, *(getattr(r, f.name) for f in dataclasses.fields(r) if f.name.endswith("_bytes")))
        for r in est.records
    ]


@pytest.fixture(scope="module")
def eager_estimate():
    module = TinyLM(n_train=8)
    return estimate(module, next(iter(module.train_dataloader())), device="cpu", steps=2)


@pytest.mark.parametrize("compile_", [_outer, _lightnings, _inner], ids=["torch.compile", "from_compiled", "submodule"])
def test_a_compiled_module_is_estimated_eagerly_and_says_so(eager_estimate, compile_):
    module = TinyLM(n_train=8)
    batch = next(iter(module.train_dataloader()))
    compiled = compile_(module)
    counters.clear()
    est = estimate(compiled, batch, device="cpu", steps=2)
    assert counters["frames"]["total"] == 0  # nothing traced on fake tensors
    assert _bytes(est) == _bytes(eager_estimate) and est.peak_bytes == eager_estimate.peak_bytes
    assert est.compiled and not eager_estimate.compiled and est.as_dict()["compiled"] is True
    assert est.describe().endswith(", compiled module estimated eagerly (a compiled graph may save less)")
    # the user's module keeps its compiled methods
    if compile_ is _lightnings:
        assert "training_step" in compiled.__dict__ and compiled._compiler_ctx


def test_the_callback_estimates_a_fit_of_a_compiled_module(tmp_path):
    callback = MemTrace(estimate=True, history=False, what_if_budget_s=0, report=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=2).fit(_outer(TinyLM(n_train=8)))
    assert not [w for w in caught if "could not estimate" in str(w.message)]
    assert callback.estimated and callback.estimated.compiled
    rows = callback.estimate_comparison.set_index("category")
    assert rows.loc["parameters", "estimated_bytes"] == rows.loc["parameters", "measured_bytes"] == 13_714_432
