"""DDP's gradient buckets: their bytes against a real ``DistributedDataParallel``'s own (gloo, one process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_memtrace.capture.ddp_buckets import (
    bucket_bytes,
    bucket_tensors,
    has_gradient_buckets,
    keeps_first_buckets,
)


def _mixed_model() -> nn.Module:
    """Tied weights (counted once), a frozen bias (no slot), a bf16 layer (a bucket of its own dtype), and more than
    DDP's 1 MiB first bucket."""
    model = nn.Sequential(
        nn.Embedding(1000, 600), nn.Linear(600, 600), nn.Linear(600, 1000), nn.Linear(1000, 3000), nn.Linear(3000, 3000)
    )
    model[2].weight = model[0].weight
    model[1].bias.requires_grad_(False)
    model[3].to(torch.bfloat16)
    return model


#: The slots of :func:`_mixed_model`'s trainable parameters: fp32 (embedding = tied head weight, layer 1's weight,
#: layer 2's bias, layer 4) and bf16 (layer 3), each parameter once.
MIXED_BUCKET_BYTES = (1000 * 600 + 600 * 600 + 1000 + 3000 * 3000 + 3000) * 4 + (1000 * 3000 + 3000) * 2


def _ddp_bucket_sizes(tmp_path, **options) -> list[int]:
    """The bucket sizes a real DDP reports for :func:`_mixed_model` (one gloo rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(_mixed_model(), **options)
        sizes = [int(size) for size in str(wrapped._get_ddp_logging_data()["bucket_sizes"]).split(",")]
        assert has_gradient_buckets(wrapped) is not options.get("gradient_as_bucket_view", False)
        # DDP makes its buckets again before the second forward unless it looks for unused parameters (no static graph)
        assert keeps_first_buckets(wrapped) is (
            options.get("find_unused_parameters", False) and not options.get("static_graph", False)
        )
        return sizes
    finally:
        dist.destroy_process_group()


def test_bucket_bytes_are_ddps_own(tmp_path):
    model = _mixed_model()
    assert bucket_bytes(model) == MIXED_BUCKET_BYTES == 45_862_000
    # DDP's grouping differs between its options (one bucket per dtype at first, or 1 MiB then 25 MiB buckets): the
    # bytes do not
    assert sum(_ddp_bucket_sizes(tmp_path)) == MIXED_BUCKET_BYTES
    assert sum(_ddp_bucket_sizes(tmp_path, find_unused_parameters=True)) == MIXED_BUCKET_BYTES
    assert sum(_ddp_bucket_sizes(tmp_path, gradient_as_bucket_view=True)) == MIXED_BUCKET_BYTES
    assert sum(_ddp_bucket_sizes(tmp_path, find_unused_parameters=True, static_graph=True)) == MIXED_BUCKET_BYTES


def test_bucket_tensors_hold_the_bucket_bytes_in_each_dtype():
    tensors = bucket_tensors(_mixed_model(), torch.device("meta"))
    assert sum(t.numel() * t.element_size() for t in tensors) == MIXED_BUCKET_BYTES
    assert {t.dtype for t in tensors} == {torch.float32, torch.bfloat16}
    assert sum(t.numel() for t in tensors if t.dtype == torch.bfloat16) == 1000 * 3000 + 3000
    # no bucket over DDP's 25 MiB limit but by one parameter, none split
    assert max(t.numel() * t.element_size() for t in tensors) < 25 * 1024**2 + 3000 * 3000 * 4


def test_only_ddp_without_bucket_views_has_buckets():
    assert not has_gradient_buckets(nn.Linear(2, 2))
    assert not has_gradient_buckets(None)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    assert bucket_bytes(frozen) == 0 and bucket_tensors(frozen, torch.device("meta")) == []
