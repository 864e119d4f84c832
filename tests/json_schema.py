"""The documented shapes of ``memtrace summary --json`` and ``memtrace diff --json`` (README, "Machine-readable
answers"), and a checker: exact keys, and the type of every value (bytes are ints, never floats or bools)."""

from __future__ import annotations

from typing import Any

NoneType = type(None)


#: Any JSON value (a finding's ``numbers`` hold ints, floats, strings, None and objects of them).
JSON_VALUE = (int, float, str, bool, NoneType, list, dict)


class MapOf:
    """A JSON object with any string keys and values of one type."""

    def __init__(self, value: Any) -> None:
        self.value = value


SITE = {"site": str, "function": str, "category": str, "bytes": int, "count": int}
PHASE = {
    "phase": str,
    "step": int,
    "first_event": int,
    "last_event": int,
    "events": int,
    "peak_bytes": int,
    "peak_event": int,
}
FILE_LINE = {"file": str, "line": int, "function": str, "bytes": int, "count": int}
ANNOTATION = {"name": str, "stage": str, "time_us": int, "live_bytes": int}
DEVICE = {
    "device": int,
    "events": int,
    "has_time": bool,
    "scope": str,
    "scope_events": int,
    "peak_bytes": int,
    "peak_event": int,
    "peak_time_us": int,
    "stage": str,
    "step": int,
    "reserved_bytes": (int, NoneType),
    "live_bytes": (int, NoneType),
    "categories": MapOf(int),
    "sites": [SITE],
    "site_count": int,
    "file_lines": ([FILE_LINE], NoneType),
    "annotations": [ANNOTATION],
    "phases": [PHASE],
}
QUESTION = {
    "window_us": ([int], NoneType),
    "at": (int, NoneType),
    "step": (int, NoneType),
    "phase": (str, NoneType),
    "file": (str, NoneType),
}
FINDING = {"code": str, "severity": str, "message": str, "numbers": MapOf(JSON_VALUE)}
POST_MORTEM = {
    "file": str,
    "rank": int,
    "device": str,
    "step": int,
    "epoch": int,
    "batch_idx": int,
    "dataloader_idx": int,
    "stage": str,
    "exception_type": str,
    "message": str,
    "raised_as": (str, NoneType),
    "requested_bytes": (int, NoneType),
    "allocated_bytes": int,
    "reserved_bytes": int,
    "device_free_bytes": (int, NoneType),
    "categories": MapOf(int),
    "failed_at": (str, NoneType),
    "advice": [str],
    "what_if": (MapOf(JSON_VALUE), NoneType),
}
RUN = {
    "run": str,
    "label": str,
    "snapshot": (str, NoneType),
    "is_memtrace": bool,
    "categories_inferred": bool,
    "category_rules": MapOf(str),
    "question": QUESTION,
    "findings": [FINDING],
    "post_mortems": [POST_MORTEM],
    "devices": [DEVICE],
}
SUMMARY = {"schema": str, "file": str, **RUN}
SUMMARY_RUNS = {"schema": str, "file": str, "runs": [RUN]}
SIDE = {
    "name": str,
    "snapshot": (str, NoneType),
    "device": (int, NoneType),
    "peak_bytes": (int, NoneType),
    "peak_event": (int, NoneType),
    "categories": MapOf(int),
}
DIFF = {
    "schema": str,
    "a": SIDE,
    "b": SIDE,
    "figures": [{"figure": str, "a": int, "b": int, "delta": int}],
    "categories": [{"category": str, "a": int, "b": int, "delta": int}],
    "sites": [{"site": str, "a": int, "b": int, "delta": int}],
    "site_count": int,
}


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_shape(value: Any, spec: Any, where: str = "$") -> None:
    """Raise AssertionError where ``value`` does not have the shape ``spec`` (a type, a tuple of alternatives, a dict
    of exact keys, a one-item list for arrays, or :class:`MapOf`)."""
    if isinstance(spec, tuple):
        errors = []
        for alternative in spec:
            try:
                check_shape(value, alternative, where)
                return
            except AssertionError as error:
                errors.append(str(error))
        raise AssertionError(" / ".join(errors))
    if isinstance(spec, dict):
        assert isinstance(value, dict), f"{where}: not an object"
        assert set(value) == set(spec), f"{where}: keys {sorted(value)} != {sorted(spec)}"
        for key, sub in spec.items():
            check_shape(value[key], sub, f"{where}.{key}")
    elif isinstance(spec, list):
        assert isinstance(value, list), f"{where}: not an array"
        for i, item in enumerate(value):
            check_shape(item, spec[0], f"{where}[{i}]")
    elif isinstance(spec, MapOf):
        assert isinstance(value, dict), f"{where}: not an object"
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: key {key!r}"
            check_shape(item, spec.value, f"{where}.{key}")
    else:
        assert _is(value, spec), f"{where}: {value!r} is not {spec.__name__}"
