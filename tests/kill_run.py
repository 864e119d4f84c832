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
    """READY once step 20 is past and the CSV holds 100 rows (rows reach it every second or every 256 rows)."""

    def __init__(self, csv: Path) -> None:
        self.csv, self.said = csv, False

    def on_train_batch_end(self, trainer, *args):
        if self.said or trainer.global_step < 20 or not self.csv.exists():
            return
        if self.csv.read_bytes().count(b"\n") > 100:
            self.said = True
            print("READY", flush=True)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    callback = MemTrace(dirpath=out, history_skip_steps=0, history_steps=1000000, max_entries=2000)
    trainer(out, [callback, Ready(out / "phases_rank0.csv")], max_steps=1000000, max_epochs=-1).fit(MLP())
