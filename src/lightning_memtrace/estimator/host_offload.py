"""``torch.autograd.graph.save_on_cpu`` in a step estimated for CUDA: its copies live in host memory.

``save_on_cpu`` packs each tensor saved for backward as a copy in host memory, so that the device copy can be freed
after the forward, and unpacks it in backward as a new device copy. The estimate's fake tensors all count as the
target's memory, and for a CUDA target estimated on CPU they are CPU tensors, so the packed copies were counted as
device memory (or were no copy at all: ``.cpu()`` of a CPU tensor is the tensor): an 8-layer MLP stack's estimate
with offloading was 81 % above the one without. While a CUDA target is estimated, a ``save_on_cpu`` made in the
step packs an uncounted copy (host memory) and unpacks a counted one (the device copy backward uses), as CUDA runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture.tracker import AllocationTracker


@contextlib.contextmanager
def host_copies_uncounted(tracker: AllocationTracker) -> Iterator[None]:
    """While inside, a ``save_on_cpu`` made packs its copies uncounted by ``tracker`` and unpacks counted copies."""
    save_on_cpu = torch.autograd.graph.save_on_cpu
    original = save_on_cpu.__init__

    def on_the_host(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)

        def pack(tensor: Tensor) -> tuple[torch.device, Tensor]:
            with tracker.uncounted():
                host = tensor.clone()
            return tensor.device, host

        def unpack(packed: tuple[torch.device, Tensor]) -> Tensor:
            return packed[1].clone()

        self.pack_hook, self.unpack_hook = pack, unpack

    save_on_cpu.__init__ = on_the_host  # type: ignore[method-assign]
    try:
        yield
    finally:
        save_on_cpu.__init__ = original  # type: ignore[method-assign]
