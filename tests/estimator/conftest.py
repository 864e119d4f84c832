"""Fixtures of the estimator's tests: the tiny LM's real run and estimate, the one-layer meta model, expected text."""

from __future__ import annotations

import pytest
from estimate_checks import ONE_LAYER, real_run
from lm_helpers import TinyLM

from lightning_memtrace.estimator import build_meta_model, estimate_for_module



@pytest.fixture(scope="session")
def lm_pair(tmp_path_factory):
    """The tiny causal LM: a real run's phases, the estimate of the same run and the module."""
    phases = real_run(tmp_path_factory.mktemp("lm"), TinyLM(batch_size=4, seq_len=64))
    module = TinyLM(batch_size=4, seq_len=64)
    batch = next(iter(module.train_dataloader()))
    return phases, estimate_for_module(module, batch, steps=3), module


@pytest.fixture(scope="session")
def one_layer():
    return build_meta_model(ONE_LAYER)
