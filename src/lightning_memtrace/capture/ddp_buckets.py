"""DDP's gradient buckets: the memory ``DistributedDataParallel`` adds to every rank's training step.

DDP's reducer all-reduces gradients in *buckets*: flat tensors made when the model is wrapped, that live as long as
the wrapper, and hold one slot for every parameter that requires a gradient (each parameter once, in its own dtype).
With ``gradient_as_bucket_view=False`` (DDP's default, and Lightning's ``DDPStrategy``'s) the gradients are separate
tensors, and the buckets are a second copy of them: on every rank, for the whole run, as many bytes as the
gradients. With ``gradient_as_bucket_view=True`` the gradients are views into the buckets, and nothing is added.

The estimate adds the buckets to its fake run where the run has them (:func:`bucket_tensors`), so that its rows and
peak are a DDP rank's; a real run's MemTrace counts them as ``other``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from lightning_memtrace.units import format_bytes

if TYPE_CHECKING:  # torch is imported where a function needs it: the analysis side reads the remedy's text alone
    import torch
    from torch import Tensor, nn

#: Lightning's strategy that makes DDP's gradients views of its buckets (no second copy), as a ``Trainer`` takes it.
BUCKET_VIEW_STRATEGY = "DDPStrategy(gradient_as_bucket_view=True)"
#: DDP's default limits on a bucket's bytes: the first bucket, then every other one (``bucket_cap_mb=25``).
FIRST_BUCKET_BYTES = 1024**2
BUCKET_BYTES = 25 * 1024**2


def bucket_view_saving(nbytes: int) -> str:
    """What the bucket views do, in the words every place that advises them uses: the Trainer argument and its saving
    of ``nbytes`` (the buckets' bytes)."""
    return (
        f"Trainer(strategy={BUCKET_VIEW_STRATEGY}) makes the gradients views of the buckets and saves "
        f"{format_bytes(nbytes)} on every rank"
    )


def _bucketed(parameters: Iterable[Tensor]) -> list[list[Tensor]]:
    """The parameters in buckets of about DDP's sizes: only those that require a gradient, each once, in reverse
    order, one bucket per dtype and device at a time, closed once it holds its limit (a parameter is never split).

    DDP's own grouping changes with its options and after its first step (buckets rebuilt in the order the gradients
    became ready); the bytes, one slot per parameter, do not. The count of buckets matters only to an allocator that
    rounds each block (CUDA's, to 512 B)."""
    seen: set[int] = set()
    closed: list[list[Tensor]] = []
    open_groups: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], int]] = {}
    limits: dict[tuple[torch.dtype, torch.device], int] = {}
    for param in reversed([p for p in parameters if p.requires_grad]):
        if id(param) in seen:
            continue
        seen.add(id(param))
        key = (param.dtype, param.device)
        group, size = open_groups.get(key, ([], 0))
        group.append(param)
        size += param.numel() * param.element_size()
        limit = limits.setdefault(key, FIRST_BUCKET_BYTES)
        if size >= limit:
            closed.append(group)
            limits[key] = BUCKET_BYTES
            open_groups.pop(key, None)
        else:
            open_groups[key] = (group, size)
    return closed + [group for group, _ in open_groups.values()]


def bucket_bytes(model: nn.Module) -> int:
    """The bytes of DDP's gradient buckets for ``model``: its parameters that require a gradient, each once."""
    return sum(p.numel() * p.element_size() for group in _bucketed(model.parameters()) for p in group)


def bucket_tensors(model: nn.Module, device: torch.device) -> list[Tensor]:
    """Tensors as large as DDP's gradient buckets for ``model`` (one per bucket), made on ``device`` (under a fake
    mode: fake tensors). Keep them for as long as the run they stand for."""
    import torch

    return [
        torch.empty(sum(p.numel() for p in group), dtype=group[0].dtype, device=device)
        for group in _bucketed(model.parameters())
    ]


def keeps_first_buckets(wrapped: object) -> bool:
    """Whether DDP keeps the buckets it made when it wrapped the model for the whole run: it makes them again (in
    the order gradients become ready) before its second forward, unless it looks for unused parameters without a
    static graph. A CPU tracker started after the wrapping never sees buckets it keeps."""
    return bool(getattr(wrapped, "find_unused_parameters", False)) and not getattr(wrapped, "static_graph", False)


def maker_frames() -> list[dict[str, object]]:
    """The stack frame that made DDP's first buckets (its constructor), for a block that stands for them."""
    import torch.nn.parallel.distributed as distributed

    return [{"filename": distributed.__file__, "line": 0, "name": "__init__"}]


def has_gradient_buckets(wrapped: object) -> bool:
    """Whether ``wrapped`` (a strategy's model) is a ``DistributedDataParallel`` whose buckets are a second copy of the
    gradients (``gradient_as_bucket_view=False``)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(wrapped, DistributedDataParallel) and not getattr(wrapped, "gradient_as_bucket_view", False)
