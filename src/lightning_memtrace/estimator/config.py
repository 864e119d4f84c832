"""The estimate of a Hugging Face model from its config alone (a causal LM by default, or another task's model, see
:mod:`~lightning_memtrace.estimator.tasks`): built on the meta device, no weights."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memtrace.estimator.inputs import OptimizerName, Precision
from lightning_memtrace.estimator.remedies import LoraShape, Settings, module_for
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.estimator.run import estimate
from lightning_memtrace.estimator.tasks import Task, prepare_config, task_batch, task_detail
from lightning_memtrace.models import TRANSFORMERS_AVAILABLE, load_config_dict
from lightning_memtrace.types import Quantization


def _hf_config(config: str | os.PathLike | Mapping[str, Any]) -> Any:
    """The ``PretrainedConfig`` of a dict, a ``config.json``, a folder or a hub id (where the network allows)."""
    if isinstance(config, Mapping):
        return _config_of(dict(config))
    path = Path(config).expanduser()
    text = str(config)
    if not path.exists() and (text.endswith(".json") or text.startswith((".", "/", "~")) or os.sep + os.sep in text):
        raise FileNotFoundError(f"no such config file or folder: {text}")
    if path.exists():
        return _config_of(load_config_dict(path))
    return _hub_config(text)


def _config_of(fields: dict[str, Any]) -> Any:
    """``AutoConfig.for_model``; a ``model_type`` this transformers does not know is said in a few words (its own error
    lists every model type it knows, thousands of characters)."""
    import transformers
    from transformers import AutoConfig

    _check_layers(fields)
    try:
        return AutoConfig.for_model(**fields)
    except ValueError as error:
        if "Unrecognized model identifier" not in str(error):
            raise
        raise ValueError(
            f"model_type {fields.get('model_type')!r} is unknown to transformers {transformers.__version__}"
        ) from None


#: Seconds to wait for the hub's host before calling the network unreachable.
HUB_PROBE_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """Whether Hugging Face's offline mode is on (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``, read now)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return str(getattr(constants, "ENDPOINT", "https://huggingface.co"))
    except ImportError:  # pragma: no cover
        return "https://huggingface.co"


def _hub_reachable(endpoint: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connection to the hub's host, ``timeout`` seconds at most (no retries)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_config(hub_id: str) -> Any:
    """The config of a hub id: from the local cache first; offline or unreachable, one clear error at once (no
    retries), so that no one waits for the hub's retries to run out."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(hub_id, local_files_only=True)
    except (OSError, ValueError):
        pass
    if hub_offline():
        raise OSError(
            "not a file or folder, nor in the local Hugging Face cache, and HF_HUB_OFFLINE is set (no download): "
            "pass a config.json or a folder holding one"
        )
    endpoint = _hub_endpoint()
    if not _hub_reachable(endpoint):
        raise ConnectionError(
            f"not a file or folder, nor in the local Hugging Face cache, and {endpoint} cannot be reached (offline?): "
            "pass a config.json or a folder holding one"
        )
    return AutoConfig.from_pretrained(hub_id)  # a hub id, the network reachable


class AttentionUnavailableError(ValueError):
    """The attention implementation asked for cannot be built on this machine (flash-attn not installed...)."""


#: More layers than any model has (the largest have a few hundred); a config asking for more is a typo or hostile,
#: and building its layers one by one would not end (10**9 layers).
MOST_LAYERS = 10_000


#: The names configs give their number of layers (transformers maps them to ``num_hidden_layers``).
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _check_layers(fields: Mapping[str, Any]) -> None:
    """Refuse a layer count no model has, before transformers reads it (a config makes a list of one entry per
    layer as it is built: 10**9 layers never get as far as the model)."""
    for section in (fields, fields.get("text_config")):
        if not isinstance(section, Mapping):
            continue
        for name in _LAYER_FIELDS:
            layers = section.get(name)
            if isinstance(layers, int) and not isinstance(layers, bool) and not 0 <= layers <= MOST_LAYERS:
                raise ValueError(f"{name}={layers}: the estimate builds 0 to {MOST_LAYERS:,} layers")


def build_meta_model(
    config: str | os.PathLike | Mapping[str, Any],
    attn_implementation: str | None = None,
    task: Task | str = Task.CAUSAL_LM,
) -> nn.Module:
    """A Hugging Face model on the meta device (a causal LM, or ``task``'s model), to pass to
    :func:`estimate_from_config` many times.

    Args:
        config: The Hugging Face config (a dict, a ``config.json``, a folder or a hub id).
        attn_implementation: ``eager``, ``sdpa``, ``flash_attention_2``... None: what transformers picks for the
            model, as ``AutoModelForCausalLM.from_config`` does (SDPA for most architectures). The choice is in
            ``model.config._attn_implementation``.
        task: What the model is trained for (:class:`~lightning_memtrace.estimator.tasks.Task`): the auto class that
            builds it (``AutoModelForSequenceClassification`` for ``sequence-classification``...).

    Raises:
        AttentionUnavailableError: ``attn_implementation`` cannot be built here (e.g. ``flash_attention_2`` without
            the ``flash_attn`` package).
    """
    if not TRANSFORMERS_AVAILABLE:
        raise ModuleNotFoundError(str(TRANSFORMERS_AVAILABLE))
    import transformers

    task = Task(task)
    auto_class = getattr(transformers, task.auto_class)
    hf_config = _hf_config(config)
    hf_config.use_cache = False
    prepare_config(task, hf_config)
    # Only what the caller asked for: otherwise transformers' own default, the one a user's from_config gets.
    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            try:
                return auto_class.from_config(hf_config, dtype=torch.float32, **attention)
            except ImportError as error:
                raise AttentionUnavailableError(
                    f"attn_implementation={attn_implementation!r} cannot be built here ({str(error).splitlines()[0]}); "
                    "for a CUDA target, estimate with 'sdpa': CUDA's fused SDPA kernels save the same tensors as "
                    "FlashAttention (q, k, v, the output and an fp32 logsumexp)"
                ) from None


def estimate_from_config(
    config: str | os.PathLike | Mapping[str, Any],
    batch_size: int,
    seq_len: int | None,
    *,
    optimizer: str | OptimizerName = OptimizerName.ADAMW,
    precision: str | int | Precision = "32-true",
    gradient_checkpointing: bool = False,
    accumulate_grad_batches: int = 1,
    device: torch.device | str = "cuda",
    lr: float = 1e-3,
    steps: int = 2,
    model: nn.Module | None = None,
    attn_implementation: str | None = None,
    fsdp: int = 1,
    optimizer_factory: Callable[[nn.Module], Any] | None = None,
    prepare: Callable[[nn.Module], Any] | None = None,
    ddp_buckets: bool = False,
    task: Task | str = Task.CAUSAL_LM,
    target_len: int | None = None,
    image_size: int | None = None,
    quantize: Quantization | str | None = None,
    lora: bool | LoraShape = False,
) -> Estimate:
    """Estimate a Hugging Face causal LM (or ``task``'s model) from its config alone (a dict, a ``config.json``, a
    folder or a hub id).

    The model is built on the meta device (no weights, no download of weights), trained on ``input_ids`` of shape
    ``(batch_size, seq_len)`` with ``labels=input_ids`` (another task: its batch and labels, see
    :func:`~lightning_memtrace.estimator.tasks.task_batch`), with the attention a user's ``from_config`` gets (SDPA for
    most architectures) unless ``attn_implementation`` says otherwise. SDPA runs on the kernel the target would run
    (on CPU the same as a real CPU run; for CUDA, a fused kernel's saved tensors: see
    :mod:`~lightning_memtrace.estimator.attention`); :attr:`Estimate.attention` states which.

    Args:
        config: The Hugging Face config.
        batch_size: Micro-batch size.
        seq_len: Tokens per sequence (None for an image or speech task).
        optimizer: ``adamw``, ``adam``, ``sgd`` (momentum 0.9: one state tensor per parameter) or ``sgd-plain``
            (no momentum, no state).
        precision: Lightning's precision setting.
        gradient_checkpointing: Non-reentrant activation checkpointing.
        accumulate_grad_batches: Batches per optimizer step.
        device: The device to estimate for (``cuda`` by default).
        lr: Learning rate (it does not change memory).
        steps: Optimizer steps to run.
        model: A meta model built before (from :func:`build_meta_model`), to reuse across batch sizes; its own
            attention is kept.
        attn_implementation: ``eager``, ``sdpa``... for the model built here; None: transformers' default for it.
        fsdp: Ranks to shard over with FSDP2 (each decoder layer, then the root); the estimate is rank zero's.
        optimizer_factory: ``factory(fake_model) -> optimizer`` in place of ``optimizer`` (a what-if remedy's).
        prepare: ``fn(fake_model)`` run on the fake copy before the optimizer is built (see :func:`estimate`).
        ddp_buckets: Data-parallel with DDP (``gradient_as_bucket_view=False``): its gradient buckets, a second copy of
            the gradients, are held throughout (see :func:`estimate`).
        task: What the model is trained for (``causal-lm``, ``masked-lm``, ``seq2seq-lm``,
            ``sequence-classification``, ``token-classification``, ``question-answering``, ``image-classification``,
            ``speech-seq2seq``); a ``model`` passed in must be the task's (:func:`build_meta_model` with the same
            ``task``).
        target_len: A seq2seq model's label tokens (default ``seq_len``; speech: the config's
            ``max_target_positions``).
        image_size: An image's side for ``image-classification`` (default: the config's ``image_size``, else 224).
        quantize: Load the base quantized by bitsandbytes, as ``from_pretrained(..., quantization_config=...)``
            does: ``nf4`` (QLoRA's 4-bit base, double quantization, computing in the precision's half type) or
            ``int8`` (see :mod:`~lightning_memtrace.estimator.quantization`). Needs bitsandbytes.
        lora: Train LoRA adapters (peft), the base frozen, as :func:`~lightning_memtrace.estimator.remedies.apply_lora`
            applies them (after quantizing): True for r=16 without dropout on the attention projections (a task head
            in full), or a :class:`~lightning_memtrace.estimator.remedies.LoraShape`. Needs peft.
    """
    name = OptimizerName(str(optimizer).lower())
    precision = Precision.parse(precision)
    task = Task(task)
    built = model if model is not None else build_meta_model(config, attn_implementation, task)
    if quantize and fsdp > 1:
        raise ValueError(
            "FSDP over quantized weights (FSDP-QLoRA, bnb_4bit_quant_storage) is not estimated: estimate --quantize "
            "on one device"
        )
    if quantize or lora:
        adds = Settings(precision=precision.value, quantize=quantize and Quantization(quantize).value, lora=bool(lora))
        shape = lora if isinstance(lora, LoraShape) else None
        built = module_for(built, adds, shape, copy=built is model)  # the caller's model is reused as it is
    batch = task_batch(task, getattr(built, "config", None), batch_size, seq_len, target_len, image_size)

    def factory(fake_model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in fake_model.parameters() if p.requires_grad]
        if name is OptimizerName.ADAMW:
            return torch.optim.AdamW(params, lr=lr)
        if name is OptimizerName.ADAM:
            return torch.optim.Adam(params, lr=lr)
        if name is OptimizerName.SGD_PLAIN:
            return torch.optim.SGD(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    made = estimate(
        built,
        batch,
        optimizer_factory=optimizer_factory or factory,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_checkpointing=gradient_checkpointing,
        device=device,
        steps=steps,
        world_size=fsdp,
        prepare=prepare,
        ddp_buckets=ddp_buckets,
    )
    detail = task_detail(task, batch)
    return dataclasses.replace(made, task=detail) if detail else made
