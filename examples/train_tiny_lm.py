"""MemTrace on a tiny causal LM built from a config (no download): `make demo`.

Trains a 3.4M-parameter Qwen2 for a few steps on random tokens on whatever device is here, with
``Trainer(callbacks=[MemTrace()])``, then prints where the CSV, the snapshot and the report are and a per-phase table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm
from lightning_memtrace.units import format_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "configs" / "qwen2-tiny.json"


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index]}


class TinyCausalLM(pl.LightningModule):
    def __init__(self, config_path: str, batch_size: int, seq_len: int) -> None:
        super().__init__()
        self.model = build_causal_lm(config_path)
        self.batch_size, self.seq_len = batch_size, seq_len

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(RandomTokens(64, self.seq_len, self.model.config.vocab_size, 0), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(RandomTokens(8, self.seq_len, self.model.config.vocab_size, 1), batch_size=self.batch_size)


def resolve_config(out_dir: Path) -> Path:
    if SHARED_CONFIG.is_file():
        return SHARED_CONFIG
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / "qwen2-tiny.json"
    copy.write_text(json.dumps(TINY_QWEN2_CONFIG, indent=2))
    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="memtrace_demo", help="root folder of the run's logs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)

    out = Path(args.out)
    config = resolve_config(out)
    memtrace = MemTrace()
    trainer = pl.Trainer(
        default_root_dir=str(out),
        max_steps=args.steps,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=CSVLogger(str(out)),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[memtrace],
    )
    trainer.fit(TinyCausalLM(str(config), args.batch_size, args.seq_len))

    folder = memtrace.output_dir
    phases = load_phases(folder)
    print()
    print(f"model config:   {config}")
    print(f"phases CSV:     {folder / 'phases_rank0.csv'}  ({len(phases)} rows)")
    for path in memtrace.files:
        print(f"{'snapshot:' if 'snapshot' in path.name else 'file:':<15} {path}")
    if memtrace.report_path is not None:
        print(f"report:         {memtrace.report_path}  (self-contained HTML, opens offline)")
        print(f"timeline:       {folder / 'timeline.png'}")
    print(f"logger metrics: {trainer.logger.log_dir}/metrics.csv (memtrace/<phase>/<counter>, MiB)")
    print("post-mortem:    oom_rank0_step<N>.txt/.pickle appear in the same folder if a run dies of out-of-memory")
    print()
    train = phases[~phases["phase"].str.startswith("val")]
    table = train.groupby("phase", sort=False)[
        ["allocated_bytes", "peak_bytes", "parameters_bytes", "gradients_bytes", "optimizer_state_bytes",
         "activations_bytes", "other_bytes"]
    ].max()
    print(f"per-phase maximum over {train['step'].nunique()} steps ({memtrace.device}):")
    header = f"{'phase':<22}" + "".join(f"{c.replace('_bytes', ''):>17}" for c in table.columns)
    print(header)
    for phase, row in table.iterrows():
        print(f"{phase:<22}" + "".join(f"{format_bytes(int(v)):>17}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
