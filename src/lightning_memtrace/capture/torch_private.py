"""Every private torch entry point the capture package uses, each behind its availability check or version guard.

Private names change between torch releases without notice: each one is looked up here, at call time where tests or a
newer torch may replace it, and the callers get a plain function (or None where the installed torch lacks it) so that
they can keep their fallback: allocator reports → the dispatch mode, CUDA history → no snapshot, and so on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.capture import fork_guard

__all__ = ["TorchDispatchMode"]  # the dispatch backend's base class (torch.utils._python_dispatch)


# ----------------------------------------------------------------------------------------------- dispatch mode
def skip_dynamo_for(code: Any) -> bool:
    """Tell dynamo never to compile ``code`` nor anything it calls, without a per-call wrapper.

    ``torch._disable_dynamo`` (what TorchDispatchMode wraps handlers in) costs several microseconds on every operator;
    a frame strategy set once on the code object costs nothing per call. False where this torch has no such strategy.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        return True
    except Exception:  # any torch without the API (ImportError, AttributeError, TypeError): the per-call wrapper
        return False


def watch_compiles(callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback`` whenever dynamo starts compiling, until the returned function is called (it stops that);
    None where this torch has no compile callbacks."""
    try:
        from torch._dynamo.callback import callback_handler
    except Exception:  # any torch without them (ImportError, AttributeError): nothing is watched
        return None

    def started(_: Any) -> None:
        callback()

    callback_handler.register_start_callback(started)

    def stop_watching() -> None:
        with contextlib.suppress(ValueError):  # cleared by dynamo's own reset meanwhile
            callback_handler.remove_start_callback(started)

    return stop_watching


def dispatch_modes_let_compiled_code_compile() -> bool:
    """Whether a dispatch mode can let ``torch.compile``'d code compile and run compiled under it
    (``ignore_compile_internals``, torch 2.9 and later); before, dynamo runs any code under a mode eagerly."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


def dynamo_compiled_anything() -> bool:
    """Whether dynamo has compiled a graph in this process (its counters, which ``torch._dynamo.reset`` keeps)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    try:
        return bool(counters is not None and counters["stats"]["unique_graphs"])
    except Exception:  # a torch whose counters look otherwise: as if nothing was compiled
        return False


def operator_call(func: Any) -> Callable[..., Any]:
    """The operator's C++ overload (``OpOverload._op``), callable without ``OpOverload.__call__``'s extra frame."""
    call = getattr(func, "_op", None)
    return call if callable(call) else func


def unaliased_outputs(func: Any) -> tuple[int, ...]:
    """Indices of the operator's outputs that alias no input in its schema (new storages); (0,) when unknown."""
    try:
        return tuple(i for i, ret in enumerate(func._schema.returns) if ret.alias_info is None)
    except Exception:  # not an OpOverload (a Python op, a HOP): assume its first output is new
        return (0,)


def operator_name(func: Any) -> str | None:
    try:
        return func.overloadpacket.__name__
    except Exception:  # no overload packet: not one of the resizing aten ops
        return None


#: The operators ``torch.profiler.record_function`` (``torch.autograd.profiler.record_function``) calls on entering
#: and leaving its range, by overload packet name: the stage of the annotation each one makes.
_RECORD_FUNCTION_OPS = {
    "_record_function_enter_new": "START",
    "_record_function_enter": "START",
    "_record_function_exit": "END",
}


def record_function_stage(func: Any) -> str | None:
    """``"START"`` / ``"END"`` for the profiler operators that enter / leave a ``record_function`` range (which a
    dispatch mode sees like any operator), None for every other operator or where this torch names them otherwise."""
    try:
        if func.namespace != "profiler":
            return None
    except Exception:  # not an OpOverload
        return None
    return _RECORD_FUNCTION_OPS.get(operator_name(func) or "")


# ----------------------------------------------------------------------------------------------- profiler session
@functools.cache
def profiler_api() -> tuple[Any, Any] | None:
    """``(torch._C._autograd, torch._C._profiler)`` where they have everything a reports session calls, else None."""
    try:
        from torch._C import _autograd as autograd_api
        from torch._C import _profiler as profiler_api
    except ImportError:
        return None
    needed = {
        autograd_api: ("_prepare_profiler", "_enable_profiler", "_disable_profiler", "_profiler_enabled"),
        profiler_api: (
            "ProfilerConfig", "ProfilerState", "ProfilerActivity", "RecordScope", "_ExperimentalConfig",
            "_ExtraFields_Allocation",
        ),
    }
    if all(hasattr(module, name) for module, names in needed.items() for name in names):
        return autograd_api, profiler_api
    return None


def user_profiler_enabled() -> bool:
    """A ``torch.autograd.profiler.profile`` (what ``torch.profiler`` wraps) is open in this process."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def another_profiler_active() -> bool:
    """A profiler (``torch.profiler``, ``torch.autograd.profiler``, or a raw session) is recording on this thread."""
    if user_profiler_enabled():
        return True
    api = profiler_api()
    return api is not None and bool(api[0]._profiler_enabled())


def _privateuse1_in_use() -> bool:
    return torch._C._get_privateuse1_backend_name() != "privateuseone"


def _quiet_activity(profiler: Any) -> Any:
    """A profiler activity whose device this machine does not use.

    Memory reports come with any activity; with CPU's, the session would also hook every operator and build a trace
    of them when it closes (twice the cost).
    """
    for name, module_name in (("MTIA", "mtia"), ("HPU", "hpu"), ("PrivateUse1", None), ("XPU", "xpu")):
        activity = getattr(profiler.ProfilerActivity, name, None)
        if activity is None:
            continue
        module = getattr(torch, module_name, None) if module_name else None
        try:
            in_use = bool(module is not None and module.is_available())
        except Exception:  # a backend that cannot answer: treat it as in use
            in_use = True
        if module_name is None:
            in_use = _privateuse1_in_use()
        if not in_use:
            return activity
    return profiler.ProfilerActivity.CPU


class MemoryOnlySession:
    """The raw calls of a profiler session that records the allocators' reports and nothing else.

    Raises:
        RuntimeError: This torch has no profiler API for allocator reports (check :func:`profiler_api` first).
    """

    def __init__(self) -> None:
        api = profiler_api()
        if api is None:
            raise RuntimeError("this torch has no profiler API for allocator reports")
        self._autograd, profiler = api
        self.config = profiler.ProfilerConfig(
            profiler.ProfilerState.KINETO, False, True, False, False, False, profiler._ExperimentalConfig()
        )
        self.activities = {_quiet_activity(profiler)}
        # A scope no training code opens: operators and record_function ranges stay unrecorded.
        self.scopes = {profiler.RecordScope.LITE_INTERPRETER}
        #: The type of an allocation report's ``extra_fields``.
        self.allocation_type = profiler._ExtraFields_Allocation

    def prepare(self) -> None:
        self._autograd._prepare_profiler(self.config, self.activities)

    def enable(self) -> None:
        self._autograd._enable_profiler(self.config, self.activities, self.scopes)

    def disable(self) -> Any:
        """Close the session: its result, whose ``experimental_event_tree()`` holds the reports."""
        return self._autograd._disable_profiler()

    def enabled(self) -> bool:
        return bool(self._autograd._profiler_enabled())


# ----------------------------------------------------------------------------------------------- C++ log levels
class NativeLogging:
    """The C++ log levels that a reports session would otherwise write to the console through.

    Kineto, the profiler library under the session, logs each start and stop of a trace ("profiler_start",
    "Completed Stage: ...") at levels that its own setting never hides; the CPU allocator logs one warning for the
    first (and every 1000th) free of a block it has no size for. Both levels are plain integers exported by torch's
    shared libraries: raising them for the few microseconds of MemTrace's own calls, on its own thread, silences
    exactly those lines and nothing that anyone else logs.
    """

    #: Above every kineto and c10 severity.
    SILENT = 1000

    def __init__(self, kineto_severity: ctypes.c_int, c10_log_level: ctypes.c_int, report_cpu: ctypes.c_bool) -> None:
        self._kineto = kineto_severity
        self._c10 = c10_log_level
        self._report_cpu = report_cpu
        #: Whether this process has spent the CPU allocator's first "unknown size" warning (it logs the 1st, 1001st,
        #: ... such free).
        self.unknown_free_warning_spent = False
        # Whether MemTrace turned the noting of every block on (a setting of the user's own is never changed), and
        # whether it is paused now, while a session notes this thread's blocks (see note_other_threads_blocks).
        self._noting_every_block = False
        self._noting_paused = False

    def kineto_silenced(self) -> contextlib.AbstractContextManager[None]:
        # The first session of the process initializes kineto inside the call, which sets kineto's own level (what
        # the user's profilers get from now on): that one is kept.
        return _raised(self._kineto, self.SILENT, keep_changed=True)

    def c10_silenced(self) -> contextlib.AbstractContextManager[None]:
        return _raised(self._c10, self.SILENT, keep_changed=False)

    def track_every_cpu_block(self) -> None:
        """Have the CPU allocator note every block's size from now on, on every thread, also while no session records.

        The allocator warns (on the 1st, 1001st, ... occasion) when a session sees a block freed whose size it never
        noted: a block made while no session was open, such as one of an earlier run in the same process. Noting
        every block costs the allocator a table insert and a formatted INFO line (built, then dropped by the log
        level) per allocation and free, about 0.7 µs; it stays on for the rest of the process, since a block made
        while it is off is unknown whenever it is freed, but pauses while a session notes this thread's blocks (see
        :meth:`note_other_threads_blocks`). Once on, the allocator checks every free, session
        or not: the first warning is spent here, silenced, on a block made for the purpose. The allocator also logs
        each block at INFO level then, so it is never turned on where the C++ log level shows INFO lines.
        """
        if self._noting_every_block:
            self.note_other_threads_blocks(True)
            return
        if self._report_cpu.value or self._c10.value <= 0:
            return
        self._report_cpu.value = True
        self._noting_every_block = True
        fork_guard.guard(self)
        self.spend_unknown_free_warning()

    def note_other_threads_blocks(self, enabled: bool) -> None:
        """Pause (``enabled=False``) or resume the noting of every block that :meth:`track_every_cpu_block` turned on.

        While a session records on this thread, the allocator notes this thread's blocks for the session anyway; the
        setting then adds only the blocks of other threads, and a formatted INFO log line for every allocation and
        free (dropped by the log level, but built first): about 0.7 µs on each, the largest cost of a session where
        nothing needs other threads' blocks (no collective's worker thread frees blocks this thread made). A
        setting MemTrace did not make is left alone.
        """
        if not self._noting_every_block or self._noting_paused == (not enabled):
            return
        self._noting_paused = not enabled
        self._report_cpu.value = enabled

    def after_fork_in_child(self) -> None:
        self.forget_every_cpu_block()

    def forget_every_cpu_block(self) -> None:
        """Stop noting every block where :meth:`track_every_cpu_block` turned it on (in a forked child, which MemTrace
        does not measure: as before MemTrace)."""
        if self._noting_every_block:
            self._report_cpu.value = False
            self._noting_every_block = self._noting_paused = False

    def spend_unknown_free_warning(self) -> None:
        """Free an unknown block, silenced, once per process: the allocator's first "unknown size" warning is spent.

        The allocator checks a free only while it notes blocks or a session records: call it in one of those states.
        """
        if self.unknown_free_warning_spent:
            return
        self.unknown_free_warning_spent = True
        block = self._unknown_block()
        with self.c10_silenced():
            del block

    def _unknown_block(self) -> torch.Tensor:
        """A block whose size the CPU allocator does not note (freeing it under a session is an "unknown" free)."""
        previous = self._report_cpu.value
        self._report_cpu.value = False
        try:
            return torch.empty(1, dtype=torch.uint8)
        finally:
            self._report_cpu.value = previous


@contextlib.contextmanager
def _raised(level: ctypes.c_int, value: int, keep_changed: bool) -> Iterator[None]:
    """Set a C++ log level to ``value`` for the block; restore it after (or keep what the block set, if asked)."""
    previous = level.value
    level.value = value
    try:
        yield
    finally:
        if keep_changed and level.value != value:
            previous = level.value
        level.value = previous


def _library(name: str) -> ctypes.CDLL | None:
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for pattern in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        path = os.path.join(folder, pattern)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


@functools.cache
def native_logging() -> NativeLogging | None:
    """The C++ log levels of this torch's shared libraries, or None where it does not export them."""
    torch_cpu, c10 = _library("torch_cpu"), _library("c10")
    if torch_cpu is None or c10 is None:
        return None
    try:
        return NativeLogging(
            ctypes.c_int.in_dll(torch_cpu, "_ZN9libkineto6Logger14severityLevel_E"),
            ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level"),
            ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage"),
        )
    except (ValueError, OSError):
        return None


# ----------------------------------------------------------------------------------------------- CUDA allocator
def reference_counts(tensor: Any) -> tuple[int, int, int] | None:
    """The tensor's C++ reference count, its storage's, and its Python object's (a Python object holds one C++
    reference however many hold it: a user's list keeping the tensor shows only in the third); None where this torch
    cannot tell the first two."""
    python_count = sys.getrefcount(tensor)
    use_count = getattr(torch.Tensor, "_use_count", None)
    storage_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or storage_count is None:
        return None
    return use_count(tensor), storage_count(tensor.untyped_storage()._cdata), python_count


def cuda_history_supported() -> bool:
    memory = getattr(torch.cuda, "memory", None)
    return (
        torch.cuda.is_available()
        and memory is not None
        and hasattr(memory, "_record_memory_history")
        and hasattr(memory, "_snapshot")
    )


def cuda_history_enabled() -> bool:
    """Whether the CUDA caching allocator records its history already (the user's own ``_record_memory_history``);
    False where this torch cannot tell."""
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if probe is None:
        return False
    try:
        return bool(probe())
    except Exception:  # CUDA not initialised or not built: nothing records
        return False


def start_cuda_history(max_entries: int) -> None:
    """Record alloc/free events with Python stacks into a ring buffer of ``max_entries`` events."""
    record = torch.cuda.memory._record_memory_history
    parameters = inspect.signature(record).parameters
    impl_parameters = _record_impl_parameters()
    if "enabled" in parameters and "stacks" in impl_parameters:
        # Where torch offers it, each event also carries the torch.compile context it was made in
        # (``compile_context``); record_function ranges are written as ``external_annotations`` by torch itself.
        extra = {"compile_context": True} if "compile_context" in impl_parameters else {}
        record(enabled="all", context="all", stacks="python", max_entries=max_entries, **extra)
    elif "enabled" in parameters:
        record(enabled="all", max_entries=max_entries)
    else:  # torch < 2.1: the legacy boolean signature
        record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=True)


def _record_impl_parameters() -> dict[str, Any]:
    impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    return dict(inspect.signature(impl).parameters) if impl is not None else {}


def stop_cuda_history() -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except TypeError:  # torch < 2.1: the legacy boolean signature
        torch.cuda.memory._record_memory_history(False)


def cuda_snapshot() -> dict[str, Any]:
    return torch.cuda.memory._snapshot()


def set_allocation_metadata(text: str) -> bool:
    """Tag the CUDA allocations made from now on (``user_metadata`` in snapshots) where torch supports it."""
    setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
    if setter is None or not torch.cuda.is_available():
        return False
    try:
        setter(text)
        return True
    except Exception:  # a torch whose setter refuses (no CUDA context yet, another signature): no tag
        return False


@functools.lru_cache(maxsize=None)
def _top_saved_tensors_hooks() -> Any:
    """torch's reader of the innermost saved-tensor hooks, as a call without arguments, or None (before torch 2.8)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        top(True)  # ignore_is_tracing: the hooks in force at run time, also while dynamo traces
    except TypeError:  # a torch whose reader takes no argument
        return top
    except Exception:
        return None
    return functools.partial(top, True)


def drop_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off this thread's dispatch mode stack, wherever it is in it, the modes above it kept in order (in
    a forked child, where nothing will exit it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    above = []
    while _get_current_dispatch_mode_stack():
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        _push_mode(other)


@contextlib.contextmanager
def dispatch_mode_set_aside(mode: TorchDispatchMode) -> Iterator[bool]:
    """While inside, ``mode`` is off this thread's dispatch mode stack if it is on top of it (the modes under it still
    apply); yields whether it was. Put back on top on the way out."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if _get_current_dispatch_mode() is not mode:
        yield False
        return
    with _pop_mode_temporarily():
        yield True


def can_tell_saved_tensors_hooks() -> bool:
    """Whether this torch tells which saved-tensor hooks are in force (before torch 2.8 it cannot)."""
    return _top_saved_tensors_hooks() is not None


def saved_tensors_hooks_in_force() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The ``(pack, unpack)`` saved-tensor hooks autograd applies now (the innermost ``saved_tensors_hooks``, such as
    a user's ``save_on_cpu`` around the fit), or None: none, or this torch cannot tell (see
    :func:`saved_tensors_hooks_pushed`)."""
    top = _top_saved_tensors_hooks()
    if top is None:
        return None
    try:
        hooks = top()
    except Exception:  # a torch whose reader breaks: as if none
        return None
    return hooks if hooks is not None and len(hooks) == 2 else None


def saved_tensors_hooks_pushed() -> bool:
    """Whether any saved-tensor hooks are pushed on this thread, on every torch (also where it cannot tell which).

    Disabling the hooks raises where any are pushed: that is the question, asked with the thread's own setting put
    back at once (the error message, if the hooks were disabled already, else enabled).
    """
    autograd = torch._C._autograd
    before = autograd._saved_tensors_hooks_get_disabled_error_message()
    try:
        autograd._saved_tensors_hooks_disable("MemTrace asks whether saved-tensor hooks are pushed")
        pushed = False
    except RuntimeError:
        pushed = True
    finally:
        if before is None:
            autograd._saved_tensors_hooks_enable()
        else:
            with contextlib.suppress(RuntimeError):  # it raises where hooks are pushed, after setting the message
                autograd._saved_tensors_hooks_disable(before)
    return pushed


# The notes of the recorders whose hooks are pushed, innermost last (an estimate inside a fit pushes over the fit's).
_SAC_NOTES: list[Callable[[torch.Tensor], None]] = []
_VERSION_WRAPPER_INIT: Callable[..., None] | None = None


def _noted_version_wrapper_init(self: Any, val: Any) -> None:
    _VERSION_WRAPPER_INIT(self, val)  # type: ignore[misc]
    if _SAC_NOTES and isinstance(val, torch.Tensor):
        _SAC_NOTES[-1](val, self)  # saved for as long as SAC keeps the wrapper


def note_sac_saves(note: Callable[[torch.Tensor, Any], None]) -> None:
    """Until :func:`stop_noting_sac_saves`, hand ``note`` each tensor that selective activation checkpointing
    (``create_selective_checkpoint_contexts``) keeps for the backward, and the ``_VersionWrapper`` it keeps it in: it
    keeps the outputs its policy saves in a store of its own, which no saved-tensor hook sees. Nothing where this
    torch has no SAC."""
    global _VERSION_WRAPPER_INIT
    wrapper = getattr(sys.modules.get("torch.utils.checkpoint"), "_VersionWrapper", None)
    if wrapper is None:
        return
    if not _SAC_NOTES:
        _VERSION_WRAPPER_INIT = wrapper.__init__
        wrapper.__init__ = _noted_version_wrapper_init
    _SAC_NOTES.append(note)


def stop_noting_sac_saves(note: Callable[[torch.Tensor, Any], None]) -> None:
    """Stop handing ``note`` the tensors SAC keeps; torch's ``_VersionWrapper`` is as it was once no note is left."""
    global _VERSION_WRAPPER_INIT
    with contextlib.suppress(ValueError):  # never added: a torch without SAC
        _SAC_NOTES.remove(note)
    if not _SAC_NOTES and _VERSION_WRAPPER_INIT is not None:
        wrapper = getattr(sys.modules.get("torch.utils.checkpoint"), "_VersionWrapper", None)
        if wrapper is not None:
            wrapper.__init__ = _VERSION_WRAPPER_INIT
        _VERSION_WRAPPER_INIT = None


def queue_backward_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward running now ends, on the thread that finishes it; False outside one."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        return True
    except Exception:  # called outside a backward, or a torch without the engine's callback queue
        return False


def in_backward() -> bool:
    """Whether this thread runs autograd's backward now (a CUDA backward runs on autograd's own device thread)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def operator_names() -> list[str]:
    """The qualified names (``aten::softmax.int``) of every operator torch's dispatcher knows."""
    return list(torch._C._dispatch_get_all_op_names())


def has_autocast_kernel(qualified_name: str, device_type: str) -> bool:
    """Whether ``device_type``'s autocast (``"cpu"``, ``"cuda"``) has a kernel of its own for the operator (a CPU-only
    build knows CUDA's too)."""
    key = "Autocast" + device_type.upper()
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, key))
    except Exception:  # a name or key this torch does not know
        return False


def argument_names(func: Any) -> list[str]:
    """The names of an operator overload's arguments, in its schema's order."""
    return [argument.name for argument in func._schema.arguments]


def autocast_off(device_type: str) -> Any:
    """A context in which ``device_type``'s autocast does not apply (as inside torch's own autocast kernels)."""
    key = getattr(torch._C.DispatchKey, "Autocast" + device_type.upper())
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key))


@contextlib.contextmanager
def kernel_registrations(namespace: str) -> Iterator[Any]:
    """A ``torch.library.Library`` to register kernels for ``namespace``'s operators with, its registrations removed
    on the way out (the kernels they replaced apply again)."""
    library = torch.library.Library(namespace, "IMPL")
    try:
        yield library
    finally:
        library._destroy()


def cuda_workspace_size() -> int | None:
    """The bytes of cuBLAS workspace this process's CUDA products get (torch 2.12 and newer, with CUDA initialised
    here), or None."""
    size = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)
    if size is None or not torch.cuda.is_initialized():
        return None
    try:
        return int(size())
    except Exception:  # a build or state where torch cannot say
        return None


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device`` where a GPU is visible (None where not, or where CUDA cannot start here,
    as in a child forked after it started)."""
    try:
        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(device.index if device.type == "cuda" else None))  # type: ignore[return-value]
    except Exception:
        return None


def cuda_oom_observer_attacher() -> Callable[[Callable[..., None]], None] | None:
    """``torch._C._cuda_attach_out_of_memory_observer`` where this torch has it and CUDA is available."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return None
    return attach


# ----------------------------------------------------------------------------------------------- FSDP2
#: FSDP2's modules that resize storages in place, and the functions they do it with.
_FSDP2_RESIZERS = (
    ("torch.distributed.fsdp._fully_shard._fsdp_param", ("alloc_storage", "free_storage")),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", ("alloc_storage", "free_storage")),
)


@contextlib.contextmanager
def fsdp2_storage_resizes(seen: Callable[[Any], None]) -> Iterator[None]:
    """Call ``seen(tensor)`` after FSDP2 resizes a tensor's storage in place, while the context is open.

    FSDP2 frees a gathered parameter by resizing its storage to 0 and gathers it again by resizing it back: a call on
    the storage itself, which no operator (and so no dispatch mode) sees. Its two functions for it are wrapped in the
    modules that call them, process-wide (nested contexts restore each other in turn); nothing happens where FSDP2 is
    not imported yet, or names them otherwise.
    """
    import sys

    restore: list[tuple[Any, str, Any]] = []
    for module_name, names in _FSDP2_RESIZERS:
        module = sys.modules.get(module_name)
        for name in names:
            original = getattr(module, name, None) if module is not None else None
            if not callable(original):
                continue

            def resize_seen(tensor: Any, _original: Any = original) -> None:
                _original(tensor)
                seen(tensor)

            restore.append((module, name, original))
            setattr(module, name, resize_seen)
    try:
        yield
    finally:
        for module, name, original in reversed(restore):
            setattr(module, name, original)


def fsdp2_params(model: Any) -> list[Any]:
    """FSDP2's record of each sharded parameter (``FSDPParam``) of every ``fully_shard``-ed module of ``model``.

    Read from the private state torch keeps on each module (``_get_fsdp_state()._fsdp_param_groups``, or the
    single ``_fsdp_param_group`` of older versions); ``[]`` where there is none, or where this torch lays it out
    otherwise (the gathered parameters then go uncounted as their own category, nothing else changes).
    """
    if model is None:
        return []
    found: list[Any] = []
    try:
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [] if group is None else [group]
            for group in groups:
                found.extend(getattr(group, "fsdp_params", ()))
    except Exception:  # a torch whose FSDP2 state differs: no unsharded categories, the rest is measured as before
        return []
    return found


def fsdp2_unsharded_tensors(fsdp_params: list[Any]) -> tuple[list[Any], list[Any]]:
    """The gathered full parameters (each ``FSDPParam``'s all-gather outputs and the parameter made of them) and
    their full gradients (before the reduce-scatter, or accumulated without it) that hold memory now.

    FSDP2 frees a gathered parameter by resizing its storage to 0: such storages are left out, never read further.
    """
    params: list[Any] = []
    grads: list[Any] = []
    for fsdp_param in fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)  # made at the first all-gather
        candidates = list(getattr(fsdp_param, "all_gather_outputs", None) or ())
        if unsharded is not None:
            candidates.append(unsharded)
            if unsharded.grad is not None:
                grads.append(unsharded.grad)
        accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        if accumulated is not None:
            grads.append(accumulated)
        params.extend(t for t in candidates if t.untyped_storage().nbytes() > 0)
    grads = [g for g in grads if g.untyped_storage().nbytes() > 0]
    return params, grads
