"""Step time with MemTrace divided by step time without, measured side by side in one run.

Usage: python benchmarks/overhead.py [--steps 40] [--rounds 3] [--batch-size 4] [--seq-len 128] [--threads 1,2]

Runs the tiny Qwen2 (3.4M parameters, from config) with AdamW under Lightning on this machine's device, interleaving
the variants round by round so that machine noise hits them alike (each run in a process of its own), and prints the
median and mean step time of each, their ratios to the plain run and the median of the rounds' own mean ratios, for
each torch thread count asked for; the mean ratio is the one that counts (it holds MemTrace's reads of the CPU
allocator's reports, about one a second). A step is timed start to start (from one ``on_train_batch_start`` to the
next), so every hook of MemTrace, its ``batch_end`` work included, is inside:

- plain: no callback
- memtrace_counters: MemTrace(track_allocations=False, history=False) (CPU: categories only; CUDA: allocator counters)
- memtrace: MemTrace() defaults (CPU: tracker on, reading the CPU allocator's reports; history window of 2 steps)
- memtrace_dispatch: MemTrace(allocation_backend="dispatch") (CPU: tracker on as a Python dispatch mode)
- torch_memtracker: torch.distributed._tools.mem_tracker.MemTracker around the step (reference)
- profiler_memory: torch.profiler with profile_memory=True, record_shapes, with_stack (reference)

Targets: CPU <= 1.03 with the tracker off and <= 1.10 with the defaults, at 1 and at 2 threads; GPU <= 1.02 counters
only, <= 1.05 history on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from lightning_memtrace import MemTrace  # noqa: E402
from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return {"input_ids": self.data[i]}


class StepTimer(pl.Callback):
    """Start-to-start step times: from one ``on_train_batch_start`` to the next (the last step ends at train end)."""

    def __init__(self, wrap=None) -> None:
        self.times: list[float] = []
        self.wrap = wrap
        self._ctx = None
        self._t0: float | None = None

    def _lap(self) -> None:
        now = time.perf_counter()
        if self._t0 is not None:
            self.times.append(now - self._t0)
        self._t0 = now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._lap()
        if self.wrap is not None:
            self._ctx = self.wrap(pl_module)
            self._ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def on_train_end(self, trainer, pl_module):
        self._lap()


class LM(pl.LightningModule):
    def __init__(self, batch_size: int, seq_len: int, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build_causal_lm(TINY_QWEN2_CONFIG)
        self.batch_size, self.seq_len, self.steps = batch_size, seq_len, steps

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(Tokens(self.steps * self.batch_size, self.seq_len, 2048), batch_size=self.batch_size)


def memtracker_ctx(module):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module)
    return tracker


def profiler_ctx(module):
    return torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)


def run(variant: str, args, root: str, extra_callbacks: tuple[pl.Callback, ...] = ()) -> list[float]:
    callbacks: list[pl.Callback] = [*extra_callbacks]
    wrap = None
    if variant == "memtrace_counters":
        callbacks.append(MemTrace(track_allocations=False, history=False, report=False))
    elif variant == "memtrace":
        callbacks.append(MemTrace(report=False))
    elif variant == "memtrace_dispatch":
        callbacks.append(MemTrace(report=False, allocation_backend="dispatch"))
    elif variant == "torch_memtracker":
        wrap = memtracker_ctx
    elif variant == "profiler_memory":
        wrap = profiler_ctx
    timer = StepTimer(wrap)
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[*callbacks, timer], accelerator="auto", devices=1,
    )
    trainer.fit(LM(args.batch_size, args.seq_len, args.steps))
    return timer.times[args.warmup:]


def report(times: dict[str, list[list[float]]], variants: list[str], args, threads: int) -> None:
    """Median and mean step of each variant over every round, their ratios to plain, and the median of the rounds'
    own mean ratios (each round's variant against that round's plain run: steadier when the machine's speed drifts
    between rounds).

    The mean is the ratio that counts: work done every few steps (MemTrace reads the CPU allocator's reports about
    once a second) is in the mean and not in the median.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain_rounds = times["plain"]
    plain_steps = [t for run in plain_rounds for t in run]
    base_median, base_mean = statistics.median(plain_steps), statistics.fmean(plain_steps)
    print(f"device={device} torch={torch.__version__} threads={threads or torch.get_num_threads()} "
          f"steps/round={args.steps - args.warmup} rounds={args.rounds} "
          f"batch={args.batch_size}x{args.seq_len} (start-to-start)")
    print(f"{'variant':<20}{'median (ms)':>12}{'mean (ms)':>11}{'median ratio':>14}{'mean ratio':>12}"
          f"{'per-round mean ratio':>22}")
    for variant in variants:
        rounds = [run for run in times[variant] if run]
        if not rounds:
            print(f"{variant:<20}{'n/a':>12}{'n/a':>11}{'n/a':>14}{'n/a':>12}{'n/a':>22}")
            continue
        steps = [t for run in rounds for t in run]
        median, mean = statistics.median(steps), statistics.fmean(steps)
        paired = statistics.median(
            statistics.fmean(run) / statistics.fmean(plain) for run, plain in zip(times[variant], plain_rounds)
            if run and plain
        )
        print(f"{variant:<20}{median * 1000:>12.2f}{mean * 1000:>11.2f}{median / base_median:>14.3f}"
              f"{mean / base_mean:>12.3f}{paired:>22.3f}", flush=True)


def parse_run_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add the options of every benchmark here (those :func:`run_child` passes on to a child, and the rounds), parse
    them and quiet the run: no warnings, no Lightning info lines, and in a child the torch thread count asked for."""
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", default="1,2", help="torch intra-op thread counts, comma-separated (0: default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one variant here and print its results
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.child:
        torch.set_num_threads(int(args.threads) or torch.get_num_threads())
    return args


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--variants", default="plain,memtrace_counters,memtrace,memtrace_dispatch,torch_memtracker,profiler_memory"
    )
    args = parse_run_args(parser)
    if args.child:
        with TemporaryDirectory() as root:
            print(json.dumps(run(args.child, args, root)))
        return 0
    measure_rounds(__file__, args.variants.split(","), args)
    return 0


def measure_rounds(script: str, variants: list[str], args) -> None:
    """For each thread count asked for: every variant once per round, each by ``script --child`` in a process of its
    own (what a run leaves behind, a reference tool's profiler state or a fragmented heap, must not slow the runs after
    it), interleaved round by round; then the table."""
    for threads in [int(t) for t in args.threads.split(",")]:
        times: dict[str, list[list[float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                times[variant].append(run_child(script, variant, threads, args) or [])
        report(times, variants, args, threads)


def run_child(script: str, variant: str, threads: int, args) -> Any:
    """Run ``script --child variant`` with ``args``' sizes in a process of its own and return the JSON it prints last;
    None where it fails (the reason goes to stderr: a reference tool that does not run here)."""
    command = [
        sys.executable, script, "--child", variant, "--threads", str(threads), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{variant}: failed ({reason})", file=sys.stderr)
        return None
    return json.loads(lines[-1])


if __name__ == "__main__":
    sys.exit(main())
