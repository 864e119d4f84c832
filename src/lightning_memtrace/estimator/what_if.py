"""What would fit: today's estimate, then the estimate again with each remedy applied, and the cheapest combination.

Measured remedies re-run the fake-tensor training step with the setup changed (:mod:`.remedies`), ``fsdp`` / ``zero3``
over N devices included (FSDP2 over torch's fake process group, rank zero measured: :mod:`.sharded`); formula remedies
are closed forms over the measured categories of each row:

- ``adamw_8bit`` where bitsandbytes is missing: AdamW's state at 2 bytes per parameter instead of 8;
- ``fsdp`` only where torch has no ``torch.distributed``: parameters, gradients and optimizer state divided by N, plus
  the parameters of the largest repeated block gathered whole while it runs; activations unchanged;
- ``optimizer_offload``: the optimizer state lives on the host (0 on the device).

A prediction fits when ``peak + headroom <= device memory`` (the headroom: :mod:`.what_if_results`, which also holds
the answer's rows and its text); cuBLAS's workspaces are in the peak (:mod:`.blas_workspace`). The setups estimated
again, a module or a config, and the snippet of a combination are in :mod:`.what_if_setups`.

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

from lightning_memtrace.estimator import remedies as rm
from lightning_memtrace.estimator.inputs import Precision
from lightning_memtrace.estimator.remedies import FORMULA_REMEDIES, PRICES, Remedy, Settings
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.estimator.search import find_max_batch
from lightning_memtrace.estimator.what_if_results import (
    HEADROOM_BYTES,
    HEADROOM_FRACTION,
    Combination,
    WhatIf,
    WhatIfRow,
    combination_lines,
    usable_bytes,
    what_if_table,
)
from lightning_memtrace.estimator.what_if_setups import (
    ConfigSetup,
    ModuleSetup,
    Setup,
    checkpointing_line,
    lora_line,
    resize_batch,
    snippet,
)

__all__ = [
    "HEADROOM_BYTES",
    "HEADROOM_FRACTION",
    "Combination",
    "ConfigSetup",
    "ModuleSetup",
    "OutOfTime",
    "Setup",
    "WhatIf",
    "WhatIfRow",
    "checkpointing_line",
    "combination_lines",
    "failure_line",
    "formula_peak",
    "formula_remedies",
    "lora_line",
    "resize_batch",
    "snippet",
    "usable_bytes",
    "what_if",
    "what_if_for_setup",
    "what_if_from_config",
    "what_if_result",
    "what_if_table",
]

#: Groups of remedies of which a combination holds one (a later one replaces an earlier one).
_GROUPS = (
    frozenset({Remedy.BF16_MIXED, Remedy.FP16_MIXED, Remedy.BF16_TRUE}),
    frozenset({Remedy.ADAMW_8BIT, Remedy.ADAFACTOR}),
    frozenset({Remedy.LORA, Remedy.QLORA}),
)


class OutOfTime(Exception):
    """The next estimate of a what-if would end past its deadline."""



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
