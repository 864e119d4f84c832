"""Selective activation checkpointing (SAC): the outputs its policy saves are activations, in the run and the estimate.

SAC (``create_selective_checkpoint_contexts``) keeps them in a store of its own, not through saved-tensor hooks.
"""

from __future__ import annotations

import functools

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import lightning.pytorch as pl
from lightning_memtrace import MemTrace, load_phases
from lm_helpers import trainer

pytestmark = pytest.mark.skipif(
    not hasattr(torch_checkpoint, "create_selective_checkpoint_contexts"), reason="this torch has no SAC"
)

BATCH, WIDTH, HIDDEN, BLOCKS = 64, 256, 1024, 3


def _save_matmuls(ctx, op, *args, **kwargs):
    policy = torch_checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op == torch.ops.aten.mm.default else policy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)).sin())


class Checkpointed(pl.LightningModule):
    def __init__(self, selective: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.context_fn = (
            functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls)
            if selective
            else torch_checkpoint.noop_context_fn
        )

    def training_step(self, batch, batch_idx):
        x = batch
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=self.context_fn)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4 * BATCH, WIDTH), batch_size=BATCH)


def _after_forward(tmp_path, selective: bool, **memtrace) -> tuple[pd.DataFrame, MemTrace]:
    callback = MemTrace(dirpath=tmp_path, report=False, **memtrace)
    trainer(tmp_path, [callback], max_steps=3).fit(Checkpointed(selective))
    phases = load_phases(tmp_path)
    return phases[phases.phase == "after_forward"], callback


@pytest.mark.parametrize("backend", ["auto", "dispatch"])
def test_the_outputs_sac_saves_are_activations(tmp_path, backend):
    block_inputs = BLOCKS * BATCH * WIDTH * 4  # what plain checkpointing keeps: each block's input
    matmul_outputs = BLOCKS * (BATCH * HIDDEN + BATCH * WIDTH) * 4  # what the policy saves besides
    plain, _ = _after_forward(tmp_path / "plain", False, allocation_backend=backend)
    selective, _ = _after_forward(tmp_path / "sac", True, allocation_backend=backend)
    assert plain.activations_bytes.tolist() == [block_inputs] * 3
    assert selective.activations_bytes.tolist() == [block_inputs + matmul_outputs] * 3
    # they were counted as other before: what is not an activation is the same with SAC as without
    assert (selective.other_bytes.to_numpy() - plain.other_bytes.to_numpy()).max() < 1024
    # torch's class is as it was once the fit is over
    assert torch_checkpoint._VersionWrapper.__init__.__module__ == "torch.utils.checkpoint"


def test_the_estimate_counts_what_sac_saves_as_the_run_does(tmp_path):
    _, callback = _after_forward(tmp_path, True, estimate=True, what_if_budget_s=0)
    rows = pd.read_csv(tmp_path / "estimate_vs_measured_rank0.csv").set_index("category")
    matmul_outputs = BLOCKS * (BATCH * HIDDEN + BATCH * WIDTH) * 4
    assert rows.loc["activations", "estimated_bytes"] == rows.loc["activations", "measured_bytes"]
    assert rows.loc["activations", "measured_bytes"] == BLOCKS * BATCH * WIDTH * 4 + matmul_outputs
    assert abs(rows.loc["peak", "error_percent"]) <= 3.0
