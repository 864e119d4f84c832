"""An allocation tracker: exact allocated/peak counters and a snapshot-format history on any device.

The CUDA caching allocator counts its own bytes and records its own history; the CPU allocator (and others) do
neither. :class:`AllocationTracker` gives those devices the same numbers, from one of two sources: the CPU
allocator's own reports of each allocation and free (backend ``"reports"``, see
:mod:`~lightning_memtrace.allocator_reports`), or a ``TorchDispatchMode`` that sees every storage an operator creates
and a weak reference on the storage that sees it freed (backend ``"dispatch"``, any device). A bounded ring buffer
keeps the events in the format of ``torch.cuda.memory._snapshot()``, so that the same readers
(``torch.cuda._memory_viz``, pytorch.org/memory_viz, ``memtrace report``) open them.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.allocator_reports import (
    AllocatorReports,
    SessionLost,
    another_profiler_active,
    track_every_cpu_block,
    unavailable_reason,
)
from lightning_memtrace.capture.frames import Frame, capture_frames, traceback_frames
from lightning_memtrace.types import Category

_ALLOC, _FREE, _OOM = 0, 1, 2
#: The category of an allocation that is none of parameters, gradients, optimizer state, inputs or activations.
UNKNOWN_CATEGORY = "unknown"
#: Plain-str names of the category enums (so that snapshots pickle str, and label() skips Enum.__str__).
_CATEGORY_NAMES: dict[Any, str] = {category: category.value for category in Category}
_RESIZING_OPS = frozenset({"resize_", "resize_as_", "set_", "resize_storage_bytes_"})
_CPU_OOM_PATTERN = re.compile(r"tried to allocate (\d+) bytes")
_CUDA_OOM_PATTERN = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNIT_FACTORS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
#: Size of the block that puts a mark into the CPU allocator's report stream (a row, a free seen by weak reference).
#: Odd, so that no tensor's block is this size; the block is freed at once, and neither report is counted.
MARK_BYTES = 4093


def is_out_of_memory(exception: BaseException) -> bool:
    """True for a CUDA ``OutOfMemoryError`` and for the CPU allocator's "can't allocate memory" ``RuntimeError``."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    if isinstance(exception, (RuntimeError, MemoryError)):
        message = str(exception)
        return "can't allocate memory" in message or "out of memory" in message.lower()
    return False


def requested_bytes_from_message(message: str) -> int | None:
    """The size the failed allocation asked for, as stated in the allocator's error message."""
    found = _CPU_OOM_PATTERN.search(message)
    if found:
        return int(found.group(1))
    found = _CUDA_OOM_PATTERN.search(message)
    if found:
        return int(float(found.group(1)) * _UNIT_FACTORS[found.group(2)])
    return None


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
    """

    __slots__ = ("stage", "metadata", "labels", "foreign", "allocated", "peak", "payload")

    def __init__(
        self,
        stage: str,
        metadata: str,
        labels: list[tuple[int, str]] | None = None,
        foreign: list[tuple[weakref.ref, str]] | None = None,
        payload: Any = None,
    ) -> None:
        self.stage = stage
        self.metadata = metadata
        self.labels = labels or []
        self.foreign = foreign or []
        self.allocated: int | None = None
        self.peak: int | None = None
        self.payload = payload


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


def _dispatch(mode: _TrackerMode, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    # Every operator on the device comes through here, so the common path (a known operator with one or no new
    # output) is kept to a few attribute reads: the plan is cached by the operator's id (OpOverload's own __hash__ is
    # Python code) and the operator is called through its C++ overload, without OpOverload.__call__'s extra frame.
    tracker = mode.tracker
    plan = tracker._plans.get(id(func))
    if plan is None:
        plan = tracker._plan(func)
    call, fresh, resizing = plan
    try:
        out = call(*args, **kwargs) if kwargs else call(*args)
    except RuntimeError as error:
        if tracker.backend == "dispatch" and is_out_of_memory(error):
            # Under backend "reports" the failure is recorded by note_oom() once the error has left the operator:
            # reading the reports inside it would hand the operator's caller a warning of torch's about the session.
            tracker._record_oom(error)
        raise
    if fresh:
        if isinstance(out, Tensor):
            tracker._track_output(out)
        elif isinstance(out, (list, tuple)):
            if len(fresh) == 1 and isinstance(out, list):
                tracker._seen(out)
            else:
                for index in fresh:
                    tracker._seen(out[index])
    if resizing:
        tracker._refresh_sizes(args)
    return out


def _skip_dynamo_for(code: Any) -> bool:
    """Tell dynamo never to compile ``code`` nor anything it calls, without a per-call wrapper.

    ``torch._disable_dynamo`` (what TorchDispatchMode wraps handlers in) costs several microseconds on every operator;
    a frame strategy set once on the code object costs nothing per call.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        return True
    except Exception:
        return False


_DISPATCH_SKIPS_DYNAMO = _skip_dynamo_for(_dispatch.__code__)


class _TrackerMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Only fall back to torch's per-call dynamo-disable wrapper where the frame strategy could not be set.
        return not _DISPATCH_SKIPS_DYNAMO

    def __init__(self, tracker: AllocationTracker) -> None:
        super().__init__()
        self.tracker = tracker

    __torch_dispatch__ = _dispatch


class AllocationTracker:
    """Counts the bytes of live storages on one device and keeps a ring buffer of alloc/free events.

    Args:
        device: The device whose storages are counted; storages elsewhere are ignored.
        max_entries: Size of the event ring buffer (older events are dropped).
        frames_min_bytes: Allocations at least this large always get a Python stack; smaller ones only while
            :attr:`capture_all_frames` is set (the history window).
        stack_depth: Most frames kept per stack.
        idle_entries: Size of the ring buffer outside a history window (see :meth:`record_history`).
        backend: How allocations are seen. ``"dispatch"``: a ``TorchDispatchMode`` sees every storage an operator
            makes and a weak reference sees it freed (any device, Python work on every operator). ``"reports"``
            (CPU only): the CPU allocator's own reports of every allocation and free, read through a profiler
            session that records nothing else (:mod:`~lightning_memtrace.allocator_reports`; no Python work per
            operator; it also counts the temporaries inside operators); the dispatch mode then runs only inside a
            history window, to give allocations their Python stacks. ``"auto"``: ``"reports"`` where it can run
            (a CPU tracker, no other profiler recording), else ``"dispatch"``.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        max_entries: int = 100_000,
        frames_min_bytes: int = 16 * 1024**2,
        stack_depth: int = 48,
        idle_entries: int = 4096,
        backend: str = "dispatch",
    ) -> None:
        if backend not in ("dispatch", "reports", "auto"):
            raise ValueError(f"backend must be 'dispatch', 'reports' or 'auto', not {backend!r}")
        self.device = torch.device(device)
        self.requested_backend = backend
        if backend != "dispatch" and self.device.type == "cpu":
            track_every_cpu_block()  # blocks made from now on are known to the reports session
        #: The backend in use once started: "dispatch" or "reports".
        self.backend = "dispatch"
        #: Why "auto" (or "reports") fell back to "dispatch", if it did.
        self.fallback_reason: str | None = None
        #: Set when another profiler took the reports session over (allocated/peak missed what happened meanwhile).
        self.session_lost = False
        self._reports: Any = None
        # Blocks the allocator reported (backend "reports"), by address; storages counted by weak reference
        # (adopted ones, and every one under backend "dispatch") are in _live.
        self._blocks: dict[int, LiveAllocation] = {}
        self._pending_frames: dict[int, list[Frame]] = {}
        #: Backend "reports": run the dispatch mode inside a history window to give allocations their stacks (off
        #: for compiled modules, which a dispatch mode makes run eagerly).
        self.window_stacks = True
        self._allocated = 0
        self._peak = 0
        self._max_allocated = 0
        self.capture_all_frames = False
        self.frames_min_bytes = frames_min_bytes
        self.stack_depth = stack_depth
        #: The stage (and its snapshot tag) allocations are made in now: see :meth:`set_stage`.
        self.metadata = ""
        self.stage = "outside"
        # The stage at the point of the report stream being applied (behind `stage` while rows are deferred).
        self._stream_metadata = ""
        self._stream_stage = "outside"
        # Marks put into the report stream and not reached yet: (address of the mark's block or None, mark).
        self._marks: deque[tuple[int | None, RowMark | LiveAllocation]] = deque()
        self._thread = threading.get_ident()
        self.oom_events: deque[OutOfMemoryEvent] = deque(maxlen=8)
        self.oom_listeners: list[Callable[[OutOfMemoryEvent], None]] = []
        self._live: dict[int, LiveAllocation] = {}
        self._live_addrs: dict[int, int] = {}
        self.max_entries = max(1, int(max_entries))
        self.idle_entries = max(1, min(int(idle_entries), self.max_entries))
        # Outside a history window only the last `idle_entries` events are kept (for a post-mortem's recent trace):
        # a large ring of live Python objects would slow every garbage collection of the training process.
        self._events: deque[tuple] = deque(maxlen=self.idle_entries)
        self._ref_keys: dict[int, int] = {}
        self._plans: dict[int, tuple[Callable[..., Any], tuple[int, ...], bool]] = {}
        self._planned_ops: list[Any] = []
        self._on_freed = self._freed
        self._cpu_only = self.device.type == "cpu"
        self._device_type = self.device.type
        self._device_index = (self.device.index or 0) if self.device.type not in ("cpu", "meta") else None
        self._mode: _TrackerMode | None = None
        self._fake_addr = 1 << 44

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.active:
            return
        if self.requested_backend != "dispatch":
            reason = self._start_reports()
            if reason is None:
                self.backend = "reports"
                # Inside a history window the dispatch mode only notes the stacks of operator outputs.
                self._track_output = self._note_frames  # type: ignore[method-assign]
                if self.capture_all_frames and self.window_stacks:
                    self._enter_mode()
                return
            if self.requested_backend == "reports":
                raise RuntimeError(f"the allocator-reports backend cannot run: {reason}")
            self.fallback_reason = reason
        self.backend = "dispatch"
        self._enter_mode()

    def _start_reports(self) -> str | None:
        if self.device.type != "cpu":
            return f"allocator reports cover the CPU allocator only, not {self.device.type}"
        reason = unavailable_reason()
        if reason is not None:
            return reason
        try:
            reports = AllocatorReports()
            reports.start()
        except Exception as error:
            return f"could not open a profiler session ({error})"
        self._reports = reports
        return None

    def _enter_mode(self) -> None:
        if self._mode is None:
            self._mode = _TrackerMode(self)
            self._mode.__enter__()

    def _exit_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        return self._mode is not None or (self._reports is not None and self._reports.active)

    def stop(self) -> None:
        """Stop seeing new allocations; storages counted by weak reference keep being counted down as they are freed."""
        self._exit_mode()
        reports, self._reports = self._reports, None
        if reports is not None:
            self._apply_reports(reports.stop())
        self._reach_marks(len(self._marks))

    def sync(self) -> None:
        """Take in the allocator's reports since the last call (backend "reports"; nothing to do otherwise)."""
        reports = self._reports
        if reports is None:
            return
        try:
            events = reports.drain()
        except SessionLost:
            # A user's profiler took the thread over: reports were lost meanwhile; resume once it is gone.
            self.session_lost = True
            events = []
        except Exception:
            self.session_lost = True
            return
        if not reports.active and not another_profiler_active():
            try:
                reports.start()
            except Exception:  # still not ours to open: try again at the next read
                pass
        self._apply_reports(events)
        self._reach_marks(len(self._marks))

    @property
    def deferring(self) -> bool:
        """Rows are read where the report stream reaches their marks (backend "reports", outside a history window)."""
        return self._reports is not None and not self.capture_all_frames

    def set_stage(self, stage: str, metadata: str) -> None:
        """Allocations from now on belong to ``stage`` (tagged ``metadata``).

        While :attr:`deferring`, the stage changes in the report stream at the next :meth:`mark` (which carries it).
        """
        self.stage, self.metadata = stage, metadata
        if not self.deferring:
            self._stream_stage, self._stream_metadata = stage, metadata

    def mark(self, mark: RowMark | LiveAllocation) -> None:
        """Put ``mark`` into the allocator's report stream here: it takes effect when :meth:`sync` reaches it.

        A :class:`RowMark` starts its stage and reads its row; a :class:`LiveAllocation` (a storage counted by weak
        reference) is freed. The mark is a block of :data:`MARK_BYTES` allocated and freed at once on this thread; a
        mark made on another thread reaches no report stream and takes effect with the next mark after it.
        """
        if threading.get_ident() != self._thread:
            self._marks.append((None, mark))
            return
        block = torch.UntypedStorage(MARK_BYTES, device="cpu")
        self._marks.append((block.data_ptr(), mark))
        del block

    def _reach_marks(self, count: int) -> None:
        """Apply the first ``count`` marks, oldest first, at the current point of the stream."""
        marks = self._marks
        for _ in range(count):
            mark = marks.popleft()[1]
            if type(mark) is RowMark:
                self._reach_row(mark)
            else:
                self._allocated -= mark.nbytes
                self._events.append((_FREE, time.time_ns() // 1000, mark, self._stream_metadata))

    def _reach_row(self, row: RowMark) -> None:
        self._stream_stage, self._stream_metadata = row.stage, row.metadata
        for ref, category in row.foreign:
            storage = ref()
            if storage is not None and storage.data_ptr() not in self._blocks:
                self._track_storage(storage, adopted=True)
        blocks, live, live_addrs = self._blocks, self._live, self._live_addrs
        for addr, category in row.labels:
            entry = blocks.get(addr)
            if entry is None:
                key = live_addrs.get(addr)
                entry = live.get(key) if key is not None else None
            if entry is not None:
                entry.category = category
        row.allocated = allocated = self._allocated
        row.peak = max(self._peak, allocated)
        self.reset_peak()

    def _mark_at(self, addr: int) -> int | None:
        """How many marks the stream reaches with a mark block at ``addr`` (marks before it that never reached the
        stream, made on another thread, come with it)."""
        for index, (mark_addr, _) in enumerate(self._marks):
            if mark_addr == addr:
                return index + 1
        return None

    def _apply_reports(self, events: list[tuple[int, int, int]]) -> None:
        blocks = self._blocks
        live_addrs = self._live_addrs
        pending = self._pending_frames
        history = self._events
        marks = self._marks
        metadata = self._stream_metadata
        stage = self._stream_stage
        with_frames = self.capture_all_frames
        last_frames: list[Frame] | None = None
        orphans: list[LiveAllocation] = []
        allocated, peak = self._allocated, self._peak
        mark_free: int | None = None
        last = len(events) - 1
        for index, (time_ns, addr, size) in enumerate(events):
            if size == MARK_BYTES and marks and index < last and events[index + 1][1:] == (addr, -MARK_BYTES):
                reached = self._mark_at(addr)
                if reached is not None:
                    self._allocated, self._peak = allocated, peak
                    self._reach_marks(reached)
                    allocated, peak = self._allocated, self._peak
                    metadata, stage = self._stream_metadata, self._stream_stage
                    mark_free = addr
                    continue
            elif mark_free == addr and size == -MARK_BYTES:
                mark_free = None
                continue
            now = time_ns // 1000
            if size > 0:
                stale = blocks.pop(addr, None)
                if stale is not None:
                    # Its free happened where no report reached us (another thread, a lost session): the address
                    # being handed out again proves it.
                    allocated -= stale.nbytes
                    history.append((_FREE, now, stale, metadata))
                if addr in live_addrs:
                    # Already counted: a storage adopted by weak reference before this report was read.
                    continue
                frames = None
                if with_frames:
                    frames = pending.pop(addr, None)
                    if frames is None:
                        # Not an operator's output (a temporary inside one): the nearest output's stack, the
                        # previous one's, else the next one's.
                        frames = last_frames
                    else:
                        last_frames = frames
                        for orphan in orphans:
                            orphan.frames = frames
                        orphans.clear()
                entry = LiveAllocation(size, addr, now, frames, metadata, stage)
                if with_frames and frames is None:
                    orphans.append(entry)
                blocks[addr] = entry
                allocated += size
                if allocated > peak:
                    peak = allocated
                history.append((_ALLOC, now, entry))
            else:
                entry = blocks.pop(addr, None)
                if entry is not None:
                    allocated -= entry.nbytes
                    history.append((_FREE, now, entry, metadata))
        self._allocated, self._peak = allocated, peak
        pending.clear()

    def __enter__(self) -> AllocationTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------------------- counting
    def adopt(self, tensor_or_storage: Tensor | torch.UntypedStorage) -> bool:
        """Count a storage that exists already (parameters, a batch made before tracking). True if it was new."""
        storage = tensor_or_storage.untyped_storage() if isinstance(tensor_or_storage, Tensor) else tensor_or_storage
        return self._track_storage(storage, adopted=True)

    @property
    def allocated(self) -> int:
        """Bytes counted as live now (backend "reports": after taking in the reports so far)."""
        self.sync()
        return self._allocated

    @property
    def peak(self) -> int:
        """Highest :attr:`allocated` since the last :meth:`reset_peak`."""
        self.sync()
        return self._peak

    def counts_address(self, addr: int) -> bool:
        """Memory at ``addr`` is counted: a block the allocator reported, or a storage counted by weak reference."""
        return addr in self._blocks or addr in self._live_addrs

    def counters(self) -> tuple[int, int]:
        """(allocated, peak) as they stand, without taking in new reports (see :meth:`sync`)."""
        return self._allocated, self._peak

    def reset_peak(self) -> None:
        self._max_allocated = max(self._max_allocated, self._peak)
        self._peak = self._allocated

    @property
    def max_allocated(self) -> int:
        """Highest :attr:`allocated` since the tracker was made (peak resets do not touch it)."""
        return max(self._max_allocated, self._peak)

    def live_allocations(self) -> list[LiveAllocation]:
        self.sync()
        return [*self._live.values(), *self._blocks.values()]

    def label(self, storages: dict[int, tuple[str, torch.UntypedStorage]]) -> None:
        """Count the storages not counted yet (as :meth:`adopt`) and tag every one with its category.

        Reports not taken in yet are not read here (call :meth:`sync` first): a storage adopted before its report is
        read is recognized by its address then, and counted once.

        Args:
            storages: storage key -> (category, storage), as the category counter names them.
        """
        live = self._live
        blocks = self._blocks
        for key, (category, storage) in storages.items():
            entry = live.get(key)
            if entry is None and blocks:
                entry = blocks.get(storage.data_ptr())
            if entry is None:
                self._track_storage(storage, adopted=True)
                entry = live.get(key)
                if entry is None:  # another device, or no bytes
                    continue
            name = _CATEGORY_NAMES.get(category)
            entry.category = name if name is not None else str(category)

    def _plan(self, func: Any) -> tuple[Callable[..., Any], tuple[int, ...], bool]:
        """How to call an operator, which of its outputs are new storages (no alias in its schema), and whether it
        resizes one of its arguments."""
        try:
            returns = func._schema.returns
            fresh = tuple(i for i, ret in enumerate(returns) if ret.alias_info is None)
        except Exception:
            fresh = (0,)
        try:
            resizing = func.overloadpacket.__name__ in _RESIZING_OPS
        except Exception:
            resizing = False
        call = getattr(func, "_op", None)
        if not callable(call):
            call = func
        plan = (call, fresh, resizing)
        self._plans[id(func)] = plan
        # The plan is keyed by id(): keep the operator alive so that its id is never reused for another object.
        self._planned_ops.append(func)
        return plan

    def _seen(self, out: Any) -> None:
        if isinstance(out, Tensor):
            self._track_output(out)
        elif isinstance(out, (list, tuple)):
            for item in out:
                if isinstance(item, Tensor):
                    self._track_output(item)

    def _track_output(self, tensor: Tensor) -> None:
        """Count the storage of an operator's output: :meth:`_track_storage` without its rare cases.

        A CPU storage an operator has just made has its own address and is not counted yet (unless the operator
        returned an existing one), so only the size check remains on this path.
        """
        if not self._cpu_only:
            # Meta storages have no address and other devices are rare here: the general path.
            self._track_storage(tensor.untyped_storage(), skip=3)
            return
        if not tensor.is_cpu:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        live = self._live
        if key in live:
            return
        nbytes = storage.nbytes()
        if not nbytes:
            return
        addr = storage.data_ptr()
        if not addr or addr in self._live_addrs:
            self._track_storage(storage, skip=3)
            return
        self._count(storage, key, nbytes, addr, skip=4, adopted=False)

    def _note_frames(self, tensor: Tensor) -> None:
        """Backend "reports": remember the Python stack of an operator's new output, for its allocation report."""
        if not tensor.is_cpu:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self._pending_frames[storage.data_ptr()] = capture_frames(skip=3, depth=self.stack_depth)

    def _on_device(self, device: torch.device) -> bool:
        return device.type == self._device_type and (self._device_index is None or device.index == self._device_index)

    def _track_storage(self, storage: torch.UntypedStorage, adopted: bool = False, skip: int = 2) -> bool:
        key = storage._cdata
        if key in self._live:
            return False
        if not self._on_device(storage.device):
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        # Meta and fake storages have no memory; asking fake ones for a pointer warns (and will raise).
        addr = 0 if storage.device.type == "meta" else storage.data_ptr()
        if addr == 0:
            # Meta and fake storages have no address: give each a distinct one so snapshots stay well formed.
            self._fake_addr += 512 + (nbytes + 511) // 512 * 512
            addr = self._fake_addr
        if addr in self._live_addrs or addr in self._blocks:
            # Memory already counted: a second storage object over it (from_blob, shared numpy memory), or a block
            # the allocator reported.
            return False
        self._count(storage, key, nbytes, addr, skip=skip + 1, adopted=adopted)
        return True

    def _count(self, storage: torch.UntypedStorage, key: int, nbytes: int, addr: int, skip: int, adopted: bool) -> None:
        """Add a checked storage to the live table, with a weak reference that counts it down when it is freed."""
        now = time.time_ns() // 1000
        frames = None
        if self.capture_all_frames or nbytes >= self.frames_min_bytes:
            frames = capture_frames(skip=skip, depth=self.stack_depth)
        entry = LiveAllocation(nbytes, addr, now, frames, self._stream_metadata, self._stream_stage)
        ref = entry.ref = weakref.ref(storage, self._on_freed)
        self._ref_keys[id(ref)] = key
        self._live[key] = entry
        self._live_addrs[addr] = key
        allocated = self._allocated = self._allocated + nbytes
        if allocated > self._peak:
            self._peak = allocated
        if not adopted:
            self._events.append((_ALLOC, now, entry))

    def _freed(self, ref: weakref.ref) -> None:
        # One bound method for every storage (no closure per allocation): the weakref's id leads to the storage key.
        key = self._ref_keys.pop(id(ref), None)
        if key is None:
            return
        entry = self._live.pop(key, None)
        if entry is None:
            return
        addrs = self._live_addrs
        if addrs.get(entry.addr) == key:
            del addrs[entry.addr]
        if self.deferring:
            self.mark(entry)  # counted down where the report stream reaches the free
            return
        self._allocated -= entry.nbytes
        self._events.append((_FREE, time.time_ns() // 1000, entry, self._stream_metadata))

    def _refresh_sizes(self, args: tuple) -> None:
        if self.backend == "reports":
            return  # the allocator reports a resize as a free and an allocation
        for arg in args:
            if not isinstance(arg, Tensor):
                continue
            storage = arg.untyped_storage()
            entry = self._live.get(storage._cdata)
            if entry is None:
                self._track_storage(storage)
                continue
            nbytes = storage.nbytes()
            if nbytes != entry.nbytes or storage.data_ptr() != entry.addr:
                # Resized in place: account for it as a free of the old block and an alloc of the new one.
                if entry.ref is not None:
                    self._ref_keys.pop(id(entry.ref), None)
                self._live.pop(storage._cdata, None)
                self._live_addrs.pop(entry.addr, None)
                self._allocated -= entry.nbytes
                self._events.append((_FREE, time.time_ns() // 1000, entry, self._stream_metadata))
                self._track_storage(storage)

    def note_oom(self, error: BaseException) -> None:
        """Record an out-of-memory error that the tracker did not see raised (backend "reports", outside a window).

        The allocator does not report a failed allocation: the stack comes from the error's traceback.
        """
        self.sync()
        self._record_oom(error, frames=traceback_frames(error, self.stack_depth))

    def _record_oom(self, error: BaseException, frames: list[Frame] | None = None) -> None:
        message = str(error)
        event = OutOfMemoryEvent(
            requested_bytes=requested_bytes_from_message(message),
            allocated_bytes=self._allocated,
            time_us=time.time_ns() // 1000,
            stage=self.stage,
            metadata=self.metadata,
            frames=frames if frames is not None else capture_frames(skip=3, depth=self.stack_depth),
            message=message.splitlines()[0] if message else "",
        )
        self.oom_events.append(event)
        self._events.append((_OOM, event.time_us, event))
        for listener in list(self.oom_listeners):
            try:
                listener(event)
            except Exception:
                pass

    # ----------------------------------------------------------------------------------------------- export
    def record_history(self, enabled: bool) -> None:
        """Open (or close) a history window: every allocation gets a stack and the ring holds ``max_entries``.

        Under backend "reports" the dispatch mode runs only inside the window, to note those stacks.
        """
        if self._reports is not None:
            self.sync()  # reports up to now belong outside (or inside) the window that is closing (or opening)
            self._stream_stage, self._stream_metadata = self.stage, self.metadata
            if enabled and self.window_stacks:
                self._enter_mode()
            else:
                self._exit_mode()
        self.capture_all_frames = enabled
        size = self.max_entries if enabled else self.idle_entries
        if self._events.maxlen != size:
            self._events = deque(self._events, maxlen=size)

    def events_since(self, since_us: int = 0) -> int:
        self.sync()
        return sum(1 for ev in self._events if ev[1] >= since_us)

    def snapshot(self, since_us: int = 0, device_index: int = 0) -> dict[str, Any]:
        """The tracker's state in the dict format of ``torch.cuda.memory._snapshot()``.

        ``segments`` hold one segment per live storage (the CPU allocator has no caching, so reserved equals
        allocated); ``device_traces[device_index]`` holds the events since ``since_us`` (Unix microseconds).
        Allocations and blocks carry ``category`` and ``user_metadata`` (the phase and step they were made in).
        """
        self.sync()
        segments = []
        for entry in sorted([*self._live.values(), *self._blocks.values()], key=lambda e: e.addr):
            block = {
                "address": entry.addr,
                "size": entry.nbytes,
                "requested_size": entry.nbytes,
                "state": "active_allocated",
                "frames": entry.frames or [],
                "category": entry.category or UNKNOWN_CATEGORY,
                "user_metadata": entry.metadata,
            }
            segments.append(
                {
                    "device": device_index,
                    "address": entry.addr,
                    "total_size": entry.nbytes,
                    "allocated_size": entry.nbytes,
                    "active_size": entry.nbytes,
                    "requested_size": entry.nbytes,
                    "stream": 0,
                    "segment_type": "large" if entry.nbytes > 1024**2 else "small",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": [block],
                }
            )
        trace: list[dict[str, Any]] = []
        for event in list(self._events):
            if event[1] < since_us:
                continue
            kind = event[0]
            if kind == _ALLOC:
                entry = event[2]
                trace.append(self._trace_entry("alloc", entry, event[1], entry.frames or [], entry.metadata))
            elif kind == _FREE:
                entry = event[2]
                trace.append(self._trace_entry("free_requested", entry, event[1], [], event[3]))
                trace.append(self._trace_entry("free_completed", entry, event[1], [], event[3]))
            else:
                oom: OutOfMemoryEvent = event[2]
                trace.append(
                    {
                        "action": "oom",
                        "addr": 0,
                        "size": oom.requested_bytes or 0,
                        "stream": 0,
                        "time_us": oom.time_us,
                        "device_free": 0,
                        "user_metadata": oom.metadata,
                        "frames": oom.frames,
                    }
                )
        if trace:
            # MemoryViz.js colours allocations by `category` and then appends "unknown" to its category list with a
            # typo (`snapshot.categores`) that throws unless "unknown" is already listed: make sure it is, with a
            # `snapshot` marker event, which every reader treats as a no-op.
            trace.append(
                {
                    "action": "snapshot",
                    "addr": 0,
                    "size": 0,
                    "stream": 0,
                    "time_us": time.time_ns() // 1000,
                    "user_metadata": self.metadata,
                    "category": UNKNOWN_CATEGORY,
                    "frames": [],
                }
            )
        device_traces: list[list[dict[str, Any]]] = [[] for _ in range(device_index + 1)]
        device_traces[device_index] = trace
        return {"segments": segments, "device_traces": device_traces, "allocator_settings": {}}

    @staticmethod
    def _trace_entry(action: str, entry: LiveAllocation, time_us: int, frames: list, metadata: str) -> dict[str, Any]:
        return {
            "action": action,
            "addr": entry.addr,
            "size": entry.nbytes,
            "stream": 0,
            "time_us": time_us,
            "user_metadata": metadata,
            "category": entry.category or UNKNOWN_CATEGORY,
            "frames": frames,
        }
