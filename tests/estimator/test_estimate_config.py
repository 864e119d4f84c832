"""The estimate of a Hugging Face causal LM from its config alone (``estimator.config``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from shared_files import config_path
from estimate_checks import CONFIGS, ONE_LAYER, ONE_LAYER_PARAM_BYTES, ONE_LAYER_TENSORS

from lightning_memtrace.estimator import Estimate, estimate_from_config
from lightning_memtrace.types import Phase


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


def test_qwen2_5_1_5b_exact_fast_and_small(tmp_path):
    """The one big test: Qwen2.5-1.5B, AdamW, fp32, batch 16 x 256, in a fresh process (time and peak RSS)."""
    config_path("qwen2.5-1.5b.json")
    script = textwrap.dedent(f"""
        import json, resource, time, warnings
        warnings.filterwarnings("ignore")
        from lightning_memtrace.estimator import estimate_from_config
        start = time.perf_counter()
        est = estimate_from_config({str(CONFIGS / "qwen2.5-1.5b.json")!r}, 16, 256, optimizer="adamw", device="cuda")
        seconds = time.perf_counter() - start
        cats = est.category_bytes()
        # VmHWM is this process's own peak: ru_maxrss also keeps the peak of the (large) test process it was forked from
        hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
        rss = int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({{"seconds": seconds, "rss": rss,
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
