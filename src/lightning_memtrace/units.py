"""Byte formatting. Bytes stay integers everywhere; these helpers convert only for display (1024-based)."""

from __future__ import annotations

MIB = 1024**2
GIB = 1024**3
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(num_bytes: float, precision: int = 1) -> str:
    """Format a byte count with a 1024-based unit, e.g. ``format_bytes(1536) == '1.5 KiB'``."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_exact(num_bytes: int) -> str:
    """``'8.0 MiB (8,388,608 B)'``: the readable size and the exact count."""
    return f"{format_bytes(num_bytes)} ({int(num_bytes):,} B)"


def parse_bytes(text: str) -> int:
    """Parse ``'80GiB'``, ``'80 GB'``, ``'1.5e9'`` or ``'512MiB'`` into bytes (GB/MB are taken as 1000-based)."""
    s = text.strip().replace(" ", "")
    factors = {
        "kib": 1024, "mib": MIB, "gib": GIB, "tib": 1024**4,
        "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
        "k": 1024, "m": MIB, "g": GIB, "t": 1024**4, "b": 1,
    }
    lower = s.lower()
    for suffix in sorted(factors, key=len, reverse=True):
        if lower.endswith(suffix):
            return int(float(s[: -len(suffix)]) * factors[suffix])
    return int(float(s))


def percent(part: float, whole: float) -> float:
    """``part`` as a percent of ``whole`` (0 when ``whole`` is 0)."""
    return 100.0 * part / whole if whole else 0.0
