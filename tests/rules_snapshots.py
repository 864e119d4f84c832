"""A synthetic torch snapshot for the tests of user rules for categories (``--rule``, ``category_rules``)."""

from __future__ import annotations

from typing import Any

TRAIN = {"name": "main", "filename": "/home/u/train.py", "line": 9}
MODEL = {"name": "forward", "filename": "/home/u/model.py", "line": 5}
ATTN = {"name": "forward", "filename": "/home/u/attn.py", "line": 10}
CACHE = {"name": "update", "filename": "/site-packages/transformers/cache_utils.py", "line": 40}
MLP = {"name": "forward", "filename": "/home/u/mlp.py", "line": 3}
SOFTMAX = {"name": "softmax", "filename": "/home/u/attn.py", "line": 12}


def alloc_event(addr: int, size: int, t: int, frames: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "time_us": t, "frames": frames, **extra}


def free_event(addr: int, size: int, t: int, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": "free_completed", "addr": addr, "size": size, "time_us": t, "frames": frames}


def synthetic() -> dict[str, Any]:
    """A torch snapshot: a block alive before the trace (made in attn.py), then A (attn.py under model.py), a softmax
    temporary, B (cache_utils.py called from attn.py) and C (mlp.py); all but the temporary alive at the end."""
    seeded = {
        "size": 512,
        "requested_size": 64,
        "address": 9_000,
        "state": "active_allocated",
        "frames": [ATTN, TRAIN],
    }
    return {
        "segments": [{"device": 0, "address": 9_000, "total_size": 512, "blocks": [seeded]}],
        "device_traces": [
            [
                alloc_event(1, 1000, 1, [ATTN, MODEL, TRAIN]),
                alloc_event(2, 50, 2, [SOFTMAX, ATTN, MODEL, TRAIN]),
                free_event(2, 50, 3, [ATTN, MODEL, TRAIN]),
                alloc_event(3, 300, 4, [CACHE, ATTN, MODEL, TRAIN]),
                alloc_event(4, 200, 5, [MLP, MODEL, TRAIN]),
            ]
        ],
    }
