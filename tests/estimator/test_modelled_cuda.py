"""A CUDA target's rows read the caching allocator's model: blocks for allocated and peak, segments for reserved."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memtrace.cli.estimate import main
from lightning_memtrace.estimator import estimate, estimate_from_config
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import CachingAllocatorModel
from lightning_memtrace.models import TINY_QWEN2_CONFIG
from lightning_memtrace.units import format_bytes

MIB = 1 << 20
WEIGHT, BIAS, BATCH = 1000 * 1000 * 4, 1000 * 4, 64 * 1000 * 4  # bytes of the Linear's weight and bias, one input
TINY_PARAM_BYTES = 13_714_432


@pytest.fixture
def no_workspaces(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # torch's way to run without cuBLAS workspaces
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


def _linear(device: str, **kwargs):
    batch = (torch.randn(64, 1000), torch.randn(64, 1000))
    return estimate(
        nn.Linear(1000, 1000),
        batch,
        training_step=lambda m, b: F.mse_loss(m(b[0]), b[1]),
        optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        device=device,
        **kwargs,
    )


def test_a_cuda_targets_rows_count_the_allocators_blocks_and_segments(no_workspaces):
    cpu, cuda = _linear("cpu"), _linear("cuda")
    first_cpu, first_cuda = cpu.records[0], cuda.records[0]
    assert first_cpu.phase.value == first_cuda.phase.value == "batch_start"
    # tensors: weight, bias and the batch's two tensors; blocks: each rounded up to 512 B (4,000,000 -> 4,000,256,
    # 4,000 -> 4,096; 256,000 is a multiple already)
    assert first_cpu.allocated_bytes == WEIGHT + BIAS + 2 * BATCH
    assert first_cuda.allocated_bytes == 4_000_256 + 4_096 + 2 * BATCH
    # reserved: a 20 MiB segment cut for the weight (under 10 MiB), one 2 MiB segment for the small rest
    assert first_cuda.reserved_bytes == 22 * MIB and first_cpu.reserved_bytes == first_cpu.allocated_bytes
    # the gradient fits in the weight's segment: nothing more is reserved in the whole run
    assert {r.reserved_bytes for r in cuda.records} == {22 * MIB}
    assert cuda.peak_reserved_bytes == 22 * MIB and cpu.peak_reserved_bytes is None
    # the categories are the tensors' own bytes on both; the rounding is in other, as on a real GPU's rows
    for a, b in zip(cpu.records, cuda.records):
        assert (a.parameters_bytes, a.gradients_bytes, a.activations_bytes, a.inputs_bytes) == (
            b.parameters_bytes, b.gradients_bytes, b.activations_bytes, b.inputs_bytes
        )
        assert 0 <= b.allocated_bytes - a.allocated_bytes == b.other_bytes - a.other_bytes < 4096
    assert (cuda.allocator, cpu.allocator) == ("defaults", "")


def test_the_allocators_settings_come_from_the_environment(no_workspaces, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = _linear("cuda")
    assert expandable.allocator == "expandable segments"
    # one 20 MiB page mapped for the large pool, one 2 MiB page for the small: the same 22 MiB here
    assert expandable.peak_reserved_bytes == 22 * MIB
    assert expandable.allocator_log is not None and expandable.allocator_log.settings.expandable_segments
    assert expandable.allocator_needs_expandable() is None  # on already: nothing to compare with


def test_served_again_the_log_gives_the_rows_numbers(no_workspaces):
    est = _linear("cuda")
    model = CachingAllocatorModel(AllocatorSettings())
    blocks = []
    for op in est.allocator_log.ops:
        if op >= 0:
            blocks.append(model.malloc(op))
        else:
            model.free(blocks[-1 - op])
    assert model.reserved == est.records[-1].reserved_bytes
    assert model.max_allocated == est.peak_bytes


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """The tiny Qwen2's estimate on a CUDA target, and its config's path."""
    path = tmp_path_factory.mktemp("configs") / "tiny.json"
    path.write_text(json.dumps(TINY_QWEN2_CONFIG))
    return estimate_from_config(path, batch_size=4, seq_len=128, device="cuda"), str(path)


def test_what_the_allocator_needs_lies_between_the_peak_and_what_it_reserves_unhindered(tiny_lm):
    est, _ = tiny_lm
    needs = est.allocator_needs()
    assert est.peak_bytes < needs <= est.peak_reserved_bytes and needs % (2 * MIB) == 0
    assert est.allocator_fits(needs) and not est.allocator_fits(needs - 2 * MIB)
    assert est.allocator_fits(est.peak_reserved_bytes) and not est.allocator_fits(est.peak_bytes)
    assert est.as_dict()["allocator_needs_bytes"] == needs
    assert est.as_dict()["peak_reserved_bytes"] == est.peak_reserved_bytes
    # the same requests with expandable segments: one growing segment per pool, 20 MiB pages for the large one
    expandable = est.allocator_needs_expandable()
    settings = AllocatorSettings(expandable_segments=True)
    assert expandable % (2 * MIB) == 0 and est.peak_bytes < expandable
    assert est.allocator_log.serves_within(expandable, settings)
    assert not est.allocator_log.serves_within(expandable - 2 * MIB, settings)
    # every row's reserved is whole segments, never below what is allocated
    assert all(r.reserved_bytes % (2 * MIB) == 0 and r.reserved_bytes >= r.allocated_bytes for r in est.records)


def test_the_table_and_the_command_show_reserved_and_what_the_allocator_needs(tiny_lm, capsys):
    est, config = tiny_lm
    table = est.table()
    assert table.splitlines()[1].split()[:4] == ["phase", "peak", "allocated", "reserved"]
    assert f"reserved by the caching allocator (defaults): {format_bytes(est.peak_reserved_bytes)} " in table
    assert f"({est.peak_reserved_bytes:,} B)" in table
    cpu = estimate_from_config(config, batch_size=4, seq_len=128, device="cpu")
    assert "reserved" not in cpu.table() and cpu.allocator_needs() is None and cpu.allocator_fits(1 << 40) is None
    args = ["--config", config, "--batch-size", "4", "--seq-len", "128", "--device", "cuda"]
    needs = est.allocator_needs()
    short = needs - 2 * MIB
    assert main([*args, "--device-memory", str(short)]) == 0  # the peak fits: the exit status still says so
    out = capsys.readouterr().out
    expandable = est.allocator_needs_expandable()
    assert f"the caching allocator needs {format_bytes(needs)} ({needs:,} B)" in out
    assert f"(in {format_bytes(short)} it runs out)" in out
    assert f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it needs {format_bytes(expandable)}" in out
    main([*args, "--device-memory", str(needs), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["allocator_fits"] is True and payload["estimate"]["allocator_needs_bytes"] == needs
    assert payload["estimate"]["allocator_needs_expandable_bytes"] == expandable
    main([*args, "--device-memory", str(short), "--json"])
    assert json.loads(capsys.readouterr().out)["allocator_fits"] is False


def test_a_sharded_estimate_places_each_parameters_local_shard(tiny_lm, no_workspaces):
    _, config = tiny_lm
    sharded = estimate_from_config(config, batch_size=4, seq_len=128, device="cuda", fsdp=4)
    cpu = estimate_from_config(config, batch_size=4, seq_len=128, device="cpu", fsdp=4)
    first, first_cpu = sharded.records[0], cpu.records[0]
    # rank 0's shards only (not the full parameters' bytes, which FSDP2's DTensors stand for), in 512 B blocks
    assert first.parameters_bytes == first_cpu.parameters_bytes < TINY_PARAM_BYTES // 3
    assert 0 <= first.allocated_bytes - first_cpu.allocated_bytes < 64 * 1024
    # and nothing of the full parameters (13.7 MB) stays allocated later: rows apart by the allocator's rounding and
    # the blocks it does not cut (up to 1 MiB each), and by Adam's step scalars, host tensors on CUDA
    assert all(abs(a.allocated_bytes - b.allocated_bytes) < 2 * MIB for a, b in zip(sharded.records, cpu.records))
