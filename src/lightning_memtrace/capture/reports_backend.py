"""The allocator-reports backend: the CPU allocator's own reports, read through a profiler session that records nothing
else (CPU only; no Python work per operator; it also counts the temporaries inside operators).

PyTorch's CPU allocator reports every allocation and free (address, size) to the profiler of the calling thread when
that profiler profiles memory. A session with no operator scopes, no shapes and no stacks records only those reports,
in C++, at no Python cost per operator; :class:`AllocatorReports` reads them at each measurement by closing the
session and opening the next one at once (under a paused garbage collector, so nothing is freed in between).

The session belongs to the thread that opened it and is given up to any profiler the user starts: a
``torch.profiler.profile`` opened later takes the thread over, which :meth:`AllocatorReports.drain` notices. Other
threads' allocations reach no session of this thread; each report also carries the allocator's process-wide total,
which shows when another thread frees a block this thread made (a collective's worker thread, under FSDP2 with gloo).

:class:`ReportsBackend` applies the reports to the tracker's counting state, and keeps the *marks*: tiny blocks put
into the report stream where a row was taken, so that the row reads the bytes of that point of the stream later.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from lightning_memtrace.capture import fork_guard, torch_private
from lightning_memtrace.capture.allocation_state import ALLOC, FREE, AllocationState, LiveAllocation, RowMark
from lightning_memtrace.capture.storages import storage_of
from lightning_memtrace.collector import gc_paused
from lightning_memtrace.types import Frame

#: (time in Unix nanoseconds, address, signed size: positive for an allocation, negative for a free)
AllocatorEvent = tuple[int, int, int]


#: How torch's warning starts that an out-of-memory report has no kineto event to pair with (the session traces no
#: CPU operators): it says nothing about the user's run.
_PAIRING_WARNING = "Failed to recover relationship between all profiler"


def _raises_pairing_warning(entry: tuple) -> bool:
    action, message, category = entry[0], entry[1], entry[2]
    return (
        action == "error"
        and (message is None or bool(message.match(_PAIRING_WARNING)))
        and isinstance(category, type)
        and issubclass(UserWarning, category)
    )


@contextlib.contextmanager
def pairing_warning_dropped() -> Iterator[None]:
    """Drop torch's pairing warning (raised as a Python warning when the C++ call returns), show every other one.

    ``warnings.catch_warnings`` and ``filterwarnings`` would do it too, but each change to the filters resets the
    record of warnings already shown once: a warning of the user's that Python shows once would show at every drain,
    several times a step. Showing goes through ``warnings.showwarning``, which is swapped for the call instead. Where
    a filter turns such a warning into an error (``-W error``), the error would end the call and lose its result
    before anything is shown: the filters are changed for the call then, as the lesser harm.
    """
    if any(_raises_pairing_warning(entry) for entry in warnings.filters):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PAIRING_WARNING)
            yield
        return
    shown_before = warnings.showwarning

    def show_unless_pairing(message: Any, category: Any, filename: Any, lineno: Any, *args: Any, **kwargs: Any) -> None:
        if not str(message).startswith(_PAIRING_WARNING):
            shown_before(message, category, filename, lineno, *args, **kwargs)

    warnings.showwarning = show_unless_pairing
    try:
        yield
    finally:
        if warnings.showwarning is show_unless_pairing:  # unless someone else swapped it meanwhile
            warnings.showwarning = shown_before


class ReportColumns(NamedTuple):
    """Reports as three columns, oldest first (no tuple per report: there are thousands per training step)."""

    #: Time of each report, in Unix nanoseconds.
    times: list[int]
    #: Address of each block.
    addrs: list[int]
    #: Signed size of each: positive for an allocation, negative for a free.
    sizes: list[int]

    @classmethod
    def of(cls, events: list[AllocatorEvent]) -> ReportColumns:
        columns = tuple(map(list, zip(*events))) if events else ([], [], [])
        return cls(*columns)

    @classmethod
    def none(cls) -> ReportColumns:
        return cls([], [], [])

_EXTRA_FIELDS = operator.attrgetter("extra_fields")
_START_NS = operator.attrgetter("start_time_ns")
_PTR = operator.attrgetter("ptr")
_SIZE = operator.attrgetter("alloc_size")
_TOTAL = operator.attrgetter("total_allocated")
#: Size of the block that puts a mark into the CPU allocator's report stream (a row, a free seen by weak reference).
#: Odd, so that no tensor's block is this size; the block is freed at once, and neither report is counted.
MARK_BYTES = 4093


class WatchedStorage(weakref.ref):
    """A weak reference to a storage a deferred row named (a batch's input), whose end puts a mark into the report
    stream (see :meth:`ReportsBackend.watch`).

    Attributes:
        addr: The storage's address when watched.
        nbytes: Its bytes then.
        entry: What it was counted as where the stream reached a row that named it (None until then).
    """

    __slots__ = ("addr", "nbytes", "entry")

    def __init__(self, storage: torch.UntypedStorage, callback: Any) -> None:
        super().__init__(storage, callback)
        self.addr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.entry: LiveAllocation | None = None


class SessionLost(RuntimeError):
    """Another profiler took the thread's profiling session over: the reports since the last drain are lost."""


class ReportsUnavailable(RuntimeError):
    """Allocator reports cannot be read here (the message says why)."""


def track_every_cpu_block() -> None:
    """Note every CPU block's size from now on (see :meth:`NativeLogging.track_every_cpu_block`), where possible.

    Called as early as MemTrace is made, so that blocks of the model and data made afterwards are known to a later
    session.
    """
    native = torch_private.native_logging()
    if native is not None:
        native.track_every_cpu_block()


def _process_group_running() -> bool:
    """Whether a ``torch.distributed`` process group is up (gloo's worker threads free blocks this thread made)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def unavailable_reason() -> str | None:
    """Why allocator reports cannot be read here, or None when they can."""
    if torch_private.profiler_api() is None:
        return "this torch has no profiler API for allocator reports"
    if torch_private.native_logging() is None:
        return "this torch does not export the C++ log levels that keep a reports session off the console"
    if torch_private.another_profiler_active():
        return "another profiler is recording on this thread"
    return None


def _accelerator_in_use() -> bool:
    """Whether this process has started an accelerator's allocator (whose reports a CPU session would also get)."""
    if torch.cuda.is_initialized():
        return True
    for name in ("xpu", "mps", "mtia"):
        module = getattr(torch, name, None)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is None:
            if name == "mps" and module is not None and torch.backends.mps.is_available():
                return True
            continue
        try:
            if is_initialized():
                return True
        except Exception:  # a backend that cannot answer: check each report's device
            return True
    return False


class AllocatorReports:
    """One thread's CPU allocator reports, read in order.

    Call :meth:`start`, then :meth:`drain` whenever the reports so far are wanted, and :meth:`stop` at the end.
    """

    def __init__(self, other_threads_blocks: bool = True) -> None:
        native = torch_private.native_logging()
        if torch_private.profiler_api() is None or native is None:
            raise ReportsUnavailable(unavailable_reason() or "allocator reports are unavailable")
        self._session = torch_private.MemoryOnlySession()
        self._native = native
        # Whether the allocator goes on noting other threads' blocks while the session records (their frees of
        # blocks this thread made show in the reports' totals; see _other_threads), at a cost on every allocation.
        self._other_threads_blocks = other_threads_blocks
        self.active = False
        # The CPU allocator's process-wide total after the last report read, while the reports run on unbroken.
        self._last_total: int | None = None
        #: ``(index, bytes)`` for each report of the last drain before which other threads changed the CPU
        #: allocator's total (by ``bytes``: negative where they freed more than they allocated); see :meth:`_events`.
        self.other_threads: list[tuple[int, int]] = []
        # The thread whose session this is, and the results of sessions closed for a fork, not read yet (oldest first).
        self._thread = threading.get_ident()
        self._closed_for_fork: list[Any] = []
        self._reopen_after_fork = False

    def start(self) -> None:
        if self.active:
            return
        reason = unavailable_reason()
        if reason is not None:
            raise ReportsUnavailable(reason)
        # Training frees blocks made before MemTrace started as a matter of course, and the allocator warns on the
        # first such free (see NativeLogging.track_every_cpu_block, which spends that warning where it can).
        native = self._native
        native.track_every_cpu_block()
        self._thread = threading.get_ident()
        self._open()
        self.active = True
        fork_guard.guard(self)
        self._last_total = None  # reports were missed since the last one read (if any)
        native.spend_unknown_free_warning()
        if not self._other_threads_blocks:
            native.note_other_threads_blocks(False)

    def _closed(self) -> None:
        """The session is over here (stopped, or taken over): every block is noted again, as before it."""
        self.active = False
        self._last_total = None
        self._native.note_other_threads_blocks(True)
        fork_guard.unguard(self)

    # ----------------------------------------------------------------------------------------------- forks
    def before_fork(self) -> None:
        """The session's thread forks (a DataLoader starting its workers): close the session, so that the child does
        not inherit it, and keep its reports for the next drain."""
        if not self.active or threading.get_ident() != self._thread or not self.owned():
            return
        with self._native.kineto_silenced(), self._native.c10_silenced(), pairing_warning_dropped():
            self._closed_for_fork.append(self._session.disable())
        self._reopen_after_fork = True

    def after_fork_in_parent(self) -> None:
        if self._reopen_after_fork:
            self._reopen_after_fork = False
            self._open()

    def after_fork_in_child(self) -> None:
        """The child measures nothing: this copy of the session is over (it was closed before the fork), and the
        allocator notes blocks as it did before MemTrace."""
        self.active = False
        self._reopen_after_fork = False
        self._closed_for_fork = []
        self._native.forget_every_cpu_block()

    def _open(self) -> None:
        # Two silenced calls: kineto's first use in the process sets its own level inside the first one.
        with self._native.kineto_silenced():
            self._session.prepare()
        with self._native.kineto_silenced():
            self._session.enable()

    def owned(self) -> bool:
        """The thread's profiling session is still this one (no user profiler took over)."""
        return not torch_private.user_profiler_enabled() and self._session.enabled()

    def drain(self, reopen: bool = True) -> list[AllocatorEvent]:
        """The reports since the last drain, oldest first; the session goes on unless ``reopen`` is False.

        Raises:
            SessionLost: Another profiler took the session over (it is then no longer active here).
        """
        return list(zip(*self.drain_columns(reopen)))

    def drain_columns(self, reopen: bool = True) -> ReportColumns:
        """:meth:`drain`, as columns."""
        if not self.active:
            return ReportColumns.none()
        if not self.owned():
            self._closed()
            raise SessionLost("another profiler took over the profiling session")
        with gc_paused():
            with self._native.kineto_silenced(), self._native.c10_silenced(), pairing_warning_dropped():
                result = self._session.disable()
            if reopen:
                self._open()
            else:
                self._closed()
        if not self._closed_for_fork:
            return self._events(result)
        results, self._closed_for_fork = [*self._closed_for_fork, result], []
        return self._events_of(results)

    def _events_of(self, results: list[Any]) -> ReportColumns:
        """:meth:`_events` of several sessions' results, one after the other (sessions closed for a fork)."""
        times: list[int] = []
        addrs: list[int] = []
        sizes: list[int] = []
        other_threads: list[tuple[int, int]] = []
        for result in results:
            columns = self._events(result)
            other_threads.extend((index + len(times), change) for index, change in self.other_threads)
            times += columns.times
            addrs += columns.addrs
            sizes += columns.sizes
        self.other_threads = other_threads
        return ReportColumns(times, addrs, sizes)

    def _events(self, result: Any) -> ReportColumns:
        allocation_type = self._session.allocation_type
        tree = result.experimental_event_tree()
        # Reading a field of an event costs a C++ call each: map them at C speed, a field at a time.
        fields = list(map(_EXTRA_FIELDS, tree))
        check_device = _accelerator_in_use()
        if check_device or not set(map(type, fields)) <= {allocation_type}:
            # Other events (a record_function range) or other allocators' reports: keep the CPU allocations only.
            kept = [
                (event, f)
                for event, f in zip(tree, fields)
                if type(f) is allocation_type and (not check_device or f.device.type == "cpu")
            ]
            tree, fields = [event for event, _ in kept], [f for _, f in kept]
        times, sizes = list(map(_START_NS, tree)), list(map(_SIZE, fields))
        if not all(map(operator.le, times, times[1:])):
            order = sorted(range(len(times)), key=times.__getitem__)
            times, sizes, fields = [times[i] for i in order], [sizes[i] for i in order], [fields[i] for i in order]
        self.other_threads = self._other_threads(fields, sizes)
        return ReportColumns(times, list(map(_PTR, fields)), sizes)

    def _other_threads(self, fields: list[Any], sizes: list[int]) -> list[tuple[int, int]]:
        """Where other threads changed the CPU allocator's total between this thread's reports, and by how much.

        Each report carries the allocator's total after it, for the whole process (every block's size is noted, see
        :func:`track_every_cpu_block`): between two reports of this thread it moves by the second one's size plus
        whatever other threads allocated and freed meanwhile, such as a collective's worker thread dropping the last
        reference to a block this thread made. Read report by report only where the drain's total does not add up:
        other threads' changes that cancel out within one drain are not seen (a block of this thread's freed there is
        then counted down when its address is handed out again, as without the totals).
        """
        if not fields:
            return []
        previous, last = self._last_total, _TOTAL(fields[-1])
        self._last_total = last
        if previous is None:
            previous = _TOTAL(fields[0]) - sizes[0]
        if previous + sum(sizes) == last:
            return []
        out = []
        for index, (total, size) in enumerate(zip(map(_TOTAL, fields), sizes)):
            if total != previous + size:
                out.append((index, total - previous - size))
            previous = total
        return out

    def stop(self) -> list[AllocatorEvent]:
        """The last reports; closes the session (if it is still this one)."""
        return list(zip(*self.stop_columns()))

    def stop_columns(self) -> ReportColumns:
        """:meth:`stop`, as columns."""
        try:
            return self.drain_columns(reopen=False)
        except SessionLost:
            return ReportColumns.none()
        finally:
            self._closed()  # also where closing broke in C++


class ReportsBackend:
    """Counts the blocks the CPU allocator reports, in the shared state, whenever :meth:`sync` takes the reports in.

    Rows are *deferred* outside a history window: :meth:`mark` puts a mark into the report stream and the row is read
    where :meth:`sync` reaches it, so that the training thread pays for no read between the reads it asks for.
    """

    name = "reports"

    def __init__(self, state: AllocationState) -> None:
        self.state = state
        #: The open session, from a successful :meth:`start` to :meth:`stop` (lost or not).
        self.session: AllocatorReports | None = None
        #: Set when another profiler took the session over (allocated/peak missed what happened meanwhile).
        self.session_lost = False
        #: Python stacks of the operator outputs made since the last read, noted by the dispatch mode inside a history
        #: window: by address, oldest first (see ``_give_frames``).
        self.pending_frames: dict[int, list[list[Frame]]] = {}
        # Marks put into the report stream and not reached yet: (address of the mark's block or None, mark).
        self._marks: deque[tuple[int | None, RowMark | LiveAllocation | WatchedStorage]] = deque()
        self._thread = threading.get_ident()
        # What other threads did to the CPU allocator's total, as far as it is explained, by block size: blocks they
        # allocated (not counted here) and storages counted by weak reference that they freed (counted down by mark).
        self._other_allocations: dict[int, int] = {}
        self._explained_frees: dict[int, int] = {}
        #: Blocks counted down where another thread freed them (address -> (bytes, time of the fall in the total,
        #: µs)), until the address shows again.
        self._freed_elsewhere: dict[int, tuple[int, int]] = {}
        # Bytes (by block size) of blocks freed by other threads that were counted down as another block of that size.
        self._owed: dict[int, int] = {}
        # Whether a fall in the total nothing explains is taken for a block of this thread's that another thread freed.
        self._collective_threads = False

    # ----------------------------------------------------------------------------------------------- lifecycle
    @property
    def active(self) -> bool:
        return self.session is not None and self.session.active

    def start(self) -> None:
        """Open the session on this thread.

        Raises:
            ReportsUnavailable: Reports cannot be read here (CPU only; the installed torch; another profiler).
        """
        if self.state.device_type != "cpu":
            raise ReportsUnavailable(f"allocator reports cover the CPU allocator only, not {self.state.device_type}")
        reason = unavailable_reason()
        if reason is not None:
            raise ReportsUnavailable(reason)
        collective_threads = _process_group_running()
        try:
            session = AllocatorReports(other_threads_blocks=collective_threads)
            session.start()
        except Exception as error:
            raise ReportsUnavailable(f"could not open a profiler session ({error})") from error
        self.session = session
        self.state.defer_free = self.mark
        self._collective_threads = collective_threads

    def stop(self) -> None:
        """Take the last reports in and close the session; every mark not reached yet is reached now."""
        session, self.session = self.session, None
        self.state.defer_free = None
        if session is not None:
            self.apply_columns(session.stop_columns(), session.other_threads)
        self._reach_marks(len(self._marks))

    def sync(self) -> None:
        """Take in the allocator's reports since the last call (and reach the marks among them)."""
        if self.session is None:
            return
        with gc_paused():  # the reports' objects set off none of the training process's collections
            self._sync()

    def _sync(self) -> None:
        session = self.session
        assert session is not None
        try:
            reports = session.drain_columns()
        except SessionLost:
            # A user's profiler took the thread over: reports were lost meanwhile; resume once it is gone.
            self.session_lost = True
            reports = ReportColumns.none()
        except Exception:  # the session broke in C++: counters stand as they are; the recorder warns (session_lost)
            self.session_lost = True
            return
        if not session.active and not torch_private.another_profiler_active():
            try:
                session.start()
            except Exception:  # still not ours to open: try again at the next read
                pass
        self.apply_columns(reports, session.other_threads)
        self._reach_marks(len(self._marks))

    @property
    def reads_every_batch(self) -> bool:
        """A process group runs: its worker threads free blocks this thread made, which only the allocator's totals
        between two reads tell (changes that cancel out within one read go unseen), so read every training batch."""
        return self._collective_threads

    # ----------------------------------------------------------------------------------------------- marks
    def watch(self, storage: torch.UntypedStorage) -> weakref.ref:
        """A weak reference to ``storage`` for the rows that name it; while rows are deferred, its end is marked in
        the report stream.

        A row counts a storage the reports have not shown (memory from elsewhere: a DataLoader worker's shared
        memory, numpy's) where the stream reaches the row, if the storage is still alive then. A batch's inputs may
        be gone by then (rows are read every second or so): a watched one is then counted from the row's mark to
        the mark of its end all the same.
        """
        if self.session is None:
            return weakref.ref(storage)
        return WatchedStorage(storage, self._watched_freed)

    def _watched_freed(self, watched: WatchedStorage) -> None:
        state = self.state
        if self.session is not None and state.defer_free is not None and not state.capture_all_frames:
            self.mark(watched)

    def mark(self, mark: RowMark | LiveAllocation | WatchedStorage) -> None:
        """Put ``mark`` into the allocator's report stream here: it takes effect when :meth:`sync` reaches it.

        A :class:`RowMark` starts its stage and reads its row; a :class:`LiveAllocation` (a storage counted by weak
        reference) is freed, as is a :class:`WatchedStorage` counted after its end. The mark is a block of
        :data:`MARK_BYTES` allocated and freed at once on this thread; a mark made on another thread reaches no report
        stream and takes effect with the next mark after it.
        """
        if threading.get_ident() != self._thread:
            if type(mark) is LiveAllocation:
                sizes = self._explained_frees
                if len(sizes) > 256:  # storages the allocator never noted: their frees move no total
                    sizes.clear()
                sizes[mark.nbytes] = sizes.get(mark.nbytes, 0) + 1
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
            elif type(mark) is WatchedStorage:
                self._reach_watched_end(mark)
            else:
                self.state.count_down(mark)

    def _reach_row(self, row: RowMark) -> None:
        state = self.state
        state.stream_stage, state.stream_metadata = row.stage, row.metadata
        blocks, live, live_addrs = state.blocks, state.live, state.live_addrs
        for ref, _category in row.foreign:
            storage = storage_of(ref)
            if storage is not None:
                if storage.data_ptr() not in blocks:
                    state.track_storage(storage, adopted=True)
                    if type(ref) is WatchedStorage:
                        ref.entry = live.get(storage._cdata)
            elif type(ref) is WatchedStorage and ref.entry is None:
                self._adopt_ended(ref)
        for addr, category in row.labels:
            entry = blocks.get(addr)
            if entry is None:
                key = live_addrs.get(addr)
                entry = live.get(key) if key is not None else None
            if entry is not None:
                entry.category = category
        if row.names:
            state.note_naming()
        row.allocated = allocated = state.allocated
        row.peak = max(state.peak, allocated)
        state.reset_peak()

    def _adopt_ended(self, watched: WatchedStorage) -> None:
        """Count a watched storage that was alive at the row being reached and is gone now: as a block, from here to
        the mark of its end (:meth:`_reach_watched_end`), unless its memory is counted already."""
        state = self.state
        addr = watched.addr
        if addr in state.blocks or addr in state.live_addrs:
            return
        entry = LiveAllocation(
            watched.nbytes, addr, time.time_ns() // 1000, None, state.stream_metadata, state.stream_stage
        )
        state.blocks[addr] = watched.entry = entry
        state.allocated += entry.nbytes
        if state.allocated > state.peak:
            state.peak = state.allocated

    def _reach_watched_end(self, watched: WatchedStorage) -> None:
        """A watched storage ended here: if it was counted after its end, it is counted down now."""
        entry = watched.entry
        if entry is not None and self.state.blocks.get(entry.addr) is entry:
            del self.state.blocks[entry.addr]
            self.state.count_down(entry)

    def _reached_mark(self, reports: ReportColumns, index: int, allocated: int, peak: int) -> bool:
        """Whether the block reported at ``index`` is a mark's (allocated and freed at once, and queued): its marks
        (and those before it that never reached the stream, made on another thread) are reached then, at
        ``allocated`` and ``peak`` bytes."""
        addrs, sizes = reports.addrs, reports.sizes
        addr = addrs[index]
        if not self._marks or index + 1 >= len(addrs) or addrs[index + 1] != addr or sizes[index + 1] != -MARK_BYTES:
            return False
        for position, (mark_addr, _) in enumerate(self._marks):
            if mark_addr == addr:
                self.state.allocated, self.state.peak = allocated, peak
                self._reach_marks(position + 1)
                return True
        return False

    # ----------------------------------------------------------------------------------------------- reports
    def apply(self, events: list[AllocatorEvent], other_threads: list[tuple[int, int]] | None = None) -> None:
        """Count the reported allocations and frees, oldest first, and reach the marks among them.

        Args:
            events: The reports, oldest first.
            other_threads: ``(index, bytes)``: other threads changed the allocator's total by ``bytes`` just before
                ``events[index]`` (see :meth:`AllocatorReports._other_threads`).
        """
        self.apply_columns(ReportColumns.of(events), other_threads)

    def apply_columns(self, reports: ReportColumns, other_threads: list[tuple[int, int]] | None = None) -> None:
        """:meth:`apply`, for reports as columns.

        Runs for every allocation of the training process: the loop keeps to locals (no call per report).
        """
        state = self.state
        blocks, live_addrs, history = state.blocks, state.live_addrs, state.events
        append = history.append
        metadata, stage = state.stream_metadata, state.stream_stage
        with_frames = state.capture_all_frames
        fresh: list[LiveAllocation] = []
        allocated, peak = state.allocated, state.peak
        mark_free: int | None = None
        elsewhere = other_threads or []
        next_elsewhere = elsewhere[0][0] if elsewhere else -1
        elsewhere_at = 0
        freed_elsewhere = self._freed_elsewhere
        for index, (time_ns, addr, size) in enumerate(zip(*reports)):
            if index == next_elsewhere:
                allocated -= self._other_threads_changed(elsewhere[elsewhere_at][1], time_ns // 1000, metadata)
                elsewhere_at += 1
                next_elsewhere = elsewhere[elsewhere_at][0] if elsewhere_at < len(elsewhere) else -1
            if size == MARK_BYTES and self._reached_mark(reports, index, allocated, peak):
                allocated, peak = state.allocated, state.peak
                metadata, stage = state.stream_metadata, state.stream_stage
                mark_free = addr
                continue
            if mark_free == addr and size == -MARK_BYTES:
                mark_free = None
                continue
            now = time_ns // 1000
            if size > 0:
                stale = blocks.pop(addr, None)
                if stale is not None:
                    # Its free happened where no report reached us (another thread, a lost session): the address
                    # being handed out again proves it.
                    allocated -= self._stale_bytes(stale)
                    append((FREE, now, stale, metadata))
                elif freed_elsewhere and addr in freed_elsewhere:
                    del freed_elsewhere[addr]
                if addr in live_addrs:
                    # Already counted: a storage adopted by weak reference before this report was read.
                    continue
                entry = LiveAllocation(size, addr, now, None, metadata, stage)
                if with_frames:
                    fresh.append(entry)
                blocks[addr] = entry
                allocated += size
                if allocated > peak:
                    peak = allocated
                append((ALLOC, now, entry))
            else:
                entry = blocks.pop(addr, None)
                if entry is not None:
                    allocated -= entry.nbytes
                    append((FREE, now, entry, metadata))
                elif freed_elsewhere and addr in freed_elsewhere:
                    allocated -= self._freed_here_after_all(addr, now, metadata)
        state.allocated, state.peak = allocated, peak
        if fresh:
            self._give_frames(fresh)
        self.pending_frames.clear()

    # ----------------------------------------------------------------------------------------------- other threads
    def _other_threads_changed(self, change: int, now: int, metadata: str) -> int:
        """Other threads changed the allocator's total by ``change`` bytes since this thread's previous report: the
        bytes of a counted block they freed (now counted down), or 0.

        A block this thread made and another thread freed (a collective's worker thread dropping the last reference
        to its output) is otherwise counted until its address is handed out again. A fall in the total is matched
        first to what is explained already (a block another thread allocated, a storage counted by weak reference
        that it freed), then, while a process group runs, to the newest counted block of exactly that size (see
        :meth:`_count_down_freed_elsewhere`; a wrong pick is put right when this thread frees it); anything else
        (several changes at once) is left to the address being handed out again. Without a process group there is no
        collective thread to hand blocks to, and a fall is some other thread's own block (one made before the
        session, say), never taken for one of this thread's.
        """
        if change > 0:
            pending = self._other_allocations
            if len(pending) > 4096:  # blocks other threads keep for good: nothing to match them with
                pending.clear()
            pending[change] = pending.get(change, 0) + 1
            return 0
        size = -change
        for explained in (self._explained_frees, self._other_allocations):
            count = explained.get(size)
            if count:
                if count == 1:
                    del explained[size]
                else:
                    explained[size] = count - 1
                return 0
        if self._collective_threads and self._count_down_freed_elsewhere(size, now, now, metadata):
            return size
        return 0

    def _count_down_freed_elsewhere(self, size: int, fell_at: int, now: int, metadata: str) -> bool:
        """Take the newest counted block of ``size`` bytes made by ``fell_at`` (µs) for the one another thread freed
        then: a collective's worker lets go of the buffer of the collective that just ended, the newest of its size
        as a rule. Returns whether there was one (it is then out of the count, freed ``now`` in the history)."""
        blocks = self.state.blocks
        for addr, entry in reversed(blocks.items()):
            if entry.nbytes == size and entry.time_us <= fell_at:
                break
        else:
            return False
        del blocks[addr]
        freed = self._freed_elsewhere
        if len(freed) > 4096:
            freed.clear()
        freed[addr] = (size, fell_at)
        self.state.events.append((FREE, now, entry, metadata))
        return True

    def _freed_here_after_all(self, addr: int, now: int, metadata: str) -> int:
        """This thread freed a block taken for one another thread freed: that thread freed another block of the same
        size made by then, still counted. This free is counted (bytes returned) and that block taken out of the count
        instead; where there is none, the bytes are owed to the first block of that size found freed later."""
        size, fell_at = self._freed_elsewhere.pop(addr)
        if self._count_down_freed_elsewhere(size, fell_at, now, metadata):
            return size
        self._owed[size] = self._owed.get(size, 0) + 1
        return 0

    def _stale_bytes(self, stale: LiveAllocation) -> int:
        """Bytes to count down for a block found freed where no report reached us (0 if counted down already)."""
        owed = self._owed.get(stale.nbytes)
        if not owed:
            return stale.nbytes
        if owed == 1:
            del self._owed[stale.nbytes]
        else:
            self._owed[stale.nbytes] = owed - 1
        return 0

    def _give_frames(self, fresh: list[LiveAllocation]) -> None:
        """Give each new block the stack noted for it: the k-th block made at an address gets the k-th stack noted
        there (the allocator hands an address out again as soon as it is freed). A block no operator returned (a
        temporary inside one) gets the nearest output's stack: the previous one's, else the next one's."""
        pending = self.pending_frames
        last_frames: list[Frame] | None = None
        orphans: list[LiveAllocation] = []
        for entry in fresh:
            noted = pending.get(entry.addr)
            frames = noted.pop(0) if noted else None
            if frames is None:
                entry.frames = last_frames
                if last_frames is None:
                    orphans.append(entry)
            else:
                entry.frames = last_frames = frames
                for orphan in orphans:
                    orphan.frames = frames
                orphans.clear()
