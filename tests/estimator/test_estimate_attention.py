"""The estimate follows the attention a user's run gets: transformers' default (SDPA for most architectures) on the
kernel the real CPU run dispatches to, within 3% of MemTrace's measurement of real Lightning CPU runs.

All eleven architectures in fp32; bf16-mixed (SDPA's math kernel upcasts inside autocast, its flash kernel does not)
and checkpointing on a representative subset. The full grid: ``benchmarks/estimate_accuracy.py --architectures``.
"""

from __future__ import annotations

import pytest
import transformers
from estimate_checks import check_against_real, real_run
from tiny_architectures import ARCHITECTURES, ConfigLM

from lightning_memtrace.estimator import AttentionUnavailableError, build_meta_model, estimate_from_config

BATCH, SEQ = 4, 128
#: (architecture, precision, checkpointing): every architecture in fp32; the math kernel (gpt2: attention dropout),
#: the flash kernel (llama, qwen2) and eager (gemma2's default) under bf16-mixed and checkpointing.
CASES = [(name, "32-true", False) for name in ARCHITECTURES] + [
    ("gpt2", "bf16-mixed", False),
    ("llama", "bf16-mixed", False),
    ("gemma2", "bf16-mixed", True),
    ("gpt2", "32-true", True),
    ("qwen2", "bf16-mixed", True),
]


@pytest.mark.parametrize("name, precision, checkpointing", CASES, ids=lambda v: str(v))
def test_estimate_matches_real_run_with_default_attention(tmp_path, name, precision, checkpointing):
    config = ARCHITECTURES[name]
    module = ConfigLM(config, BATCH, SEQ, gradient_checkpointing=checkpointing)
    # MemTrace's default CPU tracker (the allocator's own reports), as a user measures
    phases = real_run(tmp_path, module, precision=precision, allocation_backend="auto")
    est = estimate_from_config(
        config, BATCH, SEQ, device="cpu", precision=precision, gradient_checkpointing=checkpointing, steps=3
    )
    implementation = module.model.config._attn_implementation
    assert est.attention.split(" ")[0] == implementation
    check_against_real(est, phases)
    real_peak = phases[phases.step >= 1].peak_bytes.max()
    assert abs(est.peak_bytes - real_peak) <= 0.03 * real_peak


def test_attention_is_stated_and_can_be_set():
    llama = ARCHITECTURES["llama"]
    default = estimate_from_config(llama, 2, 64, device="cpu")
    eager = estimate_from_config(llama, 2, 64, device="cpu", attn_implementation="eager")
    assert default.attention == "sdpa (flash kernel)"
    assert eager.attention == "eager"
    # per layer, eager keeps the B·H·L² probabilities (fp32) where the flash kernel keeps an fp32 logsumexp of B·H·L
    probabilities, logsumexp = 2 * 4 * 64 * 64 * 4, 2 * 4 * 64 * 4
    saved = eager.category_bytes()["activations"] - default.category_bytes()["activations"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert saved == 2 * (probabilities - logsumexp)
    else:  # transformers 4 builds the causal mask for every batch (B×1×L×L fp32), and SDPA keeps it per layer
        assert saved == 2 * (probabilities - logsumexp - 2 * 64 * 64 * 4)
    assert "attention sdpa (flash kernel)" in default.describe()
    assert default.as_dict()["attention"] == "sdpa (flash kernel)"
    gpt2 = estimate_from_config(ARCHITECTURES["gpt2"], 2, 64, device="cpu")
    assert gpt2.attention == "sdpa (math kernel)"  # attention dropout: CPU's flash kernel refuses it


def test_cuda_target_assumes_a_fused_kernel():
    """Estimated on CPU for CUDA: CUDA's flash/efficient kernels take dropout and keep no probabilities."""
    gpt2 = ARCHITECTURES["gpt2"]
    cuda = estimate_from_config(gpt2, 2, 64, device="cuda")
    cpu = estimate_from_config(gpt2, 2, 64, device="cpu")
    assert cuda.attention == "sdpa (CUDA flash/efficient kernel assumed, sized by CPU's flash kernel)"
    # the CPU math kernel keeps probabilities and a dropout mask per layer that CUDA's kernels do not
    assert cpu.category_bytes()["activations"] - cuda.category_bytes()["activations"] >= 2 * (2 * 4 * 64 * 64 * 4)
    eager = estimate_from_config(gpt2, 2, 64, device="cuda", attn_implementation="eager")
    assert eager.attention == "eager"


def test_cuda_target_with_checkpointing_recomputes_attention_on_the_same_kernel():
    """``Tensor.backward`` is a torch function: the SDPA stand-in's mode ran the backward with itself popped, so the
    layers a checkpoint recomputed there ran on CPU's math kernel (dropout), and the checkpoint refused their saved
    tensors (a CheckpointError: every GPT-2 estimate for CUDA with checkpointing failed)."""
    gpt2 = ARCHITECTURES["gpt2"]
    with_dropout = estimate_from_config(gpt2, 2, 64, device="cuda", gradient_checkpointing=True)
    without = estimate_from_config(dict(gpt2, attn_pdrop=0.0), 2, 64, device="cuda", gradient_checkpointing=True)
    # CUDA's fused kernels draw attention dropout inside the kernel: nothing more is kept, in forward or recompute
    figures = [[r.step, r.phase, r.peak_bytes, r.allocated_bytes, r.activations_bytes] for r in with_dropout.records]
    assert figures == [[r.step, r.phase, r.peak_bytes, r.allocated_bytes, r.activations_bytes] for r in without.records]
    plain = estimate_from_config(gpt2, 2, 64, device="cuda")
    assert with_dropout.category_bytes("after_forward")["activations"] < plain.category_bytes("after_forward")[
        "activations"
    ]


def test_flash_attention_without_the_package_is_one_clear_error():
    pytest.importorskip("transformers")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash_attn is installed")
    with pytest.raises(AttentionUnavailableError, match="estimate with 'sdpa'"):
        build_meta_model(ARCHITECTURES["llama"], attn_implementation="flash_attention_2")
