"""Attention on fake tensors as the target device runs it: SDPA's kernel, watched (and for CUDA, stood in for).

What attention saves for backward is most of what separates one implementation from another: eager attention and
SDPA's math kernel keep the ``B·H·L²`` probabilities (and, with dropout, the dropout mask); SDPA's fused kernels
(CPU flash, CUDA flash, CUDA memory-efficient) keep only q, k, v, the output and an fp32 logsumexp of ``B·H·L``.

On a CPU target the fake step dispatches SDPA exactly as the real CPU run does (same dtype, autocast and dropout pick
the same kernel), so nothing is changed, only watched. On a CUDA target estimated with fake CPU tensors, the CPU kernel
choice would be wrong (CPU's flash kernel refuses dropout, CUDA's kernels take it), so each SDPA call runs on CPU's
flash kernel without dropout: its saved tensors (output and an fp32 logsumexp of ``B·H·L``) have the sizes of
CUDA's flash kernel's, and CUDA draws dropout inside the kernel from a seed (no mask kept). Left out: the philox seed
and offset (a few bytes) and the memory-efficient kernel's logsumexp rounded up to 32 positions.

Transformers reads values to choose its path (is the padding mask all ones, do the positions restart within a row),
and fake tensors have none: it would build a ``B×L×L`` mask that the real run never builds. :func:`sdpa_watched`
answers as the real batch would: padding and packing are read from the batch's real ``attention_mask`` and
``position_ids`` (a batch given as shapes: neither).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.estimator.fake import outer_modes_paused

#: SDPA's arguments in order (``F.scaled_dot_product_attention``'s signature).
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SdpaKernel(str, Enum):
    """The kernel an SDPA call ran on."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


#: The aten op that names each fused kernel (``_for_cpu`` included); no fused op means the math kernel.
_FUSED_OPS = (
    ("_scaled_dot_product_flash_attention", SdpaKernel.FLASH),
    ("_scaled_dot_product_efficient_attention", SdpaKernel.EFFICIENT),
    ("_scaled_dot_product_cudnn_attention", SdpaKernel.CUDNN),
)


class _KernelSpy(TorchDispatchMode):
    """Notes the fused SDPA op among the aten ops of one call (math is CompositeImplicit: it decomposes)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = SdpaKernel.MATH

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        for prefix, kernel in _FUSED_OPS:
            if name.startswith(prefix):
                self.kernel = kernel
        return func(*args, **(kwargs or {}))


def _bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


class _SdpaMode(TorchFunctionMode):
    """Watches every ``F.scaled_dot_product_attention`` call; with ``cuda_stand_in``, runs it on the flash kernel."""

    def __init__(self, cuda_stand_in: bool) -> None:
        super().__init__()
        self.cuda_stand_in = cuda_stand_in
        self.kernels: list[SdpaKernel] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if self.cuda_stand_in:
            out = self._on_flash(func, _bound(tuple(args), kwargs))
            if out is not None:
                return out
        spy = _KernelSpy()
        with spy:
            out = func(*args, **kwargs)
        self.kernels.append(spy.kernel)
        return out

    def _on_flash(self, func: Any, bound: dict[str, Any]) -> Any:
        """CUDA's fused kernel as CPU's flash kernel: no dropout mask kept; None where the flash kernel refuses."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        bound["dropout_p"] = 0.0  # CUDA's flash and efficient kernels draw dropout in the kernel (nothing saved)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = func(**bound)
        except RuntimeError:
            return None  # e.g. a mask shape the flash kernel refuses: the call runs as it is, on math
        self.kernels.append(SdpaKernel.FLASH)
        return out


def _fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


@contextlib.contextmanager
def _packing_as_in_the_batch(packed: bool) -> Iterator[None]:
    """Transformers' packed-sequence check, answered for fake position ids (which it cannot read) as the real batch
    answers it.

    Packed (the batch's ``position_ids`` restart within a row), the check makes its mask from the fake ids as the real
    run makes it from the real ones. One sequence per row (or positions the model makes itself), what the check gives
    is asked of the check itself, on real positions ``[[0, 1]]``: transformers 5 gives None (no packing: SDPA may skip
    the causal mask), 4.57 a mask of zeros in any case (the causal mask is built), made from the fake ids.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        if not _fake(position_ids) or packed:
            return original(position_ids)
        with outer_modes_paused():
            unpacked = original(torch.arange(2).unsqueeze(0))
        return None if unpacked is None else original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


#: Transformers' "may SDPA's causal mask be skipped?" checks, whose first argument is the 2-D padding mask:
#: ``(module, owner, name)``, the owner a class where the function is a static method of one.
_CAUSAL_SKIP_CHECKS = (
    ("transformers.masking_utils", None, "_ignore_causal_mask_sdpa"),
    ("transformers.modeling_attn_mask_utils", "AttentionMaskConverter", "_ignore_causal_mask_sdpa"),
)


@contextlib.contextmanager
def _padding_as_in_the_batch(padded: bool) -> Iterator[None]:
    """Transformers' check whether SDPA may skip the causal mask (and take ``is_causal``, the flash kernel's way),
    answered for a fake 2-D padding mask as the real batch answers it.

    The check reads the mask's values: a fake one has none, and transformers then builds a ``B×1×L×L`` mask (5.x)
    or cannot go on (4.x). With no padding (a batch whose ``attention_mask`` is all ones, or has none) the mask is
    read as absent, which the check treats as all ones; with padding the check's answer is no, as on the real batch.
    Transformers' warning about padding without a mask is skipped for fake ids (see ``_PADDING_WARNING``).
    """
    patched: list[tuple[Any, str, Any]] = []
    for module_name, owner_name, name in _CAUSAL_SKIP_CHECKS:
        module = sys.modules.get(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        original = owner.__dict__.get(name) if owner is not None else None
        function = original.__func__ if isinstance(original, staticmethod) else original
        if not callable(function):
            continue
        checked = _answered_for_fake_masks(function, padded)
        setattr(owner, name, staticmethod(checked) if isinstance(original, staticmethod) else checked)
        patched.append((owner, name, original))
    modeling = sys.modules.get("transformers.modeling_utils")
    model_class = getattr(modeling, "PreTrainedModel", None)
    warn = model_class.__dict__.get(_PADDING_WARNING) if model_class is not None else None
    if callable(warn):
        setattr(model_class, _PADDING_WARNING, _skipped_for_fake_ids(warn))
        patched.append((model_class, _PADDING_WARNING, warn))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


#: Transformers' one-time warning that ``input_ids`` may hold padding and no ``attention_mask`` was given: it reads
#: the ids, so transformers 5 skips it for fake ones, and 4.57 could not go on.
_PADDING_WARNING = "warn_if_padding_and_no_attention_mask"


def _skipped_for_fake_ids(warn: Any) -> Any:
    @functools.wraps(warn)
    def skipped(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return None if _fake(input_ids) else warn(self, input_ids, *args, **kwargs)

    return skipped


def _answered_for_fake_masks(check: Any, padded: bool) -> Any:
    name = next(iter(inspect.signature(check).parameters))  # the mask (``padding_mask``, ``attention_mask``)

    @functools.wraps(check)
    def answered(*args: Any, **kwargs: Any) -> Any:
        mask = args[0] if args else kwargs.get(name)
        if _fake(mask) and mask.dim() == 2:
            if padded:
                return False
            if args:
                args = (None, *args[1:])
            else:
                kwargs[name] = None
        return check(*args, **kwargs)

    return answered


@contextlib.contextmanager
def sdpa_watched(cuda_stand_in: bool, padded: bool = False, packed: bool = False) -> Iterator[list[SdpaKernel]]:
    """Within: the kernel of each SDPA call is appended to the yielded list.

    Args:
        cuda_stand_in: The target is CUDA and the tensors are fake CPU ones: run SDPA on CPU's flash kernel without
            dropout, whose saved tensors have the sizes CUDA's flash or memory-efficient kernel saves.
        padded: The batch's ``attention_mask`` marks padding (see :func:`_padding_as_in_the_batch`).
        packed: The batch's ``position_ids`` hold several sequences in a row (see :func:`_packing_as_in_the_batch`).
    """
    mode = _SdpaMode(cuda_stand_in)
    with _packing_as_in_the_batch(packed), _padding_as_in_the_batch(padded), mode:
        yield mode.kernels


def attn_implementation(model: nn.Module) -> str:
    """The Hugging Face attention implementation of the model (or of the first submodule with a config), or ``""``."""
    for sub in model.modules():
        value = getattr(getattr(sub, "config", None), "_attn_implementation", None)
        if isinstance(value, str) and value:
            return value
    return ""


def attention_label(implementation: str, kernels: list[SdpaKernel], cuda_stand_in: bool) -> str:
    """What the estimate ran, stated: ``eager``, ``sdpa (flash kernel)``, or the CUDA kernel assumed.

    Args:
        implementation: The Hugging Face attention implementation (``""`` for a module without one).
        kernels: The kernel of every SDPA call the estimate ran.
        cuda_stand_in: SDPA was run as CUDA would (see :func:`sdpa_watched`).
    """
    name = implementation or ("sdpa" if kernels else "")
    if not kernels:
        return name
    seen = list(dict.fromkeys(kernels))
    if cuda_stand_in:
        parts = []
        if SdpaKernel.FLASH in seen:
            parts.append("CUDA flash/efficient kernel assumed, sized by CPU's flash kernel")
        if SdpaKernel.MATH in seen:
            parts.append("math kernel where CPU's flash kernel refused the inputs (CUDA's fused kernels may take them)")
        return f"{name} ({'; '.join(parts)})"
    kernel_text = " + ".join(k.value for k in seen)
    return f"{name} ({kernel_text} kernel{'s' if len(seen) > 1 else ''})"
