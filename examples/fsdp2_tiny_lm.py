"""MemTrace under sharded training: the tiny Qwen2 with FSDP2 (Lightning's ``ModelParallelStrategy``), on CPU.

Each decoder layer is ``fully_shard``-ed, then the root, as torchtitan and Lightning's own examples do; the processes
talk over gloo, so it runs on a laptop. Every rank writes its own CSV and snapshot; at the end rank zero prints, per
rank, the highest row of the steps after the first: what it holds of the parameters, gradients and AdamW state (its
local shards) and what FSDP2 gathered.

Usage: python examples/fsdp2_tiny_lm.py [--ranks 2] [--steps 4] [--batch-size 4] [--seq-len 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm
from lightning_memtrace.units import format_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
#: The per-rank table's columns.
SHOWN = ["peak", "parameters", "gradients", "optimizer_state", "unsharded_parameters", "unsharded_gradients"]


class Tokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index]}


class ShardedLM(pl.LightningModule):
    def __init__(self, batch_size: int, seq_len: int) -> None:
        super().__init__()
        self.model = build_causal_lm(TINY_QWEN2_CONFIG)
        self.batch_size, self.seq_len = batch_size, seq_len

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        vocab = TINY_QWEN2_CONFIG["vocab_size"]
        return DataLoader(Tokens(64 * self.batch_size, self.seq_len, vocab), batch_size=self.batch_size)


def per_rank_table(folder: Path) -> str:
    """Per rank, the row with the highest peak among steps after the first, and what that rank holds then."""
    phases = load_phases(folder)
    steady = phases[phases.step >= 1] if (phases.step >= 1).any() else phases
    lines = ["rank  phase           " + "".join(f"{name:>22}" for name in SHOWN)]
    for rank, rows in steady.groupby("rank"):
        row = rows.loc[rows.peak_bytes.idxmax()]
        cells = "".join(f"{format_bytes(int(row[f'{name}_bytes'])):>22}" for name in SHOWN)
        lines.append(f"{int(rank):>4}  {row['phase']:<16}{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="memtrace_fsdp2")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    logger = CSVLogger(args.out)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.ranks,
        strategy=ModelParallelStrategy(data_parallel_size=args.ranks, tensor_parallel_size=1),
        max_steps=args.steps,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MemTrace(report=False)],
    )
    trainer.fit(ShardedLM(args.batch_size, args.seq_len))
    if trainer.global_rank == 0:
        folder = Path(logger.log_dir) / "memtrace"
        print(f"\nper-rank CSVs and snapshots: {folder}")
        print(f"highest row per rank, steps after the first ({args.ranks} ranks, batch {args.batch_size}x{args.seq_len}):")
        print(per_rank_table(folder))


if __name__ == "__main__":
    main()
