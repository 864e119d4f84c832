from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_files import FIXTURES  # noqa: E402  (tests/ is on the path from here on)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip("shared/fixtures/snapshots is absent")
    return FIXTURES


EXPECTED = Path(__file__).resolve().parent / "expected"
UPDATE_EXPECTED_ENV = "MEMTRACE_UPDATE_EXPECTED"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-expected",
        action="store_true",
        default=False,
        help="rewrite tests/expected/*.txt from the current outputs instead of comparing (or set MEMTRACE_UPDATE_EXPECTED=1)",
    )


@pytest.fixture
def expected(request: pytest.FixtureRequest):
    """``expected(text, "name.txt")``: compare a text output with ``tests/expected/name.txt`` (torchinfo style).

    With ``--update-expected`` or ``MEMTRACE_UPDATE_EXPECTED=1`` the file is rewritten instead.
    """
    update = request.config.getoption("--update-expected") or os.environ.get(UPDATE_EXPECTED_ENV) == "1"

    def compare(text: str, name: str) -> None:
        path = EXPECTED / name
        if update or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            if not update:
                pytest.fail(f"{path} did not exist: written now, check it and run again")
            return
        assert text == path.read_text(encoding="utf-8"), f"output differs from {path} (--update-expected rewrites it)"

    return compare
