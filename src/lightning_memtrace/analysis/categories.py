"""Category inference: what an allocation is for, from the stage it was made in and the stage it was freed in.

Used for snapshots that MemTrace did not write (and for allocations it left uncategorised).
"""

from __future__ import annotations

import numpy as np

from lightning_memtrace.analysis.stacks import S_AFTER, S_BWD, S_FWD, S_INIT, S_OPT, S_OUT, S_VAL, S_ZG
from lightning_memtrace.types import CATEGORIES

#: Category codes: positions in :data:`~lightning_memtrace.types.CATEGORIES`.
CAT_CODE = {name: code for code, name in enumerate(CATEGORIES)}

#: The rules, in words, as the report states them.
INFERENCE_RULES = (
    "made in optimizer.step and kept → optimizer state, freed inside it → optimizer intermediates; made in "
    "backward and kept → gradients; made in a module's forward and kept past it → activations, freed within "
    "it → intermediates; alive before recording → pre-existing"
)


def infer_categories(
    stage_alloc: np.ndarray,
    stage_end: np.ndarray,
    alloc_index: np.ndarray,
    end_index: np.ndarray,
    n: int,
    forward_rows: np.ndarray,
) -> np.ndarray:
    """Categories (codes into :data:`CATEGORIES`) of allocations from where they were made and freed.

    Rules: alive before the trace → pre-existing; made in ``optimizer.step`` and kept → optimizer state, freed inside
    it → optimizer intermediates; made in backward and kept past it → gradients, freed in it → intermediates; made in a
    module's construction or ``.to()`` → parameters; made in forward and kept past it → activations, freed within it →
    intermediates; made outside any pass: freed in backward → activations (a loss), alive across a later forward →
    inputs, else other.

    Args:
        stage_alloc: Stage code at the allocating event (``S_OUT`` for pre-existing).
        stage_end: Stage code at the freeing event (``-1`` when alive at the end).
        alloc_index: Row of the allocation (``-1``: pre-existing).
        end_index: Row of the free (``n``: alive at the end).
        n: Number of rows.
        forward_rows: Sorted rows whose stage is forward.

    Returns:
        ``int16`` codes.
    """
    cat = np.full(len(stage_alloc), CAT_CODE["other"], dtype=np.int16)
    kept = stage_end != stage_alloc
    sa = stage_alloc
    # Outside any pass: inputs if a forward ran while alive.
    if len(forward_rows):
        first_fwd_after = np.searchsorted(forward_rows, alloc_index, side="right")
        has_fwd = first_fwd_after < len(forward_rows)
        fwd_row = forward_rows[np.minimum(first_fwd_after, len(forward_rows) - 1)]
        alive_across_fwd = has_fwd & (fwd_row < end_index)
    else:
        alive_across_fwd = np.zeros(len(sa), dtype=bool)
    outside = (sa == S_OUT) | (sa == S_AFTER) | (sa == S_VAL)
    cat[outside & alive_across_fwd] = CAT_CODE["inputs"]
    cat[outside & (stage_end == S_BWD)] = CAT_CODE["activations"]
    cat[sa == S_INIT] = CAT_CODE["parameters"]
    cat[(sa == S_FWD) & kept] = CAT_CODE["activations"]
    cat[(sa == S_FWD) & ~kept] = CAT_CODE["intermediates"]
    cat[(sa == S_BWD) & kept] = CAT_CODE["gradients"]
    cat[(sa == S_BWD) & ~kept] = CAT_CODE["intermediates"]
    cat[(sa == S_OPT) & kept] = CAT_CODE["optimizer_state"]
    cat[(sa == S_OPT) & ~kept] = CAT_CODE["optimizer_intermediates"]
    cat[sa == S_ZG] = CAT_CODE["other"]
    cat[alloc_index < 0] = CAT_CODE["pre_existing"]
    return cat
