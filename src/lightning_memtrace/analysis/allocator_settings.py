"""The CUDA caching allocator's settings that change what it reserves: ``PYTORCH_CUDA_ALLOC_CONF``, parsed."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """The caching allocator's settings that change what it reserves (``PYTORCH_CUDA_ALLOC_CONF``).

    Attributes:
        expandable_segments: ``expandable_segments:True``.
        max_split_size: ``max_split_size_mb`` in bytes (None: unlimited, the default): free blocks this large are
            not cut for smaller requests, and are the first given back when CUDA runs out.
        roundup_power2_divisions: ``roundup_power2_divisions:N`` (one number for every size; 0 or 1: off).
        backend: ``backend:`` (``native``, the default, or ``cudaMallocAsync``: CUDA's own stream-ordered allocator,
            which the model does not follow; its runs are served with the native allocator's rules and say so).
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    roundup_power2_divisions: int = 0
    backend: str = "native"

    @classmethod
    def parse(cls, conf: str) -> AllocatorSettings:
        """Read the settings from ``PYTORCH_CUDA_ALLOC_CONF`` text (``key:value`` pairs separated by commas).

        Keys that do not change the reserved bytes (``garbage_collection_threshold``, pinned-memory keys) and
        ``roundup_power2_divisions`` given per size range (``[256:1,>:4]``) are left at their defaults.
        """
        expandable, max_split, divisions, backend = False, None, 0, "native"
        for item in _settings_items(conf):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                expandable = value.lower() == "true"
            elif key == "max_split_size_mb" and value.isdigit():
                max_split = int(value) << 20
            elif key == "roundup_power2_divisions" and value.isdigit():
                divisions = int(value)
            elif key == "backend" and value:
                backend = value
        return cls(expandable, max_split, divisions, backend)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> AllocatorSettings:
        """The settings a CUDA process started with this environment would use (``PYTORCH_CUDA_ALLOC_CONF``, else
        torch 2.9's ``PYTORCH_ALLOC_CONF``)."""
        environ = os.environ if environ is None else environ
        conf = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
        return cls.parse(conf)

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any]) -> AllocatorSettings:
        """The settings a snapshot recorded (its ``allocator_settings``; defaults where it has none)."""
        recorded = snapshot.get("allocator_settings") if isinstance(snapshot, Mapping) else None
        if not isinstance(recorded, Mapping):
            return cls()
        max_split = recorded.get("max_split_size", -1)
        divisions = recorded.get("roundup_power2_divisions")
        single = 0
        if isinstance(divisions, Mapping) and divisions:
            values = {int(v) for v in divisions.values() if isinstance(v, int)}
            single = values.pop() if len(values) == 1 else 0
        return cls(
            expandable_segments=bool(recorded.get("expandable_segments", False)),
            max_split_size=int(max_split) if isinstance(max_split, int) and 0 < max_split < (1 << 62) else None,
            roundup_power2_divisions=single,
        )

    def describe(self) -> str:
        """``"expandable segments"``, ``"max_split_size_mb:512"``... or ``"defaults"``."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable segments")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size >> 20}")
        if self.roundup_power2_divisions > 1:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.backend != "native":
            parts.append(f"backend:{self.backend}, not modelled: served with the native allocator's rules")
        return ", ".join(parts) or "defaults"


def _settings_items(conf: str) -> Iterator[str]:
    """``conf``'s comma-separated items, a bracketed list kept whole."""
    depth, start = 0, 0
    for i, char in enumerate(conf):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            yield conf[start:i]
            start = i + 1
    yield conf[start:]
