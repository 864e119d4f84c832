"""The estimate's table as text, against expected-output files in ``tests/expected`` (``estimator.result``).

``MEMTRACE_UPDATE_EXPECTED=1`` rewrites the files from the current output (then review the diff).
"""

from __future__ import annotations

from estimate_checks import ONE_LAYER

from lightning_memtrace.estimator import estimate_from_config


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
