"""MemTrace's own recorder, pointed at fake tensors: the one place where the estimator wires a recorder."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_memtrace.capture.categories import CategoryCounter
from lightning_memtrace.capture.config import RecorderConfig
from lightning_memtrace.capture.recorder import MemoryRecorder, RecorderParts
from lightning_memtrace.capture.dispatch_backend import KernelScratchRule
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.estimator.modelled_cuda import ModelledCudaAllocator


def meta_recorder(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device,
    kernel_scratch: KernelScratchRule | None = None,
    allocator: ModelledCudaAllocator | None = None,
) -> MemoryRecorder:
    """MemTrace's recorder counting fake tensors on ``device``.

    Fake tensors' storages live on the meta device: the tracker counts there, without stacks (no history is written),
    and no real allocator is touched (on CUDA, allocator counters would reset the real device's peak statistics
    under a running training). ``kernel_scratch``: what the kernels it covers hold beyond their outputs (scratch
    counted at the peak, buffers kept from then on). ``allocator``: the CUDA caching allocator's model the
    allocations drive, whose counters the rows then read (the module's state placed in it first).
    """
    tracker = AllocationTracker("meta", max_entries=1, frames_min_bytes=1 << 62)
    if kernel_scratch is not None:
        tracker.count_kernel_scratch(kernel_scratch)
    if allocator is not None:
        allocator.place_module(model)
        tracker.drive_allocator(allocator)
    parts = RecorderParts(
        tracker=tracker,
        counters=allocator,
        categories=CategoryCounter(device, model, list(optimizers)),
    )
    config = RecorderConfig(track_allocations=True, history=False, post_mortem=False)
    return MemoryRecorder(model, list(optimizers), config, device=device, parts=parts)
