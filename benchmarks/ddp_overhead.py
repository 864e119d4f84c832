"""2-rank DDP step time with MemTrace divided by step time without, measured side by side in one run.

Usage: python benchmarks/ddp_overhead.py [--steps 60] [--rounds 2]

Launches a 2-process DDP run (gloo on CPU, or NCCL where 2 GPUs exist) of a small MLP per variant, interleaving the
variants round by round, and prints rank zero's median step time and the ratio to the plain run. Variants: plain,
memtrace_tracker_off (MemTrace(track_allocations=False)), memtrace_no_gather (tracker off, gather_ranks=False), memtrace (defaults, including the cross-rank gather once
per step). Target (issue 5): <= 1.05 with the tracker off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

VARIANTS = ("plain", "memtrace_tracker_off", "memtrace_no_gather", "memtrace")


def child(variant: str, steps: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl
    from lightning_memtrace import MemTrace

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(steps * 64, 256, generator=g), torch.randn(steps * 64, 1, generator=g)), batch_size=32)

    class Timer(pl.Callback):
        times: list[float] = []

        def on_train_batch_start(self, *args):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.t0)

    callbacks: list[pl.Callback] = [Timer()]
    if variant == "memtrace_tracker_off":
        callbacks.insert(0, MemTrace(dirpath=out, track_allocations=False))
    elif variant == "memtrace_no_gather":
        callbacks.insert(0, MemTrace(dirpath=out, track_allocations=False, gather_ranks=False))
    elif variant == "memtrace":
        callbacks.insert(0, MemTrace(dirpath=out))
    trainer = pl.Trainer(
        accelerator="auto", devices=2, strategy="ddp", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        default_root_dir=out,
    )
    torch.set_num_threads(1)
    trainer.fit(Net())
    if trainer.is_global_zero:
        Path(out, "times.json").write_text(json.dumps(Timer.times[10:]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.out)
        return 0
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory() as out:
                env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
                subprocess.run(
                    [sys.executable, __file__, "--child", variant, "--steps", str(args.steps), "--out", out],
                    check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                times[variant].extend(json.loads(Path(out, "times.json").read_text()))
    base = statistics.median(times["plain"])
    print(f"2-rank DDP, {args.steps} steps x {args.rounds} rounds per variant (first 10 steps of each run dropped)")
    print(f"{'variant':<24}{'median step (ms)':>18}{'ratio vs plain':>16}")
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        print(f"{variant:<24}{median * 1000:>18.2f}{median / base:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
