"""A 2-process DDP run (gloo, CPU) with MemTrace, launched by tests/test_ddp.py as a script.

Usage: python tests/ddp_run.py OUT_DIR [normal|oom|estimate|bucket_view|unused|oom_wide|gpu_estimate]
In "oom" mode rank 1 asks for 10**15 bytes in its second training step. "estimate": a wider MLP (DDP's buckets of
1.1 MiB) with ``MemTrace(estimate=True)`` and its end-of-fit what-if; "bucket_view": the same with
``gradient_as_bucket_view=True`` (no what-if); "unused": the same with ``find_unused_parameters=True``; "oom_wide":
"oom" with the wider MLP; "gpu_estimate": "estimate" as one DDP rank on one CUDA device (nccl).
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning_memtrace import MemTrace  # noqa: E402
from lm_helpers import MLP  # noqa: E402


class RankMLP(MLP):
    def __init__(self, oom_rank: int | None = None, width: int = 64) -> None:
        super().__init__(width=width, batch_size=8)
        self.oom_rank = oom_rank
        # ranks differ in size on purpose: rank 1 carries an extra buffer, so the maxima have an owner
        self.extra: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.extra is None:
            self.extra = torch.zeros(1024 * 1024, dtype=torch.uint8)  # 1 MiB more live on rank 1
        if self.oom_rank == self.global_rank and batch_idx == 1:
            torch.empty(10**15, dtype=torch.uint8)
        return super().training_step(batch, batch_idx)


def main() -> None:
    out = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "normal"
    warnings.filterwarnings("ignore")
    gpu = mode == "gpu_estimate"
    wide = mode in ("estimate", "bucket_view", "unused", "oom_wide", "gpu_estimate")
    estimate = mode in ("estimate", "bucket_view", "unused", "gpu_estimate")
    callback = MemTrace(
        gather_every_n_steps=1, estimate=estimate, what_if_budget_s=60 if mode == "estimate" else 0, report=not estimate
    )
    trainer = pl.Trainer(
        default_root_dir=str(out),
        accelerator="gpu" if gpu else "cpu",
        devices=1 if gpu else 2,
        strategy=DDPStrategy(
            process_group_backend="nccl" if gpu else "gloo",
            timeout=timedelta(seconds=60 if gpu else 20),
            gradient_as_bucket_view=mode == "bucket_view",
            find_unused_parameters=mode == "unused",
        ),
        max_steps=3,
        logger=CSVLogger(str(out), name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(RankMLP(oom_rank=1 if mode.startswith("oom") else None, width=512 if wide else 64))
    if trainer.is_global_zero:
        (out / "rank_maxima.json").write_text(json.dumps(callback.last_rank_maxima))


if __name__ == "__main__":
    main()
