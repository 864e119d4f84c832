"""The estimate on fake tensors against MemTrace's measurement of real CPU runs, and its closed-form figures."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lm_helpers import MLP, TinyLM, trainer

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.estimator import (
    Estimate,
    InputSpec,
    build_meta_model,
    closed_form,
    compare_estimate,
    compare_phase_peaks,
    comparison_path,
    estimate,
    estimate_for_module,
    estimate_from_config,
    find_max_batch,
)
from lightning_memtrace.models import TINY_QWEN2_CONFIG
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.types import Phase

CONFIGS = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "configs"
PHASES = ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]
EXACT = ["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "inputs_bytes"]
TINY_PARAM_BYTES = 13_714_432
TINY_PARAM_TENSORS = 50  # distinct parameter tensors of the tiny Qwen2 (one float32 `step` each on CPU)
MLP_PARAM_BYTES = (32 * 128 + 128 + 128 * 128 + 128 + 128 + 1) * 4


def _real_run(tmp_path, module, max_steps: int = 3, **kwargs) -> pd.DataFrame:
    # The estimate runs on fake tensors and sees storages; the storage-level (dispatch) tracker measures the same
    # thing on the real run. The default CPU tracker also counts temporaries inside operators.
    callback = MemTrace(history=False, allocation_backend="dispatch")
    trainer(tmp_path, [callback], max_steps=max_steps, **kwargs).fit(module)
    return load_phases(callback.output_dir)


def _check_against_real(est: Estimate, phases: pd.DataFrame) -> pd.DataFrame:
    """Per (step, phase): categories exact to the byte, peak within 3%; returns the per-phase peak comparison."""
    est_rows = est.to_dataframe()
    real = phases[phases.phase.isin(PHASES)]
    merged = pd.merge(est_rows, real, on=["step", "batch_idx", "phase"], suffixes=("_est", "_real"))
    assert len(merged) == len(real) == len(est_rows)
    for column in EXACT:
        assert (merged[f"{column}_est"] == merged[f"{column}_real"]).all(), column
    peaks = compare_phase_peaks(est, phases)
    assert len(peaks) == len(real)
    assert (peaks.error_percent.abs() <= 3.0).all(), peaks
    return peaks


@pytest.fixture(scope="module")
def lm_pair(tmp_path_factory):
    phases = _real_run(tmp_path_factory.mktemp("lm"), TinyLM(batch_size=4, seq_len=64))
    module = TinyLM(batch_size=4, seq_len=64)
    batch = next(iter(module.train_dataloader()))
    return phases, estimate_for_module(module, batch, steps=3), module


def test_causal_lm_matches_real_run(lm_pair):
    phases, est, module = lm_pair
    peaks = _check_against_real(est, phases)
    rows = est.to_dataframe()
    assert (rows.parameters_bytes == TINY_PARAM_BYTES).all()
    assert len(list(module.parameters())) == TINY_PARAM_TENSORS
    after_step = rows[rows.phase == "after_optimizer_step"]
    assert (after_step.optimizer_state_bytes == 2 * TINY_PARAM_BYTES + 4 * TINY_PARAM_TENSORS).all()
    assert (after_step.gradients_bytes == TINY_PARAM_BYTES).all()
    assert (rows.inputs_bytes == 4 * 64 * 8).all()
    # Lightning's order: gradients of the previous step alive through the next forward, none at step 0
    first = rows[rows.step == 0].set_index("phase")
    second = rows[rows.step == 1].set_index("phase")
    assert first.loc["after_forward", "gradients_bytes"] == 0
    assert second.loc["after_forward", "gradients_bytes"] == TINY_PARAM_BYTES
    # the activations autograd saved are the real run's, to the byte
    real_acts = phases[phases.phase == "after_forward"].activations_bytes.max()
    assert second.loc["after_forward", "activations_bytes"] == real_acts > 1_000_000
    # the peak of the steady step is in the forward (activations + last step's gradients)
    assert est.peak_record.phase.value == "after_forward"
    assert peaks.error_percent.abs().max() < 0.01  # in practice within a few bytes
    assert est.peak_bytes == phases.peak_bytes.max()
    cf = est.closed_form
    assert (cf.parameters_bytes, cf.gradients_bytes, cf.optimizer_state_bytes, cf.step_tensor_bytes) == (
        TINY_PARAM_BYTES,
        TINY_PARAM_BYTES,
        2 * TINY_PARAM_BYTES,
        4 * TINY_PARAM_TENSORS,
    )
    assert cf.parameter_count == 3_428_608


def test_compare_estimate_and_comparison_csv(lm_pair, tmp_path):
    phases, est, _ = lm_pair
    table = compare_estimate(est, phases)
    assert list(table.columns) == [
        "category",
        "phase",
        "estimated_bytes",
        "measured_bytes",
        "error_bytes",
        "error_percent",
    ]
    by = table.set_index("category")
    assert by.loc["parameters", "estimated_bytes"] == by.loc["parameters", "measured_bytes"] == TINY_PARAM_BYTES
    assert by.loc["optimizer_state", "measured_bytes"] == 2 * TINY_PARAM_BYTES + 4 * TINY_PARAM_TENSORS
    assert by.loc["optimizer_state", "error_percent"] == 0.0
    assert by.loc["activations", "phase"] == "after_forward"
    assert by.loc["activations", "error_bytes"] == 0
    assert abs(by.loc["peak", "error_percent"]) < 3.0
    assert str(table.estimated_bytes.dtype) == "int64"
    from lightning_memtrace.estimator import write_comparison_csv

    path = write_comparison_csv(table, comparison_path(tmp_path / "memtrace", rank=0))
    assert path.name == "estimate_vs_measured_rank0.csv"
    back = pd.read_csv(path)
    assert list(back.category) == list(table.category)
    assert (back.estimated_bytes == table.estimated_bytes).all()
    assert not list(path.parent.glob(".*.tmp"))


def test_mlp_matches_real_run_byte_for_byte_with_accumulation(tmp_path):
    phases = _real_run(tmp_path, MLP(), accumulate_grad_batches=2)
    module = MLP()
    est = estimate_for_module(module, next(iter(module.train_dataloader())), accumulate_grad_batches=2, steps=3)
    _check_against_real(est, phases)
    rows = est.to_dataframe()
    assert len(rows[rows.phase == "after_optimizer_step"]) == 3 and len(rows[rows.phase == "batch_start"]) == 6
    assert (rows.parameters_bytes == MLP_PARAM_BYTES).all()
    assert rows.optimizer_state_bytes.max() == 2 * MLP_PARAM_BYTES + 4 * 6
    # accumulation: no zero_grad on the stepping batch, gradients alive across the window
    assert (rows[(rows.batch_idx % 2 == 1)].gradients_bytes == MLP_PARAM_BYTES).all()
    merged = pd.merge(rows, phases, on=["step", "batch_idx", "phase"], suffixes=("_e", "_r"))
    assert (merged.peak_bytes_e == merged.peak_bytes_r).all()  # exact on a plain MLP


def test_gradient_checkpointing_with_bf16_mixed_matches_real_run(tmp_path):
    module = TinyLM(batch_size=2, seq_len=64, gradient_checkpointing=True)
    phases = _real_run(tmp_path, module, max_steps=2, precision="bf16-mixed")
    plain_module = TinyLM(batch_size=2, seq_len=64)
    batch = next(iter(plain_module.train_dataloader()))
    est = estimate_for_module(plain_module, batch, precision="bf16-mixed", gradient_checkpointing=True, steps=2)
    assert est.gradient_checkpointing and est.precision == "bf16-mixed"
    peaks = _check_against_real(est, phases)
    assert peaks.error_percent.abs().max() < 0.01  # autocast without its weight cache, as Lightning runs it
    plain = estimate_for_module(plain_module, batch, precision="bf16-mixed", steps=2)
    acts = est.category_bytes("after_forward")
    assert 0 < acts["activations"] < plain.category_bytes("after_forward")["activations"] / 2
    assert est.peak_bytes < plain.peak_bytes


def test_estimate_leaves_the_module_alone_and_allocates_nothing_real():
    module = MLP()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    batch = (InputSpec((1_000_000, 32)), InputSpec((1_000_000, 1)))
    with AllocationTracker("cpu") as outer:  # a running MemTrace does not see the estimate
        est = estimate(module, batch, training_step=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    assert outer.peak < 1_000_000
    # one million samples: the forward alone is about 1.1 GB of activations, none of it real
    assert est.category_bytes("after_forward")["activations"] > 1_000_000_000
    for name, p in module.named_parameters():
        assert p.grad is None and torch.equal(p, before[name]) and type(p) is torch.nn.Parameter
    assert est.closed_form.parameters_bytes == MLP_PARAM_BYTES


ONE_LAYER = dict(TINY_QWEN2_CONFIG, num_hidden_layers=1)
ONE_LAYER_PARAM_BYTES = 5_002_240  # 1,250,560 parameters, tied embeddings once
ONE_LAYER_TENSORS = 14


@pytest.fixture(scope="module")
def one_layer():
    return build_meta_model(ONE_LAYER)


def test_precisions_on_a_config(one_layer):
    def run(precision: str) -> Estimate:
        return estimate_from_config(ONE_LAYER, 2, 64, device="cpu", precision=precision, model=one_layer)

    fp32, bf16_true, mixed, fp16 = run("32-true"), run("bf16-true"), run("bf16-mixed"), run("16-mixed")
    assert fp32.category_bytes()["parameters"] == ONE_LAYER_PARAM_BYTES
    assert fp32.category_bytes()["optimizer_state"] == 2 * ONE_LAYER_PARAM_BYTES + 4 * ONE_LAYER_TENSORS
    assert bf16_true.category_bytes()["parameters"] == ONE_LAYER_PARAM_BYTES // 2
    assert bf16_true.category_bytes()["optimizer_state"] == ONE_LAYER_PARAM_BYTES + 4 * ONE_LAYER_TENSORS
    # mixed precision keeps fp32 weights, gradients and state
    for est in (mixed, fp16):
        assert est.category_bytes()["parameters"] == ONE_LAYER_PARAM_BYTES
        assert est.category_bytes()["gradients"] == ONE_LAYER_PARAM_BYTES
        assert est.closed_form.optimizer_state_bytes == 2 * ONE_LAYER_PARAM_BYTES
    # the meta model used for the estimates is untouched
    assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in one_layer.parameters())


def test_cuda_target_without_cuda_leaves_out_host_step_tensors(one_layer):
    cuda = estimate_from_config(ONE_LAYER, 2, 64, device="cuda", model=one_layer)
    cpu = estimate_from_config(ONE_LAYER, 2, 64, device="cpu", model=one_layer)
    assert cuda.device == "cuda"
    assert cuda.category_bytes()["optimizer_state"] == 2 * ONE_LAYER_PARAM_BYTES
    assert cuda.closed_form.step_tensor_bytes == 0
    assert cpu.category_bytes()["optimizer_state"] == 2 * ONE_LAYER_PARAM_BYTES + 4 * ONE_LAYER_TENSORS
    # CUDA's default foreach AdamW holds N·P of temporaries (sqrt of every exp_avg_sq at once) on top of weights,
    # gradients and state; the CPU single-tensor path only two temporaries of one parameter at a time
    cuda_step = cuda.phase_peaks()[Phase.AFTER_OPTIMIZER_STEP]
    cpu_step = cpu.phase_peaks()[Phase.AFTER_OPTIMIZER_STEP]
    assert cuda_step >= 5 * ONE_LAYER_PARAM_BYTES
    assert 4 * ONE_LAYER_PARAM_BYTES < cpu_step < 5 * ONE_LAYER_PARAM_BYTES


def test_closed_form_sgd_and_tied_weights():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cf = closed_form(model, sgd)
    assert (cf.parameter_count, cf.parameters_bytes, cf.optimizer_state_bytes) == (40, 160, 160)
    assert closed_form(model, torch.optim.SGD(model.parameters(), lr=0.1)).optimizer_state_bytes == 0
    assert closed_form(model, "adamw", steps_on_device=True).optimizer_state_with_steps_bytes == 324


def test_qwen2_5_1_5b_exact_fast_and_small(tmp_path):
    """The one big test: Qwen2.5-1.5B, AdamW, fp32, batch 16 x 256, in a fresh process (time and peak RSS)."""
    script = textwrap.dedent(f"""
        import json, resource, time, warnings
        warnings.filterwarnings("ignore")
        from lightning_memtrace.estimator import estimate_from_config
        start = time.perf_counter()
        est = estimate_from_config({str(CONFIGS / "qwen2.5-1.5b.json")!r}, 16, 256, optimizer="adamw", device="cuda")
        seconds = time.perf_counter() - start
        cats = est.category_bytes()
        print(json.dumps({{"seconds": seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "parameters": cats["parameters"], "gradients": cats["gradients"],
                          "optimizer_state": cats["optimizer_state"], "peak": est.peak_bytes,
                          "closed": est.closed_form.as_dict(),
                          "activations": cats["activations"], "peak_phase": est.peak_record.phase.value}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["parameters"] == 6_174_857_216  # tied embeddings once
    assert result["gradients"] == 6_174_857_216
    assert result["optimizer_state"] == 12_349_714_432  # step tensors are host memory on CUDA
    assert result["closed"]["parameters_bytes"] == 6_174_857_216
    assert result["closed"]["optimizer_state_bytes"] == 12_349_714_432
    assert result["closed"]["parameter_count"] == 1_543_714_304
    assert result["seconds"] <= 60, result
    assert result["rss"] <= 2 * 1024**3, result
    # activations at batch 16 x 256: logits alone are 16*256*151936*4 B = 2.3 GiB, upcast and softmaxed again
    assert result["activations"] > 16 * 256 * 151_936 * 4
    assert result["peak_phase"] == "after_forward"
    assert result["peak"] > 6_174_857_216 * 4


def _mlp_peak(batch_size: int) -> int:
    module = MLP(batch_size=batch_size)
    batch = (InputSpec((batch_size, 32)), InputSpec((batch_size, 1)))
    return estimate_for_module(module, batch, steps=2).peak_bytes


def test_max_batch_search_is_monotone_and_holds_on_a_real_run(tmp_path):
    peaks = {b: _mlp_peak(b) for b in range(1, 65)}
    values = [peaks[b] for b in sorted(peaks)]
    assert all(a <= b for a, b in itertools.pairwise(values))
    assert values[-1] > values[0]
    # a budget between the peaks of 40 and 41: the search answers 40, whatever its path
    cap = (peaks[40] + peaks[41]) // 2
    calls: list[int] = []

    def counted(size: int) -> int:
        calls.append(size)
        return peaks[size] if size in peaks else _mlp_peak(size)

    result = find_max_batch(counted, cap, high=1024)
    assert result.batch_size == 40 and not result.capped
    assert len(calls) <= 16  # doubling, then bisection
    # monotone in the budget too
    answers = [find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[b]).batch_size for b in (10, 30, 40)]
    assert answers == [10, 30, 40]
    assert find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[1] - 1).batch_size == 0
    # run for real: the tracker's peak over the run stays under the cap at 40 and goes over it at 41
    fit = _real_run(tmp_path / "b40", MLP(batch_size=40), max_steps=2).peak_bytes.max()
    over = _real_run(tmp_path / "b41", MLP(batch_size=41), max_steps=2).peak_bytes.max()
    assert fit <= cap < over
    assert fit == peaks[40] and over == peaks[41]


def test_plain_module_with_optimizer_factory_and_bad_inputs():
    model = torch.nn.Linear(8, 4)
    est = estimate(
        model,
        torch.empty(3, 8, device="meta"),
        optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        device="cpu",
    )
    assert est.optimizer == "SGD"
    assert est.category_bytes()["optimizer_state"] == (8 * 4 + 4) * 4
    assert est.batch_size == 3
    with pytest.raises(ValueError, match="precision"):
        estimate(model, torch.empty(3, 8), precision="8-bit")
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        estimate(model, torch.empty(3, 8), gradient_checkpointing=True)
    assert not math.isnan(est.seconds)


class _EstimateAtFirstBatch(pl.Callback):
    """What ``MemTrace(estimate=True)`` does: estimate from the real module and first batch, inside the real run."""

    def __init__(self) -> None:
        self.estimate: Estimate | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.estimate is None:
            self.estimate = estimate_for_module(
                pl_module,
                batch,
                precision=trainer.precision,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
                steps=3,
            )


def test_estimate_inside_a_running_fit_does_not_disturb_the_measurement(tmp_path):
    reference = _real_run(tmp_path / "plain", MLP())
    callback, probe = MemTrace(history=False, allocation_backend="dispatch"), _EstimateAtFirstBatch()
    module = MLP()
    # after MemTrace: its tracker is running and its saved-tensor hooks are pushed when the estimate runs
    trainer(tmp_path / "probed", [callback, probe], max_steps=3).fit(module)
    phases = load_phases(callback.output_dir)
    columns = [c for c in phases.columns if c.endswith("_bytes")]
    assert (phases[columns].to_numpy() == reference[columns].to_numpy()).all()
    assert probe.estimate is not None and probe.estimate.precision == "32-true"
    _check_against_real(probe.estimate, phases)
    assert all(type(p) is torch.nn.Parameter for p in module.parameters())
