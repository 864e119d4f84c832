"""The FSDP2 estimate against real sharded runs, and its time on a 1.5B model.

Usage: python benchmarks/fsdp_estimate.py [--ranks 2,4] [--batch-size 4] [--seq-len 128] [--skip-real] [--skip-large]

For each rank count: a real ``ModelParallelStrategy`` fit of the tiny Qwen2 on CPU (gloo, ``examples/fsdp2_tiny_lm.py``,
each decoder layer then the root ``fully_shard``-ed) and ``estimate(..., world_size=N)`` of the same module, side by
side: the highest ``peak_bytes`` of any rank after the first step, and each category at ``after_forward``. Then the time
and peak memory of ``memtrace estimate --config qwen2.5-1.5b --batch-size 4 --seq-len 1024 --fsdp 8``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from lightning_memtrace import load_phases  # noqa: E402
from lightning_memtrace.estimator import estimate  # noqa: E402
from lightning_memtrace.estimator.inputs import lm_batch  # noqa: E402
from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm  # noqa: E402
from lightning_memtrace.units import format_bytes  # noqa: E402

QWEN_1_5B = ROOT.parent / "shared" / "reference" / "configs" / "qwen2.5-1.5b.json"
COLUMNS = ("parameters", "gradients", "optimizer_state", "activations", "unsharded_parameters")


def real_run(ranks: int, batch: int, seq_len: int, folder: Path) -> object:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    command = [sys.executable, str(ROOT / "examples" / "fsdp2_tiny_lm.py"), "--ranks", str(ranks), "--steps", "3",
               "--batch-size", str(batch), "--seq-len", str(seq_len), "--out", str(folder)]
    subprocess.run(command, check=True, capture_output=True, env=env, cwd=str(folder))
    phases = load_phases(folder / "lightning_logs" / "version_0" / "memtrace")
    return phases[phases.step >= 1]


def compare(ranks: int, batch: int, seq_len: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        real = real_run(ranks, batch, seq_len, Path(folder))
    started = time.perf_counter()
    est = estimate(build_causal_lm(TINY_QWEN2_CONFIG), lm_batch(batch, seq_len), device="cpu", steps=3,
                   world_size=ranks, optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    seconds = time.perf_counter() - started
    highest = int(real.peak_bytes.max())
    print(f"\n{ranks} ranks, batch {batch}x{seq_len} per rank: estimate {format_bytes(est.peak_bytes)} "
          f"({est.peak_bytes:,} B) vs highest real peak {format_bytes(highest)} ({highest:,} B): "
          f"{100 * (est.peak_bytes - highest) / highest:+.2f}% (estimate took {seconds:.1f} s)")
    forward = next(r for r in est.records if r.step == 1 and r.phase.value == "after_forward")
    rows = real[real.phase == "after_forward"]
    for column in COLUMNS:
        values = sorted(set(rows[f"{column}_bytes"]))
        print(f"  after_forward {column:<22} estimate {getattr(forward, f'{column}_bytes'):>12,} B   real (ranks) "
              + ", ".join(f"{v:,}" for v in values) + " B")


def large() -> None:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "lightning_memtrace.cli", "estimate", "--config", str(QWEN_1_5B), "--batch-size", "4",
         "--seq-len", "1024", "--fsdp", "8", "--json"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    import json

    peak = json.loads(out.stdout)["estimate"]["peak_bytes"] if out.returncode == 0 else None
    print(f"\nqwen2.5-1.5b, batch 4x1024, --fsdp 8 (cuda target): {seconds:.1f} s, max RSS {format_bytes(rss)}, "
          f"rank 0 peak {format_bytes(peak) if peak else out.stderr.strip()[-300:]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if not args.skip_real:
        for ranks in (int(r) for r in args.ranks.split(",")):
            compare(ranks, args.batch_size, args.seq_len)
    if not args.skip_large and QWEN_1_5B.is_file():
        large()
    return 0


if __name__ == "__main__":
    sys.exit(main())
