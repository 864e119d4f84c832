"""The textbook figures beside the measured ones (``estimator.closed_form``)."""

from __future__ import annotations

import torch

from lightning_memtrace.estimator import closed_form


def test_closed_form_sgd_and_tied_weights():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cf = closed_form(model, sgd)
    assert (cf.parameter_count, cf.parameters_bytes, cf.optimizer_state_bytes) == (40, 160, 160)
    assert closed_form(model, torch.optim.SGD(model.parameters(), lr=0.1)).optimizer_state_bytes == 0
    assert closed_form(model, "adamw", steps_on_device=True).optimizer_state_with_steps_bytes == 324
