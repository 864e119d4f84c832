"""shown_once_kept: MemTrace's own work in the training process makes Python forget no warning it showed once."""

from __future__ import annotations

import warnings

import pytest

from lightning_memtrace.trainer.shown_once import shown_once_kept

pytestmark = pytest.mark.skipif(not hasattr(warnings, "_filters_mutated"), reason="no filters hook in this Python")


def _warn_here(text: str = "shown once") -> None:
    warnings.warn(text, UserWarning, stacklevel=1)  # one location: Python's once-record applies


def _shown_again_after(block) -> bool:
    """Whether a warning shown once before ``block`` (run under shown_once_kept) shows again after it."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        _warn_here()
        hook = warnings._filters_mutated
        with shown_once_kept():
            block()
        assert warnings._filters_mutated is hook
        _warn_here()
        return len(shown) == 2


def _filters_changed_and_put_back() -> None:
    with warnings.catch_warnings():  # as pandas does inside astype
        warnings.simplefilter("always", DeprecationWarning)


def test_filters_changed_and_put_back_keep_the_record():
    assert not _shown_again_after(_filters_changed_and_put_back)
    # without it, Python forgets: the test would see nothing otherwise
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        _warn_here()
        _filters_changed_and_put_back()
        _warn_here()
    assert len(shown) == 2


def test_a_filter_added_that_shows_at_most_once_keeps_the_record():
    assert not _shown_again_after(lambda: warnings.filterwarnings("ignore", message="some module's own"))


@pytest.mark.parametrize("action", ["always", "error"])
def test_a_filter_added_that_shows_always_or_raises_forgets(action):
    assert _shown_again_after(lambda: warnings.filterwarnings(action, message="another text"))


def test_a_filter_removed_forgets():
    def remove_last() -> None:
        warnings.filters.pop()  # one of the default filters catch_warnings copied

    assert _shown_again_after(remove_last)
