"""What a recorder measures and keeps: one settings object shared by :class:`MemTrace` and :class:`MemoryRecorder`.

The choice of how allocations are seen (the tracker's backend, the history window's stacks) is made here, from the
settings and the module, so that the callback and a plain-loop recorder make the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, get_args

import torch
from torch import nn

from lightning_memtrace.analysis.rules import RuleError, compile_rules
from lightning_memtrace.capture import torch_private

#: How the CPU allocation tracker sees allocations (see :class:`RecorderConfig`).
AllocationBackend = Literal["auto", "reports", "dispatch"]
ALLOCATION_BACKENDS: tuple[str, ...] = get_args(AllocationBackend)


@dataclasses.dataclass(frozen=True)
class RecorderConfig:
    """Settings of a :class:`~lightning_memtrace.MemoryRecorder` (and of the :class:`~lightning_memtrace.MemTrace`
    callback, which passes its own on unchanged).

    Args:
        track_allocations: Count allocations with the allocation tracker. None: on where the device's allocator has no
            counters (CPU), off elsewhere.
        history: Record the allocator's history for a window of steps and write a snapshot at its end.
        history_skip_steps: Steps of the run to let pass before the window opens.
        history_steps: Steps in the window.
        max_entries: Ring-buffer size of the history, in events.
        frames_min_bytes: Outside the window, the dispatch-mode tracker records a stack only for allocations at least
            this large (bytes).
        post_mortem: Write ``oom_rank<R>_step<N>.pickle`` and ``.txt`` on out-of-memory.
        max_rows: Most rows written to the CSV in one run (None: no cap).
        every_n_steps: Take rows only on steps divisible by this.
        max_snapshots: Most window snapshots kept in the output folder (oldest removed).
        allocation_backend: ``"auto"`` reads the CPU allocator's own reports where it can (no Python work per operator)
            and falls back to the dispatch mode; ``"dispatch"`` always uses the dispatch mode (for a run profiled with
            ``torch.profiler``); ``"reports"`` insists on the reports.
        window_stacks: Record Python stacks in the history window (the dispatch mode runs there for them).
        category_rules: User rules for categories, ``{name: regex}`` (e.g. ``{"kv_cache": r"cache_utils\\.py"}``):
            checked here (a bad regex is a ``ValueError`` naming the rule), written into every snapshot's header
            (``category_rules``), and applied by whatever reads the snapshot (the end-of-fit report, ``memtrace
            summary``/``report``/``diff``) to the allocations whose category MemTrace did not record; see
            :mod:`~lightning_memtrace.analysis.rules`. Held as ``((name, regex), ...)`` in order.
        what_if_budget_s: Seconds the post-mortem may spend on its "what would fit" table (each remedy estimated on
            fake tensors for the model and the batch it died on; remedies that would pass the budget are left out,
            said in one line). 0: no table.
    """

    track_allocations: bool | None = None
    history: bool = True
    history_skip_steps: int = 1
    history_steps: int = 2
    max_entries: int = 100_000
    frames_min_bytes: int = 16 * 1024**2
    post_mortem: bool = True
    max_rows: int | None = 1_000_000
    every_n_steps: int = 1
    max_snapshots: int = 10
    allocation_backend: AllocationBackend = "auto"
    window_stacks: bool = True
    category_rules: Mapping[str, str] | tuple[tuple[str, str], ...] | None = ()
    what_if_budget_s: float = 60.0

    def __post_init__(self) -> None:
        if self.allocation_backend not in ALLOCATION_BACKENDS:
            choices = ", ".join(repr(b) for b in ALLOCATION_BACKENDS)
            raise ValueError(f"allocation_backend must be one of {choices}, not {self.allocation_backend!r}")
        set_value = object.__setattr__  # frozen: normalize once, here
        try:
            rules = compile_rules(self.category_rules)
        except RuleError as error:
            raise ValueError(f"category_rules: {error}") from None
        set_value(self, "category_rules", tuple((name, regex.pattern) for name, regex in rules))
        set_value(self, "history_skip_steps", max(0, int(self.history_skip_steps)))
        set_value(self, "history_steps", max(0, int(self.history_steps)))
        set_value(self, "every_n_steps", max(1, int(self.every_n_steps)))
        set_value(self, "max_snapshots", max(1, int(self.max_snapshots)))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def replace(self, **changes: object) -> RecorderConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def uses_reports(self) -> bool:
        """The CPU allocator's reports may be read (so the allocator must know every block's size)."""
        return self.allocation_backend != "dispatch" and self.track_allocations is not False


def has_compiled_parts(module: nn.Module | None) -> bool:
    """The module (or a child) is ``torch.compile``'d."""
    if module is None:
        return False
    if getattr(module, "_compiler_ctx", None):
        return True
    optimized_type = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
    if optimized_type is None:
        return False
    return any(isinstance(child, optimized_type) for child in module.modules())


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """How allocations are seen in one run: the settings to record with, and what to tell the user (if anything)."""

    config: RecorderConfig
    warning: str | None = None
    #: The counting dispatch mode makes torch.compile'd code run eagerly, to count it (the user asked for that);
    #: otherwise compiled code runs compiled under it, as without MemTrace, and is not counted.
    compiled_eagerly: bool = False


def choose_backend(
    config: RecorderConfig, model: nn.Module | None, reports_available: bool, has_counters: bool
) -> BackendChoice:
    """Settle the tracker's backend for a run of ``model``.

    A compiled module on a device without allocator counters: the counting dispatch mode would miss what its compiled
    parts allocate (or, made to count them, run them eagerly), so the allocator's reports are used where they are
    available (the window's stack-noting mode lets compiled code compile; before torch 2.9 it cannot, and the window
    goes without stacks), and otherwise the tracker is off unless the user turned it on explicitly.
    """
    if config.track_allocations is False or has_counters or not has_compiled_parts(model):
        return BackendChoice(config)
    if config.allocation_backend != "dispatch" and reports_available:
        stacks = config.window_stacks and torch_private.dispatch_modes_let_compiled_code_compile()
        return BackendChoice(config.replace(allocation_backend="reports", window_stacks=stacks))
    if config.track_allocations is None:
        return BackendChoice(
            config.replace(track_allocations=False),
            "the module has torch.compile'd parts. The CPU allocation tracker (a dispatch mode) would make them run "
            "eagerly, so it is off for this run: allocated_bytes is the sum of the categories and peaks inside "
            "compiled regions are not seen. Pass MemTrace(track_allocations=True) to trade compilation for exact "
            "counters.",
        )
    eagerly = "track_allocations=True makes the torch.compile'd parts of the module run eagerly."
    return BackendChoice(config, eagerly, compiled_eagerly=True)
