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

import dataclasses
from array import array
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lightning_memtrace.capture.allocation_state import LiveAllocation
from lightning_memtrace.capture.storages import memory_tensors
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import Block, CachingAllocatorModel, SimulatedOutOfMemory


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
        #: Every request and free served, to serve again under a capacity (see :meth:`AllocatorLog.serves_within`).
        self.log = AllocatorLog(model.settings, array("q"))
        self._allocations = 0

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


@dataclasses.dataclass(frozen=True)
class AllocatorLog:
    """The requests and frees a model served, in order, to serve them again under a capacity.

    Attributes:
        settings: The settings they were served with.
        ops: One number per call: a request's bytes (requests are numbered from 0 in order), or ``-1 - n`` for
            the free of request ``n``.
    """

    settings: AllocatorSettings
    ops: Sequence[int]

    def serves_within(self, capacity: int, settings: AllocatorSettings | None = None) -> bool:
        """Whether the allocator, able to reserve ``capacity`` bytes at most, serves every request (freeing its
        cache where it must, as torch's does before an out-of-memory error); under other ``settings`` if given."""
        model = CachingAllocatorModel(settings or self.settings, capacity=int(capacity))
        blocks: list[Block | None] = []
        try:
            for op in self.ops:
                if op >= 0:
                    blocks.append(model.malloc(op))
                else:
                    block = blocks[-1 - op]
                    blocks[-1 - op] = None
                    if block is not None:
                        model.free(block)
        except SimulatedOutOfMemory:
            return False
        return True


def _applied_in_order(module: nn.Module) -> Iterator[torch.Tensor]:
    for child in module.children():
        yield from _applied_in_order(child)
    for tensor in (*module._parameters.values(), *module._buffers.values()):
        if isinstance(tensor, torch.Tensor):
            yield tensor
