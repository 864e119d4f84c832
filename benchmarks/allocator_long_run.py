"""The caching allocator served on past a two-step estimate, against a long estimate's own steps.

Usage: python benchmarks/allocator_long_run.py [--steps 40]

For each case (the tiny Qwen2 and GPT-2 124M from config, several precisions and optimizers, a CUDA target): a
two-step estimate whose allocator's log is served on (``Estimate.long_run``: the last step's requests again until the
allocator's state repeats or its reserved bytes stop growing, see ``estimator/allocator_log.py``), beside an estimate
that runs ``--steps`` steps for real on fake tensors: the most either reserves, the step it is first reached, and what
each says the allocator needs (``allocator_needs()``; the long estimate's over its own steps
only). The two agree where serving on finds what later steps do.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from lightning_memtrace.estimator import estimate_from_config  # noqa: E402
from lightning_memtrace.estimator.allocator_log import AllocatorLog  # noqa: E402
from lightning_memtrace.models import TINY_QWEN2_CONFIG  # noqa: E402

GPT2 = ROOT.parent / "shared" / "reference" / "configs" / "gpt2-124m.json"
MIB = 1 << 20
CASES = [
    ("tiny Qwen2", TINY_QWEN2_CONFIG, 4, 128, {}),
    ("tiny Qwen2", TINY_QWEN2_CONFIG, 8, 128, {"precision": "bf16-mixed"}),
    ("tiny Qwen2", TINY_QWEN2_CONFIG, 4, 256, {"gradient_checkpointing": True}),
    ("GPT-2", GPT2, 8, 256, {}),
    ("GPT-2", GPT2, 4, 512, {"precision": "bf16-mixed"}),
    ("GPT-2", GPT2, 2, 256, {"optimizer": "sgd"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the long estimate")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"{'case':52} {'2 steps served on':>24} {f'{args.steps} steps':>18} {'needs (2 / long)':>20} {'time':>6}")
    for name, config, batch, seq_len, options in CASES:
        if not isinstance(config, dict) and not Path(config).is_file():
            print(f"{name}: config absent ({config}), skipped")
            continue
        started = time.perf_counter()
        short = estimate_from_config(config, batch, seq_len, device="cuda", steps=2, **options)
        long = estimate_from_config(config, batch, seq_len, device="cuda", steps=args.steps, **options)
        # the long estimate's own requests only, not served on
        log = long.allocator_log
        long = dataclasses.replace(long, allocator_log=AllocatorLog(log.settings, log.ops))
        reached = min(r.step for r in long.records if r.reserved_bytes == long.peak_reserved_bytes)
        served = short.long_run
        label = f"{name} {batch} x {seq_len} {options or 'fp32'}"
        print(
            f"{label:52} {short.long_run_reserved_bytes // MIB:>8,} MiB from step {served.reserved_from_step:<3}"
            f" {long.peak_reserved_bytes // MIB:>6,} MiB step {reached:<3}"
            f" {short.allocator_needs() // MIB:>8,} / {long.allocator_needs() // MIB:<8,}"
            f" {time.perf_counter() - started:>5.0f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
