"""The setups a what-if estimates again under other settings: a module and an example batch, or a model config; and
the lines of code (a snippet) that would give a setup the remedies a prediction assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_memtrace.capture.ddp_buckets import BUCKET_VIEW_STRATEGY
from lightning_memtrace.estimator import remedies as rm
from lightning_memtrace.estimator.inputs import InputSpec, Precision, map_batch
from lightning_memtrace.estimator.quantization import config_line
from lightning_memtrace.estimator.remedies import Remedy, Settings
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.types import Quantization


class Setup:
    """A training setup to estimate under different :class:`Settings` (subclasses: a module, a config)."""

    settings: Settings
    #: The snippet's line that turns checkpointing on where the model is Hugging Face's (None: it is not).
    checkpointing_line: str | None = None
    #: The snippet's line that applies LoRA as the estimate does, with the model's own projections and heads.
    lora_line: str | None = None
    #: The LoRA that the ``lora`` and ``qlora`` remedies (and a setup with LoRA) apply.
    lora_shape: rm.LoraShape = rm.LoraShape()
    #: The module or model the remedies change (the snippet reads its layers' names).
    base_model: nn.Module | None = None

    def run(self, settings: Settings) -> Estimate:  # pragma: no cover - abstract
        raise NotImplementedError

    def block_parameter_bytes(self, settings: Settings) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


def _block_bytes(model: nn.Module, precision: str) -> int:
    """Parameter bytes of the largest repeated block, at the precision's parameter dtype."""
    dtype = Precision.parse(precision).param_dtype
    blocks = rm.repeated_blocks(model)
    sizes = [
        sum(
            p.numel() * (dtype.itemsize if dtype and p.is_floating_point() else p.element_size())
            for p in b.parameters()
        )
        for b in blocks
    ]
    return max(sizes, default=0)


def lora_line(model: nn.Module, shape: rm.LoraShape | None = None) -> str | None:
    """peft's call that applies LoRA as :func:`~lightning_memtrace.estimator.remedies.apply_lora` does: the model's
    layers that ``shape`` targets, and its task heads trained in full; None for a model without them."""
    shape = shape or rm.LoraShape()
    targets = rm.lora_targets(model, shape.targets)
    if not targets:
        return None
    heads = rm.lora_heads(model)
    named = "all-linear" if shape.targets == "all-linear" else targets
    options = [f"r={shape.rank}", f"lora_alpha={2 * shape.rank}", f"target_modules={named!r}"]
    if shape.dropout:
        options.append(f"lora_dropout={shape.dropout:g}")
    if heads:
        options.append(f"modules_to_save={heads!r}")
    return (
        f"model = peft.inject_adapter_in_model(LoraConfig({', '.join(options)}), model)  "
        "# base frozen; or lightning_memtrace.estimator.remedies.apply_lora(model)"
    ).replace("'", '"')


def checkpointing_line(model: nn.Module) -> str | None:
    """Hugging Face's call that turns non-reentrant checkpointing on, as the model offers it (the method the estimate
    calls: ``activation_checkpointing_enable`` in transformers 5.2x, else ``gradient_checkpointing_enable``); None for
    a model without one."""
    from lightning_memtrace.estimator.run import hf_checkpointing_method

    found = hf_checkpointing_method(model)
    if found is None:
        return None
    _, method, keyword = found
    return f'model.{method}({keyword}={{"use_reentrant": False}})'


def resize_batch(batch: Any, batch_size: int | None) -> Any:
    """The batch with every leaf's first dimension set to ``batch_size`` (shapes only; None leaves it)."""
    if batch_size is None:
        return batch

    def one(leaf: Any) -> Any:
        shape = tuple(leaf.shape)
        if not shape:
            return leaf
        return InputSpec((int(batch_size), *shape[1:]), leaf.dtype)

    return map_batch(batch, one)


class ModuleSetup(Setup):
    """A module and an example batch, as :func:`~lightning_memtrace.estimator.estimate` takes them."""

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        settings: Settings,
        optimizer_factory: Callable[[nn.Module], Any] | None = None,
        training_step: Callable[[nn.Module, Any], Any] | None = None,
        device: torch.device | str | None = None,
        steps: int = 2,
    ) -> None:
        from lightning_memtrace.capture.storages import quantized
        from lightning_memtrace.estimator.run import _checkpointing_on, _is_lightning_module, _target_device

        self.module, self.batch = module, batch
        # What the module has already is today's setting: the remedy that would add it again is skipped ("already
        # LoRA", "already on", "already quantized"), and no estimate applies it a second time.
        self.lora_already = rm.has_lora_adapters(module)
        self.checkpointing_already = _checkpointing_on(module)
        self.quantized_already = quantized(list(module.parameters()))
        self.settings = dataclasses.replace(
            settings,
            lora=settings.lora or self.lora_already,
            gradient_checkpointing=settings.gradient_checkpointing or self.checkpointing_already,
            quantize=settings.quantize or ("quantized" if self.quantized_already else None),
        )
        self.optimizer_factory, self.training_step, self.steps = optimizer_factory, training_step, steps
        self.device = _target_device(module, device)
        self.lightning = _is_lightning_module(module)
        self.checkpointing_line = checkpointing_line(module)
        self.lora_line = lora_line(module)
        self.base_model = module

    def _base_factory(self, model: nn.Module) -> Any:
        if self.optimizer_factory is not None:
            return self.optimizer_factory(model)
        if self.lightning:
            return model.configure_optimizers()
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(self, settings: Settings) -> Estimate:
        from lightning_memtrace.estimator.run import estimate

        changed = settings.optimizer is not None or settings.foreach_off
        return estimate(
            self._module_for(settings),
            resize_batch(self.batch, settings.batch_size if settings.batch_size != self.settings.batch_size else None),
            optimizer_factory=rm.optimizer_factory_for(settings, self._base_factory)
            if changed
            else self.optimizer_factory,
            training_step=self.training_step,
            precision=settings.precision,
            accumulate_grad_batches=settings.accumulate_grad_batches,
            gradient_checkpointing=False,
            device=self.device,
            steps=self.steps,
            prepare=None if self.checkpointing_already else rm.prepare_for(settings),
            world_size=settings.world_size,
            ddp_buckets=settings.ddp_buckets,
        )

    def _module_for(self, settings: Settings) -> nn.Module:
        """The module with what ``settings`` adds to it (LoRA, a quantized base), leaving what it has already."""
        adds = dataclasses.replace(
            settings,
            lora=settings.lora and not self.lora_already,
            quantize=None if self.quantized_already else settings.quantize,
        )
        if adds.quantize and self.lora_already:
            raise ValueError("the module has LoRA adapters already: load its base quantized before adding them")
        return rm.module_for(self.module, adds)

    def block_parameter_bytes(self, settings: Settings) -> int:
        return _block_bytes(self.module, settings.precision)


class ConfigSetup(Setup):
    """A Hugging Face causal LM (or another task's model) from its config, as
    :func:`~lightning_memtrace.estimator.estimate_from_config` takes it."""

    def __init__(
        self,
        config: Any,
        seq_len: int | None,
        settings: Settings,
        model: nn.Module | None = None,
        lora_shape: rm.LoraShape | None = None,
        **options: Any,
    ):
        from lightning_memtrace.estimator.config import build_meta_model

        self.config, self.seq_len, self.settings = config, None if seq_len is None else int(seq_len), settings
        self.model = model if model is not None else build_meta_model(config, task=options.get("task", "causal-lm"))
        self.lora_shape = lora_shape or rm.LoraShape()
        self.checkpointing_line = checkpointing_line(self.model)
        self.lora_line = lora_line(self.model, self.lora_shape)
        self.base_model = self.model
        self.options = options  # optimizer, device, lr, steps, task, target_len, image_size

    def _base_factory(self, model: nn.Module) -> Any:
        from lightning_memtrace.estimator.closed_form import _optimizer_kind

        params = [p for p in model.parameters() if p.requires_grad]
        lr = self.options.get("lr", 1e-3)
        kind = _optimizer_kind(str(self.options.get("optimizer", "adamw")))
        name = str(self.options.get("optimizer", "adamw")).lower()
        if kind == "adam":
            return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if kind == "sgd_momentum" else 0.0)

    def run(self, settings: Settings) -> Estimate:
        from lightning_memtrace.estimator.config import estimate_from_config

        changed = settings.optimizer is not None or settings.foreach_off
        return estimate_from_config(
            self.config,
            int(settings.batch_size or 1),
            self.seq_len,
            precision=settings.precision,
            accumulate_grad_batches=settings.accumulate_grad_batches,
            model=self.model,
            quantize=settings.quantize,
            lora=self.lora_shape if settings.lora else False,  # after quantizing, as a user applies it
            optimizer_factory=rm.optimizer_factory_for(settings, self._base_factory) if changed else None,
            prepare=rm.prepare_for(settings),
            fsdp=settings.world_size,
            ddp_buckets=settings.ddp_buckets,
            **self.options,
        )

    def block_parameter_bytes(self, settings: Settings) -> int:
        return _block_bytes(self.model, settings.precision)



# ------------------------------------------------------------------------------------------------ snippet
def snippet(setup: Setup, picked: Sequence[Remedy], devices: int = 1) -> str:
    """The Lightning-idiomatic lines the prediction for ``picked`` assumed: Trainer arguments, module calls."""
    base = setup.settings
    settings = base.with_remedies(picked)
    trainer: list[str] = []
    if settings.precision != base.precision:
        trainer.append(f'precision="{settings.precision}"')
    if settings.accumulate_grad_batches != base.accumulate_grad_batches:
        trainer.append(f"accumulate_grad_batches={settings.accumulate_grad_batches}")
    trainer.extend(_strategy(picked, devices))
    lines = [f"Trainer({', '.join(trainer)})"] if trainer else []
    if settings.batch_size != base.batch_size:
        lines.append(f"DataLoader(..., batch_size={settings.batch_size})")
    lines.extend(_module_lines(setup, picked))
    return "\n".join(lines) if lines else "(no change)"


def _strategy(picked: Sequence[Remedy], devices: int) -> list[str]:
    if Remedy.FSDP in picked and Remedy.OPTIMIZER_OFFLOAD in picked:
        return [f"devices={devices}", "strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True)"]
    if Remedy.FSDP in picked:
        return [f"devices={devices}", 'strategy="fsdp"']
    if Remedy.OPTIMIZER_OFFLOAD in picked:
        return ["strategy=DeepSpeedStrategy(stage=2, offload_optimizer=True)"]
    if Remedy.GRADIENT_AS_BUCKET_VIEW in picked:
        return [f"strategy={BUCKET_VIEW_STRATEGY}"]
    return []


def _module_lines(setup: Setup, picked: Sequence[Remedy]) -> list[str]:
    lines = []
    if Remedy.QLORA in picked:
        precision = Precision.parse(setup.settings.with_remedies(picked).precision)
        loading = config_line(Quantization.NF4, precision, setup.base_model)
        lines.append(f"model = AutoModelFor...from_pretrained(..., quantization_config={loading})")
    if (Remedy.LORA in picked or Remedy.QLORA in picked) and setup.lora_line:  # none where LoRA found no layer
        lines.append(setup.lora_line)
    if Remedy.GRADIENT_CHECKPOINTING in picked:
        lines.append(
            setup.checkpointing_line
            or "lightning_memtrace.estimator.remedies.enable_checkpointing(model)  # blocks checkpointed"
        )
    optimizers = {
        Remedy.ADAMW_8BIT: "configure_optimizers: return bitsandbytes.optim.AdamW8bit(params, lr=...)",
        Remedy.ADAFACTOR: "configure_optimizers: return transformers.optimization.Adafactor(params, lr=..., "
        "scale_parameter=False, relative_step=False)",
        Remedy.OPTIMIZER_FOREACH_OFF: "configure_optimizers: pass foreach=False to the optimizer",
    }
    lines.extend(text for remedy, text in optimizers.items() if remedy in picked)
    return lines

