"""The counters of a CUDA run, from the caching allocator's model driven by the estimate's fake allocations.

Where the estimate's target is CUDA, every storage the tracker counts (and every kernel's scratch, and every buffer a
library keeps) is also asked of a :class:`~lightning_memtrace.analysis.caching_allocator.CachingAllocatorModel`, so
the rows' ``allocated_bytes`` and ``peak_bytes`` are what ``torch.cuda.memory_allocated()`` would report (blocks:
rounded to 512 B, whole where the allocator does not cut them) and ``reserved_bytes`` what
``torch.cuda.memory_reserved()`` would. The categories stay the tensors' own bytes; the difference is in ``other``,
as in a real CUDA run's rows.

The module's parameters and buffers are placed first, in the order ``module.to("cuda")`` makes them
(``Module._apply``: children first, then a module's own parameters and buffers), as Lightning moves the model before
the first batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import torch
from torch import nn

from lightning_memtrace.capture.allocation_state import LiveAllocation
from lightning_memtrace.capture.storages import memory_tensors
from lightning_memtrace.analysis.caching_allocator import Block, CachingAllocatorModel
from lightning_memtrace.estimator.allocator_log import AllocatorLog


class ModelledCudaAllocator:
    """Feeds a tracker's allocations and frees to a caching allocator's model, and reads counters from it.

    It is the tracker state's ``allocator`` (an
    :class:`~lightning_memtrace.capture.allocation_state.AllocatorObserver`) and the recorder's counters (a
    :class:`~lightning_memtrace.capture.counters.MemoryCounters`).
    """

    name = "modelled-cuda"

    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model
        #: Blocks (and their allocation's number in :attr:`log`) by the tracker's address of the allocation they hold.
        self._blocks: dict[int, tuple[Block, int]] = {}
        #: Blocks placed ahead of the tracker (the module's state), by storage key.
        self._placed: dict[int, tuple[Block, int]] = {}
        #: Every request and free served, and where each step starts, to serve again (see
        #: :mod:`~lightning_memtrace.estimator.allocator_log`).
        self.log = AllocatorLog(model.settings, array("q"), array("q"), array("q"))
        self._allocations = 0

    def mark_step(self, step: int) -> None:
        """Note that optimizer step ``step`` (the run's ``global_step``) starts here with its first batch (or, at the
        end, that the last step ended and ``step`` would come next)."""
        self.log.step_starts.append(len(self.log.ops))
        self.log.step_numbers.append(step)

    def place_module(self, module: nn.Module) -> None:
        """Allocate ``module``'s parameters and buffers now, in ``module.to()``'s order (tied ones once; a sharded
        parameter's local shard). What the tracker does not count by the first row is given back then."""
        for tensor in memory_tensors(_applied_in_order(module)):
            storage = tensor.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            if key not in self._placed and nbytes > 0:
                self._placed[key] = self._malloc(nbytes)

    def _malloc(self, nbytes: int) -> tuple[Block, int]:
        block = self.model.malloc(nbytes)
        self.log.ops.append(nbytes)
        self._allocations += 1
        return block, self._allocations - 1

    def _free(self, held: tuple[Block, int]) -> None:
        self.model.free(held[0])
        self.log.ops.append(-1 - held[1])

    # ------------------------------------------------------------------------------------------------ observer
    def allocate(self, entry: LiveAllocation, key: int | None) -> None:
        held = self._placed.pop(key, None) if key is not None else None
        if held is not None and held[0].requested != entry.nbytes:  # resized since it was placed
            self._free(held)
            held = None
        self._blocks[entry.addr] = held if held is not None else self._malloc(entry.nbytes)

    def release(self, entry: LiveAllocation) -> None:
        held = self._blocks.pop(entry.addr, None)
        if held is not None:
            self._free(held)

    def pass_through(self, nbytes: int) -> None:
        self._free(self._malloc(nbytes))

    # ------------------------------------------------------------------------------------------------ counters
    @property
    def max_allocated(self) -> int:
        return self.model.max_allocated

    @property
    def max_reserved(self) -> int:
        return self.model.max_reserved

    def read(self) -> tuple[int, int, int]:
        for held in self._placed.values():  # placed, and not counted by the tracker: not the run's memory
            self._free(held)
        self._placed.clear()
        model = self.model
        allocated, reserved, peak = model.allocated, model.reserved, max(model.peak_allocated, model.allocated)
        model.reset_peak()
        return allocated, reserved, peak


def _applied_in_order(module: nn.Module) -> Iterator[torch.Tensor]:
    for child in module.children():
        yield from _applied_in_order(child)
    for tensor in (*module._parameters.values(), *module._buffers.values()):
        if isinstance(tensor, torch.Tensor):
            yield tensor
