"""What would fit, within a time budget: the what-if that MemTrace runs by itself (in an out-of-memory post-mortem, at
the end of a fit with ``estimate=True``), on fake tensors from the real module and batch, never raising.

Remedies are estimated in order of price; none starts that the longest estimate so far says would end past the budget
(see :func:`~lightning_memtrace.estimator.what_if.what_if_for_setup`), and what was left out is said in one line.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_memtrace.estimator.inputs import InputSpec, map_batch
from lightning_memtrace.estimator.remedies import Remedy
from lightning_memtrace.estimator.what_if import OutOfTime, failure_line, what_if_result
from lightning_memtrace.estimator.what_if_results import WhatIf, combination_lines

#: The default time budget of a what-if MemTrace runs by itself, in seconds.
DEFAULT_BUDGET_S = 60.0
#: Why ``fsdp`` is not estimated inside a run: it shards over N devices, and a run gives none to choose.
FSDP_IN_RUN = "not estimated inside a run: `memtrace estimate --what-if --devices N` or what_if(..., devices=N)"
#: Why ``fsdp`` is not estimated where the run's own process group exists (the estimate makes a fake one).
FSDP_DISTRIBUTED = "torch.distributed is initialized in this run (the estimate would need its own fake process group)"


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory a training step on ``device`` may use at most, in bytes: a CUDA device's total memory (times the
    process's ``torch.cuda.set_per_process_memory_fraction``, the limit the caching allocator enforces), the host's
    physical RAM for CPU (``os.sysconf``), None elsewhere or where it cannot be read."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            total = int(torch.cuda.get_device_properties(index).total_memory)
            fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            return int(total * fraction(index)) if fraction is not None else total
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def batch_shapes(batch: Any) -> Any:
    """The batch with each tensor replaced by its :class:`InputSpec` (shape and dtype): what the estimate reads of
    it, kept without keeping the tensors alive."""
    return map_batch(batch, lambda leaf: InputSpec(tuple(leaf.shape), leaf.dtype))


def optimizer_factory_like(optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[nn.Module], Any] | None:
    """A factory building the first optimizer's class with its defaults on a module's parameters (a plain loop's
    optimizer, rebuilt on the estimate's fake copy), or None without optimizers."""
    first = next(iter(optimizers), None)
    if first is None:
        return None
    kind, defaults = type(first), dict(first.defaults)
    return lambda model: kind([p for p in model.parameters() if p.requires_grad], **defaults)


@dataclasses.dataclass(frozen=True)
class BudgetedWhatIf:
    """A what-if made within a time budget.

    Attributes:
        result: The what-if (possibly with remedies left out: :attr:`WhatIf.not_estimated`), None where none was made.
        budget_s: The budget, in seconds.
        seconds: The time it took, in seconds.
        note: One line where the budget stopped it or it could not be made, else None.
    """

    result: WhatIf | None
    budget_s: float
    seconds: float
    note: str | None = None

    @property
    def made(self) -> bool:
        """Whether there is a table: at least one remedy estimated."""
        return self.result is not None and bool(self.result.rows)

    def text(self) -> str:
        """The table (see :func:`~lightning_memtrace.estimator.what_if_results.what_if_table`) where one was made, then the
        note."""
        lines = [self.result.table()] if self.made and self.result is not None else []
        if self.result is not None and not self.made and not self.note:
            lines.append(f"what-if: no remedy applies (skipped: {', '.join(self.result.skipped) or 'none'})")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_dataframe(self) -> Any:
        """The rows as :meth:`WhatIf.to_dataframe` gives them (bytes as ints; ``max_micro_batch`` a nullable int)."""
        import pandas as pd

        if self.result is None:
            return pd.DataFrame()
        frame = self.result.to_dataframe()
        frame["max_micro_batch"] = frame["max_micro_batch"].astype("Int64")
        return frame

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready). Keys: ``made`` (bool), ``budget_s`` and ``seconds`` (s), ``note`` (str or None),
        ``text`` (:meth:`text`), ``combination_text`` (the combination line and its snippet, or why there is
        none; empty without result), ``peak_bytes`` (today's peak, None without result), and those of
        :meth:`WhatIf.as_dict` except ``estimate``: ``device_memory``, ``usable_bytes`` (bytes), ``headroom``,
        ``today_fits``, ``devices``, ``what_if`` (rows: ``remedy``, ``kind``, ``price``, ``peak_bytes``,
        ``saved_bytes``, ``fits``, ``max_micro_batch``, ``<category>_bytes``), ``skipped``, ``not_estimated``,
        ``combination`` (``remedies``, ``peak_bytes``, ``fits``, ``kind``, ``snippet``, or None)."""
        out: dict[str, Any] = {
            "made": self.made,
            "budget_s": self.budget_s,
            "seconds": round(self.seconds, 3),
            "note": self.note,
            "text": self.text(),
            "combination_text": "\n".join(combination_lines(self.result)) if self.result is not None else "",
            "peak_bytes": self.result.estimate.peak_bytes if self.result is not None else None,
        }
        if self.result is not None:
            out.update({k: v for k, v in self.result.as_dict().items() if k != "estimate"})
        return out


def _stop_note(result: WhatIf | None, seconds: float, budget_s: float, hint: str) -> str | None:
    """The one line where the budget left something out, or None."""
    if result is not None and not result.not_estimated and result.searched:
        return None
    if result is None:
        left = "today's estimate and every remedy"
    elif result.not_estimated:
        left = ", ".join(result.not_estimated)
    else:
        left = "the combination search"
    more = f" ({hint})" if hint else ""
    return f"what-if: stopped after {seconds:.1f} s (budget {budget_s:g} s); not estimated: {left}{more}"


def what_if_within(
    module: nn.Module,
    batch: Any,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    device_memory: int | None = None,
    precision: str = "32-true",
    accumulate_grad_batches: int = 1,
    optimizer_factory: Callable[[nn.Module], Any] | None = None,
    remedies: Iterable[Remedy | str] | None = None,
    hint: str = "",
    ddp_buckets: bool = False,
) -> BudgetedWhatIf:
    """:func:`~lightning_memtrace.estimator.what_if.what_if_result` for ``module`` and ``batch`` (fake tensors: the
    module's parameters, gradients and optimizer state are not touched, nothing real is allocated) within
    ``budget_s`` seconds. Never raises: a failure is the note.

    Args:
        module: The module being trained (a LightningModule: its ``training_step`` and ``configure_optimizers``).
        batch: Its batch (tensors or :class:`InputSpec` shapes).
        budget_s: Seconds it may take.
        device_memory: The device's memory in bytes (see :func:`device_memory_bytes`).
        precision, accumulate_grad_batches: The run's (Lightning's meaning).
        optimizer_factory: ``factory(model) -> optimizer`` for a plain module (see :func:`optimizer_factory_like`).
        remedies: Identifiers to try (default: all, in order of price).
        hint: How to raise the budget, said at the end of the note (e.g. ``raise MemTrace(what_if_budget_s=...)``).
        ddp_buckets: The run is DDP's with its gradient buckets (see :func:`~lightning_memtrace.estimator.estimate`).
    """
    started = time.monotonic()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    result: WhatIf | None = None
    try:
        result = what_if_result(
            module,
            batch,
            device_memory=device_memory,
            devices=1,
            optimizer_factory=optimizer_factory,
            precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            remedies=remedies,
            deadline=started + float(budget_s),
            ddp_buckets=ddp_buckets,
        )
    except OutOfTime:
        pass
    except Exception as error:  # noqa: BLE001 - never raises: a failure is the note
        seconds = time.monotonic() - started
        return BudgetedWhatIf(None, budget_s, seconds, f"what-if: could not be made ({failure_line(error)})")
    seconds = time.monotonic() - started
    if result is not None and Remedy.FSDP.value in result.skipped:
        skipped = {**result.skipped, Remedy.FSDP.value: FSDP_DISTRIBUTED if distributed else FSDP_IN_RUN}
        result = dataclasses.replace(result, skipped=skipped)
    return BudgetedWhatIf(result, float(budget_s), seconds, _stop_note(result, seconds, float(budget_s), hint))
