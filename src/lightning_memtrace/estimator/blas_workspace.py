"""cuBLAS's workspaces: device memory a CUDA run holds from its first matrix product on, which no fake tensor shows.

torch gives each thread that runs a cuBLAS (or cuBLASLt) product a workspace of its own from the caching allocator, one
per stream, kept until the process ends (``at::cuda::getCurrentCUDABlasHandle``; cuBLASLt shares it where
``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is on, the default of torch's own builds). A training step runs products on two
threads: the forward on the training thread, the backward (checkpointed layers' recomputation included) on autograd's
thread for the device. So from the first backward on, ``memory_allocated()`` holds two workspaces: 2 x 32 MiB on
Hopper and newer GPUs, 2 x 8.1 MiB on older ones. Real snapshots show them as blocks of exactly that size made
by ``at::cuda::getNewWorkspace()`` (one under the forward's first product, one under the backward's), and a plain
GPT-2 run on an H200 peaked 79 MiB above an estimate without them.

The size is torch's: what it says where CUDA runs here (torch 2.12 and newer), else ``CUBLAS_WORKSPACE_CONFIG``
(``:SIZE_KiB:COUNT`` pairs) where set, else its default for the GPU's compute capability. Where no GPU is visible, the
estimate assumes one of compute capability 9 or newer (H100, H200, B200); ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``
gives an older GPU's figure.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture import torch_private

aten = torch.ops.aten

#: torch's default workspace on GPUs of compute capability 9 and newer (``:4096:8``).
NEWER_GPU_BYTES = 4096 * 1024 * 8
#: torch's default workspace on older GPUs (``:4096:2:16:8``).
OLDER_GPU_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
#: The oldest compute capability (major) that gets :data:`NEWER_GPU_BYTES`.
NEWER_GPU_MAJOR = 9
#: Operators whose CUDA kernels are cuBLAS or cuBLASLt products (``linear`` and ``matmul`` reach them decomposed).
CUBLAS_OPS = frozenset(
    {
        aten.mm,
        aten.addmm,
        aten._addmm_activation,
        aten.bmm,
        aten.baddbmm,
        aten.addbmm,
        aten.mv,
        aten.addmv,
        aten.dot,
        aten.vdot,
        aten._scaled_mm,
        aten._int_mm,
    }
)
_CONFIG_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def configured_bytes(config: str) -> int | None:
    """The workspace ``CUBLAS_WORKSPACE_CONFIG`` asks for (the sum of its ``:SIZE_KiB:COUNT`` pairs), None where it
    names none (torch then keeps its default)."""
    pairs = _CONFIG_PAIR.findall(config)
    if not pairs:
        return None
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def workspace_bytes(device: torch.device) -> int:
    """The bytes of one cuBLAS workspace a CUDA run on ``device`` gets (see the module's text)."""
    exact = torch_private.cuda_workspace_size()
    if exact is not None:
        return exact
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is not None:
        configured = configured_bytes(config)
        if configured is not None:
            return configured
    capability = torch_private.cuda_capability(device)
    if capability is not None and capability[0] < NEWER_GPU_MAJOR:
        return OLDER_GPU_BYTES
    return NEWER_GPU_BYTES


class CublasWorkspaces:
    """The cuBLAS workspaces of one estimate for a CUDA target: on the first product of the forward, and on the first of
    the backward, a workspace is made and kept to the end (a
    :class:`~lightning_memtrace.capture.dispatch_backend.KernelScratchRule`: the tracker counts it as new memory, in
    ``other``)."""

    def __init__(self, nbytes: int) -> None:
        #: Bytes of one workspace.
        self.nbytes = int(nbytes)
        #: The workspaces made, by thread (``"forward"``, ``"backward"``).
        self.held: dict[str, Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of the workspaces made so far."""
        return self.nbytes * len(self.held)

    @staticmethod
    def covers(func: Any) -> bool:
        return getattr(func, "overloadpacket", None) in CUBLAS_OPS

    def after(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> tuple[Any, int, tuple[Tensor, ...]]:
        """``out`` as it is, no scratch, and the workspace of this product's thread where it is the thread's first."""
        thread = "backward" if torch_private.in_backward() else "forward"
        if thread in self.held or self.nbytes <= 0:
            return out, 0, ()
        device = out.device if isinstance(out, Tensor) else None
        workspace = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.held[thread] = workspace
        return out, 0, (workspace,)
