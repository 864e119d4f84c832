"""A model built from its config, loaded quantized as
``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` loads it (QLoRA's 4-bit base, LLM.int8's
8-bit one), on the meta device: no weights, no memory.

transformers' own bitsandbytes quantizer picks the layers and replaces them (every ``nn.Linear`` but the output head,
tied weights and the model's ``_keep_in_fp32_modules``), and bitsandbytes quantizes each meta weight with its own
functions (their meta kernels): the packed weights and their scales have the shapes and dtypes a real load gives.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_memtrace.estimator.inputs import Precision
from lightning_memtrace.types import Quantization


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype the quantized layers compute in: the precision's half type (QLoRA's ``bnb_4bit_compute_dtype``),
    else float32 (``BitsAndBytesConfig``'s default)."""
    return precision.autocast_dtype or precision.param_dtype or torch.float32


def bitsandbytes_config(quantization: Quantization, precision: Precision) -> object:
    """The ``transformers.BitsAndBytesConfig`` of ``quantization`` (4-bit: nf4 with double quantization, QLoRA's)."""
    import transformers

    if quantization is Quantization.INT8:
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype(precision),
    )


def config_line(quantization: Quantization, precision: Precision) -> str:
    """How a user loads the model so (the estimate's first line, the snippet)."""
    if quantization is Quantization.INT8:
        return "BitsAndBytesConfig(load_in_8bit=True)"
    dtype = str(compute_dtype(precision)).removeprefix("torch.")
    return (
        'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, '
        f"bnb_4bit_compute_dtype=torch.{dtype})"
    )


def load_quantized(model: nn.Module, quantization: Quantization | str, precision: Precision) -> nn.Module:
    """``model`` (a Hugging Face model on the meta device) with its layers replaced and quantized as loading it with
    :func:`bitsandbytes_config` would, in place.

    Raises:
        ModuleNotFoundError: bitsandbytes is not installed.
        ValueError: ``model`` is not a Hugging Face model, or has nothing to quantize.
    """
    from lightning_memtrace.estimator.remedies import import_bitsandbytes

    bnb = import_bitsandbytes()
    from transformers.quantizers.auto import AutoHfQuantizer

    quantization = Quantization(quantization)
    if not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model: it cannot be loaded quantized")
    quantizer = AutoHfQuantizer.from_config(bitsandbytes_config(quantization, precision), pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "meta"})
    meta = torch.device("meta")
    quantized = 0
    # bitsandbytes caches its code table on the device of the first weight it quantizes: a meta one would break
    # every real load after this one
    code_tables = bnb.functional.name2qmap
    cached = set(code_tables)
    try:
        for layer in model.modules():
            weight = layer._parameters.get("weight")
            if isinstance(weight, (bnb.nn.Params4bit, bnb.nn.Int8Params)) and weight.is_meta:
                # what `.to(device)` does on a real load: the packed weight and its scales (and the layer's reference)
                layer.weight = weight._quantize(meta)
                quantized += 1
    finally:
        for name in set(code_tables) - cached:
            del code_tables[name]
    if not quantized:
        raise ValueError(f"{type(model).__name__} has no layer that bitsandbytes quantizes")
    return model


def quantized_layers(model: nn.Module) -> str:
    """The model's quantized weights in words (``"4-bit nf4 weights in 14 layers (bitsandbytes)"``), for the estimate's
    first line; empty where none is. Reads the weights' own attributes, so also on the estimate's fake copy."""
    from lightning_memtrace.capture.storages import is_quantized_weight

    kinds: dict[str, int] = {}
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is None or not is_quantized_weight(weight):
            continue
        if getattr(weight, "quant_state", None) is not None or hasattr(weight, "quant_type"):
            kind = f"4-bit {getattr(weight, 'quant_type', '')}".rstrip()
        else:
            kind = "8-bit"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{kind} weights in {count} layers (bitsandbytes)" for kind, count in kinds.items())
