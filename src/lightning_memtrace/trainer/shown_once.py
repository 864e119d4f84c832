"""Keeping Python's record of the warnings it has shown once while MemTrace's own work runs in the training process.

Every change to the warning filters (``warnings.catch_warnings``, ``filterwarnings``) makes Python forget which
warnings it has shown once, so each shows again the next time it is raised. pandas and matplotlib change the filters
inside many of their calls (``astype``, importing styles): the report written at the end of a fit would make a
warning of the user's, or Lightning's own once-a-process warnings, show again at the next fit or test.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


def _filters_unchanged() -> None:
    """Stands in for ``warnings._filters_mutated`` while the filters come back to what they were."""


@contextlib.contextmanager
def shown_once_kept() -> Iterator[None]:
    """Run the block without making Python forget the warnings it has shown once.

    The block may change the filters and put them back (pandas does, inside its calls). Filters it leaves added (a
    module imported for the first time adds its own) keep the record as it is where they show a warning at most once
    or not at all: what was shown once stays rightly shown. Any other change (a filter removed, one that shows always
    or raises) makes Python forget, as the block's changes would have. Where this Python has no
    ``warnings._filters_mutated`` (the hook CPython 3.9 to 3.13 calls), the block runs as it is.
    """
    mutated = getattr(warnings, "_filters_mutated", None)
    if not callable(mutated):
        yield
        return
    filters_before = list(warnings.filters)
    warnings._filters_mutated = _filters_unchanged  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if warnings._filters_mutated is _filters_unchanged:  # type: ignore[attr-defined]
            warnings._filters_mutated = mutated  # type: ignore[attr-defined]
        if not _record_still_right(filters_before, list(warnings.filters)):
            mutated()


#: Filter actions under which a warning shows at most once where it is raised (or never): a record of "shown once"
#: made before such a filter came stays right under it.
_AT_MOST_ONCE = frozenset({"ignore", "default", "module", "once"})


def _record_still_right(before: list, after: list) -> bool:
    if any(entry not in after for entry in before):
        return False
    return all(entry[0] in _AT_MOST_ONCE for entry in after if entry not in before)
