"""Ground truth on a CUDA device: GPT-2 124M built from config, AdamW, with MemTrace, checked against the allocator.

Usage: python benchmarks/gpu_ground_truth.py [--batch-size 8] [--seq-len 512] [--steps 4] [--out DIR]

Prints one JSON line per check (run by ``benchmarks/gpu_check.sh``):

- ``model_states``: parameter, gradient and AdamW-state bytes in MemTrace's CSV against the bytes computed from the
  model;
- ``peak``: the CSV's highest ``peak_bytes`` and ``MemTrace.max_allocated_bytes`` against a plain run's
  ``torch.cuda.max_memory_allocated()`` (same seed, same settings);
- ``snapshot``: the window snapshot's allocations tagged with their phases, opened by ``torch.cuda._memory_viz``;
- ``report``: ``memtrace report`` on the run's folder (exit status, HTML size);
- ``estimate``: ``estimate_from_config`` against the plain run's peak, in percent, per precision and remedy.

On a machine without CUDA it runs the same checks on the CPU at a small size (``--batch-size 1 --seq-len 32``), to
check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from lightning_memtrace import MemTrace, load_phases  # noqa: E402
from lightning_memtrace.estimator import estimate_from_config  # noqa: E402
from lightning_memtrace.models import build_causal_lm  # noqa: E402
from overhead import Tokens  # noqa: E402  (the random-token dataset of the CPU/GPU overhead benchmark)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GPT2 = ROOT.parent / "shared" / "reference" / "configs" / "gpt2-124m.json"
CUDA = torch.cuda.is_available()


class GPT2LM(pl.LightningModule):
    def __init__(
        self, batch_size: int, seq_len: int, steps: int, checkpointing: bool = False, attention: str | None = "eager"
    ) -> None:
        super().__init__()
        self.model = build_causal_lm(GPT2, attn_implementation=attention)
        self.model.config.use_cache = False
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.batch_size, self.seq_len, self.steps = batch_size, seq_len, steps

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        data = Tokens(self.steps * self.batch_size, self.seq_len, self.model.config.vocab_size)
        return DataLoader(data, batch_size=self.batch_size)


def emit(check: str, **fields) -> None:
    print(json.dumps({"check": check, **fields}, default=str), flush=True)


def fresh() -> int:
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def fit(
    root: Path, callbacks, args, precision: str = "32-true", checkpointing: bool = False,
    attention: str | None = "eager",
) -> tuple[GPT2LM, float]:
    torch.manual_seed(0)
    module = GPT2LM(args.batch_size, args.seq_len, args.steps, checkpointing, attention)
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=args.steps, accelerator="gpu" if CUDA else "cpu", devices=1,
        precision=precision, logger=pl.loggers.CSVLogger(root), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(module)
    return module, time.perf_counter() - start


def plain_peak(root: Path, args, precision: str, checkpointing: bool = False, attention: str | None = "eager") -> int:
    base = fresh()
    fit(root, [], args, precision, checkpointing, attention)
    return (torch.cuda.max_memory_allocated() - base) if CUDA else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8 if CUDA else 1)
    parser.add_argument("--seq-len", type=int, default=512 if CUDA else 32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="gpu_ground_truth")
    parser.add_argument("--skip-estimates", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("environment", torch=torch.__version__, cuda=torch.version.cuda, lightning=pl.__version__,
         device=torch.cuda.get_device_name(0) if CUDA else "cpu", batch=f"{args.batch_size}x{args.seq_len}")

    bare = plain_peak(out / "plain", args, "32-true")
    fresh()
    callback = MemTrace()
    module, seconds = fit(out / "memtrace", [callback], args)
    phases = load_phases(callback.output_dir)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    after_step = phases[phases.phase == "after_optimizer_step"]
    emit(
        "model_states", rows=len(phases), parameter_bytes=params,
        parameters_ok=bool((phases.parameters_bytes == params).all()),
        gradients_max=int(phases.gradients_bytes.max()), gradients_ok=int(phases.gradients_bytes.max()) == params,
        optimizer_state_max=int(after_step.optimizer_state_bytes.max()),
        optimizer_state_ok=int(after_step.optimizer_state_bytes.max()) == 2 * params, fit_seconds=round(seconds, 2),
    )
    csv_peak = int(phases.peak_bytes.max())
    emit(
        "peak", csv_peak_bytes=csv_peak, max_allocated_bytes=callback.max_allocated_bytes, plain_run_peak_bytes=bare,
        csv_vs_plain_percent=round(100 * (csv_peak - bare) / bare, 3) if bare else None,
        user_counter_after_fit=torch.cuda.max_memory_allocated() if CUDA else None,
    )
    print(phases.groupby("phase", sort=False)[["allocated_bytes", "peak_bytes", "activations_bytes"]].max()
          .to_string(), flush=True)
    snapshots = sorted(callback.output_dir.glob("snapshot_*.pickle"))
    if snapshots:
        with open(snapshots[0], "rb") as handle:
            snapshot = pickle.load(handle)
        trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
        allocs = [e for e in trace if e.get("action") == "alloc"]
        tags = sorted({str(e.get("user_metadata", "")).split(" ")[0] for e in allocs})
        viz = "skipped"
        if CUDA:
            from torch.cuda import _memory_viz

            try:
                _memory_viz.segsum(snapshot)
                _memory_viz.trace(snapshot)
                viz = "ok"
            except Exception as error:  # noqa: BLE001
                viz = f"failed: {error!r}"
        emit("snapshot", file=snapshots[0].name, bytes=snapshots[0].stat().st_size, events=len(trace),
             allocs=len(allocs), with_frames=sum(bool(e.get("frames")) for e in allocs), phase_tags=tags[:12],
             memory_viz=viz)
    else:
        emit("snapshot", file=None, listing=sorted(p.name for p in callback.output_dir.iterdir()))
    html = out / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_memtrace.cli", "report", str(callback.output_dir), "-o", str(html)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    emit("report", rc=result.returncode, html_bytes=html.stat().st_size if html.exists() else 0,
         stderr=result.stderr.strip().splitlines()[-3:], stdout_lines=len(result.stdout.splitlines()))
    del module, callback
    if args.skip_estimates:
        return 0
    # eager: what build_causal_lm gives (the runs above); None: transformers' default attention (SDPA)
    for precision, checkpointing, attention in [
        ("32-true", False, "eager"), ("32-true", False, None), ("bf16-mixed", False, None),
        ("bf16-mixed", False, "eager"), ("32-true", True, None),
    ]:
        peak = bare if (precision, checkpointing, attention) == ("32-true", False, "eager") else plain_peak(
            out / f"plain_{precision}_{checkpointing}_{attention}", args, precision, checkpointing, attention)
        start = time.perf_counter()
        estimate = estimate_from_config(
            GPT2, args.batch_size, args.seq_len, optimizer="adamw", precision=precision,
            gradient_checkpointing=checkpointing, device="cuda" if CUDA else "cpu", steps=3,
            attn_implementation=attention,
        )
        emit("estimate", precision=precision, gradient_checkpointing=checkpointing, estimate_bytes=estimate.peak_bytes,
             measured_bytes=peak, error_percent=round(100 * (estimate.peak_bytes - peak) / peak, 2) if peak else None,
             attention=str(getattr(estimate, "attention", "")), seconds=round(time.perf_counter() - start, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
