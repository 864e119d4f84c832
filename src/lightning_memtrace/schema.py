"""What MemTrace adds to a PyTorch memory snapshot, written and read here only.

* The **header**: the snapshot's ``"memtrace"`` key, a dict (:func:`build_header`, :func:`read_header`).
* The **tag** of each allocation (``user_metadata``): ``"phase=<stage> step=<N>"`` (:func:`format_tag`,
  :func:`parse_tag`).
"""

from __future__ import annotations

import re
from typing import Any

from lightning_memtrace.types import Stage

#: The snapshot key that holds the header.
HEADER_KEY = "memtrace"
#: Version of the header's layout.
SNAPSHOT_FORMAT = 1
PRODUCER = "lightning_memtrace"
#: The per-allocation field that holds the tag.
TAG_FIELD = "user_metadata"
#: The per-allocation (and per-block) field that holds MemTrace's category.
CATEGORY_FIELD = "category"
#: The category of an allocation MemTrace never saw when it named the live storages (readers infer one for it).
UNKNOWN_CATEGORY = "unknown"

_TAG_RE = re.compile(r"(\w+)=([^\s,;]+)")


def build_header(
    *,
    device: str,
    rank: int,
    steps: tuple[int, int],
    allocated_bytes: int,
    allocated_at_start_bytes: int | None,
    categories: dict[str, int],
    phases: list[dict[str, Any]],
    run: str = "",
    category_rules: dict[str, str] | None = None,
    ddp_bucket_bytes: int = 0,
) -> dict[str, Any]:
    """The header of a snapshot covering ``steps`` (first, last); ``phases``: ``{"step", "phase", "time_us"}`` marks;
    ``run``: the run id of the rows the snapshot goes with (the CSV's ``run`` column); ``category_rules``: the run's
    user rules for categories, ``{name: regex}`` in matching order (``{}``: none), which readers apply by default;
    ``ddp_bucket_bytes``: DDP's gradient buckets beside the gradients, among the ``other`` bytes (0: none)."""
    return {
        "format": SNAPSHOT_FORMAT,
        "producer": PRODUCER,
        "device": device,
        "rank": rank,
        "steps": [steps[0], steps[1]],
        "allocated_bytes": allocated_bytes,
        "allocated_at_start_bytes": allocated_at_start_bytes,
        "categories": categories,
        "phases": phases,
        "run": run,
        "category_rules": dict(category_rules or {}),
        "ddp_bucket_bytes": int(ddp_bucket_bytes),
    }


def read_header(data: dict[str, Any]) -> dict[str, Any] | None:
    """The header of an unpickled snapshot, or None (not written by MemTrace)."""
    value = data.get(HEADER_KEY)
    return value if isinstance(value, dict) else None


def header_device(header: dict[str, Any] | None, default: str = "") -> str:
    """The device the snapshot was taken on (``"cuda:0"``, ``"cpu"``)."""
    return str((header or {}).get("device", default))


def header_run(header: dict[str, Any] | None) -> str:
    """The run id the snapshot goes with, or ``""`` (not written by MemTrace, or before run ids)."""
    return str((header or {}).get("run") or "")


def header_category_rules(header: dict[str, Any] | None) -> dict[str, Any] | None:
    """The header's ``category_rules`` (``{name: regex}``) as written, or None (none, or not written by MemTrace).

    The reader checks them (:class:`~lightning_memtrace.analysis.rules.CategoryRules`): a header is untrusted input."""
    rules = (header or {}).get("category_rules")
    return rules if isinstance(rules, dict) and rules else None


def header_ddp_bucket_bytes(header: dict[str, Any] | None) -> int:
    """The bytes of DDP's gradient buckets the header names (0: none, not said, or not a byte count a device holds)."""
    value = (header or {}).get("ddp_bucket_bytes")
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 63
    return value if valid else 0


def header_is_cpu(header: dict[str, Any] | None) -> bool:
    return header_device(header).startswith("cpu")


def header_steps(header: dict[str, Any] | None) -> tuple[Any, Any] | None:
    """The (first, last) steps of the snapshot's window, or None."""
    steps = (header or {}).get("steps")
    return (steps[0], steps[1]) if isinstance(steps, list) and len(steps) == 2 else None


def header_phase_marks(header: dict[str, Any] | None) -> list[Any] | None:
    """The ``{"step", "phase", "time_us"}`` marks of the header, or None."""
    phases = (header or {}).get("phases")
    return phases if isinstance(phases, list) else None


def format_tag(stage: Stage | str, step: int) -> str:
    """``"phase=forward step=3"``."""
    return f"phase={Stage(stage).value} step={step}"


def parse_tag(text: str) -> tuple[Stage | None, int | None]:
    """``"phase=forward step=3"`` → ``(Stage.FORWARD, 3)``; what is missing or unknown is None.

    ``stage=`` is read as ``phase=``, and ``train``/``training`` as forward.
    """
    stage: Stage | None = None
    step: int | None = None
    for key, value in _TAG_RE.findall(text or ""):
        if key in ("phase", "stage"):
            try:
                stage = Stage(value)
            except ValueError:
                stage = Stage.FORWARD if value in ("train", "training") else None
        elif key == "step":
            try:
                step = int(value)
            except ValueError:
                continue  # not a number: keep the step read before, if any
    return stage, step
