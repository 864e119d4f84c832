"""cuBLAS's workspaces in CUDA-target estimates: one kept per thread that runs products, sized as torch sizes it."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memtrace.capture import torch_private
from lightning_memtrace.estimator import estimate
from lightning_memtrace.estimator import blas_workspace
from lightning_memtrace.estimator.blas_workspace import NEWER_GPU_BYTES, OLDER_GPU_BYTES, configured_bytes

BATCH, WIDTH = 64, 256


class Mlp(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self.layers, x, use_reentrant=False)
        return self.layers(x)


class Elementwise(nn.Module):
    """No matrix product anywhere: no cuBLAS, no workspace."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale)


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def _other_by_phase(est, step: int) -> dict[str, int]:
    return {r.phase.value: r.other_bytes for r in est.records if r.step == step}


@pytest.fixture
def no_config(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch_private, "cuda_workspace_size", lambda: None)


@pytest.mark.parametrize(
    ("config", "expected"),
    [(":4096:8", 33_554_432), (":4096:2:16:8", 8_519_680), (":16:8", 131_072), ("4096", None), ("", None)],
)
def test_the_config_is_read_as_torch_reads_it(config, expected):
    assert configured_bytes(config) == expected


@pytest.mark.parametrize(
    ("capability", "expected"), [((9, 0), NEWER_GPU_BYTES), ((10, 0), NEWER_GPU_BYTES), ((8, 0), OLDER_GPU_BYTES),
                                 ((7, 5), OLDER_GPU_BYTES), (None, NEWER_GPU_BYTES)]
)
def test_the_default_size_follows_the_gpu(no_config, monkeypatch, capability, expected):
    monkeypatch.setattr(torch_private, "cuda_capability", lambda device: capability)
    assert blas_workspace.workspace_bytes(torch.device("cuda")) == expected
    assert (NEWER_GPU_BYTES, OLDER_GPU_BYTES) == (32 * 2**20, 8_519_680)


def test_the_config_and_torchs_own_answer_come_first(no_config, monkeypatch):
    monkeypatch.setattr(torch_private, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert blas_workspace.workspace_bytes(torch.device("cuda")) == 8_519_680
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unreadable")  # torch keeps its default then
    assert blas_workspace.workspace_bytes(torch.device("cuda")) == NEWER_GPU_BYTES
    monkeypatch.setattr(torch_private, "cuda_workspace_size", lambda: 1_048_576)
    assert blas_workspace.workspace_bytes(torch.device("cuda")) == 1_048_576


def test_a_cuda_target_holds_one_workspace_from_the_forward_and_one_from_the_backward(no_config, monkeypatch):
    assert estimate(Mlp(), _batch(), training_step=_step, device="cpu").blas_workspace_bytes == 0
    cuda = estimate(Mlp(), _batch(), training_step=_step, device="cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # torch's way to run without workspaces
    bare = estimate(Mlp(), _batch(), training_step=_step, device="cuda")
    assert (cuda.blas_workspace_bytes, bare.blas_workspace_bytes) == (2 * NEWER_GPU_BYTES, 0)
    # step 0: none before the first product, the forward's after it, the backward's from the backward on
    first = {p: v - _other_by_phase(bare, 0)[p] for p, v in _other_by_phase(cuda, 0).items()}
    assert first == {"batch_start": 0, "after_forward": NEWER_GPU_BYTES, **dict.fromkeys(
        ("after_backward", "after_optimizer_step", "batch_end"), 2 * NEWER_GPU_BYTES)}
    steady = cuda.steady_step
    assert {p: v - _other_by_phase(bare, steady)[p] for p, v in _other_by_phase(cuda, steady).items()} == dict.fromkeys(
        ("batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"), 2 * NEWER_GPU_BYTES
    )
    assert cuda.peak_bytes == bare.peak_bytes + 2 * NEWER_GPU_BYTES
    assert "cuBLAS workspaces 64.0 MiB (in other)" in cuda.describe()
    assert "cuBLAS" not in bare.describe()
    assert cuda.as_dict()["blas_workspace_bytes"] == 2 * NEWER_GPU_BYTES


def test_checkpointed_layers_recompute_on_the_backwards_thread(no_config, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    est = estimate(Mlp(checkpointed=True), _batch(), training_step=_step, device="cuda")
    assert est.blas_workspace_bytes == 2 * OLDER_GPU_BYTES


def test_a_step_without_products_holds_none(no_config):
    est = estimate(Elementwise(), _batch(), training_step=_step, device="cuda")
    assert est.blas_workspace_bytes == 0
    # no workspace (8 MiB or more) in other: only the caching allocator's rounding of small blocks to 512 B
    assert all(r.other_bytes < 64 * 1024 for r in est.records)


@pytest.mark.parametrize(
    ("name", "size"),
    [("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle", NEWER_GPU_BYTES),  # a full step, on Hopper
     ("MAGMA27_assignment2_memory_snapshot.pickle", OLDER_GPU_BYTES)],
)
def test_real_training_snapshots_hold_two_workspaces_of_torchs_size(fixtures_dir, name, size):
    with open(fixtures_dir / name, "rb") as f:
        snapshot = pickle.load(f)  # noqa: S301 - the project's own test fixtures
    blocks = [
        b for seg in snapshot["segments"] for b in seg["blocks"]
        if b["state"] == "active_allocated" and b["size"] == size
    ]
    assert len(blocks) == 2


@pytest.mark.parametrize(
    ("name", "blocks"),
    [("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle", 2), ("shreyansh26_profile_grad.pkl", 1)],
)
def test_a_snapshots_cublas_workspaces_are_one_site_of_other(fixtures_dir, name, blocks):
    # made under the user's first product (einsum) and under autograd's BmmBackward0: both the workspace torch keeps
    from lightning_memtrace.analysis.loader import load_snapshot
    from lightning_memtrace.analysis.replay import replay

    sites = replay(load_snapshot(fixtures_dir / name)).peak.sites
    workspace = sites[sites.function == "cuBLAS workspace"]
    assert workspace[["category", "bytes", "count"]].values.tolist() == [["other", blocks * NEWER_GPU_BYTES, blocks]]
