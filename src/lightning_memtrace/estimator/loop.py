"""Lightning's automatic optimization loop on fake tensors, step for step, with MemTrace's recorder taking the rows.

Order of a batch: batch_start, forward, zero_grad (set_to_none), backward, optimizer step, batch_end. Under manual
optimization the module's ``training_step`` does the work (see :mod:`~lightning_memtrace.estimator.manual`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtrace.capture.dispatch_backend import KernelScratchRule
from lightning_memtrace.capture.recorder import MemoryRecorder
from lightning_memtrace.estimator.host_offload import host_copies_uncounted
from lightning_memtrace.capture.ddp_buckets import bucket_tensors
from lightning_memtrace.estimator.backward import GradScale, module_backward, recorded_backward
from lightning_memtrace.estimator.fake import fake_batch
from lightning_memtrace.estimator.inputs import Precision
from lightning_memtrace.estimator.manual import ManualOptimization
from lightning_memtrace.estimator.meta_recorder import meta_recorder
from lightning_memtrace.estimator.modelled_cuda import ModelledCudaAllocator
from lightning_memtrace.types import PhaseRecord

#: How a plain module's batch reaches it, said in every error of the default training step.
PLAIN_MODULE_HINT = (
    "for a plain nn.Module, pass training_step=lambda model, batch: <loss tensor>, e.g. "
    "estimate(mlp, (x, y), training_step=lambda m, b: F.cross_entropy(m(b[0]), b[1])); without it the batch is "
    "passed as model(**batch) for a dict, model(*batch) for a list or tuple, model(batch) otherwise, and the output "
    "(its .loss, its 'loss', or the tensor's mean) is the loss"
)


def default_training_step(model: nn.Module, batch: Any) -> Tensor:
    """The loss of a plain module: ``model(**batch).loss`` (labels = input_ids for a causal LM), ``model(*batch)``..."""
    if isinstance(batch, Mapping):
        call = "model(**batch)"
    elif isinstance(batch, (list, tuple)):
        call = f"model(*batch) with {len(batch)} items"
    else:
        call = "model(batch)"
    try:
        if isinstance(batch, Mapping):
            if "input_ids" in batch and "labels" not in batch and hasattr(model, "config"):
                out = model(**batch, labels=batch["input_ids"])
            else:
                out = model(**batch)
        elif isinstance(batch, (list, tuple)):
            out = model(*batch)
        else:
            out = model(batch)
    except TypeError as error:
        raise TypeError(
            f"the estimate called {type(model).__name__} as {call}, which failed ({error}): {PLAIN_MODULE_HINT}"
        ) from error
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, Tensor):
        loss = out.float().mean()
    if not isinstance(loss, Tensor):
        raise TypeError(f"{type(model).__name__}'s output has no loss ({type(out).__name__}): {PLAIN_MODULE_HINT}")
    return loss


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    # As Lightning's MixedPrecision plugin: no cache of cast weights (they would stay alive through the forward).
    with torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False):
        yield


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if not isinstance(loss, Tensor):
            raise TypeError("training_step returned a dict without a 'loss' tensor")
        return loss
    if output is None:
        return None
    raise ValueError(f"training_step returned {type(output).__name__}: return a loss tensor or a dict with 'loss'")


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    mode: Any,
    device: torch.device,
    precision: Precision,
    accumulate: int,
    steps: int,
    lightning: bool,
    training_step: Callable[[nn.Module, Any], Any] | None,
    prefetch: bool,
    ddp_buckets: bool = False,
    kernel_scratch: KernelScratchRule | None = None,
    host_offload: bool = False,
    allocator: ModelledCudaAllocator | None = None,
    manual: tuple[list[torch.optim.Optimizer], list[Any]] | None = None,
) -> list[PhaseRecord]:
    """Lightning's automatic optimization loop, step for step, with MemTrace's recorder taking the rows
    (``ddp_buckets``: with DDP's gradient buckets alive throughout, see
    :mod:`~lightning_memtrace.capture.ddp_buckets`; ``kernel_scratch``: what kernels hold that fake tensors do not
    show, the CPU kernels' scratch or cuBLAS's workspaces, see :mod:`~lightning_memtrace.estimator.kernel_scratch` and
    :mod:`~lightning_memtrace.estimator.blas_workspace`; ``host_offload``: ``save_on_cpu``'s copies are host memory,
    not the target's, see :mod:`~lightning_memtrace.estimator.host_offload`; ``allocator``: the CUDA caching
    allocator's model the rows' allocated, reserved and peak bytes come from, see
    :mod:`~lightning_memtrace.estimator.modelled_cuda`; ``manual``: the optimizers and schedulers' configs of a
    LightningModule under manual optimization, whose ``training_step`` then does the work, see
    :mod:`~lightning_memtrace.estimator.manual`)."""
    recorder = meta_recorder(model, manual[0] if manual else [optimizer], device, kernel_scratch, allocator)
    loop = LightningLoop(model, optimizer, recorder, device, precision, accumulate, lightning, training_step)
    if manual is not None:
        loop.manual = ManualOptimization(
            manual[0], manual[1], recorder, loop.grad_scale, loop.count_step, loop.module_backward
        )
        loop.manual.attach(model)
    float_dtype = precision.param_dtype

    def new_batch() -> Any:
        return fake_batch(batch, mode, device, float_dtype)

    offload = host_copies_uncounted(recorder.tracker) if host_offload else contextlib.nullcontext()
    with mode, offload:
        recorder.start()
        try:
            # made when DDP wraps the model, before the first batch; alive for the whole run
            buckets = bucket_tensors(model, device) if ddp_buckets else []
            buffer: list[Any] = [new_batch()] if prefetch else []
            for batch_idx in range(steps * accumulate):
                if allocator is not None and batch_idx % accumulate == 0:
                    allocator.mark_step(loop.global_step)
                if prefetch:
                    # Lightning's prefetching fetcher: the next batch is fetched before this one starts.
                    current = buffer.pop(0)
                    buffer.append(new_batch())
                else:
                    # On an accelerator only the current batch is on the device (moved in `batch_to_device`).
                    current = new_batch()
                loop.run_batch(current, batch_idx)
                del current
            if allocator is not None:
                allocator.mark_step(loop.global_step)
            del buffer, buckets
        finally:
            loop.clear()
            if loop.manual is not None:
                loop.manual.detach()
            recorder.stop()
    return list(recorder.records)


@dataclasses.dataclass(eq=False)
class LightningLoop:
    """One training batch as Lightning's automatic optimization runs it, with the recorder's rows at its hooks."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    recorder: MemoryRecorder
    device: torch.device
    precision: Precision
    accumulate: int
    lightning: bool
    training_step: Callable[[nn.Module, Any], Any] | None
    global_step: int = 0
    batch: Any = None
    batch_idx: int = 0
    # Lightning's ClosureResult: the loss and whatever training_step returned beside it, alive until the batch ends.
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Under manual optimization, what the module's training_step steps with (None: automatic optimization).
    manual: ManualOptimization | None = None

    def __post_init__(self) -> None:
        self.step_fn = self.training_step or default_training_step
        self.grad_scale = GradScale(self.precision is Precision.FP16_MIXED, self.device)
        self.module_backward = module_backward(self.model) if self.lightning else None

    def clear(self) -> None:
        self.batch = None
        self.result = {}

    def count_step(self) -> None:
        """An optimizer step under manual optimization (Lightning counts each one in ``global_step``)."""
        self.global_step += 1

    def run_manual_batch(self, batch: Any, batch_idx: int) -> None:
        """One batch under manual optimization: its ``training_step`` (under autocast, as Lightning runs it) steps."""
        self.batch, self.batch_idx, self.result = batch, batch_idx, {}
        self.recorder.begin_batch(batch, step=self.global_step, batch_idx=batch_idx)
        with _autocast(self.device.type, self.precision.autocast_dtype), _default_dtype(self.precision.param_dtype):
            output = self.model.training_step(batch, batch_idx)
        if output is not None:
            self.result["extra"] = output  # Lightning's ManualResult keeps it until the batch ends
        del output
        self.recorder.end_batch(next_step=self.global_step)
        self.clear()

    def run_batch(self, batch: Any, batch_idx: int) -> None:
        if self.manual is not None:
            self.run_manual_batch(batch, batch_idx)
            return
        self.batch, self.batch_idx, self.result = batch, batch_idx, {}
        should_step = (batch_idx + 1) % self.accumulate == 0
        self.recorder.begin_batch(batch, step=self.global_step, batch_idx=batch_idx)
        if should_step:
            self.grad_scale.step(self.optimizer, self.closure)
            self.global_step += 1
        else:
            self.closure()
        # closure.consume_result(): only the detached loss (and any extra outputs) reach on_train_batch_end.
        self.result.pop("closure_loss", None)
        self.recorder.end_batch(next_step=self.global_step)
        self.clear()

    @torch.enable_grad()
    def closure(self) -> Tensor | None:
        """Lightning's ``Closure``: training_step, zero_grad on the first batch of a window, backward.

        Under ``enable_grad`` as Lightning's is: an optimizer may call it under ``no_grad`` (transformers' Adafactor).
        """
        recorder, result = self.recorder, self.result
        with _autocast(self.device.type, self.precision.autocast_dtype), _default_dtype(self.precision.param_dtype):
            if self.lightning:
                output = self.model.training_step(self.batch, self.batch_idx)
            else:
                output = self.step_fn(self.model, self.batch)
        loss = _loss_of(output)
        if isinstance(output, Mapping):
            # ClosureResult keeps what training_step returned beside the loss until the batch ends.
            result["extra"] = {k: v for k, v in output.items() if k != "loss"}
        del output
        if loss is None:
            return None
        closure_loss = loss / self.accumulate
        del loss
        result["closure_loss"] = closure_loss
        result["loss"] = closure_loss.detach().clone()
        if self.batch_idx % self.accumulate == 0:
            recorder.mark_forward_done()  # on_before_zero_grad
            self.optimizer.zero_grad(set_to_none=True)
        recorded_backward(recorder, closure_loss, self.grad_scale, backward=self.module_backward)
        del closure_loss
        return result["loss"]
