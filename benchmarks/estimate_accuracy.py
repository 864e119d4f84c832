"""MemTrace's estimate beside the usual answers to "will it fit?", and beside measured peaks where we can measure.

Usage: python benchmarks/estimate_accuracy.py [--batch-size 16] [--seq-len 256] [--precision 32-true]
       [--optimizer adamw] [--configs a.json b.json ...] [--measure-max-params 20e6] [--gpu-max-params 200e6]
       python benchmarks/estimate_accuracy.py --architectures [gpt2 llama ...] [--attn-implementations default eager]

For each reference config (``shared/reference/configs``: Qwen2.5-1.5B, GPT-2 124M, a tiny Qwen2) it prints:

- ``estimate``: :func:`lightning_memtrace.estimator.estimate_from_config` for a CUDA device (peak of the steady step,
  fake tensors, no weights);
- ``accelerate``: the formula of ``accelerate estimate-memory`` for training with Adam, 4x the model size (parameters,
  gradients and Adam's two moments; no activations, whatever the batch);
- ``rule of thumb``: model states plus the activation rule of thumb of the "understand GPU memory" story
  (Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit, scaled to the bytes per value of the
  precision), which leaves out the logits, their fp32 upcast and the loss;
- ``measured (cpu)``: for models up to ``--measure-max-params`` parameters, the highest ``peak_bytes`` that MemTrace
  measures in a real 3-step Lightning run on this machine's CPU, beside the estimate made for the CPU (``est (cpu)``)
  and its error;
- ``measured (cuda)``: where CUDA is available, for models up to ``--gpu-max-params``,
  ``torch.cuda.max_memory_allocated`` of a real run beside the CUDA estimate.

With ``--architectures``, the grid instead: eleven tiny architectures (``tests/estimator/tiny_architectures.py``:
gpt2, llama, mistral, qwen2, gemma, gemma2, phi3, gpt_neox, bert as a decoder, opt, falcon; batch 4 x 128 unless
given) in fp32 and bf16-mixed, with and without checkpointing, for each attention implementation asked (``default``:
what transformers picks, as a user's ``from_config``), the CPU estimate beside MemTrace's measurement of a real
3-step Lightning CPU run (highest ``peak_bytes`` of the rows after the first step) and the error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT.parent / "shared" / "reference" / "configs"
DEFAULT_CONFIGS = ("qwen2.5-1.5b.json", "gpt2-124m.json", "qwen2-tiny.json")


def _bytes_per_value(precision: str) -> int:
    return 2 if precision in ("bf16-true", "16-true") else 4


def accelerate_formula(param_bytes: int) -> int:
    """``accelerate estimate-memory``, training with Adam: 4x the model size."""
    return 4 * param_bytes


def rule_of_thumb(config: dict[str, Any], param_bytes: int, batch: int, seq: int, precision: str) -> int:
    """Model states (params, grads, 2 Adam moments) plus L·s·b·h·(34 + 5·a·s/h) activations (16-bit, rescaled)."""
    h = int(config.get("hidden_size") or config.get("n_embd"))
    a = int(config.get("num_attention_heads") or config.get("n_head"))
    layers = int(config.get("num_hidden_layers") or config.get("n_layer"))
    per_layer_16bit = seq * batch * h * (34 + 5 * a * seq / h)
    activations = layers * per_layer_16bit * _bytes_per_value(precision) / 2
    return int(4 * param_bytes + activations)


class _Tokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index]}


def _lightning_module(config: Path, batch: int, seq: int, optimizer: str) -> Any:
    import lightning.pytorch as pl

    from lightning_memtrace.models import build_causal_lm

    class ConfigLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_causal_lm(config)
            self.model.config.use_cache = False

        def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=b["input_ids"], labels=b["input_ids"]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)
            cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
            return cls(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_Tokens(4 * batch, seq, self.model.config.vocab_size), batch_size=batch)

    return ConfigLM()


def measure(config: Path, batch: int, seq: int, precision: str, optimizer: str, accelerator: str) -> int:
    """The real run's peak: MemTrace's highest ``peak_bytes`` (CPU) or ``max_memory_allocated`` (CUDA)."""
    import lightning.pytorch as pl

    from lightning_memtrace import MemTrace, load_phases

    module = _lightning_module(config, batch, seq, optimizer)
    callback = MemTrace(history=False)
    # On CUDA, MemTrace resets the peak statistics at every row: measure max_memory_allocated without it.
    callbacks = [callback] if accelerator == "cpu" else []
    with tempfile.TemporaryDirectory() as tmp:
        base = 0
        if accelerator == "gpu":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        trainer = pl.Trainer(
            default_root_dir=tmp,
            max_steps=3,
            accelerator=accelerator,
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            precision=precision,
            callbacks=callbacks,
        )
        trainer.fit(module)
        if accelerator == "gpu":
            return torch.cuda.max_memory_allocated() - base
        return int(load_phases(callback.output_dir).peak_bytes.max())


def _grid_row(name: str, precision: str, checkpointing: bool, attention: str | None, batch: int, seq: int) -> dict:
    """One cell of the architecture grid: the CPU estimate and the real CPU run's peak after the first step."""
    import lightning.pytorch as pl
    from tiny_architectures import ARCHITECTURES, ConfigLM

    from lightning_memtrace import MemTrace, load_phases
    from lightning_memtrace.estimator import estimate_from_config

    config = ARCHITECTURES[name]
    est = estimate_from_config(
        config,
        batch,
        seq,
        device="cpu",
        precision=precision,
        gradient_checkpointing=checkpointing,
        steps=3,
        attn_implementation=attention,
    )
    module = ConfigLM(config, batch, seq, gradient_checkpointing=checkpointing, attn_implementation=attention)
    callback = MemTrace(history=False)
    with tempfile.TemporaryDirectory() as tmp:
        pl.Trainer(
            default_root_dir=tmp,
            max_steps=3,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            precision=precision,
            callbacks=[callback],
        ).fit(module)
        phases = load_phases(callback.output_dir)
    measured = int(phases[phases.step >= 1].peak_bytes.max())
    return {
        "architecture": name,
        "precision": precision,
        "checkpointing": checkpointing,
        "attention": est.attention,
        "estimate_cpu": est.peak_bytes,
        "measured_cpu": measured,
        "error_cpu_percent": 100 * (est.peak_bytes - measured) / measured,
    }


def architecture_grid(args: argparse.Namespace) -> int:
    """Every architecture x precision x checkpointing x attention: CPU estimate beside the real CPU run."""
    sys.path[:0] = [str(ROOT / "tests" / "estimator"), str(ROOT / "tests")]  # tiny_architectures uses lm_helpers
    from tiny_architectures import ARCHITECTURES

    names = args.architectures or list(ARCHITECTURES)
    batch = args.batch_size if args.batch_size_given else 4
    seq = args.seq_len if args.seq_len_given else 128
    rows = []
    for name in names:
        for attention in args.attn_implementations:
            for precision in ("32-true", "bf16-mixed"):
                for checkpointing in (False, True):
                    implementation = None if attention == "default" else attention
                    row = _grid_row(name, precision, checkpointing, implementation, batch, seq)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\nbatch {batch} x {seq} tokens, AdamW; estimate (cpu) vs MemTrace on a real CPU run, peak after step 0")
    header = ["architecture", "attention", "precision", "ckpt", "estimate", "measured", "err"]
    table = [header] + [
        [
            r["architecture"],
            r["attention"],
            r["precision"],
            "yes" if r["checkpointing"] else "no",
            f"{r['estimate_cpu']:,}",
            f"{r['measured_cpu']:,}",
            f"{r['error_cpu_percent']:+.2f}%",
        ]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for index, line in enumerate(table):
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    worst = max((abs(r["error_cpu_percent"]) for r in rows), default=0.0)
    print(f"largest error: {worst:.2f}%")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[str(CONFIGS / name) for name in DEFAULT_CONFIGS],
        help="config.json paths, or names of the reference configs (default: all three)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    parser.add_argument(
        "--measure-max-params",
        type=float,
        default=20e6,
        help="measure real CPU runs for models up to this many parameters",
    )
    parser.add_argument(
        "--gpu-max-params",
        type=float,
        default=200e6,
        help="measure real CUDA runs (where available) for models up to this many parameters",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--architectures",
        nargs="*",
        default=None,
        help="the grid of tiny architectures instead of --configs (all eleven when none is named)",
    )
    parser.add_argument(
        "--attn-implementations",
        nargs="+",
        default=["default"],
        help="with --architectures: 'default' (transformers' pick), eager, sdpa...",
    )
    args = parser.parse_args(argv)
    args.batch_size_given = "--batch-size" in (argv if argv is not None else sys.argv)
    args.seq_len_given = "--seq-len" in (argv if argv is not None else sys.argv)
    if args.architectures is not None:
        warnings.filterwarnings("ignore")
        return architecture_grid(args)

    from lightning_memtrace.estimator import build_meta_model, estimate_from_config
    from lightning_memtrace.models import load_config_dict
    from lightning_memtrace.units import format_bytes

    warnings.filterwarnings("ignore")
    rows = []
    for path in map(Path, args.configs):
        if not path.exists() and (CONFIGS / path).is_file():
            path = CONFIGS / path  # a reference config by name: --configs gpt2-124m.json
        config = load_config_dict(path)
        model = build_meta_model(path)
        kwargs: dict[str, Any] = {"optimizer": args.optimizer, "precision": args.precision, "model": model}
        start = time.perf_counter()
        est = estimate_from_config(path, args.batch_size, args.seq_len, device="cuda", **kwargs)
        seconds = time.perf_counter() - start
        cf = est.closed_form
        row: dict[str, Any] = {
            "config": path.name,
            "parameters": cf.parameter_count,
            "estimate": est.peak_bytes,
            "estimate_seconds": round(seconds, 2),
            "activations": est.category_bytes()["activations"],
            "accelerate": accelerate_formula(cf.parameters_bytes),
            "rule_of_thumb": rule_of_thumb(config, cf.parameters_bytes, args.batch_size, args.seq_len, args.precision),
        }
        if cf.parameter_count <= args.measure_max_params:
            cpu_est = estimate_from_config(path, args.batch_size, args.seq_len, device="cpu", steps=3, **kwargs)
            measured = measure(path, args.batch_size, args.seq_len, args.precision, args.optimizer, "cpu")
            row.update(
                estimate_cpu=cpu_est.peak_bytes,
                measured_cpu=measured,
                error_cpu_percent=100 * (cpu_est.peak_bytes - measured) / measured,
            )
        if torch.cuda.is_available() and cf.parameter_count <= args.gpu_max_params:
            measured = measure(path, args.batch_size, args.seq_len, args.precision, args.optimizer, "gpu")
            row.update(measured_cuda=measured, error_cuda_percent=100 * (est.peak_bytes - measured) / measured)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    print(
        f"\nbatch {args.batch_size} x {args.seq_len} tokens, {args.precision}, {args.optimizer}; "
        "peaks (allocated bytes)"
    )
    header = [
        "config",
        "params",
        "estimate",
        "accelerate (4x)",
        "rule of thumb",
        "est (cpu)",
        "measured (cpu)",
        "err",
        "measured (cuda)",
        "err",
        "est time",
    ]
    table = [header]

    def fmt(row: dict[str, Any], key: str) -> str:
        return format_bytes(row[key]) if key in row else "-"

    def pct(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:+.2f}%" if key in row and not math.isnan(row[key]) else "-"

    for row in rows:
        table.append(
            [
                row["config"],
                f"{row['parameters'] / 1e6:,.1f}M",
                fmt(row, "estimate"),
                fmt(row, "accelerate"),
                fmt(row, "rule_of_thumb"),
                fmt(row, "estimate_cpu"),
                fmt(row, "measured_cpu"),
                pct(row, "error_cpu_percent"),
                fmt(row, "measured_cuda"),
                pct(row, "error_cuda_percent"),
                f"{row['estimate_seconds']:.1f} s",
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for index, line in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
