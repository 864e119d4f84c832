"""The estimate's table as text, against expected-output files in ``tests/expected`` (``estimator.result``).

``MEMTRACE_UPDATE_EXPECTED=1`` rewrites the files from the current output (then review the diff).
"""

from __future__ import annotations

import dataclasses

from estimate_checks import ONE_LAYER

from lightning_memtrace.estimator import estimate_from_config
from lightning_memtrace.units import format_bytes


def test_table_one_layer_fp32_adamw_cpu(one_layer, expected):
    est = estimate_from_config(ONE_LAYER, 2, 64, device="cpu", model=one_layer)
    expected(est.table() + "\n", "estimate_one_layer_fp32_adamw_cpu.txt")


def test_table_one_layer_bf16_mixed_sgd_checkpointing_accumulate(one_layer, expected):
    est = estimate_from_config(
        ONE_LAYER,
        2,
        64,
        device="cpu",
        optimizer="sgd",
        precision="bf16-mixed",
        gradient_checkpointing=True,
        accumulate_grad_batches=2,
        model=one_layer,
    )
    expected(est.table() + "\n", "estimate_one_layer_bf16_mixed_sgd_checkpointing_cpu.txt")


def test_table_names_the_step_it_shows_and_the_peak_step(one_layer):
    """Issue 13, point 8: the callback's table (3 steps) said "step 2, steady state" above "peak ... step 1"."""
    est = estimate_from_config(ONE_LAYER, 2, 64, device="cpu", model=one_layer, steps=3)
    lines = est.table().splitlines()
    assert lines[0].startswith("estimate (rows of step 2, steady state)")
    assert lines[-1].startswith("peak of steps 0-2: ") and " in step 2, " in lines[-1]
    # where the peak is in an earlier step, the line names that step and gives the shown step's own peak
    high = est.peak_bytes + 1_000_000
    bumped = tuple(
        dataclasses.replace(r, peak_bytes=high) if (r.step, r.phase.value) == (1, "after_forward") else r
        for r in est.records
    )
    last = dataclasses.replace(est, records=bumped).table().splitlines()[-1]
    assert last.startswith("peak of steps 0-2: ") and f"({high:,} B) in step 1, " in last
    own = max(r.peak_bytes for r in est.records if r.step == 2)
    assert last.endswith(f"; step 2 (shown above) peaks at {format_bytes(own)} ({own:,} B)")


def test_table_labels_micro_batches_and_sgd_momentum(one_layer):
    """Issue 13, point 8: unlabelled micro-batch blocks; ``sgd`` has momentum (state), ``sgd-plain`` has none."""
    momentum = estimate_from_config(
        ONE_LAYER, 2, 64, device="cpu", optimizer="sgd", accumulate_grad_batches=3, model=one_layer
    )
    table = momentum.table()
    labels = [line for line in table.splitlines() if line.startswith("micro-batch")]
    assert [label.split(" (")[0] for label in labels] == ["micro-batch 1/3", "micro-batch 2/3", "micro-batch 3/3"]
    assert "SGD (momentum 0.9)" in table.splitlines()[0]
    assert momentum.as_dict()["optimizer_detail"] == "momentum 0.9"
    plain = estimate_from_config(ONE_LAYER, 2, 64, device="cpu", optimizer="sgd-plain", model=one_layer)
    assert "SGD (no momentum, no state)" in plain.describe()
    assert plain.category_bytes()["optimizer_state"] == 0 == plain.closed_form.optimizer_state_bytes
    assert not any(line.startswith("micro-batch") for line in plain.table().splitlines())
