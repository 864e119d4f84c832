"""Models with LayerDrop (OPT, BART, Whisper, wav2vec2...) draw ``torch.rand([]) < layerdrop`` per layer in training:
the estimate answers "not dropped", the step a real run's peak comes from, where a fake value had no answer."""

from __future__ import annotations

import pytest
import torch
from estimate_checks import check_against_real, real_run
from tiny_architectures import ARCHITECTURES, ConfigLM

from lightning_memtrace.estimator import estimate_from_config
from lightning_memtrace.estimator.fake import fake_mode
from lightning_memtrace.estimator.layer_drop import no_layer_dropped

BATCH, SEQ = 2, 64


def test_a_layer_drop_draw_on_fake_tensors_keeps_the_layer():
    mode = fake_mode()
    with mode, no_layer_dropped():
        draws = [torch.rand([]) for _ in range(3)]
        assert [bool(draw < p) for draw, p in zip(draws, (0.0, 0.5, 1))] == [False, False, False]
        assert not torch.lt(draws[0], 0.9)
        # any other question about a fake value is still unanswerable
        from torch._subclasses.fake_tensor import DataDependentOutputException

        with pytest.raises(DataDependentOutputException):
            bool(draws[0] > 0.5)
        with pytest.raises(DataDependentOutputException):
            bool(torch.rand([]) < torch.rand([]))
        with pytest.raises(DataDependentOutputException):
            bool(torch.ones(3).sum() < 1.0)
    with mode, pytest.raises(DataDependentOutputException):
        bool(torch.rand([]) < 0.5)  # outside the context, as torch has it


def test_opt_with_layer_drop_is_estimated_as_every_layer_runs(tmp_path):
    """OPT draws for LayerDrop when ``layerdrop`` > 0 (and, in transformers before 5.2x, always): the estimate is the
    one without LayerDrop, byte for byte, and that one matches a real run (which never drops a layer at 0)."""
    plain = dict(ARCHITECTURES["opt"], layerdrop=0.0)
    dropping = dict(ARCHITECTURES["opt"], layerdrop=0.5)
    estimate = estimate_from_config(dropping, BATCH, SEQ, device="cpu", steps=3)
    est = estimate.to_dataframe()
    est_plain = estimate_from_config(plain, BATCH, SEQ, device="cpu", steps=3).to_dataframe()
    for column in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes"):
        assert est[column].tolist() == est_plain[column].tolist(), column
    # the draws themselves: a 4-byte float and the comparison's 1-byte bool per layer, gone once compared
    assert set((est.peak_bytes - est_plain.peak_bytes).tolist()) <= {0, 5, 10}
    assert est.allocated_bytes.tolist() == est_plain.allocated_bytes.tolist()
    phases = real_run(tmp_path, ConfigLM(plain, BATCH, SEQ), allocation_backend="auto")
    check_against_real(estimate, phases)
