"""``make setup`` keeps the torch it finds, pinned by a constraint that pip can meet.

PyPI's default torch wheels (CUDA builds) install as distribution version ``2.13.0`` while ``torch.__version__`` says
``2.13.0+cu130``. The Makefile pinned ``torch==2.13.0+cu130``, which no installed or indexed distribution has: pip
refused to install anything (``ResolutionImpossible``), so ``make demo`` and ``make test`` failed on a machine whose
torch came from PyPI. The pin is now the distribution's own version.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _constraint_command() -> str:
    """The Python code the Makefile runs to write ``torch-constraint.txt``."""
    for line in (ROOT / "Makefile").read_text().splitlines():
        if "torch-constraint.txt" in line and " -c " in line and line.rstrip().endswith("torch-constraint.txt"):
            match = re.search(r'-c "(.+)" >', line)
            assert match, line
            return match.group(1)
    raise AssertionError("no line of the Makefile writes torch-constraint.txt")


def test_the_pin_is_the_installed_distributions_version(tmp_path):
    """A stand-in torch laid out as PyPI's CUDA wheel is: ``__version__`` with a local label, metadata without."""
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "9.8.7+cu999"\n')
    info = tmp_path / "torch-9.8.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.8.7\n")
    environment = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", _constraint_command()], capture_output=True, text=True, env=environment, check=True
    )
    assert out.stdout == "torch==9.8.7\n"
