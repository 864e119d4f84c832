"""LightningCLI with MemTrace configured from YAML (launched by tests/test_compat.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lm_helpers import MLP  # noqa: E402

if __name__ == "__main__":
    LightningCLI(MLP, save_config_kwargs={"overwrite": True})
