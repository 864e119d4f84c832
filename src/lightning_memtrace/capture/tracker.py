"""An allocation tracker: exact allocated/peak counters and a snapshot-format history on any device.

The CUDA caching allocator counts its own bytes and records its own history; the CPU allocator (and others) do
neither. :class:`AllocationTracker` gives those devices the same numbers, from one of two backends: the CPU
allocator's own reports of each allocation and free (``"reports"``, see
:mod:`~lightning_memtrace.capture.reports_backend`), or a ``TorchDispatchMode`` that sees every storage an operator
creates and a weak reference on the storage that sees it freed (``"dispatch"``, any device, see
:mod:`~lightning_memtrace.capture.dispatch_backend`). Both count into one
:class:`~lightning_memtrace.capture.allocation_state.AllocationState`, whose bounded ring buffer keeps the events in
the format of ``torch.cuda.memory._snapshot()``, so that the same readers (``torch.cuda._memory_viz``,
pytorch.org/memory_viz, ``memtrace report``) open them.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_memtrace.capture import torch_private
from lightning_memtrace.capture.allocation_state import (
    OOM,
    AllocationState,
    AllocatorObserver,
    LiveAllocation,
    OutOfMemoryEvent,
    RowMark,
)
from lightning_memtrace.capture.dispatch_backend import DispatchBackend, KernelScratchRule
from lightning_memtrace.capture.frames import capture_frames, traceback_frames
from lightning_memtrace.capture.oom_errors import requested_bytes_from_message
from lightning_memtrace.capture.reports_backend import ReportsBackend, ReportsUnavailable, track_every_cpu_block
from lightning_memtrace.capture.snapshot_builder import build_snapshot
from lightning_memtrace.capture.storages import memory_tensors
from lightning_memtrace.types import Frame

__all__ = ["AllocationTracker", "LiveAllocation", "OutOfMemoryEvent", "RowMark", "TrackerBackend"]


class TrackerBackend(Protocol):
    """What the tracker asks of a backend: see allocations into the shared state between ``start`` and ``stop``."""

    #: ``"dispatch"`` or ``"reports"``.
    name: str

    @property
    def active(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def sync(self) -> None:
        """Bring the shared state up to now (take in what the backend has seen and not counted yet)."""


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
            session that records nothing else (:mod:`~lightning_memtrace.capture.reports_backend`; no Python work
            per operator; it also counts the temporaries inside operators); the dispatch mode then runs only inside
            a history window, to give allocations their Python stacks. ``"auto"``: ``"reports"`` where it can run
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
        #: Backend "reports": run the dispatch mode inside a history window to give allocations their stacks (off
        #: for compiled modules, which a dispatch mode makes run eagerly).
        self.window_stacks = True
        #: The stage (and its snapshot tag) allocations are made in now: see :meth:`set_stage`.
        self.metadata = ""
        self.stage = "outside"
        self.oom_listeners: list[Callable[[OutOfMemoryEvent], None]] = []
        self.max_entries = max(1, int(max_entries))
        # Outside a history window only the last `idle_entries` events are kept (for a post-mortem's recent trace):
        # a large ring of live Python objects would slow every garbage collection of the training process.
        self.idle_entries = max(1, min(int(idle_entries), self.max_entries))
        self._state = AllocationState(self.device, frames_min_bytes, stack_depth, self.idle_entries)
        self._dispatch = DispatchBackend(self._state, on_oom=self._record_oom)
        self._reports = ReportsBackend(self._state)
        # Stopped in this order: the dispatch mode first, then the last reports are read.
        self._backends: tuple[TrackerBackend, ...] = (self._dispatch, self._reports)

    def let_compiled_code_compile(self, on_compile: Callable[[], None]) -> None:
        """Backend "dispatch": ``torch.compile``'d code compiles and runs compiled under the counting mode, as without
        it (else it runs eagerly, and a ``fullgraph=True`` function fails); what it allocates inside is not counted,
        and ``on_compile`` is called whenever dynamo compiles while the mode counts. Set before :meth:`start`."""
        self._dispatch.compiled_code_compiles = True
        self._dispatch.on_compile = on_compile

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.active:
            return
        self._dispatch.probe_grad_sums()  # its tensors: neither counted nor in the reports
        if self.requested_backend != "dispatch":
            try:
                self._reports.start()
            except ReportsUnavailable as unavailable:
                if self.requested_backend == "reports":
                    raise RuntimeError(f"the allocator-reports backend cannot run: {unavailable}") from None
                self.fallback_reason = str(unavailable)
            else:
                self.backend = self._reports.name
                # Inside a history window the dispatch mode only notes the stacks of operator outputs; an
                # out-of-memory error is recorded by note_oom() once it has left the operator (reading the reports
                # inside it would hand the operator's caller a warning of torch's about the session).
                self._dispatch.note_frames_into(self._reports.pending_frames)
                if self._state.capture_all_frames and self._notes_stacks_now():
                    self._dispatch.start()
                return
        self.backend = self._dispatch.name
        self._dispatch.start()

    @property
    def active(self) -> bool:
        return any(backend.active for backend in self._backends)

    def stop(self) -> None:
        """Stop seeing new allocations; storages counted by weak reference keep being counted down as they are freed."""
        for backend in self._backends:
            backend.stop()

    def sync(self) -> None:
        """Take in the allocator's reports since the last call (backend "reports"; nothing to do otherwise)."""
        for backend in self._backends:
            backend.sync()

    def __enter__(self) -> AllocationTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def session_lost(self) -> bool:
        """Another profiler took the reports session over (allocated/peak missed what happened meanwhile)."""
        return self._reports.session_lost

    @property
    def deferring(self) -> bool:
        """Rows are read where the report stream reaches their marks (backend "reports", outside a history window)."""
        return self._reports.session is not None and not self._state.capture_all_frames

    @property
    def reads_every_batch(self) -> bool:
        """The reports must be read at the end of every training batch: a process group runs, whose worker threads
        free blocks this thread made (see :meth:`ReportsBackend.reads_every_batch
        <lightning_memtrace.capture.reports_backend.ReportsBackend.reads_every_batch>`)."""
        return self._reports.reads_every_batch

    def watch(self, storage: torch.UntypedStorage) -> weakref.ref:
        """A weak reference to ``storage`` whose end is marked in the report stream while rows are deferred.

        See :meth:`ReportsBackend.watch <lightning_memtrace.capture.reports_backend.ReportsBackend.watch>`.
        """
        return self._reports.watch(storage)

    @property
    def capture_all_frames(self) -> bool:
        """Every allocation gets a Python stack (inside a history window), not only large ones."""
        return self._state.capture_all_frames

    @capture_all_frames.setter
    def capture_all_frames(self, enabled: bool) -> None:
        self._state.capture_all_frames = enabled

    def set_stage(self, stage: str, metadata: str) -> None:
        """Allocations from now on belong to ``stage`` (tagged ``metadata``).

        While :attr:`deferring`, the stage changes in the report stream at the next :meth:`mark` (which carries it).
        """
        self.stage, self.metadata = stage, metadata
        if not self.deferring:
            self._state.stream_stage, self._state.stream_metadata = stage, metadata

    def mark(self, mark: RowMark | LiveAllocation) -> None:
        """Put ``mark`` into the allocator's report stream here: it takes effect when :meth:`sync` reaches it.

        See :meth:`ReportsBackend.mark <lightning_memtrace.capture.reports_backend.ReportsBackend.mark>`.
        """
        self._reports.mark(mark)

    # ----------------------------------------------------------------------------------------------- counting
    def adopt(self, tensor_or_storage: Tensor | torch.UntypedStorage) -> bool:
        """Count a storage that exists already (parameters, a batch made before tracking). True if it was new."""
        if not isinstance(tensor_or_storage, Tensor):
            return self._state.track_storage(tensor_or_storage, adopted=True)
        new = False
        for tensor in memory_tensors([tensor_or_storage]):  # a DTensor: its local shard
            new = self._state.track_storage(tensor.untyped_storage(), adopted=True) or new
        return new

    def hold_unseen(self, nbytes: int, frames: list[Frame] | None, category: str) -> None:
        """Count ``nbytes`` that exist already and that no storage leads to, as one block of ``category`` (see
        :meth:`~lightning_memtrace.capture.allocation_state.AllocationState.hold_unseen`)."""
        self.sync()
        self._state.hold_unseen(int(nbytes), frames, category)

    def label(self, storages: dict[int, tuple[str, torch.UntypedStorage]]) -> None:
        """Count the storages not counted yet (as :meth:`adopt`) and tag every one with its category.

        Reports not taken in yet are not read here (call :meth:`sync` first): a storage adopted before its report is
        read is recognized by its address then, and counted once.

        Args:
            storages: storage key -> (category, storage), as the category counter names them.
        """
        self._state.label(storages)

    @property
    def allocated(self) -> int:
        """Bytes counted as live now (backend "reports": after taking in the reports so far)."""
        self.sync()
        return self._state.allocated

    @property
    def peak(self) -> int:
        """Highest :attr:`allocated` since the last :meth:`reset_peak`."""
        self.sync()
        return self._state.peak

    def counted_addresses(self) -> tuple[Mapping[int, Any], Mapping[int, Any]]:
        """The addresses whose memory is counted, as two mappings: blocks the allocator reported, and storages counted
        by weak reference (to test many addresses without a call each; they change as the tracker counts)."""
        return self._state.blocks, self._state.live_addrs

    def counters(self) -> tuple[int, int]:
        """(allocated, peak) as they stand, without taking in new reports (see :meth:`sync`)."""
        return self._state.allocated, self._state.peak

    def reset_peak(self) -> None:
        self._state.reset_peak()

    @property
    def max_allocated(self) -> int:
        """Highest :attr:`allocated` since the tracker was made (peak resets do not touch it)."""
        return self._state.max_allocated

    def live_allocations(self) -> list[LiveAllocation]:
        self.sync()
        return self._state.entries()

    # ----------------------------------------------------------------------------------------------- out of memory
    def note_oom(self, error: BaseException) -> None:
        """Record an out-of-memory error that the tracker did not see raised (backend "reports", outside a window).

        The allocator does not report a failed allocation: the stack comes from the error's traceback.
        """
        self.sync()
        self._record_oom(error, frames=traceback_frames(error, self._state.stack_depth))

    def _record_oom(self, error: BaseException, frames: list[Frame] | None = None) -> None:
        message = str(error)
        event = OutOfMemoryEvent(
            requested_bytes=requested_bytes_from_message(message),
            allocated_bytes=self._state.allocated,
            time_us=time.time_ns() // 1000,
            stage=self.stage,
            metadata=self.metadata,
            frames=frames if frames is not None else capture_frames(skip=3, depth=self._state.stack_depth),
            message=message.splitlines()[0] if message else "",
        )
        self._state.events.append((OOM, event.time_us, event))
        for listener in list(self.oom_listeners):
            try:
                listener(event)
            except Exception:  # a listener's failure must not replace the out-of-memory error being raised
                pass

    # ----------------------------------------------------------------------------------------------- export
    def watch_backward(self, loss: Tensor) -> None:
        """Before ``loss.backward()``: where the dispatch mode runs, autograd's sums of two gradients are made in place
        as without it (:mod:`~lightning_memtrace.capture.grad_sums`)."""
        self._dispatch.watch_backward(loss)

    def backward_done(self) -> None:
        """After the backward (or at the batch's end where it failed)."""
        self._dispatch.backward_done()

    def uncounted(self) -> contextlib.AbstractContextManager[None]:
        """Under backend "dispatch": operators run inside are not counted (see :meth:`DispatchBackend.uncounted`)."""
        return self._dispatch.uncounted()

    def count_kernel_scratch(self, rule: KernelScratchRule) -> None:
        """Under backend "dispatch", count what ``rule`` gives for the operators it covers: at the peak, the scratch
        their kernels take and free inside them; from then on, the buffers their libraries keep; set before
        :meth:`start`."""
        self._dispatch.kernel_scratch = rule

    def drive_allocator(self, allocator: AllocatorObserver | None) -> None:
        """Tell ``allocator`` (a model of a device's allocator) of every allocation and free counted from now on."""
        self._state.allocator = allocator

    def _notes_stacks_now(self) -> bool:
        """Whether the history window runs the dispatch mode that notes stacks (backend "reports"). Not where torch
        cannot let compiled code compile under a mode (before 2.9) once dynamo has compiled anything in this process:
        the mode would fail a ``fullgraph=True`` function and leave any other to run eagerly for the rest of the run."""
        return self.window_stacks and (
            torch_private.dispatch_modes_let_compiled_code_compile() or not torch_private.dynamo_compiled_anything()
        )

    def record_history(self, enabled: bool) -> None:
        """Open (or close) a history window: every allocation gets a stack and the ring holds ``max_entries``.

        Under backend "reports" the dispatch mode runs only inside the window, to note those stacks.
        """
        state = self._state
        if self._reports.session is not None:
            self.sync()  # reports up to now belong outside (or inside) the window that is closing (or opening)
            state.stream_stage, state.stream_metadata = self.stage, self.metadata
            if enabled and self._notes_stacks_now():
                state.open_ranges.clear()  # the mode saw no range open or close since it last ran
                self._dispatch.start()
            else:
                self._dispatch.stop()
        state.capture_all_frames = enabled
        state.resize_history(self.max_entries if enabled else self.idle_entries)

    def events_since(self, since_us: int = 0) -> int:
        self.sync()
        return sum(1 for ev in self._state.events if ev[1] >= since_us)

    def snapshot(self, since_us: int = 0, device_index: int = 0) -> dict[str, Any]:
        """The tracker's state in the dict format of ``torch.cuda.memory._snapshot()`` (see
        :mod:`~lightning_memtrace.capture.snapshot_builder`); the trace holds the events since ``since_us``."""
        self.sync()
        state = self._state
        return build_snapshot(
            state.entries(),
            list(state.events),
            since_us,
            device_index,
            self.metadata,
            list(state.annotations),
            list(state.naming_points),
        )
