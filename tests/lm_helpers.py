"""Small Lightning modules for the tests: a tiny causal LM from config, an MLP, manual and two-optimizer variants."""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_memtrace.models import TINY_QWEN2_CONFIG, build_causal_lm


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index]}


class TinyLM(pl.LightningModule):
    def __init__(
        self,
        batch_size: int = 4,
        seq_len: int = 64,
        gradient_checkpointing: bool = False,
        lr: float = 1e-3,
        n_train: int = 64,
        n_val: int = 8,
    ) -> None:
        super().__init__()
        self.model = build_causal_lm(TINY_QWEN2_CONFIG)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        self.batch_size, self.seq_len, self.lr = batch_size, seq_len, lr
        self.n_train, self.n_val = n_train, n_val

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        vocab = self.model.config.vocab_size
        return DataLoader(RandomTokens(self.n_train, self.seq_len, vocab), batch_size=self.batch_size)

    def val_dataloader(self):
        vocab = self.model.config.vocab_size
        return DataLoader(RandomTokens(self.n_val, self.seq_len, vocab, seed=1), batch_size=self.batch_size)


class MLP(pl.LightningModule):
    def __init__(self, width: int = 128, batch_size: int = 16, manual: bool = False, fail_at: int | None = None,
                 oom_at: int | None = None, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.automatic_optimization = not manual
        self.batch_size, self.fail_at, self.oom_at, self.optimizer_name = batch_size, fail_at, oom_at, optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise ValueError("boom from training_step")
        x, y = batch
        out = self(x)
        if self.oom_at is not None and batch_idx == self.oom_at:
            torch.empty(10**15, dtype=torch.uint8)
        loss = nn.functional.mse_loss(out, y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g)),
                          batch_size=self.batch_size)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)),
                          batch_size=self.batch_size)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))


class UnbackpropagatedGraphMLP(MLP):
    """Leaves a graph that no backward goes through at every step: a value computed only to be logged (``side``), or
    the whole step, skipped by returning None after the forward (``skip``). Keeps a weak reference to the ReLU's
    output of every step: ReLU saves its output, which under hooks that return the tensor itself holds its node back."""

    def __init__(self, mode: str) -> None:
        super().__init__(width=64)
        self.mode = mode
        self.relu_outputs: list[weakref.ref] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net[:2](x)
        self.relu_outputs.append(weakref.ref(hidden))
        loss = nn.functional.mse_loss(self.net[2:](hidden), y)
        if self.mode == "side":
            side = torch.relu(hidden - 1).mean()  # a value only logged: no backward goes through its ReLU
            self.relu_outputs.append(weakref.ref(side))
            self.log("side", side)
        if self.mode == "skip" and batch_idx % 2:
            return None  # Lightning skips the backward and the optimizer step
        return loss


class TwoOptimizers(pl.LightningModule):
    """A GAN-like module: two sub-networks, two optimizers, manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Linear(16, 32)
        self.disc = nn.Linear(32, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(x)
        loss_d = self.disc(fake.detach()).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = (1 - self.disc(self.gen(x))).pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.SGD(self.disc.parameters(), lr=1e-2, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=8)


def trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(
        default_root_dir=str(tmp_path),
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def record_plain_loop(
    model: nn.Module,
    optimizer,
    folder,
    steps: int,
    batch_size: int,
    after_batch=None,
    in_forward=None,
    **recorder_kwargs,
):
    """A plain PyTorch loop of ``steps`` steps (random batches of ``batch_size`` rows, squared-output loss) under a
    ``MemoryRecorder`` writing into ``folder`` (None: no files); ``in_forward(step)`` is called after the model's
    forward (before the ``after_forward`` row), ``after_batch(recorder, step)`` after each batch's end. Returns the
    stopped recorder."""
    from lightning_memtrace import MemoryRecorder

    features = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    with MemoryRecorder(model, [optimizer], output_dir=folder, **recorder_kwargs) as recorder:
        for step in range(steps):
            x = torch.randn(batch_size, features)
            recorder.begin_batch(x, step=step)
            loss = model(x).square().mean()
            if in_forward is not None:
                in_forward(step)
            recorder.mark_forward_done()
            loss.backward()
            recorder.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            recorder.end_batch()
            if after_batch is not None:
                after_batch(recorder, step)
    return recorder


def launcher_env() -> dict[str, str]:
    """This process's environment without the variables of a distributed launch, so that a script started from a test
    launches its own ranks."""
    launch = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launch)}


class SparseEmbedding(pl.LightningModule):
    """An ``nn.Embedding(sparse=True)`` (its gradient a sparse COO tensor) under SGD with momentum (a sparse buffer)."""

    rows, width, batch, tokens = 1000, 64, 8, 16

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(self.rows, self.width, sparse=True)
        self.head = torch.nn.Linear(self.width, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.embedding(batch).mean(1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.rows, (4 * self.batch, self.tokens), generator=generator)
        return torch.utils.data.DataLoader(ids, batch_size=self.batch)


class PositionLoop(pl.LightningModule):
    """A loop over a hidden state's positions (an RNN cell's, Mamba's slow path): the gradient of every position's
    slice is summed into the hidden state's, which autograd does in place."""

    def __init__(self, batch: int = 8, positions: int = 32, width: int = 256) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, width)
        self.batch, self.positions = batch, positions

    def training_step(self, batch, batch_idx):
        (x,) = batch
        hidden = self.proj(x)
        loss = hidden.new_zeros(())
        for position in range(hidden.shape[1]):
            loss = loss + hidden[:, position].pow(2).sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(4 * self.batch, self.positions, 64))
        return torch.utils.data.DataLoader(data, batch_size=self.batch)


class OffloadedStack(pl.LightningModule):
    """A stack of Linear + ReLU layers whose saved tensors go to host memory (``save_on_cpu``) where ``offload``."""

    def __init__(self, offload: bool, pin_memory: bool = True, rows: int = 2048, width: int = 256) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(8))
        self.offload, self.pin_memory, self.rows, self.width = offload, pin_memory, rows, width

    def training_step(self, batch, batch_idx):
        (x,) = batch
        offloaded = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory) if self.offload else nullcontext()
        with offloaded:
            for layer in self.layers:
                x = torch.relu(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(3 * self.rows, self.width))
        return torch.utils.data.DataLoader(data, batch_size=self.rows)
