"""Fixtures of the estimator's tests: the tiny LM's real run and estimate, the one-layer meta model, expected text."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from estimate_checks import ONE_LAYER, real_run
from lm_helpers import TinyLM

from lightning_memtrace.estimator import build_meta_model, estimate_for_module

EXPECTED = Path(__file__).resolve().parents[1] / "expected"
UPDATE_ENV = "MEMTRACE_UPDATE_EXPECTED"


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


@pytest.fixture
def expected_estimate_text() -> Callable[[str, str], None]:
    """``check(name, text)``: ``text`` equals ``tests/expected/<name>``; with ``MEMTRACE_UPDATE_EXPECTED=1``, writes it."""

    def check(name: str, text: str) -> None:
        path = EXPECTED / name
        if os.environ.get(UPDATE_ENV) == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n", encoding="utf-8")
            return
        assert path.is_file(), f"{path} is missing: run the test with {UPDATE_ENV}=1 to write it"
        assert text + "\n" == path.read_text(encoding="utf-8"), f"differs from {path} ({UPDATE_ENV}=1 rewrites it)"

    return check
