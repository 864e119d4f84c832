"""Will Qwen2.5-1.5B fine-tune on a 24 GiB card, and what do I change so that it does? Answered before any GPU.

A walk-through in the spirit of PyTorch's "Understanding GPU memory" tutorial, with the estimator instead of a GPU:

1. the model is built from its ``config.json`` on the meta device (no weights, no download);
2. its training step runs on fake tensors in Lightning's order, and the memory is read per phase and per category:
   the same rows MemTrace writes during a real run, with what CUDA's caching allocator would reserve (fragmentation
   included) and need, with its default settings and with expandable segments;
3. each remedy (checkpointing, precision, micro-batch, optimizer, LoRA, sharding) is applied and estimated again,
   and the cheapest combination that fits the card is printed with the Trainer arguments it assumes.

Usage: python examples/what_fits_qwen2_5_1_5b.py [--config PATH] [--batch-size 16] [--seq-len 256]
       [--device-memory 24GiB] [--devices 4]

It takes a few minutes on a laptop's CPU (each estimate runs the real training step on fake tensors).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

from lightning_memtrace.estimator import build_meta_model, estimate_from_config
from lightning_memtrace.estimator.what_if import what_if_from_config
from lightning_memtrace.units import format_bytes, parse_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "configs" / "qwen2.5-1.5b.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default=str(SHARED_CONFIG), help="a Hugging Face config.json (default: Qwen2.5-1.5B)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device-memory", default="24GiB", help="the card's memory, e.g. 24GiB")
    parser.add_argument("--devices", type=int, default=4, help="N for the fsdp remedy")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    memory = parse_bytes(args.device_memory)

    model = build_meta_model(args.config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {Path(args.config).name}, {params:,} parameters, built on the meta device (no weights)")

    print(f"\n1. Today's setup: fp32 (32-true), AdamW, batch {args.batch_size} x {args.seq_len} tokens, on a CUDA card")
    today = estimate_from_config(args.config, args.batch_size, args.seq_len, device="cuda", model=model)
    print(today.table())
    peak = today.peak_record
    assert peak is not None
    print(
        f"\nThe peak, {format_bytes(today.peak_bytes)}, falls in the stretch ending at {peak.phase.value}: the "
        "activations saved for backward sit on top of parameters, gradients and AdamW's two moments."
    )

    needs, expandable = today.allocator_needs(), today.allocator_needs_expandable()
    print(
        f"\nCUDA's caching allocator (modelled) reserves up to {format_bytes(today.long_run_reserved_bytes)} "
        f"(the steady step served on, step after step) where nothing makes it give memory back, and needs "
        f"{format_bytes(needs)} to serve every request when it must free its cache first: "
        f"{format_bytes(needs - today.peak_bytes)} of fragmentation above the peak. With "
        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it would need {format_bytes(expandable)}."
    )

    print(f"\n2. What would fit {format_bytes(memory)}:")
    result = what_if_from_config(
        args.config,
        args.batch_size,
        args.seq_len,
        device_memory=memory,
        devices=args.devices,
        device="cuda",
        model=model,
        max_batch=False,
    )
    print(result.table())


if __name__ == "__main__":
    main()
