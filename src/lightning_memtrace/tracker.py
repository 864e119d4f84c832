"""A storage-level allocation tracker: exact allocated/peak counters and a snapshot-format history on any device.

The CUDA caching allocator counts its own bytes and records its own history; the CPU allocator (and others) do
neither. :class:`AllocationTracker` gives those devices the same numbers: a ``TorchDispatchMode`` sees every storage
that an operator creates, a weak reference on the storage sees it freed, and a bounded ring buffer keeps the events
in the format of ``torch.cuda.memory._snapshot()``, so that the same readers (``torch.cuda._memory_viz``,
pytorch.org/memory_viz, ``memtrace report``) open them.
"""

from __future__ import annotations

import re
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.frames import Frame, capture_frames

_ALLOC, _FREE, _OOM = 0, 1, 2
#: The category of an allocation that is none of parameters, gradients, optimizer state, inputs or activations.
UNKNOWN_CATEGORY = "unknown"
_RESIZING_OPS = frozenset({"resize_", "resize_as_", "set_", "resize_storage_bytes_"})
_CPU_OOM_PATTERN = re.compile(r"tried to allocate (\d+) bytes")
_CUDA_OOM_PATTERN = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNIT_FACTORS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


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
    tracker = mode.tracker
    try:
        out = func(*args, **kwargs) if kwargs else func(*args)
    except RuntimeError as error:
        if is_out_of_memory(error):
            tracker._record_oom(error)
        raise
    plan = tracker._plans.get(func)
    if plan is None:
        plan = tracker._plan(func)
    fresh, resizing = plan
    if fresh:
        if isinstance(out, Tensor):
            tracker._track_storage(out.untyped_storage())
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
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        max_entries: int = 100_000,
        frames_min_bytes: int = 16 * 1024**2,
        stack_depth: int = 48,
        idle_entries: int = 4096,
    ) -> None:
        self.device = torch.device(device)
        self.allocated = 0
        self.peak = 0
        self.capture_all_frames = False
        self.frames_min_bytes = frames_min_bytes
        self.stack_depth = stack_depth
        self.metadata = ""
        self.stage = "outside"
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
        self._plans: dict[Any, tuple[tuple[int, ...], bool]] = {}
        self._device_type = self.device.type
        self._device_index = (self.device.index or 0) if self.device.type not in ("cpu", "meta") else None
        self._mode: _TrackerMode | None = None
        self._fake_addr = 1 << 44

    # ----------------------------------------------------------------------------------------------- lifecycle
    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is None:
            self._mode = _TrackerMode(self)
            self._mode.__enter__()

    def stop(self) -> None:
        """Leave the dispatch mode; counted storages keep being counted down as they are freed."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

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

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def live_allocations(self) -> list[LiveAllocation]:
        return list(self._live.values())

    def label(self, storages: dict[int, tuple[str, torch.UntypedStorage]]) -> None:
        """Count the storages not counted yet (as :meth:`adopt`) and tag every one with its category.

        Args:
            storages: storage key -> (category, storage), as the category counter names them.
        """
        live = self._live
        for key, (category, storage) in storages.items():
            entry = live.get(key)
            if entry is None:
                self._track_storage(storage, adopted=True)
                entry = live.get(key)
                if entry is None:  # another device, or no bytes
                    continue
            entry.category = str(category)

    def _plan(self, func: Any) -> tuple[tuple[int, ...], bool]:
        """Which outputs of an operator are new storages (no alias in its schema), and whether it resizes one."""
        try:
            returns = func._schema.returns
            fresh = tuple(i for i, ret in enumerate(returns) if ret.alias_info is None)
        except Exception:
            fresh = (0,)
        plan = (fresh, func.overloadpacket.__name__ in _RESIZING_OPS)
        self._plans[func] = plan
        return plan

    def _seen(self, out: Any) -> None:
        if isinstance(out, Tensor):
            self._track_storage(out.untyped_storage())
        elif isinstance(out, (list, tuple)):
            for item in out:
                if isinstance(item, Tensor):
                    self._track_storage(item.untyped_storage())

    def _track_storage(self, storage: torch.UntypedStorage, adopted: bool = False) -> bool:
        key = storage._cdata
        if key in self._live:
            return False
        device = storage.device
        if device.type != self._device_type or (self._device_index is not None and device.index != self._device_index):
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        # Meta and fake storages have no memory; asking fake ones for a pointer warns (and will raise).
        addr = 0 if device.type == "meta" else storage.data_ptr()
        if addr == 0:
            # Meta and fake storages have no address: give each a distinct one so snapshots stay well formed.
            self._fake_addr += 512 + (nbytes + 511) // 512 * 512
            addr = self._fake_addr
        if addr in self._live_addrs:
            # A second storage object over memory already counted (from_blob, shared numpy memory).
            return False
        now = time.time_ns() // 1000
        frames = None
        if self.capture_all_frames or nbytes >= self.frames_min_bytes:
            frames = capture_frames(skip=2, depth=self.stack_depth)
        entry = LiveAllocation(nbytes, addr, now, frames, self.metadata, self.stage)
        ref = weakref.ref(storage, self._freed)
        entry.ref = ref
        self._ref_keys[id(ref)] = key
        self._live[key] = entry
        self._live_addrs[addr] = key
        self.allocated += nbytes
        if self.allocated > self.peak:
            self.peak = self.allocated
        if not adopted:
            self._events.append((_ALLOC, now, entry))
        return True

    def _freed(self, ref: weakref.ref) -> None:
        # One bound method for every storage (no closure per allocation): the weakref's id leads to the storage key.
        key = self._ref_keys.pop(id(ref), None)
        entry = self._live.pop(key, None) if key is not None else None
        if entry is None:
            return
        if self._live_addrs.get(entry.addr) == key:
            del self._live_addrs[entry.addr]
        self.allocated -= entry.nbytes
        self._events.append((_FREE, time.time_ns() // 1000, entry, self.metadata))

    def _refresh_sizes(self, args: tuple) -> None:
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
                self.allocated -= entry.nbytes
                self._events.append((_FREE, time.time_ns() // 1000, entry, self.metadata))
                self._track_storage(storage)

    def _record_oom(self, error: BaseException) -> None:
        message = str(error)
        event = OutOfMemoryEvent(
            requested_bytes=requested_bytes_from_message(message),
            allocated_bytes=self.allocated,
            time_us=time.time_ns() // 1000,
            stage=self.stage,
            metadata=self.metadata,
            frames=capture_frames(skip=3, depth=self.stack_depth),
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
        """Open (or close) a history window: every allocation gets a stack and the ring holds ``max_entries``."""
        self.capture_all_frames = enabled
        size = self.max_entries if enabled else self.idle_entries
        if self._events.maxlen != size:
            self._events = deque(self._events, maxlen=size)

    def events_since(self, since_us: int = 0) -> int:
        return sum(1 for ev in self._events if ev[1] >= since_us)

    def snapshot(self, since_us: int = 0, device_index: int = 0) -> dict[str, Any]:
        """The tracker's state in the dict format of ``torch.cuda.memory._snapshot()``.

        ``segments`` hold one segment per live storage (the CPU allocator has no caching, so reserved equals
        allocated); ``device_traces[device_index]`` holds the events since ``since_us`` (Unix microseconds).
        Allocations and blocks carry ``category`` and ``user_metadata`` (the phase and step they were made in).
        """
        segments = []
        for entry in sorted(self._live.values(), key=lambda e: e.addr):
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
