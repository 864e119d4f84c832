"""Reading a trace's events into numpy columns, tolerating whatever an untrusted file holds.

One pass over the events reads their fields (pandas' C loop when it can); actions become small integer codes.
"""

from __future__ import annotations

import collections
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

#: Event actions, in code order; anything else is ``other``.
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "free",
    "other",
)
A = {name: code for code, name in enumerate(ACTIONS)}
_A_OTHER = A["other"]
_ACTION_LOOKUP: collections.defaultdict[Any, int] = collections.defaultdict(lambda: _A_OTHER, A)
_FIELDS = ["action", "addr", "size", "time_us", "frames"]


def as_int(value: Any) -> int:
    """``int(value)`` for the numbers of a snapshot; anything else (None, text, huge) is 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    try:
        number = int(value)
    except (ValueError, OverflowError):
        return 0
    return number if -(2**62) < number < 2**62 else 0


def _to_int64(values: Any, trace: list[dict[str, Any]]) -> np.ndarray:
    try:
        # NaN, infinity or a float too large for int64 (a hostile file) raises here instead of warning on the console
        # and casting to garbage
        with np.errstate(invalid="raise", over="raise"):
            out = np.asarray(values).astype(np.int64)
        if len(out) == len(trace):
            return out
    except (TypeError, ValueError, OverflowError, FloatingPointError):
        pass  # some value is not a number: convert one by one below
    return np.fromiter((as_int(v) for v in values), dtype=np.int64, count=len(trace))


def column(trace: list[dict[str, Any]], key: str, default: Any) -> list[Any]:
    """``[e[key] for e in trace]`` at C speed, falling back to ``.get`` when some event lacks the key."""
    try:
        return list(map(itemgetter(key), trace))
    except (KeyError, TypeError, IndexError):
        return [e.get(key, default) if isinstance(e, dict) else default for e in trace]


def _field_table(trace: list[dict[str, Any]]) -> Any:
    """pandas' Cython loop over the dicts reads all five fields in one pass (3x faster than five passes); None when it
    cannot (a private pandas helper: any failure falls back to one pass per field)."""
    try:
        from pandas._libs import lib

        table = lib.dicts_to_array(trace, _FIELDS)
    except Exception:  # a pandas without it, or events it cannot read: the per-field path reads them
        return None
    return table if table.shape == (len(trace), len(_FIELDS)) else None


def extract_columns(trace: list[dict[str, Any]]) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray | None, Any]:
    """The ``action, addr, size, time_us, frames`` fields of every event, in one pass when possible.

    Returns:
        ``(actions, addrs, sizes, times or None when some event has no time, frames)``; actions and frames are
        sequences of the raw values (a missing one is NaN or None).
    """
    if not trace:
        empty = np.zeros(0, dtype=np.int64)
        return [], empty, empty, None, []
    table = _field_table(trace)
    if table is not None:
        actions, addr_col, size_col, time_col, frames = (table[:, k] for k in range(len(_FIELDS)))
    else:
        actions = column(trace, "action", "other")
        addr_col = column(trace, "addr", 0)
        size_col = column(trace, "size", 0)
        time_col = column(trace, "time_us", None)
        frames = column(trace, "frames", None)
    times: np.ndarray | None
    try:
        with np.errstate(invalid="raise", over="raise"):
            times = np.asarray(time_col).astype(np.int64)  # a missing time (None, NaN) raises
    except (TypeError, ValueError, OverflowError, FloatingPointError):
        times = None
    return actions, _to_int64(addr_col, trace), _to_int64(size_col, trace), times, frames


def action_codes(actions: Any, n: int) -> np.ndarray:
    """Codes into :data:`ACTIONS`; unknown (or unhashable) actions are ``other``."""
    try:
        return np.fromiter(map(_ACTION_LOOKUP.__getitem__, actions), dtype=np.int8, count=n)
    except TypeError:  # an unhashable action (a list or dict) in an untrusted file
        return np.fromiter(
            (_ACTION_LOOKUP[a] if isinstance(a, str) else _A_OTHER for a in actions), dtype=np.int8, count=n
        )


def factorize(values: list[Any]) -> tuple[np.ndarray, Any]:
    """``pd.factorize`` of untrusted values: anything unhashable (a dict where a string belongs) becomes its repr."""
    try:
        return pd.factorize(_objects(values))
    except TypeError:
        safe = [v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for v in values]
        return pd.factorize(_objects(safe))


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def first_positions(keys: np.ndarray, count: int) -> np.ndarray:
    """For codes ``keys`` in ``range(count)``, the first position of each code."""
    first = np.zeros(count, dtype=np.int64)
    first[keys[::-1]] = np.arange(len(keys) - 1, -1, -1)
    return first


def scatter_add(n: int, index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[index] += values`` into ``n`` int64 zeros, exactly (float sums only while they cannot round)."""
    if len(values) == 0:
        return np.zeros(n, dtype=np.int64)
    if int(np.abs(values).max()) * len(values) < 2**53:
        return np.bincount(index, weights=values, minlength=n)[:n].astype(np.int64)
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, index, values)
    return out
