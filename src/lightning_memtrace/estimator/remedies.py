"""What-if remedies: what each one changes in a training setup, what it usually costs, and how it is applied.

Each :class:`Remedy` has a stable identifier (its value), a price (:data:`PRICES`, one short phrase) and a kind:
``measured`` remedies change the setup (:class:`Settings`) and the estimate runs again on fake tensors;
``formula`` remedies (:data:`FORMULA_REMEDIES`: sharding and offloading, which one process cannot run) are closed
forms over the measured categories (see :mod:`lightning_memtrace.estimator.what_if`).

The functions that change a model (:func:`apply_lora`, :func:`enable_checkpointing`) and build an optimizer
(:func:`build_optimizer`) are the ones the estimate uses on its fake copy; call them on a real module to train with
the remedy the prediction assumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memtrace.types import TextEnum


class Remedy(TextEnum):
    """The remedies, in order of price: the cheapest first (the combination search tries them in this order)."""

    GRADIENT_AS_BUCKET_VIEW = "gradient_as_bucket_view"
    OPTIMIZER_FOREACH_OFF = "optimizer_foreach_off"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    ADAMW_8BIT = "adamw_8bit"
    HALF_MICRO_BATCH = "half_micro_batch"
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"
    ADAFACTOR = "adafactor"
    BF16_TRUE = "bf16-true"
    OPTIMIZER_OFFLOAD = "optimizer_offload"
    FSDP = "fsdp"
    LORA = "lora"
    QLORA = "qlora"

    @classmethod
    def parse(cls, value: str | Remedy) -> Remedy:
        """A remedy from its identifier; ``zero3`` is another name for ``fsdp`` (full sharding)."""
        text = str(getattr(value, "value", value)).strip().lower().replace("_", "-")
        for remedy in cls:
            if remedy.value.replace("_", "-") == text:
                return remedy
        if text in ("zero3", "zero-3"):
            return cls.FSDP
        raise ValueError(f"unknown remedy {value!r}; use one of {', '.join(r.value for r in cls)}")


#: Each remedy's usual cost, in one short phrase.
PRICES: dict[Remedy, str] = {
    Remedy.GRADIENT_AS_BUCKET_VIEW: "none (gradients become views of DDP's buckets)",
    Remedy.OPTIMIZER_FOREACH_OFF: "a slightly slower optimizer step",
    Remedy.BF16_MIXED: "none on bf16 hardware (usually faster)",
    Remedy.FP16_MIXED: "loss scaling; overflow risk",
    Remedy.ADAMW_8BIT: "8-bit optimizer moments (needs bitsandbytes)",
    Remedy.HALF_MICRO_BATCH: "twice the micro-steps per optimizer step",
    Remedy.GRADIENT_CHECKPOINTING: "one extra forward per step (~30% slower)",
    Remedy.ADAFACTOR: "a different optimizer (factored 2nd moment, no momentum)",
    Remedy.BF16_TRUE: "bf16 weights and updates (precision loss)",
    Remedy.OPTIMIZER_OFFLOAD: "optimizer step on the CPU, host traffic every step",
    Remedy.FSDP: "N devices, all-gathers every layer's weights each step",
    Remedy.LORA: "trains adapters only (r=16), not the full model",
    Remedy.QLORA: "LoRA on a 4-bit (nf4) base: weights dequantized at each use, quantization error",
}

#: Remedies one process cannot run: closed forms over the measured categories.
FORMULA_REMEDIES = frozenset({Remedy.OPTIMIZER_OFFLOAD})
#: Computed as a closed form only where this torch cannot shard an estimate (no ``torch.distributed``).
SHARDING_FORMULA = frozenset({Remedy.FSDP})
#: Remedies that change the precision, and the precision each sets.
PRECISION_REMEDIES = {Remedy.BF16_MIXED: "bf16-mixed", Remedy.FP16_MIXED: "16-mixed", Remedy.BF16_TRUE: "bf16-true"}
#: LoRA's rank and the attention projections it adapts (the last part of a module's name).
LORA_RANK = 16
LORA_TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "query_key_value", "qkv_proj", "Wqkv", "query", "key", "value"}
    | {"q", "k", "v", "o"}  # T5's
)
#: The task heads trained in full beside LoRA's adapters, by the end of the model class's name: peft's
#: ``modules_to_save`` for its task types ``SEQ_CLS``, ``TOKEN_CLS`` and ``QUESTION_ANS`` (a head left frozen would
#: never learn the new labels), and the ``classifier`` of Hugging Face's LoRA recipes for images and audio.
LORA_HEADS = {
    "ForSequenceClassification": ("classifier", "score"),
    "ForTokenClassification": ("classifier", "score"),
    "ForQuestionAnswering": ("qa_outputs",),
    "ForImageClassification": ("classifier",),
    "ForAudioClassification": ("classifier",),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The knobs of a training setup that the measured remedies turn.

    Attributes:
        precision: Lightning's precision.
        batch_size: The micro-batch size (None where the batch has no first dimension to halve).
        accumulate_grad_batches: Micro-batches per optimizer step.
        gradient_checkpointing: Non-reentrant activation checkpointing.
        optimizer: ``None`` for the setup's own optimizer, else ``adafactor`` or ``adamw_8bit``.
        foreach_off: The optimizer's multi-tensor (foreach) kernels turned off.
        lora: LoRA adapters on the attention projections, the base frozen.
        ddp_buckets: Data-parallel with DDP's gradient buckets beside the gradients (``gradient_as_bucket_view=False``,
            see :mod:`~lightning_memtrace.capture.ddp_buckets`); remedy ``gradient_as_bucket_view`` turns them off.
    """

    precision: str = "32-true"
    batch_size: int | None = None
    accumulate_grad_batches: int = 1
    gradient_checkpointing: bool = False
    optimizer: str | None = None
    foreach_off: bool = False
    lora: bool = False
    #: The base loaded quantized by bitsandbytes (``nf4``, ``int8``; see
    #: :mod:`~lightning_memtrace.estimator.quantization`), None: as it is.
    quantize: str | None = None
    #: Ranks the estimate shards over (FSDP2 over torch's fake process group; 1: unsharded).
    world_size: int = 1
    #: The N that the ``fsdp`` remedy shards over (the what-if's ``devices``).
    fsdp_devices: int = 1
    ddp_buckets: bool = False

    def with_remedy(self, remedy: Remedy | str) -> Settings:
        """These settings with ``remedy`` applied (formula remedies leave them as they are)."""
        remedy = Remedy.parse(remedy)
        if remedy in PRECISION_REMEDIES:
            return dataclasses.replace(self, precision=PRECISION_REMEDIES[remedy])
        if remedy is Remedy.FSDP:
            if self.fsdp_devices < 2:
                return self
            # sharded instead of data-parallel: no DDP buckets either
            return dataclasses.replace(self, world_size=self.fsdp_devices, ddp_buckets=False)
        if remedy is Remedy.HALF_MICRO_BATCH and self.batch_size:
            return dataclasses.replace(
                self, batch_size=self.batch_size // 2, accumulate_grad_batches=2 * self.accumulate_grad_batches
            )
        changes: dict[Remedy, dict[str, Any]] = {
            Remedy.GRADIENT_CHECKPOINTING: {"gradient_checkpointing": True},
            Remedy.OPTIMIZER_FOREACH_OFF: {"foreach_off": True},
            Remedy.ADAFACTOR: {"optimizer": "adafactor"},
            Remedy.ADAMW_8BIT: {"optimizer": "adamw_8bit"},
            Remedy.LORA: {"lora": True},
            Remedy.QLORA: {"lora": True, "quantize": "nf4"},
            Remedy.GRADIENT_AS_BUCKET_VIEW: {"ddp_buckets": False},
        }
        return dataclasses.replace(self, **changes.get(remedy, {}))

    def with_remedies(self, remedies: Iterable[Remedy | str]) -> Settings:
        """These settings with every remedy applied, in order."""
        out = self
        for remedy in remedies:
            out = out.with_remedy(remedy)
        return out


def not_applicable(remedy: Remedy, settings: Settings) -> str | None:
    """Why ``remedy`` does not apply to ``settings`` (one phrase), or None where it does."""
    if remedy in PRECISION_REMEDIES:
        target = PRECISION_REMEDIES[remedy]
        if settings.precision == target:
            return f"already {target}"
        if settings.precision in ("bf16-true", "16-true") or (
            remedy is not Remedy.BF16_TRUE and "mixed" in settings.precision
        ):
            return f"already {settings.precision}"
        return None
    reasons = {
        Remedy.HALF_MICRO_BATCH: (settings.batch_size or 0) < 2 and "a micro-batch of 1 cannot be halved",
        Remedy.GRADIENT_CHECKPOINTING: settings.gradient_checkpointing and "already on",
        Remedy.OPTIMIZER_FOREACH_OFF: settings.foreach_off and "already off",
        Remedy.ADAFACTOR: settings.optimizer == "adafactor" and "already Adafactor",
        Remedy.ADAMW_8BIT: settings.optimizer == "adamw_8bit" and "already 8-bit",
        Remedy.LORA: settings.lora and "already LoRA",
        Remedy.QLORA: settings.quantize and f"already {settings.quantize}",
        Remedy.GRADIENT_AS_BUCKET_VIEW: not settings.ddp_buckets and "not a DDP run with gradient_as_bucket_view=False",
    }
    return reasons.get(remedy) or None


# ------------------------------------------------------------------------------------------------ optional packages
def available(module: str) -> bool:
    """Whether an optional package imports (``peft``, ``bitsandbytes``)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported without a word on the console and without reaching the network.

    Its import logs warnings (``Failed to load CPU gemm_4bit_forward from kernels-community`` on CPUs with AVX512-BF16)
    and asks the ``kernels`` package for a kernel from the Hugging Face Hub. MemTrace imports it at the end of a fit
    or in an OOM post-mortem, inside the user's process: a line on their console or a download there is not MemTrace's
    to make. An import the user made first is left as it is."""
    import logging

    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    missing = object()
    kernels = sys.modules.get("kernels", missing)
    logger.setLevel(logging.ERROR)
    sys.modules["kernels"] = None  # type: ignore[assignment]  # makes ``from kernels import ...`` an ImportError
    try:
        import bitsandbytes
    finally:
        logger.setLevel(level)
        if kernels is missing:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = kernels  # type: ignore[assignment]
    return bitsandbytes


def adamw_8bit_measured() -> bool:
    """Whether 8-bit AdamW runs for real here (bitsandbytes installed); else it is a closed form."""
    return available("bitsandbytes")


# ------------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass(frozen=True)
class LoraShape:
    """LoRA as the estimate applies it (peft's ``LoraConfig``; alpha ``2·rank``, which costs no memory).

    Attributes:
        rank: ``r``.
        dropout: ``lora_dropout``: above 0, each adapted layer keeps a dropped-out copy of its input (and the mask)
            for the backward.
        targets: ``"attention"`` (the attention projections), ``"all-linear"`` (every linear layer but the output
            head and a task head, as peft's ``target_modules="all-linear"``), or the layers' names (their last part).
    """

    rank: int = LORA_RANK
    dropout: float = 0.0
    targets: str | tuple[str, ...] = "attention"


def lora_targets(model: nn.Module, targets: str | tuple[str, ...] = "attention") -> list[str]:
    """The layers of ``model`` that LoRA adapts (see :attr:`LoraShape.targets`): the names (last part) of its attention
    projections, or of the layers named; for ``all-linear``, the qualified names of its linear layers but each Hugging
    Face model's output head and a task head."""
    if targets == "all-linear":
        excluded = set(lora_heads(model)) | _output_heads(model)
        return sorted(
            name
            for name, sub in model.named_modules()
            if (isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D") and name and name not in excluded
        )
    wanted = LORA_TARGETS if targets == "attention" else frozenset(targets)
    found = set()
    for name, sub in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in wanted and hasattr(sub, "weight") and not list(sub.children()):
            found.add(leaf)
    return sorted(found)


def _output_heads(model: nn.Module) -> set[str]:
    """The qualified names of the output embeddings (``lm_head``) of the Hugging Face models in ``model``."""
    heads = {id(out) for sub in model.modules() if (out := _output_embeddings(sub)) is not None}
    return {name for name, sub in model.named_modules() if id(sub) in heads}


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    get = getattr(module, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


def has_lora_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds peft LoRA layers already (a run that fine-tunes with LoRA)."""
    return any(isinstance(getattr(sub, "lora_A", None), nn.ModuleDict) for sub in model.modules())


def lora_description(model: nn.Module) -> str:
    """``model``'s peft LoRA layers in words (``"LoRA r=16 on 8 layers (dropout 0.05), base frozen"``), read from the
    layers themselves (so also on the estimate's fake copy); empty where it has none."""
    ranks: set[int] = set()
    dropouts: set[float] = set()
    layers = 0
    for sub in model.modules():
        adapters = getattr(sub, "lora_A", None)
        if not isinstance(adapters, nn.ModuleDict) or not adapters:
            continue
        layers += 1
        for name, down in adapters.items():
            ranks.add(int(getattr(down, "out_features", 0) or down.weight.shape[0]))
            dropout_layers = getattr(sub, "lora_dropout", None)
            in_layers = isinstance(dropout_layers, nn.ModuleDict) and name in dropout_layers
            dropout = dropout_layers[name] if in_layers else None
            dropouts.add(float(getattr(dropout, "p", 0.0)))
    if not layers:
        return ""
    text = f"LoRA r={'/'.join(map(str, sorted(ranks)))} on {layers} layers"
    if any(dropouts):
        text += f" (dropout {'/'.join(f'{p:g}' for p in sorted(dropouts))})"
    return text + ", base frozen"


def lora_heads(model: nn.Module) -> list[str]:
    """The qualified names of the task heads in ``model`` that LoRA trains in full (:data:`LORA_HEADS`): those of each
    Hugging Face task model inside it, such as ``model.score`` for a ``Qwen2ForSequenceClassification`` held as
    ``self.model``."""
    heads = []
    for name, sub in model.named_modules():
        kind = type(sub).__name__
        for suffix, names in LORA_HEADS.items():
            if kind.endswith(suffix):
                prefix = f"{name}." if name else ""
                heads.extend(prefix + head for head in names if isinstance(getattr(sub, head, None), nn.Module))
    return heads


def apply_lora(model: nn.Module, shape: LoraShape | None = None) -> nn.Module:
    """PEFT LoRA of ``shape`` (default: rank 16, no dropout, the attention projections), in place; the base frozen but
    for the task heads (:func:`lora_heads`), which peft trains as a copy beside the frozen original
    (``modules_to_save``).

    Raises:
        ModuleNotFoundError: peft is not installed.
        ValueError: no layer to adapt in the model.
    """
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ModuleNotFoundError as error:
        from lightning_memtrace.estimator.quantization import NEEDS_WHATIF

        raise ModuleNotFoundError(f"LoRA needs peft ({NEEDS_WHATIF}): {error}") from None

    shape = shape or LoraShape()
    targets = lora_targets(model, shape.targets)
    if not targets:
        if shape.targets == "attention":
            raise ValueError(f"no attention projection ({', '.join(sorted(LORA_TARGETS))}) in {type(model).__name__}")
        wanted = shape.targets if isinstance(shape.targets, str) else ", ".join(shape.targets)
        raise ValueError(f"no layer to adapt ({wanted}) in {type(model).__name__}")
    for param in model.parameters():
        param.requires_grad_(False)
    config = LoraConfig(
        r=shape.rank,
        lora_alpha=2 * shape.rank,
        lora_dropout=shape.dropout,
        target_modules=targets,
        modules_to_save=lora_heads(model) or None,
    )
    return inject_adapter_in_model(config, model)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def repeated_blocks(model: nn.Module, sequential: bool = True) -> list[nn.Module]:
    """The children of the largest ``nn.ModuleList`` (else, with ``sequential``, ``nn.Sequential``) by parameters: the
    repeated blocks."""

    def size(container: nn.Module) -> int:
        return sum(p.numel() for p in container.parameters())

    kinds = ((nn.ModuleList, 1), (nn.Sequential, 2)) if sequential else ((nn.ModuleList, 1),)
    for kind, least in kinds:
        containers = [m for m in model.modules() if type(m) is kind and len(m) >= least]
        if containers:
            return list(max(containers, key=size))
    return []


def enable_checkpointing(model: nn.Module) -> nn.Module:
    """Non-reentrant activation checkpointing, in place: Hugging Face's ``gradient_checkpointing_enable`` where the
    model has it, else each repeated block (:func:`repeated_blocks`) runs under ``torch.utils.checkpoint``.

    Raises:
        ValueError: neither a Hugging Face model nor repeated blocks to wrap.
    """
    from lightning_memtrace.estimator.run import _enable_gradient_checkpointing

    try:
        _enable_gradient_checkpointing(model)
        return model
    except ValueError:
        pass
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable() and no repeated blocks")
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return model


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every parameter and buffer on the meta device (nothing real allocated)."""
    from lightning_memtrace.estimator.fake import _deep_copy

    memo: dict[int, Any] = {}
    for param in module.parameters():
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return _deep_copy(module, memo)


def module_for(
    module: nn.Module, settings: Settings, shape: LoraShape | None = None, copy: bool = True
) -> nn.Module:
    """The module the estimate copies for ``settings``: ``module`` itself, or a meta copy (``module`` itself, changed,
    where ``copy`` is False: a model built for this estimate alone) loaded quantized and with LoRA of ``shape``
    applied, in that order, as a user does (new parameters must exist before the copy onto fake tensors, which then
    casts them with the rest)."""
    if not (settings.lora or settings.quantize):
        return module
    changed = meta_copy(module) if copy else module
    if settings.quantize:
        _load_quantized(changed, settings)
    return apply_lora(changed, shape) if settings.lora else changed


def _load_quantized(module: nn.Module, settings: Settings) -> None:
    from lightning_memtrace.estimator.inputs import Precision
    from lightning_memtrace.estimator.quantization import load_quantized

    load_quantized(module, str(settings.quantize), Precision.parse(settings.precision))


def prepare_for(settings: Settings) -> Callable[[nn.Module], Any] | None:
    """What the estimate does to its fake copy for ``settings`` (checkpointing), or None."""
    return enable_checkpointing if settings.gradient_checkpointing else None


# ------------------------------------------------------------------------------------------------ the optimizer
#: bitsandbytes' module of its optimizers' base class (``Optimizer8bit``, the 32-bit and paged ones' base too).
_BNB_OPTIMIZERS = "bitsandbytes.optim.optimizer"
#: Entries of each quantization map bitsandbytes' 8-bit optimizers keep (``create_dynamic_map``'s 256 codes).
_QUANTIZATION_CODES = 256


def bnb_optimizers_imported() -> bool:
    """Whether bitsandbytes' optimizers are imported in this process (MemTrace never imports them to find out)."""
    return _BNB_OPTIMIZERS in sys.modules


def _shape_only_maps(optimizer: Any) -> None:
    optimizer.name2qmap["dynamic"] = torch.empty(_QUANTIZATION_CODES)
    optimizer.name2qmap["udynamic"] = torch.empty(_QUANTIZATION_CODES)


@contextlib.contextmanager
def shape_only_quantization_maps() -> Iterator[None]:
    """bitsandbytes' 8-bit optimizers made meanwhile get quantization maps of the real shape and dtype, without values.

    Their constructor computes the maps' codes from values (``create_dynamic_map`` reads ``tolist()``), which fake
    tensors do not have: an 8-bit optimizer made on fake parameters failed with ``DataDependentOutputException``. The
    step only moves the maps to the parameters' device and quantizes with them, which fake tensors do without values.
    Nothing changes where bitsandbytes' optimizers are not imported.
    """
    base = getattr(sys.modules.get(_BNB_OPTIMIZERS), "Optimizer8bit", None)
    if base is None or "fill_qmap" not in vars(base):
        yield
        return
    original = vars(base)["fill_qmap"]
    base.fill_qmap = _shape_only_maps
    try:
        yield
    finally:
        base.fill_qmap = original


def build_optimizer(name: str, params: Iterable[torch.Tensor], lr: float = 1e-3, fake: bool = False) -> Any:
    """The remedy's optimizer on ``params``: ``adafactor`` (transformers' Adafactor, fixed ``lr``, no momentum) or
    ``adamw_8bit`` (bitsandbytes' AdamW8bit). ``fake``: for fake parameters (the estimate)."""
    params = [p for p in params if p.requires_grad]
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "adamw_8bit":
        bnb = import_bitsandbytes()
        with shape_only_quantization_maps() if fake else contextlib.nullcontext():
            return bnb.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def foreach_off(optimizer: Any) -> Any:
    """The optimizer with its multi-tensor kernels turned off (``foreach=False`` in every group)."""
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group:
            group["foreach"] = False
    return optimizer


def optimizer_factory_for(
    settings: Settings, base: Callable[[nn.Module], Any], lr: float = 1e-3
) -> Callable[[nn.Module], Any]:
    """The optimizer factory for ``settings`` on fake models: ``base`` (the setup's own), or the remedy's optimizer;
    foreach turned off where asked."""
    from lightning_memtrace.estimator.run import _first_optimizer

    def factory(model: nn.Module) -> Any:
        if settings.optimizer is not None:
            optimizer = build_optimizer(settings.optimizer, model.parameters(), lr=lr, fake=True)
        else:
            optimizer = _first_optimizer(base(model))
        return foreach_off(optimizer) if settings.foreach_off else optimizer

    return factory


# ------------------------------------------------------------------------------------------------ a real module
def apply_remedies(
    module: nn.Module, remedies: Iterable[Remedy | str], settings: Settings, lr: float = 1e-3
) -> Settings:
    """Apply measured remedies to a real LightningModule in place, as the prediction assumed them: the base's
    quantization (its Hugging Face models' weights quantized as loading them so would), LoRA, then checkpointing, then
    the optimizer (``configure_optimizers`` replaced on the instance).

    Args:
        module: The LightningModule to train (changed in place).
        remedies: Remedy identifiers (formula remedies are left to the Trainer's strategy).
        settings: Today's settings.
        lr: The learning rate of a replaced optimizer.

    Returns:
        The new settings: pass ``precision`` and ``accumulate_grad_batches`` to the Trainer and ``batch_size`` to the
        DataLoader.
    """
    import types

    picked = [Remedy.parse(r) for r in remedies]
    new = settings.with_remedies(picked)
    if new.quantize and not settings.quantize:
        _load_quantized(module, new)
    if new.lora and not settings.lora:
        apply_lora(module)
    if new.gradient_checkpointing and not settings.gradient_checkpointing:
        enable_checkpointing(module)
    if new.optimizer is not None or new.foreach_off:
        original = module.configure_optimizers

        def configure_optimizers(self: nn.Module) -> Any:
            from lightning_memtrace.estimator.run import _first_optimizer

            if new.optimizer is not None:
                optimizer = build_optimizer(new.optimizer, self.parameters(), lr=lr)
            else:
                optimizer = _first_optimizer(original())
            return foreach_off(optimizer) if new.foreach_off else optimizer

        module.configure_optimizers = types.MethodType(configure_optimizers, module)
    return new
