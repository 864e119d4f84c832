"""Modules and batches copied onto fake tensors (shapes, dtypes and devices, no data, no real memory).

Every private torch entry point the estimator uses is here (``FakeTensorMode``, ``_disable_current_modes``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_memtrace.capture.storages import (
    attribute_tensors,
    is_module_state,
    is_quantized_weight,
    quantized,
    storage_key,
    weight_state_tensors,
)
from lightning_memtrace.estimator.inputs import InputSpec, map_batch
from lightning_memtrace.estimator.trainer_view import TrainerView, no_logging


def fake_mode() -> Any:
    """A fresh ``FakeTensorMode`` that refuses real tensors as inputs, and an operator without a fake implementation
    rather than run its real kernel on zeros of the real sizes (torch's default: real memory, on the run's device, in
    the middle of the run MemTrace measures), except on sparse tensors alone (see :func:`_estimate_fake_mode_type`)."""
    return _estimate_fake_mode_type()(allow_non_fake_inputs=False)


@functools.cache
def _estimate_fake_mode_type() -> type:
    """``FakeTensorMode`` that runs a real kernel in place of a missing fake implementation only where every fake
    tensor it would make real is sparse: zeros of a sparse tensor are an empty one (no memory). Sparse gradients'
    in-place ops (SGD's momentum ``buf.mul_(momentum)``) have no fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class EstimateFakeTensorMode(FakeTensorMode):
        _call: tuple[Any, Any] = ((), None)

        def _dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
            outer = self._call
            self._call = (args, kwargs)
            try:
                return super()._dispatch_impl(func, types, args, kwargs)
            finally:
                self._call = outer

        def can_run_unsafe_fallback(self, func: Any) -> bool:
            made_real = [leaf for leaf in pytree.tree_leaves(self._call) if self.is_our_fake(leaf)]
            only_sparse = bool(made_real) and all(leaf.is_sparse for leaf in made_real)
            return only_sparse and super().can_run_unsafe_fallback(func)

    return EstimateFakeTensorMode


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (shape, dtype and device; no values to read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def value_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise where the step needs a value they do not have (a shape made by ``nonzero``, an
    ``if`` on a tensor, ``.item()``)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DataDependentOutputException, DynamicOutputShapeException)


def unsupported_operator_error() -> type[Exception]:
    """What the estimate's fake mode raises for an operator torch has no fake implementation of (no meta kernel): it
    runs no real kernel in its place, which would allocate real memory (see :func:`_estimate_fake_mode_type`)."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    return UnsupportedOperatorException


def backward_in_function_modes(loss: Tensor) -> None:
    """``loss.backward()`` with the estimate's torch function modes (SDPA's stand-in kernel, LayerDrop's answer)
    active inside it: ``Tensor.backward`` is a torch function, which a mode handles with itself popped, so a layer a
    checkpoint recomputes in backward ran without them (on a CUDA target, GPT-2's recomputed attention ran on CPU's
    math kernel, and the checkpoint refused its saved tensors). Autograd's engine is called as ``backward`` calls it."""
    run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run_backward is None or loss.numel() != 1 or not loss.requires_grad:
        loss.backward()  # the public path (and its errors)
        return
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    run_backward((loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


@contextlib.contextmanager
def meta_failures_unlogged() -> Iterator[None]:
    """Within, on this thread: a failing meta kernel raises without torch first logging its traceback.

    ``FakeTensorMode`` logs each failure with ``logging.exception`` and then raises it; the estimate reports the error
    itself, in one line, so the traceback on the user's console would be noise. Other threads still log.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    thread = threading.get_ident()

    def other_threads_only(record: logging.LogRecord) -> bool:
        return record.thread != thread

    logger.addFilter(other_threads_only)
    try:
        yield
    finally:
        logger.removeFilter(other_threads_only)


class _ThreadQuietStream:
    """A text stream that drops what one thread writes and passes every other thread's writes to ``stream``."""

    def __init__(self, stream: Any, thread: int) -> None:
        self._stream, self._thread = stream, thread

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        if threading.get_ident() != self._thread:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def own_prints_dropped() -> Iterator[None]:
    """Within, on this thread: ``print`` (to ``sys.stdout`` or ``sys.stderr``) writes nothing.

    The estimate runs the user's ``training_step``, whose prints (``self.print``, a loss every N batches) would show
    the estimate's values (a fake loss is 0.0) among the run's own lines. Other threads print as before, and file
    descriptors are left alone.
    """
    thread = threading.get_ident()
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ThreadQuietStream(out, thread), _ThreadQuietStream(err, thread)
    try:
        yield
    finally:
        # put back only what this put there: a stream someone else swapped in meanwhile stays
        if isinstance(sys.stdout, _ThreadQuietStream) and sys.stdout._stream is out:
            sys.stdout = out
        if isinstance(sys.stderr, _ThreadQuietStream) and sys.stderr._stream is err:
            sys.stderr = err


@contextlib.contextmanager
def outer_modes_paused() -> Iterator[None]:
    """Take the dispatch modes already active (a running MemTrace's tracker) off the stack while estimating.

    The estimate stays invisible to a real run's measurement, and the real run's tracker does not see the fake
    computations (which it would ignore, at a cost).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


@contextlib.contextmanager
def compiled_code_runs_eagerly() -> Iterator[None]:
    """Inside, ``torch.compile``'d functions run eagerly, as compiled modules do in the estimate (:func:`uncompiled`).

    Under the estimate's dispatch mode dynamo would leave such a function to run eagerly anyway, fail a
    ``fullgraph=True`` one (torchao's low-bit optimizers compile their step so), and mark its code never to be compiled
    again, in the real run too. ``torch.compiler.set_stance`` (torch 2.6 and later) does neither; before, as before.
    """
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (an ``OptimizedModule``'s ``_orig_mod``), else ``module`` itself.

    The estimate runs the module eagerly: a compiled graph may save less for backward than the eager ops do.
    """
    original = module.__dict__.get("_modules", {}).get("_orig_mod")
    return original if isinstance(original, nn.Module) else module


def is_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` wrapped the module or a submodule, or Lightning compiled its steps."""
    return any(
        uncompiled(sub) is not sub or isinstance(sub.__dict__.get("_compiler_ctx"), dict) for sub in module.modules()
    )


def _eager(module: nn.Module) -> nn.Module:
    """The copy runs eagerly: its submodules without ``torch.compile``'s wrapper, its class's ``forward`` and
    ``*_step`` methods where Lightning put compiled ones.

    Compiling on fake tensors would trace the user's code for nothing, and fill the compile cache the real run uses.
    ``Trainer.fit`` takes ``torch.compile(lightning_module)`` by unwrapping it and setting, on the module itself,
    ``forward`` and each ``*_step`` compiled from the original module's bound methods (and naming them in its
    ``_compiler_ctx`` as ``original_<name>``): called on the copy, they would run the real module.
    """
    # A wrapper's original module is among the modules listed before the wrapper is taken out.
    for sub in list(module.modules()):
        for name, child in list(sub._modules.items()):
            if child is not None:
                sub._modules[name] = uncompiled(child)
        context = sub.__dict__.get("_compiler_ctx")
        if isinstance(context, dict):
            for key in context:
                if key.startswith("original_"):
                    sub.__dict__.pop(key.removeprefix("original_"), None)
            sub._compiler_ctx = None
    return module


def _fake_tensor(tensor: Tensor, mode: Any, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    with mode:
        return torch.empty_strided(
            tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype or tensor.dtype, device=device
        )


def _fake_tensors(
    module: nn.Module, mode: Any, device: torch.device, param_dtype: torch.dtype | None
) -> dict[int, Any]:
    """``id(real) -> fake`` for every parameter and buffer (tied tensors once, so they stay tied)."""
    memo: dict[int, Any] = {}

    def cast(t: Tensor) -> torch.dtype | None:
        return param_dtype if param_dtype is not None and t.is_floating_point() else None

    params = list(module.parameters())
    for param in params:
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(
                _fake_tensor(param, mode, device, cast(param)), requires_grad=param.requires_grad
            )
    if quantized(params):
        _fake_weight_states(module, params, mode, device, memo)
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = _fake_tensor(buffer, mode, device, cast(buffer))
    home = next((param.device.type for param in module.parameters()), None)
    for tensor in attribute_tensors(module):
        if id(tensor) in memo:
            continue
        if home is not None and tensor.device.type != home:
            # Kept elsewhere (a table on the host beside a CUDA model): not the device's memory, so not counted; the
            # copy shares it rather than copy it (a step that moves it to the device stops the estimate, as before).
            memo[id(tensor)] = tensor
        else:
            memo[id(tensor)] = _fake_tensor(tensor, mode, device).requires_grad_(tensor.requires_grad)
    return memo


def _fake_weight_states(
    module: nn.Module, params: list[Tensor], mode: Any, device: torch.device, memo: dict[int, Any]
) -> None:
    """Quantized weights' scales and code tables (see :func:`~lightning_memtrace.capture.storages.weight_state_tensors`:
    bitsandbytes' ``Params4bit.quant_state``, ``Int8Params.CB``/``SCB``, ``Linear8bitLt.state``) onto fake tensors in
    ``memo``, and each quantized weight's attributes onto its fake, as its layer's forward reads them. A tensor that
    shares a weight's memory (an 8-bit weight's ``CB`` before its first forward) becomes a view of the weight's fake;
    the objects holding them are copied (the layer's reference to the same object gets the same copy); a reference
    back to a module is dropped."""
    fake_of_storage = {}
    for param in params:
        key = storage_key(param)
        if key is not None:
            fake_of_storage[key[0]] = memo[id(param)]
    for tensor in weight_state_tensors(params, module):
        if id(tensor) in memo:
            continue
        key = storage_key(tensor)
        shared = fake_of_storage.get(key[0]) if key is not None else None
        if shared is not None and shared.dtype == tensor.dtype:
            with mode:
                view = shared.detach().as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
            memo[id(tensor)] = view.requires_grad_(tensor.requires_grad)
        else:
            memo[id(tensor)] = _fake_tensor(tensor, mode, device).requires_grad_(tensor.requires_grad)
    for param in params:
        if is_quantized_weight(param):
            fake = memo[id(param)]
            for name, value in param.__dict__.items():
                setattr(fake, name, None if isinstance(value, nn.Module) else copy.deepcopy(value, memo))


def _replace_in_place(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    for sub in module.modules():
        for name, value in list(sub._parameters.items()):
            if value is not None:
                sub._parameters[name] = memo[id(value)]
        for name, value in list(sub._buffers.items()):
            if value is not None:
                sub._buffers[name] = memo[id(value)]
        for name, value in list(sub.__dict__.items()):
            if is_module_state(name):
                sub.__dict__[name] = _with_fakes(value, memo, 0)
    return module


def _with_fakes(value: Any, memo: dict[int, Any], depth: int) -> Any:
    """``value`` with the tensors of ``memo`` replaced (lists and dicts changed in place, tuples rebuilt; an object
    that ``memo`` copied, such as a 4-bit weight's ``quant_state``, by its copy)."""
    if isinstance(value, Tensor) or id(value) in memo:
        return memo.get(id(value), value)
    if depth < 3 and isinstance(value, list):
        value[:] = [_with_fakes(item, memo, depth + 1) for item in value]
    elif depth < 3 and isinstance(value, dict):
        for key, item in list(value.items()):
            value[key] = _with_fakes(item, memo, depth + 1)
    elif depth < 3 and type(value) is tuple:
        return tuple(_with_fakes(item, memo, depth + 1) for item in value)
    return value


def _deep_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A deep copy with the fake tensors of ``memo``; fabric and real gradients are left out.

    A LightningModule's copy is attached to a view of its Trainer (:class:`TrainerView`), as steps read it
    (``self.trainer.global_step``, ``estimated_stepping_batches`` for a scheduler in ``configure_optimizers``), and
    logs nothing: its fake values must not reach the real run's logged results.
    """
    for sub in module.modules():
        for name in ("_fabric", "_trainer"):  # a LightningModule pickles without its Trainer: put back below
            value = sub.__dict__.get(name)
            if value is not None:
                memo[id(value)] = None
        for param in list(sub._parameters.values()):
            if param is not None and param.grad is not None:
                memo[id(param.grad)] = None
    try:
        with _copy_rules():
            copied = copy.deepcopy(module, memo)
    except Exception as error:
        raise ValueError(
            f"cannot copy {type(module).__name__} onto fake tensors: {type(error).__name__}: {error}"
        ) from error
    _attached_without_logging(module, copied)
    return _eager(copied)


@contextlib.contextmanager
def _copy_rules() -> Iterator[None]:
    """Within, on this thread, ``copy.deepcopy`` follows the estimate's two rules (other threads copy as before):

    - a plain tensor is shared rather than copied: the copy's tensors that are not the module's state (those are
      fakes, in the memo) stay the run's own, as a dataset the module keeps (``self.ds = TensorDataset(...)``). A copy
      would be real memory, perhaps gigabytes, on the run's device, in the middle of the run MemTrace measures; and a
      step cannot use a real tensor on fake ones anyway (the fake mode refuses it).
    - a closure (a hook registered as ``lambda module, args, out: self.acts.append(out)``) gets the copy of each
      object it closes over that is being copied (the module, in the memo): its fake values go to the copy, not into
      the run's module. What it closes over otherwise is shared, as functions always are.
    """
    owner = threading.get_ident()

    def copy_tensor(tensor: Tensor, memo: dict[int, Any]) -> Tensor:
        return tensor if threading.get_ident() == owner else tensor.__deepcopy__(memo)

    def copy_function(function: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
        closure = function.__closure__
        if threading.get_ident() != owner or not closure:
            return function
        cells = [_cell_contents(cell) for cell in closure]
        # a copy of None is one left out (the Trainer, real gradients): the closure keeps the real one, as before
        copies = [memo.get(id(value)) if value is not _EMPTY else None for value in cells]
        if all(copied is None for copied in copies):
            return function
        new_cells = [
            types.CellType() if value is _EMPTY else types.CellType(value if copied is None else copied)
            for value, copied in zip(cells, copies)
        ]
        clone = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(new_cells)
        )
        for name in ("__kwdefaults__", "__qualname__", "__doc__", "__annotations__", "__module__"):
            setattr(clone, name, getattr(function, name))
        clone.__dict__.update(function.__dict__)
        return clone

    dispatch = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    rules = {Tensor: copy_tensor, types.FunctionType: copy_function}
    previous = {kind: dispatch.get(kind) for kind in rules}
    dispatch.update(rules)
    try:
        yield
    finally:
        for kind, rule in previous.items():
            if rule is None:
                dispatch.pop(kind, None)
            else:
                dispatch[kind] = rule


_EMPTY = object()


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return _EMPTY


def _attached_without_logging(module: nn.Module, copied: nn.Module) -> None:
    """Each LightningModule of the copy attached to a view of its original's Trainer (:class:`TrainerView`), with
    ``log`` and ``log_dict`` that do nothing."""
    from lightning.pytorch import LightningModule

    for original, sub in zip(module.modules(), copied.modules()):
        if isinstance(sub, LightningModule):
            trainer = original.__dict__.get("_trainer")
            sub.__dict__["_trainer"] = TrainerView(trainer) if trainer is not None else None
            sub.log = sub.log_dict = no_logging  # type: ignore[method-assign]


def fake_copy(
    module: nn.Module, mode: Any, device: torch.device, param_dtype: torch.dtype | None, in_place: bool
) -> nn.Module:
    """The module with every parameter, buffer and tensor attribute replaced by a fake tensor (tied tensors stay
    tied; attributes: :func:`~lightning_memtrace.capture.storages.attribute_tensors`)."""
    memo = _fake_tensors(module, mode, device, param_dtype)
    if in_place:
        return _replace_in_place(module, memo)
    return _deep_copy(module, memo)


def fake_batch(batch: Any, mode: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """The batch with each tensor (real, meta or fake) or :class:`InputSpec` replaced by a fake tensor on ``device``."""

    def one(leaf: Tensor | InputSpec) -> Tensor:
        if isinstance(leaf, InputSpec):
            dtype = leaf.dtype
            if float_dtype is not None and dtype.is_floating_point:
                dtype = float_dtype
            with mode:
                return torch.empty(leaf.shape, dtype=dtype, device=device)
        dtype = float_dtype if float_dtype is not None and leaf.is_floating_point() else leaf.dtype
        with mode:
            return torch.empty(tuple(leaf.shape), dtype=dtype, device=device)

    return map_batch(batch, one)
