"""Memory a CPU kernel takes inside an operator and frees before it returns, and outputs only the kernel knows the
size of: what no fake tensor shows.

A fake tensor has the sizes of an operator's outputs; what the kernel allocates for itself while it runs is not among
them. For most operators that is nothing. CPU convolutions are the exception: torch's slow paths (``bfloat16`` and
``float16`` on CPUs without native support, dilated and transposed convolutions) unfold the whole batch into an
im2col buffer, and oneDNN reorders inputs, outputs and gradients into its own blocked layouts; their backward sums the
bias gradient of a reduced-precision ``grad_output`` in ``float32``. A convolutional network's step peaks inside
those operators: without them the estimate of a CNN's peak was 8-42 % low. Reductions of ``bfloat16`` and ``float16``
tensors (``mean``, a sum over several dimensions, ``logsumexp``) sum a ``float32`` copy of their input. And
oneDNN's LSTM layer (``nn.LSTM`` on CPU) returns a workspace, saved for backward, whose size oneDNN decides: on fake
tensors it is empty, and an LSTM's estimated activations were 87 % low; the estimate gives that output the size the
kernel gives it. ``scaled_dot_product_attention``'s flash kernel holds blocks of scores and gradients per thread.

How much depends on the kernel torch picks on this CPU (its instruction set, the dtype, the layout, the shapes), so
it is measured, not modelled: each operator signature (shapes, strides, dtypes and arguments) runs once, on zeros of
the real sizes, in a separate process (:mod:`~lightning_memtrace.estimator.kernel_scratch_worker`) that reads the
allocator's reports of its own profiler session; its answer is kept for the rest of the process. An operator with up
to :data:`MAX_MEASURED_BYTES` of tensors runs at its own size (exact: one real forward and backward of each distinct
convolution); a larger one runs at two smaller batches, and its scratch is carried on in a straight line to its batch
(a few percent off where the kernel picks another algorithm at another batch; each run takes about a second at most).
An output sized by the kernel is measured at its own size only. What the worker could not measure is left at no
scratch (or at the fake output's size), and :attr:`KernelScratch.unmeasured` says so.

Used for CPU targets only: a CUDA target's convolutions and LSTMs run cuDNN, whose workspaces no CPU can measure.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture import fork_guard
from lightning_memtrace.capture.storages import dense_layout
from lightning_memtrace.estimator import unfaked_ops
from lightning_memtrace.estimator.kernel_scratch_worker import ANSWER_PREFIX

aten = torch.ops.aten

#: Convolutions: im2col buffers (torch's slow paths), oneDNN's reorders, a reduced-precision bias gradient's fp32 sum.
_CONVOLUTIONS = frozenset({aten.convolution.default, aten.convolution_backward.default})
#: Reductions whose CPU kernel may sum a ``bfloat16``/``float16`` input in a ``float32`` copy of it (``mean``, a sum
#: over several dimensions or into another dtype, ``logsumexp``): see :func:`_sums_a_copy`.
_REDUCTIONS = frozenset(
    {aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.sum.default, aten.logsumexp.default}
)
#: Operators with an output whose size only the CPU kernel knows (oneDNN's LSTM workspace, empty on fake tensors).
_KERNEL_SIZED_OUTPUTS = frozenset({aten.mkldnn_rnn_layer.default})
#: ``scaled_dot_product_attention``'s CPU flash kernel (transformers' default attention, ``nn.MultiheadAttention``):
#: blocks of scores, sums and gradients per thread, forward and backward (1 MiB a thread at 16 heads x 2,048 x 64).
_FLASH_ATTENTION = {
    packet.default: positions
    for packet, positions in (
        (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), (0, 1, 2)),
        (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None), (0, 1, 2, 3, 4, 5)),
    )
    if packet is not None
}
#: Softmax and log-softmax, forward and backward: their kernels work on a contiguous copy of a strided input or
#: gradient (a CTC loss's ``log_probs.transpose(0, 1)`` sends its gradient back strided); see :func:`_copies_an_input`.
_SOFTMAXES = {
    aten._softmax.default: (0,),
    aten._log_softmax.default: (0,),
    aten._softmax_backward_data.default: (0, 1),
    aten._log_softmax_backward_data.default: (0, 1),
}
#: The operators whose kernels hold memory of their own on a CPU (CTC loss's backward: ``log_beta``, as large as
#: ``log_alpha``).
SCRATCH_OPS = (
    _CONVOLUTIONS
    | _REDUCTIONS
    | frozenset(_SOFTMAXES)
    | _KERNEL_SIZED_OUTPUTS
    | {aten.mkldnn_rnn_layer_backward.default}
    | frozenset(_FLASH_ATTENTION)
    | unfaked_ops.CTC_BACKWARD_OPS
)
#: The arguments that carry the batch in dimension 0 (else the first).
_BATCH_ARGS = {
    aten.convolution.default: (0,),
    aten.convolution_backward.default: (0, 1),
    **_FLASH_ATTENTION,
    **_SOFTMAXES,
}
_REDUCED_PRECISION = (torch.bfloat16, torch.float16)
#: Largest operator run at its own size, in bytes of its tensor arguments (a larger one runs at two smaller batches).
MAX_MEASURED_BYTES = 32 << 20
#: Signatures remembered per process (the oldest go first).
MAX_REMEMBERED = 4096
#: Seconds one measurement may take.
MEASURE_TIMEOUT_S = 300.0
#: Seconds without a request after which the measuring process ends (a later request starts another).
IDLE_END_S = 30.0


def _spec(value: Any) -> Any:
    """An argument as the worker rebuilds it: a tensor as its shape, stride and dtype; lists, dicts and scalars as they
    are; a dtype by its name."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided or value.device.type != "cpu":
            raise TypeError(f"a {value.layout} tensor on {value.device} is not measured")
        return {"shape": list(value.shape), "stride": list(value.stride()), "dtype": str(value.dtype).split(".")[-1]}
    if isinstance(value, (list, tuple)):
        return [_spec(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _spec(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.dtype):
        return {"torch_dtype": str(value).split(".")[-1]}
    if isinstance(value, torch.SymInt):
        return int(value)
    raise TypeError(f"argument {value!r} is not measured")


@dataclass(frozen=True)
class KernelMemory:
    """What a CPU kernel held on one signature: ``scratch`` bytes beyond its outputs at its peak, and its outputs'
    shapes (None for an output that is no tensor; ``output_shapes`` None where measured at other batches)."""

    scratch: int
    output_shapes: tuple[tuple[int, ...] | None, ...] | None = None


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class _Worker:
    """The measuring process: started on the first request, ended at exit (or when it fails)."""

    def __init__(self, command: tuple[str, ...] | None = None) -> None:
        self.command = command or (sys.executable, "-m", "lightning_memtrace.estimator.kernel_scratch_worker")
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._idle_end: threading.Timer | None = None
        self.failure: str | None = None
        fork_guard.guard(self)

    def ask(self, request: dict[str, Any]) -> KernelMemory | str:
        """What was measured for ``request``, or why nothing was."""
        with self._lock:
            if self.failure is not None:
                return self.failure
            try:
                process = self._started()
                assert process.stdin is not None and process.stdout is not None
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                answer = self._answer(process)
            except Exception as error:
                self.failure = f"the measuring process failed: {type(error).__name__}: {error}"
                self._end()
                return self.failure
            self._end_when_idle()
        if "bytes" in answer:
            shapes = answer.get("shapes")
            return KernelMemory(
                int(answer["bytes"]),
                tuple(None if s is None else tuple(int(d) for d in s) for s in shapes) if shapes is not None else None,
            )
        return str(answer.get("error") or "no answer")

    def _answer(self, process: subprocess.Popen[str]) -> dict[str, Any]:
        box: list[str] = []

        def read() -> None:
            for line in process.stdout:  # type: ignore[union-attr]
                if line.startswith(ANSWER_PREFIX):
                    box.append(line[len(ANSWER_PREFIX) :])
                    return
            box.append("")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(MEASURE_TIMEOUT_S)
        if not box or not box[0]:
            raise TimeoutError("no answer") if reader.is_alive() else EOFError("the process ended")
        return json.loads(box[0])

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            env["MEMTRACE_SCRATCH_THREADS"] = str(torch.get_num_threads())
            self._process = subprocess.Popen(
                list(self.command),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        return self._process

    def after_fork_in_child(self) -> None:
        """A forked child (a what-if job, a DataLoader worker) starts a process of its own if it needs one: the
        parent's pipes and lock are the parent's."""
        self._process, self._idle_end, self._lock = None, None, threading.Lock()

    def _end_when_idle(self) -> None:
        # A training process that estimated once (MemTrace(estimate=True)) does not keep the process for the run.
        if self._idle_end is not None:
            self._idle_end.cancel()
        self._idle_end = threading.Timer(IDLE_END_S, self._end_idle)
        self._idle_end.daemon = True
        self._idle_end.start()

    def _end_idle(self) -> None:
        with self._lock:
            self._end()

    def _end(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
            process.wait(timeout=10)
        except Exception:
            process.kill()
            process.wait()
        finally:
            if process.stdout is not None:
                process.stdout.close()


_WORKER = _Worker()
atexit.register(lambda: _WORKER._end())
#: What each signature's kernel held, or why it is not known.
_REMEMBERED: OrderedDict[str, KernelMemory | str] = OrderedDict()


class KernelScratch:
    """The scratch bytes of the CPU kernels of one estimate (see the module's text)."""

    def __init__(self) -> None:
        #: Signatures left at no scratch, and why (``"op: reason"``), in the order met.
        self.unmeasured: list[str] = []

    @staticmethod
    def covers(func: Any) -> bool:
        return func in SCRATCH_OPS

    def after(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> tuple[Any, int, tuple[Tensor, ...]]:
        """``func``'s outputs ``out`` as the CPU kernel sizes them, and the bytes it holds beyond them at its peak (0
        where not measured); a CPU kernel keeps no buffer."""
        memory = self.measured(func, args, kwargs)
        if memory is None:
            return out, 0, ()
        if func in _KERNEL_SIZED_OUTPUTS and memory.output_shapes is not None:
            out = _sized_as(out, memory.output_shapes)
        return out, memory.scratch, ()

    def measured(self, func: Any, args: tuple, kwargs: dict | None) -> KernelMemory | None:
        """What the CPU kernel of ``func`` holds on these arguments, measured once per signature; None where it is
        not measured (noted in :attr:`unmeasured` where it could not be)."""
        if func in _REDUCTIONS and not _sums_a_copy(func, args, kwargs or {}):
            return None
        if func in _SOFTMAXES and not _copies_an_input(func, args):
            return None
        name = func.__name__
        try:
            request = {"op": name, "args": _spec(list(args)), "kwargs": _spec(dict(kwargs or {}))}
        except TypeError as error:
            self._unmeasured(name, str(error))
            return None
        key = json.dumps(request)
        known = _REMEMBERED.get(key)
        if known is None:
            known = _measured(func, args, request)
            _REMEMBERED[key] = known
            if len(_REMEMBERED) > MAX_REMEMBERED:
                _REMEMBERED.popitem(last=False)
        else:
            _REMEMBERED.move_to_end(key)
        if isinstance(known, str):
            self._unmeasured(name, known)
            return None
        return known

    def _unmeasured(self, name: str, reason: str) -> None:
        line = f"{name}: {reason}"
        if line not in self.unmeasured:
            self.unmeasured.append(line)


def _sums_a_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a reduction may sum a ``float32`` copy of its input: a ``bfloat16``/``float16`` input to ``mean``,
    ``logsumexp``, a sum over several dimensions, or a sum into another dtype. A plain sum over one dimension (a
    bias gradient) or over all of them sums in place, in every layout tried: not measured."""
    source = args[0] if args else None
    if not isinstance(source, Tensor) or source.dtype not in _REDUCED_PRECISION:
        return False
    if func not in (aten.sum.dim_IntList, aten.sum.default):
        return True
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != source.dtype:
        return True
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    return func is aten.sum.dim_IntList and (dims is None or len(dims) > 1)


def _copies_an_input(func: Any, args: tuple) -> bool:
    """Whether a softmax's tensor arguments include a strided one, which its kernel copies (contiguous ones it reads
    in place: not measured)."""
    return any(isinstance(args[i], Tensor) and not args[i].is_contiguous() for i in _SOFTMAXES[func] if i < len(args))


def _sized_as(out: Any, shapes: tuple[tuple[int, ...] | None, ...]) -> Any:
    """``out`` (a tuple of fake tensors) with each tensor whose shape the kernel gives otherwise made anew in it."""
    if not isinstance(out, tuple) or len(out) != len(shapes):
        return out
    return tuple(
        o.new_empty(shape) if isinstance(o, Tensor) and shape is not None and tuple(o.shape) != shape else o
        for o, shape in zip(out, shapes)
    )


def _measured(func: Any, args: tuple, request: dict[str, Any]) -> KernelMemory | str:
    """What the operator's kernel holds on these arguments (``request``: them as the worker rebuilds them), measured
    at their size where it is at most :data:`MAX_MEASURED_BYTES` of tensors; above that (the scratch only, not an
    output sized by the kernel), at two smaller batches and carried on in a straight line to this one (scratch grows
    with the batch: im2col and reorder buffers are per sample). Or why there is nothing."""
    size = _tensor_bytes(args)
    if size <= MAX_MEASURED_BYTES:
        return _WORKER.ask(request)
    if func in _KERNEL_SIZED_OUTPUTS:
        return f"{size:,} B of tensors, over the {MAX_MEASURED_BYTES:,} B measured (its output sized by the kernel)"
    batched = _BATCH_ARGS.get(func, (0,))
    batch = int(args[batched[0]].shape[0]) if args[batched[0]].dim() else 0
    larger = batch * MAX_MEASURED_BYTES // size
    if larger < 2:
        return f"{size:,} B of tensors, over the {MAX_MEASURED_BYTES:,} B measured even at a batch of 2"
    smaller = larger // 2
    answers = [_asked_at_batch(request, n, batched) for n in (smaller, larger)]
    if isinstance(answers[0], str):
        return answers[0]
    if isinstance(answers[1], str):
        return answers[1]
    slope = (answers[1].scratch - answers[0].scratch) / (larger - smaller)
    return KernelMemory(max(0, round(answers[1].scratch + slope * (batch - larger))))


def _asked_at_batch(request: dict[str, Any], n: int, positions: tuple[int, ...]) -> KernelMemory | str:
    """Ask the worker about ``request`` with the batch dimension of the arguments at ``positions`` set to ``n``, and
    of a keyword argument with as many rows (attention's ``attn_mask``; one of a single row is broadcast)."""
    spec_args = list(request["args"])
    spec_kwargs = dict(request["kwargs"])
    batch = spec_args[positions[0]]["shape"][0]
    places: list[tuple[Any, Any]] = [(spec_args, position) for position in positions]
    places += [
        (spec_kwargs, name)
        for name, value in spec_kwargs.items()
        if isinstance(value, dict) and value.get("shape") and value["shape"][0] == batch
    ]
    for specs, key in places:
        resized = _rebatched(specs[key], n)
        if resized is None:
            return "an argument that is not dense could not be measured at a smaller batch"
        specs[key] = resized
    return _WORKER.ask({**request, "args": spec_args, "kwargs": spec_kwargs})


def _rebatched(spec: dict[str, Any], n: int) -> dict[str, Any] | None:
    """A dense tensor's spec with ``n`` rows in dimension 0, its dimensions laid out in the same order (contiguous,
    channels-last, any permutation); None for a tensor with gaps or overlaps."""
    shape, stride = list(spec["shape"]), list(spec["stride"])
    if not dense_layout(shape, stride):
        return None
    order = sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]))  # innermost first
    shape[0] = n
    step = 1
    for d in order:
        stride[d] = step
        step *= shape[d]
    return {**spec, "shape": shape, "stride": stride}
