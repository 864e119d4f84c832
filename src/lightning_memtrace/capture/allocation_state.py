"""The counting state both tracker backends write: live storages and blocks, allocated/peak, the event history.

The dispatch backend counts storages it sees made (with a weak reference that counts each down when freed); the
reports backend counts the blocks the CPU allocator reports. Both add to the same :class:`AllocationState`, which the
tracker reads (counters, snapshots) and which holds one ring buffer of events in the order they happened.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_memtrace.capture.frames import capture_frames
from lightning_memtrace.types import Category, Frame

#: Kinds of history events: ``(ALLOC, time_us, entry)``, ``(FREE, time_us, entry, metadata)``,
#: ``(OOM, time_us, event)``.
ALLOC, FREE, OOM = 0, 1, 2
#: Naming points kept (five rows a step: the last 200 steps' rows).
NAMING_POINTS_KEPT = 1000
#: Plain-str names of the category enums (so that snapshots pickle str, and label() skips Enum.__str__).
_CATEGORY_NAMES: dict[Any, str] = {category: category.value for category in Category}


class LiveAllocation:
    """A storage the tracker counts as allocated."""

    __slots__ = ("nbytes", "addr", "time_us", "frames", "metadata", "stage", "category", "ref", "__weakref__")

    def __init__(self, nbytes: int, addr: int, time_us: int, frames: list[Frame] | None, metadata: str, stage: str):
        self.nbytes = nbytes
        self.addr = addr
        self.time_us = time_us
        self.frames = frames
        self.metadata = metadata
        self.stage = stage
        self.category: str | None = None
        self.ref: weakref.ref | None = None


class RowMark:
    """A row taken while the allocator's reports are read later: its stage starts, and its allocated and peak bytes
    are read, where the report stream reaches its mark.

    Attributes:
        stage: The stage allocations belong to from the mark on; ``metadata`` likewise.
        labels: ``(address, category)`` of every storage the row named: blocks at those addresses get the category.
        foreign: ``(weak reference, category)`` of named storages at addresses the reports had not shown by the
            time of the row: counted (adopted) at the mark unless a report shows them by then.
        allocated: Bytes live at the mark (None until the stream reaches it).
        peak: Highest bytes live since the previous row's mark (None until then).
        payload: What the taker of the row keeps with it.
        names: Whether the row named the live storages (a row taken); a mark that only changes the stage does not.
    """

    __slots__ = ("stage", "metadata", "labels", "foreign", "allocated", "peak", "payload", "names")

    def __init__(
        self,
        stage: str,
        metadata: str,
        labels: list[tuple[int, str]] | None = None,
        foreign: list[tuple[weakref.ref, str]] | None = None,
        payload: Any = None,
        names: bool = False,
    ) -> None:
        self.stage = stage
        self.metadata = metadata
        self.labels = labels or []
        self.foreign = foreign or []
        self.allocated: int | None = None
        self.peak: int | None = None
        self.payload = payload
        self.names = names


@dataclass
class OutOfMemoryEvent:
    """What the tracker saw when an allocation failed."""

    requested_bytes: int | None
    allocated_bytes: int
    time_us: int
    stage: str
    metadata: str
    frames: list[Frame] = field(default_factory=list)
    message: str = ""


class AllocatorObserver(Protocol):
    """A model of a device's allocator, told of every allocation and free the state counts."""

    def allocate(self, entry: LiveAllocation, key: int | None) -> None:
        """``entry`` is counted from now (``key``: its storage's key; None for memory no storage leads to)."""

    def release(self, entry: LiveAllocation) -> None:
        """``entry`` is no longer counted."""

    def pass_through(self, nbytes: int) -> None:
        """``nbytes`` were taken and given back inside one operator."""


class AllocationState:
    """Live storages (by weak reference) and reported blocks of one device, their bytes, and the event history.

    The dicts are made once and never replaced: the backends keep them in locals and attributes of their own.
    """

    def __init__(self, device: torch.device, frames_min_bytes: int, stack_depth: int, history_size: int) -> None:
        #: Blocks the allocator reported (backend "reports"), by address.
        self.blocks: dict[int, LiveAllocation] = {}
        #: Storages counted by weak reference (adopted ones, and every one under backend "dispatch"), by storage key.
        self.live: dict[int, LiveAllocation] = {}
        #: Address -> storage key of the entries in :attr:`live`.
        self.live_addrs: dict[int, int] = {}
        self._ref_keys: dict[int, int] = {}
        self.allocated = 0
        self.peak = 0
        self._max_allocated = 0
        #: Every allocation gets a Python stack (a history window); else only those of ``frames_min_bytes`` or more.
        self.capture_all_frames = False
        self.frames_min_bytes = frames_min_bytes
        self.stack_depth = stack_depth
        #: The stage (and its snapshot tag) at the point of the events being counted now.
        self.stream_stage = "outside"
        self.stream_metadata = ""
        #: Where a free seen by weak reference goes while the reports backend defers rows (see ``ReportsBackend.mark``).
        self.defer_free: Callable[[LiveAllocation], None] | None = None
        self.events: deque[tuple] = deque(maxlen=history_size)
        #: The newest history event at each point where the live storages were named (a row taken, the post-mortem's
        #: walk): an allocation alive across such a point that got no category was none of the named kinds there,
        #: i.e. ``other`` (:func:`~lightning_memtrace.capture.snapshot_builder.build_snapshot`).
        self.naming_points: deque[tuple | None] = deque(maxlen=NAMING_POINTS_KEPT)
        #: ``record_function`` ranges entered and left inside a history window: ``(time_us, "START" | "END", name)``.
        self.annotations: deque[tuple[int, str, str]] = deque(maxlen=history_size)
        #: Names of the ranges open now (innermost last): an exit names the range it closes.
        self.open_ranges: list[str] = []
        self._on_freed = self._freed
        self.device_type = device.type
        self._device_index = (device.index or 0) if device.type not in ("cpu", "meta") else None
        self._fake_addr = 1 << 44
        #: A model of a device's allocator fed with every allocation and free counted here (the estimator's CUDA
        #: caching allocator), else None.
        self.allocator: AllocatorObserver | None = None

    def resize_history(self, size: int) -> None:
        if self.events.maxlen != size:
            self.events = deque(self.events, maxlen=size)
            self.annotations = deque(self.annotations, maxlen=size)

    def note_range(self, stage: str, name: str | None = None) -> None:
        """A ``record_function`` range starts (``"START"``, with its name) or ends (``"END"``: the innermost open one)
        now. Kept inside a history window only (the snapshot's ``external_annotations``)."""
        if stage == "START":
            self.open_ranges.append(str(name))
        elif self.open_ranges:
            name = self.open_ranges.pop()
        else:
            return  # entered before the mode saw it: its start is unknown
        if self.capture_all_frames:
            self.annotations.append((time.time_ns() // 1000, stage, name or ""))

    def pass_through(self, nbytes: int) -> None:
        """``nbytes`` taken and given back inside one operator (an estimated kernel's scratch): only the peak sees
        them."""
        if self.allocated + nbytes > self.peak:
            self.peak = self.allocated + nbytes
        if self.allocator is not None:
            self.allocator.pass_through(nbytes)

    def reset_peak(self) -> None:
        self._max_allocated = max(self._max_allocated, self.peak)
        self.peak = self.allocated

    @property
    def max_allocated(self) -> int:
        return max(self._max_allocated, self.peak)

    def hold_unseen(self, nbytes: int, frames: list[Frame] | None, category: str) -> LiveAllocation:
        """Count ``nbytes`` that exist already and that no storage leads to (DDP's first gradient buckets, inside its
        C++ reducer), as one block of ``category`` at an address of its own, live until the tracker is dropped."""
        entry = LiveAllocation(nbytes, self._address_of_its_own(nbytes), time.time_ns() // 1000, frames, "", "outside")
        entry.category = category
        self.blocks[entry.addr] = entry
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        if self.allocator is not None:
            self.allocator.allocate(entry, None)
        return entry

    def _address_of_its_own(self, nbytes: int) -> int:
        """A distinct address for memory that has none to tell (meta, fake, or reached by no storage), past the last
        one handed out and clear of real ones."""
        self._fake_addr += 512 + (nbytes + 511) // 512 * 512
        return self._fake_addr

    def entries(self) -> list[LiveAllocation]:
        return [*self.live.values(), *self.blocks.values()]

    def track_storage(self, storage: torch.UntypedStorage, adopted: bool = False, skip: int = 2) -> bool:
        """Count a storage of this device not counted yet (by its key, nor its memory by address). True if counted."""
        key = storage._cdata
        if key in self.live:
            return False
        device = storage.device
        if device.type != self.device_type or (self._device_index is not None and device.index != self._device_index):
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        # Meta and fake storages have no memory; asking fake ones for a pointer warns (and will raise).
        addr = 0 if device.type == "meta" else storage.data_ptr()
        if addr == 0:
            # Meta and fake storages have no address: give each a distinct one so snapshots stay well formed.
            addr = self._address_of_its_own(nbytes)
        if addr in self.live_addrs or addr in self.blocks:
            # Memory already counted: a second storage object over it (from_blob, shared numpy memory), or a block
            # the allocator reported.
            return False
        self.count(storage, key, nbytes, addr, skip=skip + 1, adopted=adopted)
        return True

    def count(self, storage: torch.UntypedStorage, key: int, nbytes: int, addr: int, skip: int, adopted: bool) -> None:
        """Add a checked storage to the live table, with a weak reference that counts it down when it is freed."""
        now = time.time_ns() // 1000
        frames = None
        if self.capture_all_frames or nbytes >= self.frames_min_bytes:
            frames = capture_frames(skip=skip, depth=self.stack_depth)
        entry = LiveAllocation(nbytes, addr, now, frames, self.stream_metadata, self.stream_stage)
        ref = entry.ref = weakref.ref(storage, self._on_freed)
        self._ref_keys[id(ref)] = key
        self.live[key] = entry
        self.live_addrs[addr] = key
        allocated = self.allocated = self.allocated + nbytes
        if allocated > self.peak:
            self.peak = allocated
        if self.allocator is not None:
            self.allocator.allocate(entry, key)
        if not adopted:
            self.events.append((ALLOC, now, entry))

    def _freed(self, ref: weakref.ref) -> None:
        # One bound method for every storage (no closure per allocation): the weakref's id leads to the storage key.
        key = self._ref_keys.pop(id(ref), None)
        if key is None:
            return
        entry = self.live.pop(key, None)
        if entry is None:
            return
        addrs = self.live_addrs
        if addrs.get(entry.addr) == key:
            del addrs[entry.addr]
        defer = self.defer_free
        if defer is not None and not self.capture_all_frames:
            defer(entry)  # counted down where the report stream reaches the free
            return
        self.count_down(entry)

    def count_down(self, entry: LiveAllocation) -> None:
        """A counted storage or block is gone (already out of the tables): its bytes and a free event."""
        self.allocated -= entry.nbytes
        if self.allocator is not None:
            self.allocator.release(entry)
        self.events.append((FREE, time.time_ns() // 1000, entry, self.stream_metadata))

    def forget(self, key: int, entry: LiveAllocation) -> None:
        """Take a storage counted by weak reference out of the tables now (resized in place), and count it down."""
        if entry.ref is not None:
            self._ref_keys.pop(id(entry.ref), None)
        self.live.pop(key, None)
        self.live_addrs.pop(entry.addr, None)
        self.count_down(entry)

    def note_naming(self) -> None:
        """The live storages were named here (see :attr:`naming_points`)."""
        self.naming_points.append(self.events[-1] if self.events else None)

    def label(self, storages: dict[int, tuple[str, torch.UntypedStorage]]) -> None:
        """Count the storages not counted yet (adopted) and tag every one with its category.

        Args:
            storages: storage key -> (category, storage), as the category counter names them.
        """
        live = self.live
        blocks = self.blocks
        for key, (category, storage) in storages.items():
            entry = live.get(key)
            if entry is None and blocks:
                entry = blocks.get(storage.data_ptr())
            if entry is None:
                self.track_storage(storage, adopted=True)
                entry = live.get(key)
                if entry is None:  # another device, or no bytes
                    continue
            name = _CATEGORY_NAMES.get(category)
            entry.category = name if name is not None else str(category)
        self.note_naming()
