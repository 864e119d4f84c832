"""Validation-loop time with MemTrace divided by validation-loop time without, side by side in one run.

Usage: python benchmarks/validation_overhead.py [--batches 1000] [--rounds 5] [--batch-size 4]

A validation-heavy run: a tiny MLP trains one step, then validates on ``--batches`` batches of ``--batch-size`` rows,
so the fixed cost MemTrace pays per row (two rows per validation batch) dominates. Only the validation loop is timed,
from ``on_validation_start`` to ``on_validation_end`` (a timing callback placed after MemTrace, so MemTrace's
``on_validation_end`` is inside). The variants run interleaved round by round so that machine noise hits them alike
(one warm-up round is not counted); the script prints the median of each and its ratio to the bare run:

- bare: no MemTrace
- memtrace: ``MemTrace()`` defaults (CPU: allocation tracker on, reading the CPU allocator's reports)
- memtrace_no_tracker: ``MemTrace(track_allocations=False)`` (categories only)

Every variant logs to the same kind of ``CSVLogger``. Target (issue 10): ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from lightning_memtrace import MemTrace  # noqa: E402

TARGET = 1.10
VARIANTS = {
    "bare": lambda: None,
    "memtrace": lambda: MemTrace(),
    "memtrace_no_tracker": lambda: MemTrace(track_allocations=False),
}


class TinyMLP(pl.LightningModule):
    def __init__(self, batches: int, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.batches, self.batch_size = batches, batch_size

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _data(self, n: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        return DataLoader(TensorDataset(torch.randn(n, 32, generator=g), torch.randn(n, 1, generator=g)),
                          batch_size=self.batch_size)

    def train_dataloader(self):
        return self._data(self.batch_size, 0)

    def val_dataloader(self):
        return self._data(self.batches * self.batch_size, 1)


class ValidationTimer(pl.Callback):
    """Seconds from ``on_validation_start`` to ``on_validation_end`` of each validation run (sanity check excluded)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_validation_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.times.append(time.perf_counter() - self._t0)


def run(variant: str, args: argparse.Namespace, root: Path) -> float:
    callback = VARIANTS[variant]()
    timer = ValidationTimer()
    folder = root / variant
    trainer = pl.Trainer(
        default_root_dir=str(folder), max_steps=1, limit_train_batches=1, limit_val_batches=args.batches,
        val_check_interval=1, num_sanity_val_steps=0, logger=CSVLogger(str(folder), name="csv"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1, callbacks=[c for c in (callback, timer) if c is not None],
    )
    trainer.fit(TinyMLP(args.batches, args.batch_size))
    (seconds,) = timer.times
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with TemporaryDirectory() as tmp:
        for round_index in range(args.rounds + 1):
            for variant in VARIANTS:
                seconds = run(variant, args, Path(tmp) / f"round{round_index}")
                if round_index:  # round 0 warms up
                    times[variant].append(seconds)
    base = statistics.median(times["bare"])
    print(f"torch={torch.__version__} lightning={pl.__version__} threads={torch.get_num_threads()} "
          f"validation batches={args.batches} x {args.batch_size} rows, rounds={args.rounds} (+1 warm-up)")
    print(f"{'variant':<22}{'median loop (s)':>16}{'per batch (us)':>16}{'ratio vs bare':>15}")
    worst = 0.0
    for variant, values in times.items():
        median = statistics.median(values)
        ratio = median / base
        worst = max(worst, ratio)
        print(f"{variant:<22}{median:>16.3f}{median / args.batches * 1e6:>16.1f}{ratio:>15.3f}")
    print(f"target <= {TARGET:.2f}: {'met' if worst <= TARGET else 'NOT met'} (worst ratio {worst:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
