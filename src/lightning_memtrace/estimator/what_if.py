"""What would fit: today's estimate, then the estimate again with each remedy applied, and the cheapest combination.

Measured remedies re-run the fake-tensor training step with the setup changed (:mod:`.remedies`), ``fsdp`` / ``zero3``
over N devices included (FSDP2 over torch's fake process group, rank zero measured: :mod:`.sharded`); formula remedies
are closed forms over the measured categories of each row:

- ``adamw_8bit`` where bitsandbytes is missing: AdamW's state at 2 bytes per parameter instead of 8;
- ``fsdp`` only where torch has no ``torch.distributed``: parameters, gradients and optimizer state divided by N, plus
  the parameters of the largest repeated block gathered whole while it runs; activations unchanged;
- ``optimizer_offload``: the optimizer state lives on the host (0 on the device).

A prediction fits when ``peak + headroom <= device memory``, the headroom being :data:`HEADROOM_BYTES` (the CUDA
context and what else the allocator does not count) plus :data:`HEADROOM_FRACTION` of the device (allocator
fragmentation); cuBLAS's workspaces are in the peak (:mod:`.blas_workspace`).

With a ``deadline`` (``time.monotonic()`` seconds), no estimate starts that the longest one so far says would end past
it: the remedies not reached are listed in :attr:`WhatIf.not_estimated`, and the combination search stops.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_memtrace.capture.ddp_buckets import BUCKET_VIEW_STRATEGY
from lightning_memtrace.estimator import remedies as rm
from lightning_memtrace.estimator.inputs import InputSpec, Precision, map_batch
from lightning_memtrace.estimator.quantization import config_line
from lightning_memtrace.estimator.remedies import FORMULA_REMEDIES, PRICES, Remedy, Settings
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.estimator.search import find_max_batch
from lightning_memtrace.types import Category, Quantization
from lightning_memtrace.units import GIB, format_bytes

#: Fixed headroom kept free on the device: the CUDA context and what else the allocator does not count.
HEADROOM_BYTES = 1 * GIB
#: Headroom as a share of the device memory: fragmentation of the caching allocator.
HEADROOM_FRACTION = 0.05
#: Groups of remedies of which a combination holds one (a later one replaces an earlier one).
_GROUPS = (
    frozenset({Remedy.BF16_MIXED, Remedy.FP16_MIXED, Remedy.BF16_TRUE}),
    frozenset({Remedy.ADAMW_8BIT, Remedy.ADAFACTOR}),
    frozenset({Remedy.LORA, Remedy.QLORA}),
)


class OutOfTime(Exception):
    """The next estimate of a what-if would end past its deadline."""


def usable_bytes(device_memory: int) -> int:
    """The bytes a training step may allocate on a device of ``device_memory`` bytes, after the headroom."""
    return int(device_memory) - HEADROOM_BYTES - int(HEADROOM_FRACTION * int(device_memory))


# ------------------------------------------------------------------------------------------------ setups
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


# ------------------------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class WhatIfRow:
    """One remedy applied alone to today's setup.

    Attributes:
        remedy: The remedy's identifier.
        kind: ``measured`` (the fake-tensor step re-run) or ``formula`` (closed form over measured categories).
        price: Its usual cost, in one short phrase.
        peak_bytes: The predicted peak (allocated bytes).
        saved_bytes: Today's peak minus this one (negative: it costs memory).
        fits: Whether the peak plus headroom fits the device (None without device memory).
        max_micro_batch: The largest micro-batch that fits with it (None where not searched).
        categories: Per category, the most bytes of any row.
    """

    remedy: str
    kind: str
    price: str
    peak_bytes: int
    saved_bytes: int
    fits: bool | None
    max_micro_batch: int | None
    categories: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "categories"}
        out.update({f"{name}_bytes": value for name, value in self.categories.items()})
        return out


@dataclasses.dataclass(frozen=True)
class Combination:
    """The cheapest combination found that fits (remedies in order of price).

    Attributes:
        remedies: Identifiers, cheapest first (empty: today's setup fits as it is).
        peak_bytes: The combination's peak, estimated for the combination itself (not summed savings).
        fits: Whether it fits (True for a combination the search returns).
        kind: ``measured``, or ``formula`` where a formula remedy is part of it.
        snippet: The Trainer arguments and module calls the prediction assumed.
    """

    remedies: tuple[str, ...]
    peak_bytes: int
    fits: bool
    kind: str
    snippet: str

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "remedies": list(self.remedies)}


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """Today's estimate, one row per remedy, and the cheapest combination that fits.

    Attributes:
        estimate: Today's estimate.
        rows: One :class:`WhatIfRow` per remedy that applies, in order of price.
        skipped: Remedy identifier -> why it was not estimated (does not apply, a package is missing...).
        combination: The cheapest combination that fits, None when none fits, no device memory was given or the
            search ran out of time.
        device_memory: The device's memory in bytes, if given.
        devices: The N of ``fsdp``.
        not_estimated: Remedies not estimated because the deadline came first, in order of price.
        searched: False where the deadline stopped the combination search (or came before it).
    """

    estimate: Estimate
    rows: tuple[WhatIfRow, ...]
    skipped: dict[str, str]
    combination: Combination | None
    device_memory: int | None
    devices: int = 1
    not_estimated: tuple[str, ...] = ()
    searched: bool = True

    @property
    def usable_bytes(self) -> int | None:
        return usable_bytes(self.device_memory) if self.device_memory is not None else None

    @property
    def today_fits(self) -> bool | None:
        """Whether today's peak plus headroom fits the device (None without device memory)."""
        return None if self.device_memory is None else self.estimate.peak_bytes <= usable_bytes(self.device_memory)

    def to_dataframe(self) -> Any:
        """The rows as a pandas DataFrame: remedy, peak_bytes, saved_bytes, fits, max_micro_batch, kind, price,
        and one ``<category>_bytes`` column per category."""
        import pandas as pd

        columns = ["remedy", "peak_bytes", "saved_bytes", "fits", "max_micro_batch", "kind", "price"]
        columns += [f"{c.value}_bytes" for c in Category]
        return pd.DataFrame([row.as_dict() for row in self.rows], columns=columns)

    def as_dict(self) -> dict[str, Any]:
        return {
            "estimate": self.estimate.as_dict(),
            "device_memory": self.device_memory,
            "usable_bytes": self.usable_bytes,
            "headroom": {"bytes": HEADROOM_BYTES, "fraction": HEADROOM_FRACTION},
            "today_fits": self.today_fits,
            "devices": self.devices,
            "what_if": [row.as_dict() for row in self.rows],
            "skipped": dict(self.skipped),
            "not_estimated": list(self.not_estimated),
            "combination": self.combination.as_dict() if self.combination is not None else None,
        }

    def table(self) -> str:
        """Plain text: one line per remedy, the skipped ones, then the combination and its snippet."""
        return what_if_table(self)


# ------------------------------------------------------------------------------------------------ formulas
def _categories(est: Estimate) -> dict[str, int]:
    return {c.value: v for c, v in est.category_bytes().items()}


def formula_peak(est: Estimate, remedies: Iterable[Remedy], devices: int, gathered: int) -> tuple[int, dict[str, int]]:
    """The peak and categories of ``est`` with the formula remedies applied, row by row (``adamw_8bit`` is one only
    where bitsandbytes is missing: AdamW's state at 2 bytes per parameter instead of 8)."""
    remedies = set(remedies)
    n = max(1, int(devices)) if Remedy.FSDP in remedies else 1
    offload = Remedy.OPTIMIZER_OFFLOAD in remedies
    quarter = 4 if Remedy.ADAMW_8BIT in remedies else 1  # 8-bit moments: 2 B/param of state instead of 8

    def removed(params: int, grads: int, state: int) -> int:
        kept_state = 0 if offload else state // quarter // n
        return (params - params // n) + (grads - grads // n) + (state - kept_state) - (gathered if n > 1 else 0)

    peak = max(
        (r.peak_bytes - removed(r.parameters_bytes, r.gradients_bytes, r.optimizer_state_bytes) for r in est.records),
        default=0,
    )
    cats = _categories(est)
    cats["parameters"] = cats["parameters"] // n + (gathered if n > 1 else 0)
    cats["gradients"] //= n
    cats["optimizer_state"] = 0 if offload else cats["optimizer_state"] // quarter // n
    return peak, cats


# ------------------------------------------------------------------------------------------------ the engine
class _Engine:
    """Runs the estimates of one what-if, each settings once (a cache), and decides what fits."""

    def __init__(
        self,
        setup: Setup,
        device_memory: int | None,
        devices: int,
        max_batch: bool,
        max_batch_size: int,
        deadline: float | None = None,
    ):
        self.setup, self.device_memory, self.devices = setup, device_memory, max(1, int(devices))
        # the fsdp remedy shards the estimate over these devices (measured, see Settings.with_remedy)
        setup.settings = dataclasses.replace(setup.settings, fsdp_devices=self.devices)
        self.max_batch, self.max_batch_size = max_batch, max_batch_size
        self.cache: dict[Settings, Estimate] = {}
        self.failed: dict[Settings, str] = {}  # estimates that failed in a worker (see _prefetch)
        self.deadline = deadline
        self.longest_s = 0.0  # the longest estimate so far: what the next one is expected to take

    def run(self, settings: Settings) -> Estimate:
        if settings in self.failed:
            raise EstimateFailed(self.failed[settings])
        if settings not in self.cache:
            now = time.monotonic()
            if self.deadline is not None and now + self.longest_s > self.deadline:
                raise OutOfTime
            self.cache[settings] = self.setup.run(settings)
            self.longest_s = max(self.longest_s, time.monotonic() - now)
        return self.cache[settings]

    def fits(self, peak: int) -> bool | None:
        return None if self.device_memory is None else peak <= usable_bytes(self.device_memory)

    def formula(self, est: Estimate, settings: Settings, remedies: Iterable[Remedy]) -> tuple[int, dict[str, int]]:
        gathered = self.setup.block_parameter_bytes(settings) if self.devices > 1 else 0
        return formula_peak(est, remedies, self.devices, gathered)

    def max_micro_batch(self, settings: Settings, formula: Sequence[Remedy] = ()) -> int | None:
        """The largest micro-batch that fits with ``settings`` (and formula remedies), by :func:`find_max_batch`."""
        if self.device_memory is None or not self.max_batch or settings.batch_size is None:
            return None

        def peak_for(size: int) -> int:
            sized = dataclasses.replace(settings, batch_size=size)
            est = self.run(sized)
            return self.formula(est, sized, formula)[0] if formula else est.peak_bytes

        low = settings.batch_size if self.fits(peak_for(settings.batch_size)) else 1
        return find_max_batch(peak_for, usable_bytes(self.device_memory), low=low, high=self.max_batch_size).batch_size

    def row(self, remedy: Remedy, today: Estimate) -> WhatIfRow:
        base = self.setup.settings
        if remedy in formula_remedies():
            peak, cats = self.formula(today, base, [remedy])
            kind, batch = "formula", self.max_micro_batch(base, [remedy])
        else:
            settings = base.with_remedy(remedy)
            est = self.run(settings)
            peak, cats = est.peak_bytes, _categories(est)
            kind, batch = "measured", self.max_micro_batch(settings)
        return WhatIfRow(
            remedy.value, kind, PRICES[remedy], peak, today.peak_bytes - peak, self.fits(peak), batch, cats
        )


def formula_remedies() -> frozenset[Remedy]:
    """The remedies computed as closed forms here: offloading; ``adamw_8bit`` without bitsandbytes; ``fsdp`` where
    this torch has no ``torch.distributed`` (elsewhere it is measured: FSDP2 over torch's fake process group)."""
    out = FORMULA_REMEDIES if rm.adamw_8bit_measured() else FORMULA_REMEDIES | {Remedy.ADAMW_8BIT}
    return out if torch.distributed.is_available() else out | rm.SHARDING_FORMULA


#: Errors of a remedy that does not apply to a model (no attention projection, a missing package, an op the fake
#: mode cannot run): the remedy is skipped with the error's first line.
_REMEDY_ERRORS = (ValueError, ModuleNotFoundError, RuntimeError, NotImplementedError, TypeError)


def _applicable(remedy: Remedy, setup: Setup, devices: int, explicit: bool) -> str | None:
    """Why ``remedy`` is not estimated for ``setup`` (None: it is). ``16-mixed`` is for fp16 hardware: estimated when
    asked for by name or where today's precision is ``16-true``."""
    if remedy is Remedy.FSDP and devices < 2:
        return "needs --devices N (N >= 2)"
    if remedy is Remedy.LORA and not rm.available("peft"):
        return "needs peft"
    if remedy is Remedy.QLORA and not (rm.available("peft") and rm.available("bitsandbytes")):
        return "needs peft and bitsandbytes"
    if remedy is Remedy.FP16_MIXED and not explicit and setup.settings.precision != "16-true":
        return "for fp16-only hardware: ask for it by name"
    return rm.not_applicable(remedy, setup.settings)


class EstimateFailed(RuntimeError):
    """An estimate that failed in a worker process, raised again where its result is asked for (its first line, as
    the worker saw it)."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def failure_line(error: BaseException) -> str:
    """``Type: first line of the message`` (160 characters at most): how a failed estimate is said in one line."""
    if isinstance(error, EstimateFailed):
        return error.line
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


#: Time of a remedy's estimate relative to today's (1.5B, 16 x 256, measured): the order the workers take them in.
_RELATIVE_COST = {Remedy.HALF_MICRO_BATCH: 1.7, Remedy.GRADIENT_CHECKPOINTING: 1.2, Remedy.BF16_MIXED: 1.05}


def _prefetch(engine: _Engine, settings: Sequence[Settings], jobs: int) -> None:
    """Run the estimates of ``settings`` side by side in ``jobs`` forked workers (:mod:`.forked`) into the engine's
    cache (those that fail are raised again by :meth:`_Engine.run`); nothing when ``jobs`` is 1."""
    from lightning_memtrace.estimator.forked import can_fork, map_forked

    todo = [s for s in dict.fromkeys(settings) if s not in engine.cache]
    if jobs <= 1 or len(todo) < 2 or not can_fork():
        return

    def task(one: Settings) -> tuple[Estimate | None, str | None]:
        try:
            return engine.setup.run(one), None
        except _REMEDY_ERRORS as error:
            return None, failure_line(error)

    for one, (result, error) in zip(todo, map_forked(task, todo, jobs)):
        if result is not None:
            engine.cache[one] = result
        else:
            engine.failed[one] = str(error)


def _rows(
    engine: _Engine, today: Estimate, remedies: Sequence[Remedy], explicit: bool
) -> tuple[list[WhatIfRow], dict[str, str], list[str]]:
    """The rows of the remedies that apply, why the others were skipped, and those the deadline left out."""
    rows: list[WhatIfRow] = []
    skipped: dict[str, str] = {}

    def why_not(remedy: Remedy) -> str | None:
        return _applicable(remedy, engine.setup, engine.devices, explicit) or _optimizer_already(remedy, today)

    for index, remedy in enumerate(remedies):
        reason = why_not(remedy)
        if reason is not None:
            skipped[remedy.value] = reason
            continue
        try:
            rows.append(engine.row(remedy, today))
        except _REMEDY_ERRORS as error:
            skipped[remedy.value] = failure_line(error)
        except OutOfTime:
            late: list[str] = []
            for rest in remedies[index:]:
                why = why_not(rest)
                if why is None:
                    late.append(rest.value)
                else:
                    skipped[rest.value] = why
            return rows, skipped, late
    return rows, skipped, []


def _optimizer_already(remedy: Remedy, today: Estimate) -> str | None:
    """Why an optimizer remedy would change nothing: today's run steps that optimizer already (a module's own
    ``configure_optimizers``, read from today's estimate)."""
    names = today.optimizer.split(" + ")
    if remedy is Remedy.ADAFACTOR and "Adafactor" in names:
        return "already Adafactor"
    if remedy is Remedy.ADAMW_8BIT and any("8bit" in name for name in names):
        return "already 8-bit"
    return None


def _replacing(chosen: list[Remedy], remedy: Remedy) -> list[Remedy]:
    """``chosen`` with ``remedy`` added, replacing a member of its group, in order of price."""
    group = next((g for g in _GROUPS if remedy in g), frozenset({remedy}))
    return sorted([r for r in chosen if r not in group] + [remedy], key=list(Remedy).index)


def _search(engine: _Engine, today: Estimate, rows: Sequence[WhatIfRow]) -> tuple[list[Remedy], int] | None:
    """The cheapest combination that fits: a single remedy that fits alone, else remedies added in order of price
    where they lower the combination's own estimate, formula remedies last."""
    base = engine.setup.settings
    if engine.fits(today.peak_bytes):
        return [], today.peak_bytes
    for row in rows:
        if row.fits:
            return [Remedy(row.remedy)], row.peak_bytes
    helpful = [Remedy(r.remedy) for r in rows if r.saved_bytes > 0]
    chosen: list[Remedy] = []
    best = today
    for remedy in (r for r in helpful if r not in formula_remedies()):
        trial = _replacing(chosen, remedy)
        try:
            est = engine.run(base.with_remedies(trial))
        except _REMEDY_ERRORS:
            continue  # remedies that run alone but not together: leave this one out
        if est.peak_bytes < best.peak_bytes:
            chosen, best = trial, est
        if engine.fits(best.peak_bytes):
            return chosen, best.peak_bytes
    formula: list[Remedy] = []
    for remedy in (r for r in helpful if r in formula_remedies()):
        formula.append(remedy)
        peak = engine.formula(best, base.with_remedies(chosen), formula)[0]
        if engine.fits(peak):
            return chosen + formula, peak
    return None


def what_if_for_setup(
    setup: Setup,
    *,
    device_memory: int | None = None,
    devices: int = 1,
    remedies: Iterable[Remedy | str] | None = None,
    max_batch: bool = True,
    max_batch_size: int = 4096,
    deadline: float | None = None,
    jobs: int = 1,
) -> WhatIf:
    """Today's estimate of ``setup``, each remedy's, and the cheapest combination that fits ``device_memory``.

    Args:
        setup: A :class:`ModuleSetup` or :class:`ConfigSetup`.
        device_memory: The device's memory in bytes (None: nothing fits or does not; no combination).
        devices: N for ``fsdp`` (1: not estimated).
        remedies: Identifiers to try (default: all, in order of price).
        max_batch: Search each remedy's largest fitting micro-batch (a few estimates each).
        max_batch_size: The upper end of that search.
        deadline: ``time.monotonic()`` seconds: no estimate starts that the longest so far says would end past it
            (the remedies left go to :attr:`WhatIf.not_estimated`). None: no limit.
        jobs: Worker processes for the remedies' estimates, side by side (forked, Linux only, never with a
            ``deadline``: see :mod:`~lightning_memtrace.estimator.forked`); the answer is the same for any value.

    Raises:
        OutOfTime: The deadline came before today's estimate could start.
    """
    chosen = sorted({Remedy.parse(r) for r in (remedies or list(Remedy))}, key=list(Remedy).index)
    if not remedies and not setup.settings.ddp_buckets:
        chosen.remove(Remedy.GRADIENT_AS_BUCKET_VIEW)  # only for DDP runs: not listed as skipped elsewhere
    engine = _Engine(setup, device_memory, devices, max_batch, max_batch_size, deadline)
    if deadline is None:
        explicit = remedies is not None
        measured = [
            r for r in chosen if r not in formula_remedies() and _applicable(r, setup, engine.devices, explicit) is None
        ]
        # the longest first, so that the workers finish together (today's among them: waiting for it first costs
        # more than the warm dispatch cache it would leave the workers)
        measured.sort(key=lambda r: -_RELATIVE_COST.get(r, 1.0))
        _prefetch(
            engine,
            [setup.settings.with_remedy(r) for r in measured[:2]]
            + [setup.settings]
            + [setup.settings.with_remedy(r) for r in measured[2:]],
            jobs,
        )
        engine.failed.pop(setup.settings, None)  # today's own error is raised here, as it is without workers
    today = engine.run(setup.settings)
    rows, skipped, late = _rows(engine, today, chosen, explicit=remedies is not None)
    searched = not late
    found = None
    if device_memory is not None and searched:
        try:
            found = _search(engine, today, rows)
        except OutOfTime:
            searched = False
    combination = None
    if found is not None:
        picked, peak = found
        kind = "formula" if any(r in formula_remedies() for r in picked) else "measured"
        text = snippet(setup, picked, engine.devices)
        combination = Combination(tuple(r.value for r in picked), peak, True, kind, text)
    return WhatIf(today, tuple(rows), skipped, combination, device_memory, engine.devices, tuple(late), searched)


def what_if_result(
    module: nn.Module,
    batch: Any,
    *,
    device_memory: int | str | None = None,
    devices: int = 1,
    optimizer_factory: Callable[[nn.Module], Any] | None = None,
    training_step: Callable[[nn.Module, Any], Any] | None = None,
    precision: str = "32-true",
    accumulate_grad_batches: int = 1,
    gradient_checkpointing: bool = False,
    device: torch.device | str | None = None,
    steps: int = 2,
    remedies: Iterable[Remedy | str] | None = None,
    max_batch: bool = True,
    deadline: float | None = None,
    jobs: int = 1,
    ddp_buckets: bool = False,
) -> WhatIf:
    """What would fit, for a module and an example batch (as :func:`~lightning_memtrace.estimator.estimate` takes
    them): today's estimate, each remedy's, and the cheapest combination that fits ``device_memory``.

    Args:
        module: A LightningModule or any ``nn.Module`` (never changed).
        batch: An example batch (tensors or :class:`InputSpec` shapes; the first dimension is the micro-batch).
        device_memory: The device's memory: bytes or a size text (``"24GiB"``); None: no fits, no combination.
        devices: N for ``fsdp`` (1: not estimated).
        optimizer_factory, training_step, precision, accumulate_grad_batches, gradient_checkpointing, device, steps:
            Today's setup, as :func:`~lightning_memtrace.estimator.estimate` takes them.
        remedies: Identifiers to try (default: all).
        max_batch: Search each remedy's largest fitting micro-batch (needs ``device_memory``).
        deadline: ``time.monotonic()`` seconds after which no estimate starts (see :func:`what_if_for_setup`).
        jobs: Worker processes for the estimates (see :func:`what_if_for_setup`).
        ddp_buckets: Today's run is DDP's with its gradient buckets (``gradient_as_bucket_view=False``): they are
            estimated, and remedy ``gradient_as_bucket_view`` is tried.
    """
    from lightning_memtrace.estimator.inputs import batch_dims

    settings = Settings(
        precision=Precision.parse(precision).value,
        batch_size=batch_dims(batch)[0],
        accumulate_grad_batches=max(1, int(accumulate_grad_batches)),
        gradient_checkpointing=bool(gradient_checkpointing),
        ddp_buckets=bool(ddp_buckets),
    )
    setup = ModuleSetup(module, batch, settings, optimizer_factory, training_step, device, steps)
    memory = _bytes(device_memory)
    return what_if_for_setup(
        setup,
        device_memory=memory,
        devices=devices,
        remedies=remedies,
        max_batch=max_batch,
        deadline=deadline,
        jobs=jobs,
    )


def what_if(module: nn.Module, batch: Any, **kwargs: Any) -> Any:
    """:func:`what_if_result` as a pandas DataFrame: one row per remedy (remedy, peak_bytes, saved_bytes, fits,
    max_micro_batch, kind, price, ``<category>_bytes``); the combination is in ``df.attrs["combination"]``,
    today's peak in ``df.attrs["peak_bytes"]`` and the remedies a ``deadline`` left out in
    ``df.attrs["not_estimated"]``."""
    result = what_if_result(module, batch, **kwargs)
    frame = result.to_dataframe()
    frame.attrs["peak_bytes"] = result.estimate.peak_bytes
    frame.attrs["combination"] = result.combination.as_dict() if result.combination is not None else None
    frame.attrs["not_estimated"] = list(result.not_estimated)
    return frame


def what_if_from_config(
    config: Any,
    batch_size: int,
    seq_len: int | None,
    *,
    device_memory: int | str | None = None,
    devices: int = 1,
    optimizer: str = "adamw",
    precision: str = "32-true",
    accumulate_grad_batches: int = 1,
    gradient_checkpointing: bool = False,
    device: str = "cuda",
    steps: int = 2,
    model: nn.Module | None = None,
    remedies: Iterable[Remedy | str] | None = None,
    max_batch: bool = True,
    max_batch_size: int = 4096,
    jobs: int = 1,
    ddp_buckets: bool = False,
    task: str = "causal-lm",
    target_len: int | None = None,
    image_size: int | None = None,
    quantize: str | None = None,
    lora: bool | rm.LoraShape = False,
) -> WhatIf:
    """What would fit, for a Hugging Face causal LM (or ``task``'s model) from its config (as
    :func:`~lightning_memtrace.estimator.estimate_from_config` takes it); see :func:`what_if_result` (and
    :func:`what_if_for_setup` for ``jobs``)."""
    settings = Settings(
        precision=Precision.parse(precision).value,
        batch_size=int(batch_size),
        accumulate_grad_batches=max(1, int(accumulate_grad_batches)),
        gradient_checkpointing=bool(gradient_checkpointing),
        ddp_buckets=bool(ddp_buckets),
        lora=bool(lora),
        quantize=quantize,
    )
    setup = ConfigSetup(
        config, seq_len, settings, model, lora if isinstance(lora, rm.LoraShape) else None, optimizer=optimizer,
        device=device, steps=steps, task=task, target_len=target_len, image_size=image_size,
    )
    return what_if_for_setup(
        setup,
        device_memory=_bytes(device_memory),
        devices=devices,
        remedies=remedies,
        max_batch=max_batch,
        max_batch_size=max_batch_size,
        jobs=jobs,
    )


def _bytes(value: int | str | None) -> int | None:
    from lightning_memtrace.units import parse_bytes

    if value is None:
        return None
    return parse_bytes(value) if isinstance(value, str) else int(value)


# ------------------------------------------------------------------------------------------------ text
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


def _cells(row: WhatIfRow) -> list[str]:
    fits = "-" if row.fits is None else ("yes" if row.fits else "no")
    batch = "-" if row.max_micro_batch is None else str(row.max_micro_batch)
    return [row.remedy, row.kind, format_bytes(row.peak_bytes), format_bytes(row.saved_bytes), fits, batch, row.price]


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {2, 3, 5}
    out = []
    for index, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def what_if_table(result: WhatIf) -> str:
    """The what-if as text: a header, one line per remedy, the skipped ones, the combination and its snippet."""
    today = result.estimate
    head = f"what if (today: peak {format_bytes(today.peak_bytes)}"
    if result.device_memory is not None:
        verdict = "fits" if result.today_fits else "does not fit"
        head += (
            f", {verdict} in {format_bytes(result.device_memory)} minus headroom {format_bytes(HEADROOM_BYTES)}"
            f" + {HEADROOM_FRACTION:.0%} = {format_bytes(result.usable_bytes)} usable"
        )
    lines = [head + "):"]
    header = ["remedy", "kind", "peak", "saved", "fits", "max batch", "price"]
    lines.extend(_aligned([header, *[_cells(row) for row in result.rows]]))
    lines.extend(f"  skipped {name}: {why}" for name, why in result.skipped.items())
    if result.not_estimated:
        lines.append(f"  not estimated (out of time): {', '.join(result.not_estimated)}")
    lines.extend(combination_lines(result))
    return "\n".join(lines)


def combination_lines(result: WhatIf) -> list[str]:
    """The combination as text: the remedies, their peak and kind, then the snippet (or why there is none)."""
    if result.device_memory is None:
        return ["(no device memory given: no combination searched)"]
    budget = format_bytes(result.device_memory)
    combo = result.combination
    if combo is None and not result.searched:
        return [f"no combination searched for {budget}: out of time"]
    if combo is None:
        return [f"no combination of these remedies fits {budget}"]
    if not combo.remedies:
        return [f"to fit {budget}: nothing to change (peak {format_bytes(combo.peak_bytes)})"]
    names = " + ".join(combo.remedies)
    out = [f"to fit {budget}: {names} -> {format_bytes(combo.peak_bytes)} ({combo.kind})", "snippet:"]
    out.extend(f"  {line}" for line in combo.snippet.splitlines())
    return out
