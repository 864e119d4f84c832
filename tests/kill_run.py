"""A long CPU run with MemTrace that prints READY once rows are being written (tests/test_compat.py kills it)."""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning_memtrace import MemTrace  # noqa: E402
from lm_helpers import MLP, trainer  # noqa: E402


class Ready(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 20:
            print("READY", flush=True)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    callback = MemTrace(dirpath=out, history_skip_steps=0, history_steps=1000000, max_entries=2000)
    trainer(out, [callback, Ready()], max_steps=1000000, max_epochs=-1).fit(MLP())
