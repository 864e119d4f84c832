"""CUDA's autocast on the CPU tensors that stand in for CUDA ones: the dtypes a mixed-precision CUDA run computes in.

Where the target is CUDA and this machine has none, the estimate's steps run on fake CPU tensors, and ``torch.autocast``
then follows CPU's op lists. They differ from CUDA's: CUDA computes ``softmax``, ``log_softmax``, ``layer_norm``,
``group_norm``, ``rms_norm``, ``exp``, ``pow``, ``rsqrt``, ``sum``, ``cumsum``, norms, upsampling and more in
``float32`` where CPU keeps ``bfloat16``/``float16``, and runs ``mv``/``addmv``/``addr`` and the RNN cells in the lower
precision where CPU keeps ``float32``; CPU casts ``cross_entropy``'s input, 3-d pooling, padding and more to
``float32``, which CUDA leaves as they are. A step that applies ``F.softmax`` to reduced-precision attention scores,
say, saves ``float32`` probabilities on CUDA: twice the bytes CPU's lists give.

:func:`cuda_autocast_policy` gives each operator that CUDA's autocast covers and CPU's does not a CPU autocast kernel
with CUDA's policy for it (:data:`CUDA_POLICIES`, from torch's ``autocast_mode.cpp``), and lets the operators only
CPU's covers through untouched, for as long as it is entered; the registrations are removed on the way out. Which
operators each covers is asked of torch's dispatcher (a CPU-only build knows its CUDA autocast kernels), so the lists
follow the torch installed.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture import torch_private

_REDUCED = (torch.bfloat16, torch.float16)


class Policy(str, enum.Enum):
    """What CUDA's autocast does with an operator's floating-point arguments."""

    #: Reduced-precision arguments are cast to ``float32``.
    FP32 = "fp32"
    #: Without a ``dtype`` argument, the operator is asked for a ``float32`` result (the input is not copied).
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    #: Floating-point arguments are cast to the autocast dtype.
    LOWER_PRECISION = "lower_precision_fp"
    #: Floating-point arguments are cast to the widest of their dtypes.
    PROMOTE = "promote"
    #: Not covered: the operator runs on its arguments' own dtypes.
    NONE = "none"


def _ops(policy: Policy, names: str) -> dict[str, Policy]:
    return dict.fromkeys(names.split(), policy)


#: CUDA's autocast policy per operator (``name.overload`` or, for every overload, ``name``), from torch's
#: ``aten/src/ATen/autocast_mode.cpp``; upsampling's was read from torch's CUDA kernels on fake CUDA tensors.
CUDA_POLICIES: dict[str, Policy] = {
    **_ops(
        Policy.LOWER_PRECISION,
        "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input conv_transpose3d.input "
        "convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul "
        "linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell "
        "_scaled_dot_product_flash_attention scaled_dot_product_attention",
    ),
    **_ops(
        Policy.FP32,
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
        "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm rms_norm norm.Scalar "
        "norm.ScalarOpt_dim frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss "
        "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss "
        "mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
        "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d upsample_nearest2d "
        "upsample_nearest3d _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d "
        "upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d "
        "_upsample_bicubic2d_aa",
    ),
    **_ops(
        Policy.FP32_SET_OPT_DTYPE,
        "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
        "linalg_matrix_norm.str_ord sum sum.dim_IntList",
    ),
    **_ops(
        Policy.PROMOTE,
        "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
    ),
}
#: Operators only CPU's autocast covers that keep CPU's kernel: ones whose CUDA run takes another path altogether
#: (oneDNN's LSTM layer, the fused multi-head attention's CPU path, ``conv*d`` with string padding,
#: ``_addmm_activation``) or gives the same dtypes without it (``cat``, ``stack``, ``index_copy`` promote by
#: themselves).
KEEP_CPU_KERNEL = frozenset(
    {
        "mkldnn_rnn_layer", "_native_multi_head_attention", "conv1d.padding", "conv2d.padding", "conv3d.padding",
        "_addmm_activation", "cat", "stack", "index_copy",
    }
)


def _eligible(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast_all(value: Any, cast: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return cast(value) if _eligible(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_all(v, cast) for v in value)
    return value


def _tensors(values: Any) -> Iterator[Tensor]:
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _kernel(op: Any, policy: Policy) -> Callable[..., Any]:
    """A CPU autocast kernel applying CUDA's ``policy`` to ``op``, then calling it with autocast off, as torch's own
    autocast kernels do."""
    names = torch_private.argument_names(op)
    dtype_at = names.index("dtype") if "dtype" in names else None

    def kernel(_keyset: Any, *args: Any, **kwargs: Any) -> Any:
        cast = _cast_for(policy, args, kwargs)
        if cast is not None:
            args, kwargs = _cast_all(args, cast), {k: _cast_all(v, cast) for k, v in kwargs.items()}
        elif policy is Policy.FP32_SET_OPT_DTYPE and dtype_at is not None and args and _eligible(args[0]):
            given = args[dtype_at] if len(args) > dtype_at else kwargs.get("dtype")
            if given is None:
                if len(args) > dtype_at:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
        with torch_private.autocast_off("cpu"):
            return op(*args, **kwargs)

    return kernel


def _cast_for(policy: Policy, args: tuple, kwargs: dict[str, Any]) -> Callable[[Tensor], Tensor] | None:
    """The cast ``policy`` applies to every eligible argument of this call, None where it casts none (it sets a
    ``dtype`` instead, or there is nothing to promote)."""
    if policy is Policy.FP32:
        return _to(torch.float32)
    if policy is Policy.LOWER_PRECISION:
        return _to(torch.get_autocast_dtype("cpu"))
    if policy is Policy.PROMOTE:
        dtypes = [t.dtype for t in _tensors((*args, *kwargs.values())) if _eligible(t)]
        return _to(functools.reduce(torch.promote_types, dtypes)) if dtypes else None
    return None


def _to(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    def cast(tensor: Tensor) -> Tensor:
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    return cast


def _policy(name: str) -> Policy | None:
    """CUDA's policy for ``name`` (``packet.overload``, ``packet`` for the default overload), None where unknown."""
    return CUDA_POLICIES.get(name) or CUDA_POLICIES.get(name.partition(".")[0])


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)


@functools.lru_cache(maxsize=1)
def differing_ops() -> dict[Any, Policy]:
    """The operators whose autocast differs between CUDA and CPU in this torch, with CUDA's policy for each
    (:attr:`Policy.NONE` for those CPU's covers and CUDA's does not)."""
    has_kernel = torch_private.has_autocast_kernel
    out: dict[Any, Policy] = {}
    for qualified in torch_private.operator_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "aten":
            continue
        on_cuda, on_cpu = has_kernel(qualified, "cuda"), has_kernel(qualified, "cpu")
        if on_cuda == on_cpu:
            continue
        policy = _policy(name) if on_cuda else (None if name in KEEP_CPU_KERNEL else Policy.NONE)
        op = _overload(name) if policy is not None else None
        if op is not None:
            out[op] = policy
    return out


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[int]:
    """While inside, CPU autocast follows CUDA's op lists where they differ (see the module's text); yields how many
    operators it changed. Process-wide, as any kernel registration: for a CUDA target estimated on CPU only. Replacing
    CPU's own kernels makes torch warn: silenced here."""
    with torch_private.kernel_registrations("aten") as library:
        ops = differing_ops()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for op, policy in ops.items():
                name = op.name().split("::", 1)[1]
                if policy is Policy.NONE:
                    library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
                else:
                    library.impl(name, _kernel(op, policy), "AutocastCPU", with_keyset=True)
        yield len(ops)
