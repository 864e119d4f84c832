"""What a what-if answers: one row per remedy, the cheapest combination that fits, and all of it as text.

A prediction fits when ``peak + headroom <= device memory``, the headroom being :data:`HEADROOM_BYTES` (the CUDA
context and what else the allocator does not count) plus :data:`HEADROOM_FRACTION` of the device (allocator
fragmentation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.types import Category
from lightning_memtrace.units import GIB, format_bytes

#: Fixed headroom kept free on the device: the CUDA context and what else the allocator does not count.
HEADROOM_BYTES = 1 * GIB
#: Headroom as a share of the device memory: fragmentation of the caching allocator.
HEADROOM_FRACTION = 0.05


def usable_bytes(device_memory: int) -> int:
    """The bytes a training step may allocate on a device of ``device_memory`` bytes, after the headroom."""
    return int(device_memory) - HEADROOM_BYTES - int(HEADROOM_FRACTION * int(device_memory))


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



# ------------------------------------------------------------------------------------------------ text
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
