"""The dispatch-mode backend: a ``TorchDispatchMode`` sees every storage an operator makes (any device).

Each new storage is counted in the shared :class:`~lightning_memtrace.capture.allocation_state.AllocationState` with a
weak reference that counts it down when it is freed. Under the reports backend the same mode runs only inside a
history window, and only notes the Python stack of each operator's output for its allocation report.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch import Tensor

from lightning_memtrace.capture import fork_guard, torch_private
from lightning_memtrace.capture.allocation_state import AllocationState
from lightning_memtrace.capture.frames import capture_frames
from lightning_memtrace.capture.grad_sums import SUM, SUM_IN_PLACE, GradSums
from lightning_memtrace.capture.oom_errors import is_out_of_memory
from lightning_memtrace.capture.storages import PLAIN_TENSORS, layout_parts, memory_tensors, wrapped_tensors
from lightning_memtrace.types import Frame


class KernelScratchRule(Protocol):
    """What a kernel holds that the mode cannot see: bytes inside an operator beyond its outputs, outputs sized by the
    kernel, and buffers its library keeps from then on (set by the estimate, whose fake tensors have no kernels:
    :mod:`lightning_memtrace.estimator.kernel_scratch`, :mod:`lightning_memtrace.estimator.blas_workspace`)."""

    def covers(self, func: Any) -> bool: ...

    def after(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> tuple[Any, int, tuple[Tensor, ...]]:
        """The operator's outputs as the kernel sizes them, its scratch bytes beyond them, and the buffers its library
        made on this call and keeps (counted as new memory)."""
        ...


_RESIZING_OPS = frozenset({"resize_", "resize_as_", "set_", "resize_storage_bytes_"})
#: How to call an operator, which of its outputs are new storages, and whether it resizes one of its arguments.
OperatorPlan = tuple[Callable[..., Any], tuple[int, ...], bool]


def _dispatch(mode: _TrackerMode, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    # Every operator on the device comes through here, so the common path (a known operator with one or no new
    # output) is kept to a few attribute reads: the plan is cached by the operator's id (OpOverload's own __hash__ is
    # Python code) and the operator is called through its C++ overload, without OpOverload.__call__'s extra frame.
    backend = mode.backend
    if func is SUM:
        sums = backend.grad_sums
        if sums is not None and sums.returned and sums.in_place(args, kwargs):
            return SUM_IN_PLACE(*args)  # as autograd sums without the mode: no new storage
    plan = backend._plans.get(id(func))
    if plan is None:
        plan = backend._plan(func)
    call, fresh, resizing = plan
    try:
        out = call(*args, **kwargs) if kwargs else call(*args)
    except RuntimeError as error:
        if backend.on_oom is not None and is_out_of_memory(error):
            backend.on_oom(error)
        raise
    try:
        if fresh:
            if type(out) in PLAIN_TENSORS:
                backend._track_output(out)
            elif isinstance(out, Tensor):
                backend._track_memory_of(out)
            elif isinstance(out, (list, tuple)):
                if len(fresh) == 1 and isinstance(out, list):
                    backend._seen(out)
                else:
                    for index in fresh:
                        backend._seen(out[index])
        if resizing:
            backend._refresh_sizes(args)
    except Exception as error:
        # Inside the user's operator: the operator's result goes back to them whatever went wrong in the counting.
        backend.counting_failed(error)
    return out


def _count_nothing(*_: Any) -> None:
    return None


_DISPATCH_SKIPS_DYNAMO = torch_private.skip_dynamo_for(_dispatch.__code__)


class _TrackerMode(torch_private.TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Only fall back to torch's per-call dynamo-disable wrapper where the frame strategy could not be set.
        return not _DISPATCH_SKIPS_DYNAMO

    def __init__(self, backend: DispatchBackend) -> None:
        super().__init__()
        self.backend = backend

    __torch_dispatch__ = _dispatch


class _CompilingMode(_TrackerMode):
    """The mode under which ``torch.compile``'d code compiles and runs compiled, as it would without MemTrace, its
    allocations unseen by the mode: where it only notes stacks (the allocator's reports count), and where the
    counting mode is told so (:attr:`DispatchBackend.compiled_code_compiles`). Under a mode that does not say so,
    dynamo leaves the frame to run eagerly, fails a ``fullgraph=True`` function (torchao's low-bit optimizers compile
    their step so) and marks that code never to be compiled again (torch 2.13 too). torch before 2.9 does not ask."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class DispatchBackend:
    """Counts the storages operators make, by a dispatch mode entered on :meth:`start` (the thread's mode stack).

    Args:
        state: Where the storages are counted.
        on_oom: Called with an out-of-memory error an operator raised (before it propagates), if given.
    """

    name = "dispatch"

    def __init__(self, state: AllocationState, on_oom: Callable[[BaseException], None] | None) -> None:
        self.state = state
        self.on_oom = on_oom
        self._plans: dict[int, OperatorPlan] = {}
        # The plans are keyed by id(): the operators are kept alive so that an id is never reused for another object.
        self._planned_ops: list[Any] = []
        # The state's tables and methods, bound once: the per-operator path reads them as attributes of this object.
        self._live = state.live
        self._live_addrs = state.live_addrs
        self._count = state.count
        self._track_storage = state.track_storage
        self._cpu_only = state.device_type == "cpu"
        self._frames_into: dict[int, list[list[Frame]]] | None = None
        self._mode: _TrackerMode | None = None
        #: The first error counting an operator's outputs raised (counting stops there; see :meth:`counting_failed`).
        self.failure: Exception | None = None
        self._resizes_seen: contextlib.ExitStack | None = None
        #: Autograd's sums of two gradients made in place under the mode, as without it (see :mod:`grad_sums`).
        self.grad_sums: GradSums | None = None
        #: Scratch of the kernels it covers, counted at the peak after the operator's outputs (set before start).
        self.kernel_scratch: KernelScratchRule | None = None
        #: Counting: let ``torch.compile``'d code compile and run compiled under the mode, as without it; what it
        #: allocates inside is not counted, and ``on_compile`` is called whenever dynamo compiles meanwhile. Off (the
        #: default, which the estimate's fake tensors need): compiled code runs eagerly and is counted, and a
        #: ``fullgraph=True`` function fails. Where the mode only notes stacks, compiled code always compiles.
        self.compiled_code_compiles = False
        self.on_compile: Callable[[], None] | None = None
        self._unwatch_compiles: Callable[[], None] | None = None

    def note_frames_into(self, pending: dict[int, list[list[Frame]]]) -> None:
        """Count nothing from now on: note the Python stack of each new output in ``pending``, by address, oldest
        first (for the allocator's reports of the blocks made there, in the same order: an address is handed out again
        many times between two reads); out-of-memory errors are left to the caller (``on_oom`` is dropped)."""
        self._frames_into = pending
        self._track_output = self._note_frames  # type: ignore[method-assign]
        self.on_oom = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    @property
    def active(self) -> bool:
        return self._mode is not None

    def probe_grad_sums(self) -> None:
        """Learn how autograd sums gradients here (:class:`GradSums`), once: before the mode is entered, so that the
        probe's tensors are not counted, and best before any allocator-reports session too (the tracker's
        :meth:`~lightning_memtrace.capture.tracker.AllocationTracker.start`): the probe at a history window's opening
        put frameless blocks at the start of the process's first window snapshot."""
        if self.grad_sums is None:
            self.grad_sums = GradSums.probe()

    def start(self) -> None:
        if self._mode is None:
            self.probe_grad_sums()
            counting = self._frames_into is None
            compiles = not counting or self.compiled_code_compiles
            if counting and compiles and self.on_compile is not None:
                # before the mode: importing dynamo under it would count dynamo's own tensors
                self._unwatch_compiles = torch_private.watch_compiles(self.on_compile)
            self._mode = (_CompilingMode if compiles else _TrackerMode)(self)
            self._mode.__enter__()
            # FSDP2 frees and re-allocates its gathered parameters by resizing their storages, which no operator does.
            self._resizes_seen = contextlib.ExitStack()
            self._resizes_seen.enter_context(torch_private.fsdp2_storage_resizes(self._refresh_resized))
            fork_guard.guard(self)

    def stop(self) -> None:
        self.backward_done()
        fork_guard.unguard(self)
        mode = self._let_go()
        if mode is not None:
            mode.__exit__(None, None, None)

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) runs its operators without the mode, which nothing there will exit."""
        mode = self._let_go()
        if mode is not None:
            torch_private.drop_dispatch_mode(mode)

    def _let_go(self) -> _TrackerMode | None:
        """Stop watching dynamo's compiles and FSDP2's resizes; return the mode, no longer this backend's, to leave."""
        unwatch, self._unwatch_compiles = self._unwatch_compiles, None
        if unwatch is not None:
            unwatch()
        mode, self._mode = self._mode, None
        resizes_seen, self._resizes_seen = self._resizes_seen, None
        if resizes_seen is not None:
            resizes_seen.close()
        return mode

    def watch_backward(self, loss: Tensor) -> None:
        """Before ``loss.backward()`` under the mode: the engine's sums of two gradients made as without it."""
        if self._mode is not None and self.grad_sums is not None:
            self.grad_sums.attach(loss)

    def backward_done(self) -> None:
        if self.grad_sums is not None:
            self.grad_sums.detach()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Operators run inside are not counted (memory of another device, where the estimate emulates a CUDA run:
        ``save_on_cpu``'s host copies). Where another mode is above this one, they are counted as before."""
        mode = self._mode
        if mode is None:
            yield
            return
        with torch_private.dispatch_mode_set_aside(mode):
            yield

    def _refresh_resized(self, tensor: Tensor) -> None:
        if self._mode is not None:
            self._refresh_sizes((tensor,))

    def counting_failed(self, error: Exception) -> None:
        """Count nothing more (an output MemTrace cannot count, say): the operators run on untouched, and the next
        :meth:`sync` raises the first such error, where the recorder's caller (the callback's guarded hook) can take
        it."""
        if self.failure is None:
            self.failure = error
        for name in ("_track_output", "_track_memory_of", "_seen", "_refresh_sizes"):
            setattr(self, name, _count_nothing)

    def sync(self) -> None:
        """Nothing to take in: every storage is counted as its operator returns. Raises where counting failed."""
        if self.failure is not None:
            raise RuntimeError(f"counting the allocations of an operator failed: {self.failure!r}") from self.failure

    # ----------------------------------------------------------------------------------------------- per operator
    def _plan(self, func: Any) -> OperatorPlan:
        range_stage = torch_private.record_function_stage(func)
        if range_stage is not None:
            # record_function's entry and exit: noted as the snapshot's external annotations (as torch does on CUDA).
            plan: OperatorPlan = (self._range_call(torch_private.operator_call(func), range_stage), (), False)
            self._plans[id(func)] = plan
            self._planned_ops.append(func)
            return plan
        call = torch_private.operator_call(func)
        if self.kernel_scratch is not None and self.kernel_scratch.covers(func):
            call = self._with_scratch(call, func, self.kernel_scratch)
        plan = (
            call,
            torch_private.unaliased_outputs(func),
            torch_private.operator_name(func) in _RESIZING_OPS,
        )
        self._plans[id(func)] = plan
        self._planned_ops.append(func)
        return plan

    def _with_scratch(self, call: Callable[..., Any], func: Any, rule: KernelScratchRule) -> Callable[..., Any]:
        """``call``, its outputs as the kernel sizes them, then those counted and the kernel's scratch passed through
        the peak above them."""

        def with_scratch(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            try:
                out, nbytes, kept = rule.after(func, args, kwargs, out)
            except Exception:  # noqa: S110 - the rule's own failure leaves the operator as the mode sees it
                return out
            for buffer in kept:
                self._track_memory_of(buffer)
            if nbytes > 0:
                self._seen(out)
                self.state.pass_through(nbytes)
            return out

        return with_scratch

    def _range_call(self, call: Callable[..., Any], stage: str) -> Callable[..., Any]:
        """``call`` that also notes the start (with the range's name, its first argument) or end of a range."""
        note = self.state.note_range

        def entered(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            name = args[0] if args else kwargs.get("name", "")
            note("START", str(name))
            return out

        def left(*args: Any, **kwargs: Any) -> Any:
            note("END")
            return call(*args, **kwargs)

        return entered if stage == "START" else left

    def _seen(self, out: Any) -> None:
        if isinstance(out, Tensor):
            self._track_memory_of(out)
        elif isinstance(out, (list, tuple)):
            for item in out:
                if isinstance(item, Tensor):
                    self._track_memory_of(item)

    def _track_memory_of(self, tensor: Tensor) -> None:
        if type(tensor) in PLAIN_TENSORS:
            self._track_output(tensor)
            return
        inner = wrapped_tensors(tensor)
        if inner is None:
            self._track_output(tensor)
            return
        # A wrapper (an FSDP2 DTensor): its own storage is no memory, its local tensors are.
        for local in inner:
            self._track_output(local)

    def _track_output(self, tensor: Tensor) -> None:
        """Count the storage of an operator's output: ``AllocationState.track_storage`` without its rare cases.

        A CPU storage an operator has just made has its own address and is not counted yet (unless the operator
        returned an existing one), so only the size check remains on this path.
        """
        cpu_only = self._cpu_only
        if cpu_only and not tensor.is_cpu:
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a sparse tensor: its indices and values hold its memory
            for part in layout_parts(tensor) or ():
                self._track_storage(part.untyped_storage(), skip=3)
            return
        if not cpu_only:
            # Meta storages have no address and other devices are rare here: the general path.
            self._track_storage(storage, skip=3)
            return
        key = storage._cdata
        if key in self._live:
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
        if not tensor.is_cpu:
            return
        try:
            storages = [tensor.untyped_storage()]
        except (NotImplementedError, RuntimeError):  # a sparse tensor: its indices and values are its allocations
            storages = [part.untyped_storage() for part in layout_parts(tensor) or ()]
        for storage in storages:
            if storage.nbytes():
                frames = capture_frames(skip=3, depth=self.state.stack_depth)
                self._frames_into.setdefault(storage.data_ptr(), []).append(frames)  # type: ignore[union-attr]

    def _refresh_sizes(self, args: tuple) -> None:
        if self._frames_into is not None:
            return  # the allocator reports a resize as a free and an allocation
        live = self._live
        for arg in memory_tensors(a for a in args if isinstance(a, Tensor)):
            storage = arg.untyped_storage()
            key = storage._cdata
            entry = live.get(key)
            if entry is None:
                self._track_storage(storage)
                continue
            if storage.nbytes() != entry.nbytes or storage.data_ptr() != entry.addr:
                # Resized in place: account for it as a free of the old block and an alloc of the new one.
                self.state.forget(key, entry)
                self._track_storage(storage)
