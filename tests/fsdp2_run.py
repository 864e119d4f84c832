"""A Lightning FSDP2 fit (ModelParallelStrategy, gloo on CPU) with MemTrace; each rank writes what it really holds.

Usage: python fsdp2_run.py OUT_DIR WORLD_SIZE [ACCELERATOR] [oom]   (cpu by default: gloo; cuda: nccl, one GPU per
rank; with "oom" rank 1 asks for 10**15 bytes in its second training step)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_memtrace import MemTrace
from lightning_memtrace.capture.storages import unique_storage_bytes

OUT, WORLD = Path(sys.argv[1]), int(sys.argv[2])
ACCELERATOR = sys.argv[3] if len(sys.argv) > 3 else "cpu"
OOM = len(sys.argv) > 4 and sys.argv[4] == "oom"


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 65 and 3 rows do not split evenly over 2 or 4 ranks: the shards are padded
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 65), torch.nn.ReLU(), torch.nn.Linear(65, 3))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        first, last = self.net[0], self.net[2]
        fully_shard(first, mesh=mesh)
        # kept gathered from forward to backward: its full parameters are alive at the after_forward row
        fully_shard(last, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch).square().mean()
        if OOM and self.global_rank == 1 and batch_idx == 1:
            torch.empty(10**15, dtype=torch.uint8, device=batch.device)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 64), batch_size=8)  # moved to the rank's device by Lightning


class LocalBytes(pl.Callback):
    """At the end, the bytes this rank holds: its local parameter shards, sharded gradients and AdamW state."""

    def on_train_end(self, trainer, pl_module):
        params = list(pl_module.parameters())
        local = [p.to_local() for p in params]
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        state = [t.to_local() if hasattr(t, "to_local") else t
                 for s in trainer.optimizers[0].state.values() for t in s.values()
                 # AdamW's steps stay on the CPU: not in a GPU's rows
                 if isinstance(t, torch.Tensor) and t.device.type == local[0].device.type]
        (OUT / f"local_rank{trainer.global_rank}.json").write_text(json.dumps({
            "parameters": unique_storage_bytes(local),
            "gradients": unique_storage_bytes(grads),
            "optimizer_state": unique_storage_bytes(state),
            "full_parameters": sum(p.numel() * p.element_size() for p in params),
        }))


callback = MemTrace(dirpath=OUT / "memtrace", report=False)
pl.Trainer(
    accelerator=ACCELERATOR, devices=WORLD, strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
    max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[callback, LocalBytes()],
).fit(Sharded())
