"""The estimate of a module: copied onto fake tensors, its optimizer built there, a few training steps measured.

Where the target is CUDA and this machine has no CUDA, the steps run on fake CPU tensors with CUDA's defaults emulated
(foreach optimizers, ``step`` tensors on the host, not counted; SDPA on a fused kernel, CPU's flash kernel standing in
for CUDA's flash or memory-efficient one: see :mod:`~lightning_memtrace.estimator.attention`), autocast on CUDA's op
lists (:mod:`~lightning_memtrace.estimator.cuda_autocast`). A CUDA target's estimate holds cuBLAS's workspaces
(:mod:`~lightning_memtrace.estimator.blas_workspace`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtrace.estimator.attention import attention_label, attn_implementation, sdpa_watched
from lightning_memtrace.estimator.batch_values import answered_as_the_batch
from lightning_memtrace.capture.frames import traceback_frames
from lightning_memtrace.capture.storages import memory_tensors, unique_storages
from lightning_memtrace.estimator.closed_form import closed_form
from lightning_memtrace.analysis.frames import asking_frame, format_frame, normalize_path
from lightning_memtrace.estimator.fake import (
    compiled_code_runs_eagerly,
    fake_copy,
    fake_mode,
    is_compiled,
    is_fake,
    meta_failures_unlogged,
    outer_modes_paused,
    own_prints_dropped,
    uncompiled,
    unsupported_operator_error,
    value_dependent_errors,
)
from lightning_memtrace.estimator.inputs import Precision, batch_dims
from lightning_memtrace.estimator.blas_workspace import CublasWorkspaces, workspace_bytes
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import CachingAllocatorModel
from lightning_memtrace.estimator.modelled_cuda import ModelledCudaAllocator
from lightning_memtrace.estimator.cuda_autocast import cuda_autocast_policy
from lightning_memtrace.estimator.kernel_scratch import KernelScratch
from lightning_memtrace.capture.ddp_buckets import bucket_bytes
from lightning_memtrace.estimator.grouped_mm import grouped_mm_in_every_dtype
from lightning_memtrace.estimator.layer_drop import no_layer_dropped
from lightning_memtrace.estimator.loop import run_steps
from lightning_memtrace.estimator.manual import configured
from lightning_memtrace.estimator.quantization import quantized_layers
from lightning_memtrace.estimator.remedies import (
    bnb_optimizers_imported,
    lora_description,
    shape_only_quantization_maps,
)
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.estimator.tensor_values import FiniteCheckNeeded, values_answered
from lightning_memtrace.estimator.sharded import (
    check_world_size,
    fake_world,
    shard_like_the_run,
    sharded_already,
    sharding_label,
)
from lightning_memtrace.types import Phase, PhaseRecord


def estimate(
    module: nn.Module,
    batch: Any,
    *,
    optimizer_factory: Callable[[nn.Module], Any] | None = None,
    training_step: Callable[[nn.Module, Any], Any] | None = None,
    precision: str | int | Precision = "32-true",
    accumulate_grad_batches: int = 1,
    gradient_checkpointing: bool = False,
    device: torch.device | str | None = None,
    steps: int = 2,
    copy_module: bool = True,
    prefetch: bool = False,
    world_size: int = 1,
    prepare: Callable[[nn.Module], Any] | None = None,
    ddp_buckets: bool = False,
) -> Estimate:
    """Estimate the memory of training ``module`` on ``batch`` by running real steps on fake tensors.

    Nothing real is allocated for parameters, gradients, optimizer state, batch or activations: a 1.5B-parameter
    model estimates on a laptop. The module's own ``forward`` (or ``training_step``) runs, autograd saves what it
    saves, the optimizer's own ``step`` runs, and :class:`~lightning_memtrace.capture.recorder.MemoryRecorder` takes
    the same rows the callback takes on a real run, in Lightning's order (``zero_grad`` after the forward, so the
    previous step's gradients are alive through the next forward; with accumulation, ``zero_grad`` on the first batch
    of a window and a step on its last).

    Args:
        module: A LightningModule (its ``training_step`` and ``configure_optimizers`` are used) or any ``nn.Module``.
            Its tensors may be real, meta or fake; it is copied (``copy_module``) and never changed.
        batch: An example batch (tensors, nested in dicts/lists/tuples/dataclasses) or shapes: each leaf may be a
            real tensor, a meta tensor or an :class:`InputSpec`. Only shapes and dtypes are used.
        optimizer_factory: ``factory(model) -> optimizer`` (or anything ``configure_optimizers`` may return). Default:
            the LightningModule's ``configure_optimizers``; for a plain module, AdamW(lr=1e-3).
        training_step: ``fn(model, batch) -> loss`` for a plain module. Default: the LightningModule's
            ``training_step(batch, batch_idx)``, else ``model(**batch).loss`` (labels = input_ids for a causal LM),
            ``model(*batch)`` or ``model(batch)``, reduced with ``mean`` if it is a tensor.
        precision: ``32-true``, ``16-mixed``, ``bf16-mixed``, ``bf16-true`` or ``16-true`` (Lightning's meaning:
            mixed autocasts the forward and keeps fp32 weights; true casts the weights and float inputs).
        accumulate_grad_batches: Batches per optimizer step.
        gradient_checkpointing: Turn on activation checkpointing (Hugging Face ``gradient_checkpointing_enable``,
            non-reentrant) before estimating. False leaves the module as it is.
        device: The device to estimate for. Default: the module's device (``meta`` counts as ``cuda``).
            For ``cuda`` on a machine without CUDA, fake CPU tensors stand in: the optimizer uses foreach kernels
            (CUDA's default), Adam's ``step`` scalars are left out (host memory on CUDA), SDPA runs on CPU's flash
            kernel without dropout (the saved tensors of CUDA's flash or memory-efficient kernel: output and fp32
            logsumexp, no ``B·H·L²`` probabilities) and autocast follows CUDA's op lists. The kernel assumed is
            stated in :attr:`Estimate.attention`.
        steps: Optimizer steps to run (at least 2: the second is the steady state).
        copy_module: Copy the module onto fake tensors (False: replace the module's own tensors; only for modules
            made for the estimate).
        prefetch: Keep the next batch alive during each step, as Lightning's fetcher does for a data loader without
            a length (an iterable dataset) on CPU. Sized loaders are not prefetched.
        world_size: Above 1, the run is sharded with FSDP2 over that many ranks (each repeated block, then the root,
            ``fully_shard``-ed over torch's fake process group in this process) and rank zero is measured.
        prepare: ``fn(fake_model)`` changing the fake copy in place before checkpointing and the optimizer is built
            (a what-if remedy: checkpointed blocks, ``requires_grad``). It runs under the fake mode; it should add no
            parameters (add those to the module before, e.g. on a meta copy).
        ddp_buckets: The run is data-parallel with ``DistributedDataParallel(gradient_as_bucket_view=False)`` (DDP's
            and Lightning's ``DDPStrategy``'s default): DDP's gradient buckets, a second copy of the gradients, are
            alive from before the first batch (:attr:`Estimate.ddp_bucket_bytes`; ``other`` in the rows).

    Returns:
        An :class:`Estimate` with the callback's rows for every estimated batch and the closed-form figures.

    A step that reads a floating-point value (``loss.item()`` to log it) gets 0.0, and one that checks for NaN or
    infinity gets the answer for finite values (:mod:`~lightning_memtrace.estimator.tensor_values`); the estimate
    names those places (:attr:`Estimate.values_read`). Other reads of values raise ``ValueError``.
    """
    arguments = dict(
        optimizer_factory=optimizer_factory,
        training_step=training_step,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_checkpointing=gradient_checkpointing,
        device=device,
        steps=steps,
        copy_module=copy_module,
        prefetch=prefetch,
        world_size=world_size,
        prepare=prepare,
        ddp_buckets=ddp_buckets,
    )
    # Following NaN and infinity checks costs a Python call per op: only for a step that has one. The first run stops
    # there, and the step is remembered (the what-if estimates it again and again); a module replaced in place cannot
    # run twice, so it follows them from the start.
    step_code = training_step if training_step is not None else type(module)
    try:
        return _estimate(
            module, batch, finite_checks=not copy_module or step_code in _STEPS_WITH_CHECKS, **arguments
        )
    except FiniteCheckNeeded:
        _STEPS_WITH_CHECKS.add(step_code)
        return _estimate(module, batch, finite_checks=True, **arguments)


#: Training steps (a ``training_step`` function, else the module's class) that read a bool or an integer: their
#: estimates follow NaN and infinity checks from the start.
_STEPS_WITH_CHECKS: weakref.WeakSet[Any] = weakref.WeakSet()


def _estimate(
    module: nn.Module,
    batch: Any,
    *,
    optimizer_factory: Callable[[nn.Module], Any] | None,
    training_step: Callable[[nn.Module, Any], Any] | None,
    precision: str | int | Precision,
    accumulate_grad_batches: int,
    gradient_checkpointing: bool,
    device: torch.device | str | None,
    steps: int,
    copy_module: bool,
    prefetch: bool,
    world_size: int,
    prepare: Callable[[nn.Module], Any] | None,
    ddp_buckets: bool,
    finite_checks: bool,
) -> Estimate:
    started = time.perf_counter()
    compiled = is_compiled(module)
    module = uncompiled(module)
    precision = Precision.parse(precision)
    accumulate = max(1, int(accumulate_grad_batches))
    steps = max(2, int(steps))
    target, fake_device = _devices(module, device)
    emulate_cuda = target.type == "cuda" and fake_device.type != "cuda"
    lightning = _is_lightning_module(module)
    manual = lightning and not getattr(module, "automatic_optimization", True)
    if manual and accumulate > 1:
        # Before the fake copy and configure_optimizers: for a large model those take a while.
        raise ValueError(
            "accumulate_grad_batches > 1 with manual optimization: Lightning refuses it too (accumulate in "
            "training_step, stepping every N batches)"
        )

    sharded = sharded_already(module)
    if sharded is not None:
        raise ValueError(
            f"{type(module).__name__} is sharded in this process already ({sharded}): the estimate copies a module "
            "before it is sharded; estimate the run beforehand, e.g. estimate(module, batch, world_size=N) on the "
            "unsharded module or `memtrace estimate --config ... --fsdp N`"
        )
    world_size = check_world_size(world_size)
    if ddp_buckets and world_size > 1:
        raise ValueError("ddp_buckets is for a DDP run and world_size > 1 for an FSDP one: a run is one or the other")
    world = fake_world(world_size, fake_device.type) if world_size > 1 else contextlib.nullcontext()
    mode = fake_mode()
    with (
        warnings.catch_warnings(),
        outer_modes_paused(),
        compiled_code_runs_eagerly(),
        meta_failures_unlogged(),
        own_prints_dropped(),
        world as mesh,
    ):
        warnings.simplefilter("ignore")
        model = fake_copy(module, mode, fake_device, precision.param_dtype, in_place=not copy_module)
        model.train()
        if prepare is not None:
            _prepare(model, prepare, mode)
        if gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        blocks = shard_like_the_run(model, mesh) if mesh is not None else 0
        if manual:
            optimizers, scheduler_configs = _build_manual_optimizers(model, module, mode, target, optimizer_factory)
            optimizer = optimizers[0]
        else:
            optimizer = _build_optimizer(model, module, mode, target, optimizer_factory, lightning)
            optimizers, scheduler_configs = [optimizer], []
        prefetch = prefetch and not emulate_cuda and fake_device.type == "cpu"
        scratch = KernelScratch() if target.type == "cpu" else None
        workspaces = CublasWorkspaces(workspace_bytes(target)) if target.type == "cuda" else None
        allocator = _cuda_allocator() if target.type == "cuda" else None
        cuda_autocast = emulate_cuda and precision.autocast_dtype is not None
        with (
            cuda_autocast_policy() if cuda_autocast else contextlib.nullcontext(),
            sdpa_watched(cuda_stand_in=emulate_cuda) as kernels,
            answered_as_the_batch(batch),
            no_layer_dropped(),
            grouped_mm_in_every_dtype(model),
            values_answered(mode, finite_checks) as values_read,
        ):
            try:
                records = run_steps(
                    model,
                    optimizer,
                    batch,
                    mode,
                    fake_device,
                    precision,
                    accumulate,
                    steps,
                    lightning,
                    training_step,
                    prefetch,
                    ddp_buckets,
                    scratch if scratch is not None else workspaces,
                    host_offload=target.type == "cuda",
                    allocator=allocator,
                    manual=(optimizers, scheduler_configs) if manual else None,
                )
            except FiniteCheckNeeded:
                raise
            except value_dependent_errors() as error:
                raise ValueError(_needs_values(error, model)) from None
            except AssertionError as error:
                if _REAL_TENSOR_REFUSED not in str(error):
                    raise
                raise ValueError(_real_tensor_used(error)) from None
            except unsupported_operator_error() as error:  # a RuntimeError: before the next
                raise ValueError(_no_fake_kernel(error)) from None
            except RuntimeError as error:
                if _NUMPY_REFUSED not in str(error):
                    raise
                raise ValueError(_needs_values(error, model, asked="Tensor.numpy()")) from None
    if emulate_cuda:
        records = _without_host_state(records, optimizers, allocator)
    batch_size, seq_len = batch_dims(batch)
    return Estimate(
        records=tuple(records),
        closed_form=closed_form(
            model,
            optimizers if manual else optimizer,
            steps_on_device=target.type == "cpu" or not all(_steps_on_host(o) for o in optimizers),
        ),
        device=target.type,
        precision=precision.value,
        optimizer=" + ".join(type(o).__name__ for o in optimizers),
        optimizer_detail="; ".join(detail for detail in map(_optimizer_detail, optimizers) if detail),
        world_size=world_size,
        sharding=sharding_label(world_size, blocks),
        batch_size=batch_size,
        seq_len=seq_len,
        accumulate_grad_batches=accumulate,
        gradient_checkpointing=bool(gradient_checkpointing or _checkpointing_on(model)),
        quantization=quantized_layers(model),
        lora=lora_description(model),
        seconds=time.perf_counter() - started,
        attention=attention_label(attn_implementation(model), kernels, emulate_cuda),
        compiled=compiled,
        values_read=tuple(values_read.places),
        sparse_gradients=_has_sparse_gradients(model),
        ddp_bucket_bytes=bucket_bytes(model) if ddp_buckets else 0,
        scratch_unmeasured=tuple(scratch.unmeasured) if scratch is not None else (),
        blas_workspace_bytes=workspaces.held_bytes if workspaces is not None else 0,
        allocator_log=allocator.log if allocator is not None else None,
    )


def _cuda_allocator() -> ModelledCudaAllocator:
    """The caching allocator's model, with the settings this process's environment gives a CUDA run."""
    return ModelledCudaAllocator(CachingAllocatorModel(AllocatorSettings.from_environment()))


def estimate_for_module(
    pl_module: nn.Module,
    batch: Any,
    precision: str | int | Precision = "32-true",
    accumulate_grad_batches: int = 1,
    optimizers_factory: Callable[[nn.Module], Any] | None = None,
    gradient_checkpointing: bool = False,
    device: torch.device | str | None = None,
    steps: int = 3,
    ddp_buckets: bool = False,
) -> Estimate:
    """The estimate for the callback: the real LightningModule and its first batch, copied onto fake tensors.

    Args:
        pl_module: The module being trained (real weights are not touched; nothing real is allocated).
        batch: Its first batch (as ``on_train_batch_start`` receives it).
        precision: The Trainer's precision (``trainer.precision``).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``.
        optimizers_factory: ``factory(fake_module) -> optimizer``; default: the module's ``configure_optimizers``.
        gradient_checkpointing: Turn checkpointing on in the copy (False keeps the module's own setting).
        device: Device to estimate for; default the module's.
        steps: Optimizer steps to estimate; 3 covers the callback's default window.
        ddp_buckets: The Trainer's model is DDP's, with its gradient buckets (see :func:`estimate`).
    """
    return estimate(
        pl_module,
        batch,
        optimizer_factory=optimizers_factory,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_checkpointing=gradient_checkpointing,
        device=device if device is not None else _module_device(pl_module),
        steps=steps,
        ddp_buckets=ddp_buckets,
    )


#: How a fake tensor refuses to give its values to NumPy (``.numpy()``, ``np.asarray``, scikit-learn's metrics).
_NUMPY_REFUSED = ".numpy() is not supported for tensor subclasses"


def _needs_values(error: Exception, model: nn.Module, asked: str | None = None) -> str:
    """One line for a step that asked a fake tensor for a value: the op (``asked``, else the error's), the line that
    asked, what to do."""
    frames = traceback_frames(error, depth=128, own_frames=True)
    text = (
        f"the training step needs tensor values, which an estimate on fake tensors does not have ({asked or error}, "
        f"at {format_frame(asking_frame(frames))}): a step whose shapes or branches follow values (boolean-mask "
        "indexing, nonzero, torch.where with one argument, an integer .item(), an if on a tensor other than a NaN or "
        "infinity check, values read into NumPy, a loop over the experts a batch is routed to) cannot be estimated"
    )
    if _has_experts(model):
        text += (
            "; transformers 5 runs mixture-of-experts layers as grouped matrix products "
            "(experts_implementation='grouped_mm', its default), which the estimate runs"
        )
    return text


#: How FakeTensorMode refuses a real tensor as an operator's input.
_REAL_TENSOR_REFUSED = "Please convert all Tensors to FakeTensors first"


def _real_tensor_used(error: AssertionError) -> str:
    """One line for a step that used a real tensor the estimate did not copy (a global's, a closure's): the op, the
    line, what to do."""
    found = str(error).partition("Found in ")[2]
    op = found.partition("(")[0] or "an operator"
    place = format_frame(asking_frame(traceback_frames(error, depth=128, own_frames=True)))
    return (
        f"the training step gives {op} a real tensor that is neither the module's nor the batch's (a global's or a "
        f"closure's, at {place}): the estimate copies the module's parameters, buffers and tensor attributes and the "
        "batch onto fake tensors, nothing else; register it as a buffer (self.register_buffer) or an attribute of the "
        "module, or make it inside the step"
    )


def _no_fake_kernel(error: Exception) -> str:
    """One line for an operator torch has no fake implementation of: which, where (the line that called it, or the
    backward, where autograd's engine did), why not run."""
    frame = asking_frame(traceback_frames(error, depth=128, own_frames=True))
    filename = normalize_path(str(frame.get("filename", ""))) if frame is not None else ""
    place = "in the backward" if filename.endswith("/torch/autograd/graph.py") else f"at {format_frame(frame)}"
    return (
        f"torch has no fake implementation of {error} ({place}), and the estimate does not run the real kernel in "
        "its place (torch would, on zeros of the real sizes: real memory, on the run's device)"
    )


def _has_experts(model: nn.Module) -> bool:
    """Whether a Hugging Face config in the model (a LightningModule holds one in a submodule) has several experts."""
    names = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    config = next((sub.config for sub in model.modules() if getattr(sub, "config", None) is not None), None)
    return any(isinstance(getattr(config, name, None), int) and getattr(config, name) > 1 for name in names)


# ------------------------------------------------------------------------------------------------ devices
def _module_device(module: nn.Module) -> torch.device:
    return next((t.device for t in module.parameters()), torch.device("cpu"))


def _target_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        target = torch.device(device)
    else:
        target = _module_device(module)
        if target.type == "meta":
            target = torch.device("cuda")
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"the estimate supports cpu and cuda targets, not {target.type}")
    return target


def _devices(module: nn.Module, device: torch.device | str | None) -> tuple[torch.device, torch.device]:
    """The target device, and the device of the fake tensors (CPU stands in for CUDA on a machine without it)."""
    target = _target_device(module, device)
    fake_device = target if target.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
    if fake_device.type == "cuda" and fake_device.index is None:
        fake_device = torch.device("cuda", torch.cuda.current_device())
    return target, fake_device


# ------------------------------------------------------------------------------------------------ the model
def _is_lightning_module(module: nn.Module) -> bool:
    try:
        import lightning.pytorch as pl
    except ImportError:  # pragma: no cover - lightning is a dependency
        return False
    return isinstance(module, pl.LightningModule)


#: Hugging Face's methods that turn activation checkpointing on, each with its keyword for the checkpoint's options:
#: the newer name first (transformers 5.2x deprecates the older).
_HF_CHECKPOINTING = (
    ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
    ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
)


def hf_checkpointing_method(model: nn.Module) -> tuple[nn.Module, str, str] | None:
    """The first submodule with one of Hugging Face's checkpointing methods, the method's name and its keyword; None
    for a model without one."""
    for sub in model.modules():
        for method, keyword in _HF_CHECKPOINTING:
            if callable(getattr(sub, method, None)):
                return sub, method, keyword
    return None


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    found = hf_checkpointing_method(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no gradient_checkpointing_enable(): enable checkpointing in the module"
        )
    sub, method, keyword = found
    getattr(sub, method)(**{keyword: {"use_reentrant": False}})
    config = getattr(sub, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def _prepare(model: nn.Module, prepare: Callable[[nn.Module], Any], mode: Any) -> None:
    """Run ``prepare`` on the fake model under the fake mode."""
    with mode:
        prepare(model)


def _checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(sub, "gradient_checkpointing", False) is True for sub in model.modules())


def _has_sparse_gradients(model: nn.Module) -> bool:
    """Whether an embedding of the model makes sparse gradients (``sparse=True``, a trainable weight)."""
    return any(
        isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad
        for sub in model.modules()
    )


# ------------------------------------------------------------------------------------------------ the optimizer
def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer out of whatever ``configure_optimizers`` returned."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    optimizer = getattr(configured, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise ValueError(f"no optimizer in what configure_optimizers returned ({type(configured).__name__})")


def _in_train_mode(optimizer: torch.optim.Optimizer, mode: Any) -> torch.optim.Optimizer:
    """The optimizer, put in train mode where it has one that is off: a schedule-free optimizer (``schedulefree``'s,
    whose groups say ``train_mode``) refuses to step until ``optimizer.train()``, which a run calls in one of the
    module's hooks before its first step (hooks the estimate does not run)."""
    train_mode_off = any(group.get("train_mode") is False for group in optimizer.param_groups)
    if train_mode_off and callable(getattr(optimizer, "train", None)):
        with mode:
            optimizer.train()
    return optimizer


def _on_the_copy(optimizer: torch.optim.Optimizer, original: nn.Module, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer, or where it holds the original module's parameters, a new one of its class over the copy's.

    ``configure_optimizers`` may hand out the run's own parameters (``self.trainer.model.parameters()``, as Lightning's
    FSDP documentation writes it, which the copy's Trainer gives) or even the run's own optimizer (one made beforehand
    and returned by a closure). That optimizer is the run's: stepping or changing it would change the run (its hooks,
    MemTrace's among them, its scheduler's counter, its parameters). The new one has the same groups and settings.
    """
    groups = optimizer.param_groups
    if all(_is_fake_parameter(param) for group in groups for param in group["params"]):
        return optimizer
    fake_of = {id(real): fake for real, fake in zip(original.parameters(), model.parameters())}
    copied = [{**group, "params": [fake_of.get(id(param), param) for param in group["params"]]} for group in groups]
    if not all(_is_fake_parameter(param) for group in copied for param in group["params"]):
        name = type(optimizer).__name__
        raise ValueError(f"configure_optimizers gave {name} parameters that are not the module's own")
    try:
        return type(optimizer)(copied)
    except TypeError:  # a constructor that wants its settings as arguments: the base class's, with the same defaults
        new = type(optimizer).__new__(type(optimizer))
        torch.optim.Optimizer.__init__(new, copied, dict(optimizer.defaults))
        return new


def _is_fake_parameter(param: Tensor) -> bool:
    """A fake tensor, or a wrapper (a sharded parameter's DTensor) whose memory is held in fake ones."""
    held = list(memory_tensors([param]))
    return bool(held) and all(is_fake(tensor) for tensor in held)


def _made_on_fakes(mode: Any, make: Callable[[], Any]) -> Any:
    """``make()`` (a factory's or ``configure_optimizers``' optimizers) under the fake mode, bitsandbytes' 8-bit
    optimizers with quantization maps of shapes only (:func:`~.remedies.shape_only_quantization_maps`); made again
    where ``make`` imported bitsandbytes itself, so its maps could not be shapes only the first time."""
    imported = bnb_optimizers_imported()
    try:
        try:
            with mode, shape_only_quantization_maps():
                return make()
        except value_dependent_errors():
            if imported or not bnb_optimizers_imported():
                raise
        with mode, shape_only_quantization_maps():
            return make()
    except value_dependent_errors() as error:
        frame = format_frame(asking_frame(traceback_frames(error, depth=128, own_frames=True)))
        raise ValueError(
            f"the optimizer reads tensor values when it is made, which an estimate on fake tensors does not have "
            f"({error}, at {frame})"
        ) from None


def _build_optimizer(
    model: nn.Module,
    original: nn.Module,
    mode: Any,
    target: torch.device,
    optimizer_factory: Callable[[nn.Module], Any] | None,
    lightning: bool,
) -> torch.optim.Optimizer:
    """The optimizer on the fake parameters: the factory's, the LightningModule's, or AdamW(lr=1e-3); ``original``:
    the module ``model`` was copied from."""
    if optimizer_factory is not None:
        optimizer = _first_optimizer(_made_on_fakes(mode, lambda: optimizer_factory(model)))
    elif lightning:
        optimizer = _first_optimizer(_made_on_fakes(mode, model.configure_optimizers))
    else:
        with mode:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = _in_train_mode(_on_the_copy(optimizer, original, model), mode)
    if target.type == "cuda":
        # torch picks foreach kernels for plain CUDA tensors only; fake tensors would get the single-tensor path.
        _use_cuda_defaults(optimizer)
    return optimizer


def _build_manual_optimizers(
    model: nn.Module,
    original: nn.Module,
    mode: Any,
    target: torch.device,
    optimizer_factory: Callable[[nn.Module], Any] | None,
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Under manual optimization: every optimizer on the fake parameters and the schedulers' configs, from the
    factory or the LightningModule's ``configure_optimizers``. A scheduler of an optimizer that had to be made anew
    over the copy's parameters (see :func:`_on_the_copy`) is left out: it steps the run's own."""
    make = (lambda: optimizer_factory(model)) if optimizer_factory is not None else model.configure_optimizers
    optimizers, scheduler_configs = configured(_made_on_fakes(mode, make))
    if not optimizers:
        raise ValueError("configure_optimizers returned no optimizer")
    on_copy = [_in_train_mode(_on_the_copy(optimizer, original, model), mode) for optimizer in optimizers]
    replaced = {id(old) for old, new in zip(optimizers, on_copy) if old is not new}
    scheduler_configs = [c for c in scheduler_configs if id(getattr(c.scheduler, "optimizer", None)) not in replaced]
    if target.type == "cuda":
        for optimizer in on_copy:
            _use_cuda_defaults(optimizer)
    return on_copy, scheduler_configs


def _optimizer_detail(optimizer: torch.optim.Optimizer) -> str:
    """What the class name leaves out and memory depends on: SGD's momentum (a buffer per parameter, or none)."""
    if type(optimizer).__name__ != "SGD":
        return ""
    momenta = sorted({float(g.get("momentum", 0) or 0) for g in optimizer.param_groups})
    if not any(momenta):
        return "no momentum, no state"
    return "momentum " + "/".join(f"{m:g}" for m in momenta)


def _use_cuda_defaults(optimizer: torch.optim.Optimizer) -> None:
    """Where CUDA would default to foreach kernels, use them on the stand-in CPU tensors too."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def _steps_on_host(optimizer: torch.optim.Optimizer) -> bool:
    return not any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)


def _step_tensors(optimizer: torch.optim.Optimizer) -> dict[int, torch.UntypedStorage]:
    steps: list[Tensor] = []
    for state in optimizer.state.values():
        value = state.get("step") if isinstance(state, Mapping) else None
        if isinstance(value, Tensor):
            steps.append(value)
    return unique_storages(steps)


#: Elements from which a bitsandbytes paged optimizer keeps a parameter's state in CUDA managed memory (its
#: ``get_state_buffer``: ``p.numel() < 1e5`` stays an ordinary device tensor).
_BNB_PAGED_MIN_NUMEL = 100_000


def _paged_buffers(optimizer: torch.optim.Optimizer) -> dict[int, torch.UntypedStorage]:
    """A bitsandbytes paged optimizer's state buffers that CUDA would page (``state1``/``state2`` of a parameter of at
    least :data:`_BNB_PAGED_MIN_NUMEL` elements, as its ``get_state_buffer`` decides): CUDA managed memory, which the
    caching allocator never counts and the driver evicts to the host under pressure."""
    if not getattr(optimizer, "is_paged", False):
        return {}
    buffers: list[Tensor] = []
    for param, state in optimizer.state.items():
        if isinstance(param, Tensor) and param.numel() >= _BNB_PAGED_MIN_NUMEL and isinstance(state, Mapping):
            buffers.extend(state[k] for k in ("state1", "state2") if isinstance(state.get(k), Tensor))
    return unique_storages(buffers)


def _without_host_state(
    records: list[PhaseRecord],
    optimizers: Sequence[torch.optim.Optimizer],
    allocator: ModelledCudaAllocator | None = None,
) -> list[PhaseRecord]:
    """On CUDA, optimizer state outside the caching allocator: Adam's ``step`` scalars (host tensors) and a paged
    optimizer's paged buffers (:func:`_paged_buffers`). Taken out of the stand-in CPU measurement from the first
    optimizer step on (where the caching allocator was modelled, their blocks out of allocated and peak; the small
    segments they shared with device tensors stay reserved)."""
    storages = [s for o in optimizers if _steps_on_host(o) for s in _step_tensors(o).values()]
    storages += [s for o in optimizers for s in _paged_buffers(o).values()]
    if not storages:
        return records
    host = sum(s.nbytes() for s in storages)
    if host == 0:
        return records
    blocks = sum(allocator.model.round_size(s.nbytes()) for s in storages) if allocator is not None else host
    out = []
    seen = False
    for record in records:
        if not seen and record.optimizer_state_bytes >= host and record.phase == Phase.AFTER_OPTIMIZER_STEP:
            seen = True
        if seen:
            record = dataclasses.replace(
                record,
                allocated_bytes=record.allocated_bytes - blocks,
                reserved_bytes=record.reserved_bytes - (host if allocator is None else 0),
                peak_bytes=record.peak_bytes - blocks,
                optimizer_state_bytes=record.optimizer_state_bytes - host,
            )
        out.append(record)
    return out
