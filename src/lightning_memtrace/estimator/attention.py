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

Which causal mask transformers builds for SDPA, if any, depends on values (padding, packing): see
:mod:`~lightning_memtrace.estimator.batch_values`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextlib.contextmanager
def sdpa_watched(cuda_stand_in: bool) -> Iterator[list[SdpaKernel]]:
    """Within: the kernel of each SDPA call is appended to the yielded list.

    Args:
        cuda_stand_in: The target is CUDA and the tensors are fake CPU ones: run SDPA on CPU's flash kernel without
            dropout, whose saved tensors have the sizes CUDA's flash or memory-efficient kernel saves.
    """
    mode = _SdpaMode(cuda_stand_in)
    with mode:
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
