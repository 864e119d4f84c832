"""Grouped matrix products on fake tensors in every dtype the real kernels take: mixture-of-experts layers.

Transformers 5 runs the experts of a mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek and others) as
``torch.nn.functional.grouped_mm`` by default. The real kernels take any floating dtype (CUDA's fast kernel is for
bfloat16 only, and a loop of ``mm`` calls does the rest there, as on CPU), but the meta kernel fake tensors run checks
for bfloat16, so a float32 step stopped at the first expert. Here such a call gets the output the real kernels make
(``create_grouped_gemm_output_tensor``: its shape, the dtype asked for, rows padded to 16 bytes); a bfloat16 call runs
the meta kernel unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.estimator.fake import is_fake

#: ``aten::_grouped_mm``'s arguments in order.
_ARGS = ("self", "mat2", "offs", "bias", "out_dtype")
#: The op (torch 2.8 and later; transformers runs its own fallback where it is missing).
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def output_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The shape of ``grouped_mm(mat_a, mat_b, offs=offs)``: a 2-D operand is cut into ``len(offs)`` groups."""
    groups = offs.size(0) if offs is not None else mat_a.size(0)
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # a weight's gradient: one product per group
        return [groups, mat_a.size(0), mat_b.size(1)]
    if mat_a.dim() == 2:  # tokens by expert against each expert's weight
        return [mat_a.size(0), mat_b.size(-1)]
    if mat_b.dim() == 2:
        return [mat_a.size(1), mat_b.size(1)]
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]


class _GroupedMmMode(TorchDispatchMode):
    """Answers ``aten._grouped_mm`` on fake tensors that are not both bfloat16 with the real kernel's output."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _GROUPED_MM:
            bound = dict(zip(_ARGS, args))
            bound.update(kwargs)
            mat_a, mat_b = bound["self"], bound["mat2"]
            if is_fake(mat_a) and not mat_a.dtype == mat_b.dtype == torch.bfloat16:
                dtype = bound.get("out_dtype") or mat_a.dtype
                shape = output_shape(mat_a, mat_b, bound.get("offs"))
                return mat_a.new_empty_strided(shape, _padded_strides(shape, dtype), dtype=dtype)
        return func(*args, **kwargs)


def _padded_strides(shape: list[int], dtype: torch.dtype) -> list[int]:
    """Row-major strides with each row rounded up to 16 bytes, as the real kernels lay their output out."""
    alignment = max(1, 16 // dtype.itemsize)
    row = -(-shape[-1] // alignment) * alignment
    return [shape[1] * row, row, 1] if len(shape) == 3 else [row, 1]


@contextlib.contextmanager
def grouped_mm_in_every_dtype(model: nn.Module) -> Iterator[None]:
    """Within: fake grouped matrix products in float32 (and other dtypes) run as the real kernels do.

    Only for a model with a weight of three or more dimensions (experts stacked as ``E×out×in``): the watch costs a
    Python call per op, about 8% of the estimate of a dense 1.5B model, which has none.
    """
    if _GROUPED_MM is None or not any(param.dim() >= 3 for param in model.parameters()):
        yield
        return
    with _GroupedMmMode():
        yield
