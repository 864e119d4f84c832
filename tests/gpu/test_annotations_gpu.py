"""On CUDA, MemTrace's window snapshot holds torch's own record_function annotations, MemTrace's phases merged with
them, and (where torch offers it) the compile context of each event. Skipped without CUDA."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from lm_helpers import MLP, trainer

from lightning_memtrace import MemTrace
from lightning_memtrace.analysis.annotations import annotated_ranges, compile_context_sites
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class AnnotatedMLP(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.profiler.record_function("my_block"):
            out = self(x)
        return torch.nn.functional.mse_loss(out, y)


def test_cuda_snapshot_has_torch_and_memtrace_annotations(tmp_path):
    callback = MemTrace()
    trainer(tmp_path, [callback], accelerator="gpu", devices=1, max_steps=4).fit(AnnotatedMLP())
    path = callback.output_dir / "snapshot_rank0_steps1-2.pickle"
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    annotations = snapshot["external_annotations"]
    names = {a["name"] for a in annotations}
    assert {"forward", "backward", "optimizer_step", "after_step"} <= names
    assert "my_block" in names  # written by torch itself (record_function while history is recorded)
    times = [a["time_us"] for a in annotations]
    assert times == sorted(times)
    dev = replay(load_snapshot(path)).main
    ranges = {r.name for r in annotated_ranges(dev) if r.complete}
    assert {"forward", "backward", "optimizer_step", "my_block"} <= ranges
    impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    if impl is not None and "compile_context" in inspect.signature(impl).parameters:
        assert all("compile_context" in e for e in snapshot["device_traces"][0] if e["action"] == "alloc")


def test_compiled_module_groups_by_compile_context(tmp_path):
    impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    if impl is None or "compile_context" not in inspect.signature(impl).parameters:
        pytest.skip("this torch records no compile context")
    from lightning_memtrace import MemoryRecorder

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history_skip_steps=1, history_steps=1) as rec:
        for step in range(3):
            x = torch.randn(64, 256, device="cuda")
            rec.begin_batch(x, step=step)
            loss = compiled(x).square().mean()
            rec.mark_forward_done()
            loss.backward()
            rec.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            rec.end_batch()
    dev = replay(load_snapshot(tmp_path / "snapshot_rank0_steps1-1.pickle")).main
    with open(tmp_path / "snapshot_rank0_steps1-1.pickle", "rb") as handle:
        recorded = {e.get("compile_context") for e in pickle.load(handle)["device_traces"][0]}
    if recorded <= {None, "N/A", ""}:
        pytest.skip("torch wrote no compile context for these events")
    # the compile context is per thread, like the allocator's tag: the compiled forward's buffers (made on the
    # training thread) carry it, the backward's (autograd's device thread) do not; so look just after the last
    # allocation made in compiled code, when the forward's saved buffers are alive
    al = dev.allocations
    compiled = al[~al["compile_context"].astype(str).isin(["", "N/A", "None"])]
    assert len(compiled), sorted(map(str, recorded))
    index = int(compiled["alloc_index"].max())
    contexts = {g["compile_context"] for g in compile_context_sites(dev, index=index)}
    print("compile contexts live after the compiled forward:", sorted(contexts))
    assert contexts - {""}, contexts
