"""Quantized weights (bitsandbytes' 4-bit QLoRA and 8-bit LLM.int8 layers, as ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`` loads them, with peft's LoRA on top): MemTrace names their scales and
code tables as parameters, and the estimate of such a module (fake tensors) matches a real CPU run of it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from estimate_checks import check_against_real, real_run
from test_tasks import QWEN2, TaskModule

from lightning_memtrace.estimator import estimate

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _quantized_module(tmp_path, bits: int) -> TaskModule:
    """The tiny Qwen2 classifier saved, loaded back quantized on the CPU (nf4 with double quantization, or int8), with
    LoRA on ``q_proj`` and ``v_proj`` (peft's ``SEQ_CLS``: the head trained in full), in training mode."""
    import transformers

    module = TaskModule("sequence-classification", QWEN2)
    module.model.save_pretrained(tmp_path / "saved")
    if bits == 4:
        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    else:
        config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "saved", quantization_config=config, device_map="cpu"
        )
    except Exception as error:  # a bitsandbytes without CPU kernels
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {error}")
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, target_modules=["q_proj", "v_proj"])
    module.model = peft.get_peft_model(model, lora)
    # from_pretrained leaves the model in eval mode, where bitsandbytes repacks 4-bit weights for CPU inference
    module.model.train()
    return module


def _weight_bytes(module: torch.nn.Module, bits: int) -> int:
    """Every parameter's memory and, read attribute by attribute, the quantized weights' scales and code tables: what
    MemTrace must count as parameters."""
    tensors: list[torch.Tensor] = list(module.parameters())
    for layer in module.modules():
        if bits == 4 and isinstance(layer, bnb.nn.Linear4bit):
            state = layer.weight.quant_state
            tensors += [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        elif bits == 8 and isinstance(layer, bnb.nn.Linear8bitLt):
            held = (layer.weight.CB, layer.weight.SCB, layer.state.CB, layer.state.SCB)
            tensors += [t for t in held if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("bits", [4, 8], ids=["nf4-qlora", "int8-lora"])
def test_a_quantized_modules_estimate_matches_a_real_run(tmp_path, bits):
    """Categories exact at every (step, phase) and peaks within 3%, against MemTrace's default tracker on a real run;
    the parameters are the packed weights and their scales, byte for byte. The estimate could not copy a 4-bit
    weight (it lost its ``quant_state``) nor an 8-bit layer's state, and MemTrace counted no scales."""
    module = _quantized_module(tmp_path, bits)
    batch = next(iter(module.train_dataloader()))
    est = estimate(module, batch, device="cpu", steps=3)
    phases = real_run(tmp_path / "run", module, allocation_backend="auto")
    check_against_real(est, phases)
    weights = _weight_bytes(module, bits)  # after the run: an 8-bit layer moves its scales at its first forward
    assert set(phases.parameters_bytes[phases.step >= 1]) == {weights}
    assert est.closed_form.parameters_bytes == weights
    packed = sum(p.nbytes for p in module.parameters() if p.dtype in (torch.uint8, torch.int8))
    assert weights > packed > 0  # the scales are there, beside the packed weights


def test_a_quantized_modules_estimate_runs_for_a_cuda_target(tmp_path):
    """The same 4-bit module estimated for CUDA on this machine (bitsandbytes' fake kernels), in bf16-mixed as QLoRA
    runs: its parameters as on the CPU, its scales included."""
    module = _quantized_module(tmp_path, 4)
    batch = next(iter(module.train_dataloader()))
    est: Any = estimate(module, batch, device="cuda", steps=2, precision="bf16-mixed")
    assert est.to_dataframe().parameters_bytes.iloc[0] == _weight_bytes(module, 4)
    assert est.peak_bytes > est.to_dataframe().allocated_bytes.iloc[0]
