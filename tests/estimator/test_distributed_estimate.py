"""The estimate of a distributed run's rank. DDP: its gradient buckets (``gradient_as_bucket_view=False``) held from
the start, and the ``gradient_as_bucket_view`` remedy of the what-if (the same against real 2-process DDP runs:
tests/test_ddp.py). A module sharded already: refused in one line."""

from __future__ import annotations

import pytest
import torch
from lm_helpers import MLP

from lightning_memtrace.capture.ddp_buckets import bucket_bytes
from lightning_memtrace.estimator import estimate
from lightning_memtrace.estimator.what_if import what_if_result
from lightning_memtrace.estimator.what_if_results import HEADROOM_BYTES, HEADROOM_FRACTION

BATCH = (torch.randn(16, 32), torch.randn(16, 1))


def _mlp() -> MLP:
    return MLP(width=512)


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module")
def estimates():
    module = _mlp()
    plain = estimate(module, BATCH, device="cpu", steps=3)
    return plain, estimate(module, BATCH, device="cpu", steps=3, ddp_buckets=True)


def test_the_buckets_are_one_more_copy_of_the_gradients_throughout(estimates):
    plain, ddp = estimates
    buckets = _parameter_bytes(_mlp())  # every parameter trains: one slot each, fp32
    assert buckets == bucket_bytes(_mlp()) == 4 * (32 * 512 + 512 + 512 * 512 + 512 + 512 + 1) == 1_120_260
    assert ddp.ddp_bucket_bytes == buckets and plain.ddp_bucket_bytes == 0
    assert ddp.peak_bytes - plain.peak_bytes == buckets
    assert len(ddp.records) == len(plain.records)
    for with_buckets, without in zip(ddp.records, plain.records):
        # made before the first batch, alive to the end, counted as "other" (as MemTrace counts a real DDP's)
        assert with_buckets.other_bytes - without.other_bytes == buckets
        assert with_buckets.allocated_bytes - without.allocated_bytes == buckets
        assert with_buckets.gradients_bytes == without.gradients_bytes
    assert "DDP with gradient buckets of 1.1 MiB (gradient_as_bucket_view=False)" in ddp.describe()
    assert ddp.as_dict()["ddp_bucket_bytes"] == buckets and "DDP" not in plain.describe()


def test_ddp_buckets_and_fsdp_are_two_different_runs():
    with pytest.raises(ValueError, match="a run is one or the other"):
        estimate(_mlp(), BATCH, device="cpu", ddp_buckets=True, world_size=2)


def test_what_if_offers_bucket_views_only_to_a_ddp_run(estimates):
    plain, ddp = estimates
    # a device where only the peak without the buckets fits: the bucket views alone are the answer
    memory = int((ddp.peak_bytes - ddp.ddp_bucket_bytes // 2 + HEADROOM_BYTES) / (1 - HEADROOM_FRACTION)) + 1
    result = what_if_result(
        _mlp(), BATCH, device="cpu", steps=3, max_batch=False, device_memory=memory, ddp_buckets=True
    )
    assert result.estimate.peak_bytes == ddp.peak_bytes and not result.today_fits
    row = next(r for r in result.rows if r.remedy == "gradient_as_bucket_view")
    assert (row.kind, row.peak_bytes, row.saved_bytes) == ("measured", plain.peak_bytes, ddp.ddp_bucket_bytes)
    assert row.fits
    assert result.rows[0] is row  # the cheapest remedy: tried first
    assert result.combination.remedies == ("gradient_as_bucket_view",)
    assert result.combination.snippet == "Trainer(strategy=DDPStrategy(gradient_as_bucket_view=True))"

    without = what_if_result(_mlp(), BATCH, device="cpu", steps=3, max_batch=False, remedies=["adafactor"])
    assert [r.remedy for r in without.rows] == ["adafactor"]
    default = what_if_result(_mlp(), BATCH, device="cpu", steps=3, max_batch=False, remedies=None)
    assert "gradient_as_bucket_view" not in {r.remedy for r in default.rows} | set(default.skipped)
    asked = what_if_result(_mlp(), BATCH, device="cpu", steps=3, max_batch=False, remedies=["gradient_as_bucket_view"])
    assert asked.skipped == {"gradient_as_bucket_view": "not a DDP run with gradient_as_bucket_view=False"}


def test_a_module_sharded_already_is_refused_in_one_line():
    """A module ``fully_shard``-ed in this process (a fit under ModelParallelStrategy) cannot be copied onto fake
    tensors: the error says so and what to do instead (not FSDP's "does not support deepcopy")."""
    from torch.distributed.fsdp import fully_shard

    from lightning_memtrace.estimator.sharded import fake_world

    module = _mlp()
    with fake_world(2) as mesh:
        for layer in module.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        with pytest.raises(ValueError) as raised:
            estimate(module, BATCH, device="cpu")
    message = str(raised.value)
    assert message.startswith("MLP is sharded in this process already (FSDP2 (fully_shard)): the estimate copies")
    assert "world_size=N" in message and "--fsdp N" in message and "deepcopy" not in message
