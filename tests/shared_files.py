"""Where the tests find the files shared between sessions (``../shared``): real snapshots, model configs."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "snapshots"
CONFIGS = SHARED / "reference" / "configs"
#: Every snapshot in ``FIXTURES``.
ALL_FIXTURES = [
    "shreyansh26_profile_grad.pkl",
    "shreyansh26_profile_no_grad.pkl",
    "drisspg_mini_snapshot.pickle",
    "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle",
    "MAGMA27_assignment2_memory_snapshot.pickle",
    "Muduard_memory_snapshot.pkl",
]


def fixture_path(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"fixture {name} is absent")
    return path


def config_path(name: str) -> Path:
    """A model config from ``../shared/reference/configs``; the test skips where it is absent."""
    path = CONFIGS / name
    if not path.is_file():
        pytest.skip(f"model config {name} is absent (../shared/reference/configs)")
    return path
