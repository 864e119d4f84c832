"""Models loaded quantized as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` loads them
(QLoRA's 4-bit base, LLM.int8's 8-bit one): a model built from its config on the meta device (no weights, no
memory: ``memtrace estimate --quantize``), or a real module's models from their weights (the what-if's ``qlora``
applied for real).

transformers' own bitsandbytes quantizer picks the layers and replaces them (every ``nn.Linear`` but the output head,
tied weights and the model's ``_keep_in_fp32_modules``), and bitsandbytes quantizes each weight with its own
functions (on the meta device, their meta kernels): the packed weights and their scales have the shapes and dtypes a
real load gives.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_memtrace.estimator.inputs import Precision
from lightning_memtrace.types import Quantization


#: How to install what a quantized model or LoRA needs.
NEEDS_WHATIF = "pip install 'lightning-memtrace[whatif]'"


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype the quantized layers compute in: the precision's half type (QLoRA's ``bnb_4bit_compute_dtype``),
    else float32 (``BitsAndBytesConfig``'s default)."""
    return precision.autocast_dtype or precision.param_dtype or torch.float32


def bitsandbytes_config(quantization: Quantization, precision: Precision, skip: list[str] | None = None) -> object:
    """The ``transformers.BitsAndBytesConfig`` of ``quantization`` (4-bit: nf4 with double quantization, QLoRA's);
    ``skip``: ``llm_int8_skip_modules``, the layers left unquantized (in place of transformers' default ones)."""
    import transformers

    if quantization is Quantization.INT8:
        return transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype(precision),
        llm_int8_skip_modules=skip,
    )


def config_line(quantization: Quantization, precision: Precision, model: nn.Module | None = None) -> str:
    """How a user loads the model so, as code (the what-if's snippet); with ``model``, its task heads left
    unquantized (:func:`task_heads_kept`)."""
    options = ["load_in_8bit=True"]
    if quantization is not Quantization.INT8:
        dtype = str(compute_dtype(precision)).removeprefix("torch.")
        options = ["load_in_4bit=True", 'bnb_4bit_quant_type="nf4"', "bnb_4bit_use_double_quant=True",
                   f"bnb_4bit_compute_dtype=torch.{dtype}"]  # fmt: skip
    heads = task_heads_kept(model) if model is not None else []
    if heads:
        options.append(f"llm_int8_skip_modules={heads!r}".replace("'", '"'))
    return f"BitsAndBytesConfig({', '.join(options)})"


def task_heads_kept(model: nn.Module) -> list[str]:
    """The task heads of ``model``'s Hugging Face models (a classifier's; see
    :func:`~lightning_memtrace.estimator.remedies.lora_heads`), by their names in their model: left unquantized, as
    LoRA trains them in full (a quantized head cannot be trained, and transformers' default skips only the last
    parameter's layer, which misses a head with a bias)."""
    from lightning_memtrace.estimator.remedies import lora_heads

    return sorted({name for hf in _hugging_face_models(model) for name in lora_heads(hf)})


def load_quantized(model: nn.Module, quantization: Quantization | str, precision: Precision) -> nn.Module:
    """``model``'s Hugging Face models (``model`` itself, or those a LightningModule holds) with their layers replaced
    and quantized as loading them with :func:`bitsandbytes_config` would, in place: meta weights stay meta (their
    packed data and scales meta too), real ones are quantized from their values.

    Raises:
        ModuleNotFoundError: bitsandbytes is not installed.
        ValueError: ``model`` holds no Hugging Face model, or nothing to quantize.
    """
    from lightning_memtrace.estimator.remedies import import_bitsandbytes

    try:
        bnb = import_bitsandbytes()
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"a quantized model needs bitsandbytes ({NEEDS_WHATIF}): {error}") from None
    quantization = Quantization(quantization)
    models = _hugging_face_models(model)
    if not models:
        raise ValueError(f"{type(model).__name__} holds no Hugging Face model: it cannot be loaded quantized")
    # bitsandbytes caches its code table on the device of the first weight it quantizes: a meta one would break
    # every real load after this one
    code_tables = bnb.functional.name2qmap
    cached = set(code_tables)
    try:
        quantized = sum(_load(hf, quantization, precision, bnb) for hf in models)
    finally:
        for name in set(code_tables) - cached:
            del code_tables[name]
    if not quantized:
        raise ValueError(f"{type(model).__name__} has no layer that bitsandbytes quantizes")
    return model


def _hugging_face_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``model`` (``model`` itself where it is one)."""
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, sub in model.named_modules():
        inside = any(name.startswith(f"{outer}.") or not outer for outer, _ in found)
        if isinstance(sub, PreTrainedModel) and not inside:
            found.append((name, sub))
    return [sub for _, sub in found]


def _load(model: nn.Module, quantization: Quantization, precision: Precision, bnb: object) -> int:
    """Quantize one Hugging Face model in place (see :func:`load_quantized`); the number of layers quantized."""
    from transformers.quantizers.auto import AutoHfQuantizer

    from transformers.quantizers.base import get_keys_to_not_convert

    before = {
        name: (sub._parameters.get("weight"), sub._parameters.get("bias"))
        for name, sub in model.named_modules()
        if sub._parameters.get("weight") is not None
    }
    heads = task_heads_kept(model)
    skip = sorted(set(get_keys_to_not_convert(model)) | set(heads)) if heads else None
    quantizer = AutoHfQuantizer.from_config(bitsandbytes_config(quantization, precision, skip), pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "meta"})
    quantized = 0
    for name, layer in model.named_modules():
        weight = layer._parameters.get("weight")
        if not isinstance(weight, (bnb.nn.Params4bit, bnb.nn.Int8Params)) or not weight.is_meta:
            continue
        original, bias = before.get(name, (None, None))
        if original is None or original.is_meta:
            # what `.to(device)` does on a real load: the packed weight and its scales (and the layer's reference)
            layer.weight = weight._quantize(torch.device("meta"))
        else:
            values = original.data.t() if getattr(layer, "source_cls", nn.Linear) is not nn.Linear else original.data
            state = {key: value for key, value in weight.__dict__.items() if key != "data"}
            layer.weight = type(weight)(values.contiguous(), requires_grad=False, **state)._quantize(original.device)
            if bias is not None:
                layer.bias = nn.Parameter(bias.data, requires_grad=False)
        quantized += 1
    return quantized


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
