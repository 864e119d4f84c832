"""What would fit (``estimator.what_if``, ``estimator.remedies``): each measured remedy's prediction against a real
CPU Lightning run with the remedy applied, and the combination the search picks run for real under its budget."""

from __future__ import annotations

import importlib.util
import os

import pandas as pd
import pytest
from estimate_checks import PHASES, real_run
from lm_helpers import MLP, TinyLM

from lightning_memtrace.estimator.remedies import FORMULA_REMEDIES, Remedy, Settings, apply_remedies
from lightning_memtrace.estimator.what_if import formula_peak, what_if, what_if_result
from lightning_memtrace.estimator.what_if_results import HEADROOM_BYTES, HEADROOM_FRACTION, WhatIf, usable_bytes
from lightning_memtrace.estimator.what_if_setups import resize_batch
from lightning_memtrace.types import Category

#: The issue's size (8 x 128) with MEMTRACE_FULL_WHAT_IF=1 (bf16 on CPU makes it minutes per remedy); a smaller
#: batch otherwise, which checks the same code paths byte for byte in the time CI has.
LM_BATCH, LM_SEQ = (8, 128) if os.environ.get("MEMTRACE_FULL_WHAT_IF") else (2, 32)
MLP_BATCH = 16
TOLERANCE = 0.03
#: Prediction vs real run per (model, remedy), printed at the end of the module (pytest -s shows it).
MEASURED: list[tuple[str, str, int, int]] = []


def _lm(batch_size: int = LM_BATCH) -> TinyLM:
    return TinyLM(batch_size=batch_size, seq_len=LM_SEQ)


def _predict(module, **kwargs) -> WhatIf:
    batch = next(iter(module.train_dataloader()))
    return what_if_result(module, batch, device="cpu", steps=3, max_batch=False, **kwargs)


@pytest.fixture(scope="module")
def lm_what_if() -> WhatIf:
    return _predict(_lm())


@pytest.fixture(scope="module")
def mlp_what_if() -> WhatIf:
    return _predict(MLP(batch_size=MLP_BATCH))


def _real(tmp_path, make, remedy: str | None, batch_size: int):
    """A real CPU run of a fresh module with ``remedy`` applied as the prediction assumed it (3 steps)."""
    settings = Settings(batch_size=batch_size)
    new = settings.with_remedies([remedy] if remedy else [])
    module = make(new.batch_size)
    apply_remedies(module, [remedy] if remedy else [], settings)
    return real_run(
        tmp_path, module, max_steps=3, precision=new.precision, accumulate_grad_batches=new.accumulate_grad_batches
    )


def _check(name: str, row, phases: pd.DataFrame) -> None:
    """The predicted peak and category bytes within 3% of the most the real run recorded after its first step."""
    real = phases[phases.phase.isin(PHASES) & (phases.step >= 1)]
    real_peak = int(real.peak_bytes.max())
    MEASURED.append((name, row.remedy, row.peak_bytes, real_peak))
    assert abs(row.peak_bytes - real_peak) <= TOLERANCE * real_peak, (row.peak_bytes, real_peak)
    for category in Category:
        predicted, measured = row.categories[category.value], int(real[f"{category.value}_bytes"].max())
        slack = max(TOLERANCE * max(predicted, measured), 64)  # "other": a few bytes of loss scalars
        assert abs(predicted - measured) <= slack, (category.value, predicted, measured)


def _row(result: WhatIf, remedy: Remedy):
    rows = {row.remedy: row for row in result.rows}
    if remedy.value not in rows:
        pytest.skip(f"{remedy.value} not estimated here: {result.skipped.get(remedy.value)}")
    return rows[remedy.value]


#: gradient_as_bucket_view is a DDP run's (against real DDP runs in tests/test_ddp.py).
MEASURED_REMEDIES = [
    r for r in Remedy if r not in FORMULA_REMEDIES and r not in (Remedy.FP16_MIXED, Remedy.GRADIENT_AS_BUCKET_VIEW)
]


@pytest.mark.slow
@pytest.mark.parametrize("remedy", MEASURED_REMEDIES, ids=lambda r: r.value)
def test_tiny_qwen2_remedy_matches_real_run(tmp_path, lm_what_if, remedy):
    row = _row(lm_what_if, remedy)
    assert row.kind == "measured" and row.saved_bytes == lm_what_if.estimate.peak_bytes - row.peak_bytes
    _check("tiny qwen2", row, _real(tmp_path, _lm, remedy.value, LM_BATCH))


@pytest.mark.parametrize(
    "remedy", [r for r in MEASURED_REMEDIES if r not in (Remedy.LORA, Remedy.QLORA)], ids=lambda r: r.value
)
def test_mlp_remedy_matches_real_run(tmp_path, mlp_what_if, remedy):
    row = _row(mlp_what_if, remedy)
    _check("mlp", row, _real(tmp_path, lambda b: MLP(batch_size=b), remedy.value, MLP_BATCH))


def test_remedies_save_what_they_should(lm_what_if, mlp_what_if):
    rows = {row.remedy: row for row in lm_what_if.rows}
    today = lm_what_if.estimate.category_bytes()
    assert rows["gradient_checkpointing"].categories["activations"] < today[Category.ACTIVATIONS] / 3
    assert rows["bf16-true"].categories["parameters"] == today[Category.PARAMETERS] // 2
    assert rows["adafactor"].categories["optimizer_state"] < today[Category.OPTIMIZER_STATE] / 50
    assert rows["lora"].categories["gradients"] < today[Category.GRADIENTS] / 10
    # QLoRA: LoRA's gradients and state, and the base's layers in 4 bits (the tied embedding stays as it is)
    qlora, lora = rows["qlora"].categories, rows["lora"].categories
    assert qlora["gradients"] == lora["gradients"] and qlora["parameters"] < lora["parameters"] / 3
    assert rows["half_micro_batch"].categories["activations"] < today[Category.ACTIVATIONS] * 0.6
    assert rows["optimizer_offload"].kind == "formula" and rows["optimizer_offload"].categories["optimizer_state"] == 0
    assert "lora" in mlp_what_if.skipped and "no attention projection" in mlp_what_if.skipped["lora"]
    assert mlp_what_if.skipped["qlora"] == "ValueError: MLP holds no Hugging Face model: it cannot be loaded quantized"
    assert mlp_what_if.skipped["fsdp"].startswith("needs --devices")


def test_formulas_shard_model_states_and_keep_activations(lm_what_if):
    est = lm_what_if.estimate
    peak, cats = formula_peak(est, [Remedy.FSDP], devices=4, gathered=0)
    today = {c.value: v for c, v in est.category_bytes().items()}
    assert cats["parameters"] == today["parameters"] // 4 and cats["gradients"] == today["gradients"] // 4
    assert cats["activations"] == today["activations"]
    states = max(r.parameters_bytes + r.gradients_bytes + r.optimizer_state_bytes for r in est.records)
    assert est.peak_bytes - states < peak < est.peak_bytes
    both, cats = formula_peak(est, [Remedy.FSDP, Remedy.OPTIMIZER_OFFLOAD], devices=4, gathered=0)
    assert both < peak and cats["optimizer_state"] == 0


def test_adamw_8bit_is_a_formula_without_bitsandbytes(monkeypatch, mlp_what_if):
    from lightning_memtrace.estimator import remedies

    monkeypatch.setattr(remedies, "adamw_8bit_measured", lambda: False)
    result = _predict(MLP(batch_size=MLP_BATCH), remedies=["adamw_8bit"])
    row = result.rows[0]
    today = result.estimate.category_bytes()[Category.OPTIMIZER_STATE]
    assert row.kind == "formula" and row.categories["optimizer_state"] == today // 4
    assert 0 < row.saved_bytes <= today - today // 4


def test_bitsandbytes_is_imported_quietly_and_offline():
    """MemTrace's import of bitsandbytes (the 8-bit AdamW what-if, at the end of a fit or in an OOM post-mortem) puts
    no line on stderr and never lets bitsandbytes ask ``kernels`` for a Hub kernel; an import the user made first, of
    either package, is the one that stays."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    code = (
        "import sys, logging\n"
        "logging.getLogger('bitsandbytes').setLevel(logging.INFO)\n"
        "from lightning_memtrace.estimator.remedies import import_bitsandbytes\n"
        "{before}"
        "bnb = import_bitsandbytes()\n"
        "assert bnb.optim.AdamW8bit and import_bitsandbytes() is bnb\n"
        "assert logging.getLogger('bitsandbytes').level == logging.INFO\n"
        "print(sorted(m for m in ('kernels', 'bitsandbytes') if sys.modules.get(m) is not None))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    ours = subprocess.run([sys.executable, "-c", code.format(before="")], capture_output=True, text=True, env=env)
    assert ours.returncode == 0 and ours.stderr == "" and ours.stdout == "['bitsandbytes']\n", ours.stderr
    if importlib.util.find_spec("kernels") is not None:
        first = "import kernels\nkept = kernels\n"
        kept = code.format(before=first) + "assert sys.modules['kernels'] is kept\n"
        theirs = subprocess.run([sys.executable, "-c", kept], capture_output=True, text=True, env=env)
        assert theirs.returncode == 0 and theirs.stdout == "['bitsandbytes', 'kernels']\n", theirs.stderr


def _device_memory_for(usable: int) -> int:
    memory = int((usable + HEADROOM_BYTES) / (1 - HEADROOM_FRACTION))
    while usable_bytes(memory) > usable:
        memory -= 1
    return memory


#: The remedies of the combination test: float32 ones, whose real CPU runs are quick (CPU bf16 matmuls are slow).
COMBINED = ["optimizer_foreach_off", "half_micro_batch", "gradient_checkpointing", "adafactor"]


@pytest.mark.slow
def test_combination_that_fits_runs_under_its_budget(tmp_path, lm_what_if):
    rows = {row.remedy: row for row in lm_what_if.rows if row.remedy in COMBINED}
    best_single = min(row.peak_bytes for row in rows.values())
    usable = best_single - max(64 * 1024, best_single // 100)  # no remedy fits alone: a combination must
    memory = _device_memory_for(usable)
    result = _predict(_lm(), device_memory=memory, remedies=COMBINED)
    assert result.today_fits is False
    combo = result.combination
    assert combo is not None and combo.fits and combo.kind == "measured" and len(combo.remedies) >= 2
    assert combo.peak_bytes <= usable < result.estimate.peak_bytes
    assert list(combo.remedies) == sorted(combo.remedies, key=[r.value for r in Remedy].index)
    settings = Settings(batch_size=LM_BATCH).with_remedies(combo.remedies)
    module = _lm(settings.batch_size)
    apply_remedies(module, combo.remedies, Settings(batch_size=LM_BATCH))
    phases = real_run(
        tmp_path, module, precision=settings.precision, accumulate_grad_batches=settings.accumulate_grad_batches
    )
    real_peak = int(phases[phases.step >= 1].peak_bytes.max())
    MEASURED.append(("tiny qwen2", " + ".join(combo.remedies), combo.peak_bytes, real_peak))
    assert real_peak <= usable
    assert abs(combo.peak_bytes - real_peak) <= TOLERANCE * real_peak
    assert "Trainer(" in combo.snippet or "configure_optimizers" in combo.snippet


def test_dataframe_max_micro_batch_and_snippet():
    module = MLP(batch_size=MLP_BATCH)
    batch = next(iter(module.train_dataloader()))
    plain = what_if(module, batch, device="cpu", remedies=["bf16-true"], max_batch=False)
    memory = _device_memory_for(plain.attrs["peak_bytes"] + 40_000)
    frame = what_if(module, batch, device="cpu", device_memory=memory, remedies=["bf16-true", "half_micro_batch"])
    assert list(frame.columns[:7]) == [
        "remedy",
        "peak_bytes",
        "saved_bytes",
        "fits",
        "max_micro_batch",
        "kind",
        "price",
    ]
    assert {f"{c.value}_bytes" for c in Category} <= set(frame.columns)
    assert frame.attrs["combination"]["remedies"] == [] and frame.attrs["combination"]["snippet"] == "(no change)"
    row = frame.set_index("remedy").loc["bf16-true"]
    assert bool(row.fits) and row.max_micro_batch > MLP_BATCH
    bigger = resize_batch(batch, int(row.max_micro_batch) + 1)
    over = what_if(module, bigger, device="cpu", remedies=["bf16-true"], max_batch=False)
    assert over.peak_bytes.iloc[0] > usable_bytes(memory)


def test_workers_give_the_same_answer():
    """``jobs=2``: the remedies' estimates run in forked workers (other processes), and the answer is the one of
    ``jobs=1`` to the byte: rows, categories, skip reasons (a remedy that fails in a worker included), combination."""
    import os

    from lightning_memtrace.estimator.forked import can_fork, map_forked

    if not can_fork():
        pytest.skip("forked workers need Linux without CUDA initialised")
    pids = map_forked(lambda item: (item, os.getpid()), [1, 2, 3], 2)
    assert [item for item, _ in pids] == [1, 2, 3] and os.getpid() not in {pid for _, pid in pids}

    module = MLP(batch_size=MLP_BATCH)
    batch = next(iter(module.train_dataloader()))
    plain = what_if_result(module, batch, device="cpu", remedies=["bf16-true"], max_batch=False)
    kwargs = dict(
        device="cpu",
        remedies=["bf16-true", "half_micro_batch", "adafactor", "lora"],
        device_memory=_device_memory_for(plain.estimate.peak_bytes - 20_000),
        max_batch=False,
    )
    one = what_if_result(module, batch, jobs=1, **kwargs)
    two = what_if_result(module, batch, jobs=2, **kwargs)
    timeless = [{**r.as_dict(), "estimate": {**r.as_dict()["estimate"], "seconds": 0}} for r in (one, two)]
    assert timeless[1] == timeless[0]
    assert [row.remedy for row in one.rows] == ["half_micro_batch", "adafactor", "bf16-true"]
    assert one.skipped["lora"].startswith("ValueError: ") and one.combination is not None


def test_settings_and_snippet_text():
    settings = Settings(batch_size=8).with_remedies(["bf16-mixed", "half_micro_batch", "gradient_checkpointing"])
    assert (settings.precision, settings.batch_size, settings.accumulate_grad_batches) == ("bf16-mixed", 4, 2)
    assert settings.gradient_checkpointing and Remedy.parse("zero3") is Remedy.FSDP
    with pytest.raises(ValueError, match="unknown remedy"):
        Remedy.parse("magic")


def test_zz_report_measured():
    """Not a check: the prediction-vs-real table of this module (run with -s to see it)."""
    lines = [f"{'model':12}{'remedy':44}{'predicted':>14}{'real':>14}{'error %':>9}"]
    for model, remedy, predicted, real in MEASURED:
        lines.append(f"{model:12}{remedy:44}{predicted:>14,}{real:>14,}{100 * (predicted - real) / real:>9.3f}")
    print("\n" + "\n".join(lines))


def test_forked_workers_that_die_leave_the_work_to_this_process():
    """A worker killed mid-task (the system's out-of-memory killer) does not hang the what-if: the work is done in
    this process instead, with the same results."""
    import os
    import signal

    from lightning_memtrace.estimator.forked import can_fork, map_forked

    if not can_fork():
        pytest.skip("forked workers need Linux without CUDA initialised")
    parent = os.getpid()

    def task(item: int) -> tuple[int, bool]:
        if item == 2 and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return item * item, os.getpid() == parent

    results = map_forked(task, [1, 2, 3], 2)
    assert [value for value, _ in results] == [1, 4, 9] and all(here for _, here in results)


def test_the_checkpointing_snippet_runs_on_the_model_without_a_deprecation():
    """Transformers 5.2x deprecates ``gradient_checkpointing_enable``: the snippet calls what the model offers."""
    import warnings

    from lightning_memtrace.estimator.what_if_setups import checkpointing_line
    from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm

    model = build_causal_lm(TINY_QWEN2_CONFIG)
    line = checkpointing_line(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(line, {"model": model})  # noqa: S102 - the snippet's own text, as a user pastes it
    assert model.is_gradient_checkpointing


def test_an_optimizer_the_module_steps_already_is_not_offered_again():
    """A module whose ``configure_optimizers`` returns Adafactor: the ``adafactor`` remedy is skipped ("already
    Adafactor"), where it was listed as saving nothing; the other optimizer remedies stay."""
    from transformers.optimization import Adafactor

    class AdafactorMLP(MLP):
        def configure_optimizers(self):
            return Adafactor(self.parameters(), lr=1e-3, scale_parameter=False, relative_step=False)

    module = AdafactorMLP(batch_size=MLP_BATCH)
    batch = next(iter(module.train_dataloader()))
    remedies = ["adafactor", "optimizer_foreach_off"]
    result = what_if_result(module, batch, device="cpu", max_batch=False, remedies=remedies)
    assert result.estimate.optimizer == "Adafactor"
    assert result.skipped == {"adafactor": "already Adafactor"}
    assert [row.remedy for row in result.rows] == ["optimizer_foreach_off"]
