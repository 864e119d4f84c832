"""MemTrace's own recorder, pointed at fake tensors: the one place where the estimator wires a recorder."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memtrace.capture.categories import CategoryCounter, StorageMap
from lightning_memtrace.capture.config import RecorderConfig
from lightning_memtrace.capture.recorder import MemoryRecorder, RecorderParts
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.types import Category


class FakeCategoryCounter(CategoryCounter):
    """The callback's category counter for fake tensors, whose storages sit on ``meta`` whatever their device.

    Inputs and saved activations were matched to the device by their tensors already (``input_storages`` and
    ``SavedTensorsRecorder`` check the tensor's device); only the storage-device check is left out here.
    """

    def classify(
        self, inputs: StorageMap | None = None, saved: StorageMap | None = None
    ) -> dict[int, tuple[Category, torch.UntypedStorage]]:
        out = super().classify()
        for category, storages in ((Category.INPUTS, inputs), (Category.ACTIVATIONS, saved)):
            for key, storage in (storages or {}).items():
                if key not in out:
                    out[key] = (category, storage)
        return out


def meta_recorder(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> MemoryRecorder:
    """MemTrace's recorder counting fake tensors on ``device``.

    Fake tensors' storages live on the meta device: the tracker counts there, without stacks (no history is written),
    and no real allocator is touched (on CUDA, allocator counters would reset the real device's peak statistics
    under a running training).
    """
    parts = RecorderParts(
        tracker=AllocationTracker("meta", max_entries=1, frames_min_bytes=1 << 62),
        categories=FakeCategoryCounter(device, model, [optimizer]),
    )
    config = RecorderConfig(track_allocations=True, history=False, post_mortem=False)
    return MemoryRecorder(model, [optimizer], config, device=device, parts=parts)
