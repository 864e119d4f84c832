"""The post-mortem ``.txt`` compared with tests/expected/ (``--update-expected`` rewrites it), and its view."""

from __future__ import annotations

from lightning_memtrace.analysis.postmortem import LiveBlock, PostMortem, render_post_mortem
from lightning_memtrace.analysis.view import post_mortem_view

TORCH = "/venv/lib/python3.11/site-packages/torch/nn/functional.py"
USER = "/home/me/project/train.py"


def _frames(line: int) -> list[dict]:
    return [
        {"filename": TORCH, "line": 2000, "name": "linear"},
        {"filename": "/venv/lib/python3.11/site-packages/accelerate/utils/operations.py", "line": 80, "name": "wrap"},
        {"filename": USER, "line": line, "name": "training_step"},
    ]


def _post_mortem(device: str) -> PostMortem:
    mib = 1024**2
    return PostMortem(
        rank=0,
        device=device,
        step=12,
        epoch=1,
        batch_idx=4,
        stage="forward",
        exception_type="OutOfMemoryError",
        message="CUDA out of memory. Tried to allocate 2.00 GiB",
        requested_bytes=2048 * mib,
        allocated_bytes=300 * mib,
        reserved_bytes=512 * mib,
        categories={"parameters": 100 * mib, "gradients": 50 * mib, "activations": 120 * mib, "other": 30 * mib},
        largest=[
            LiveBlock(120 * mib, _frames(41), "phase=forward step=12", "activations"),
            LiveBlock(100 * mib, [], "", "parameters"),
            LiveBlock(30 * mib, [], "phase=backward step=11", "other"),
        ],
        failing_frames=_frames(44),
        device_free_bytes=20 * mib,
    )


def test_post_mortem_cuda(expected) -> None:
    expected(render_post_mortem(_post_mortem("cuda:0")), "postmortem_cuda.txt")


def test_post_mortem_cpu(expected) -> None:
    expected(render_post_mortem(_post_mortem("cpu")), "postmortem_cpu.txt")


def test_post_mortem_view() -> None:
    view = post_mortem_view(_post_mortem("cpu"))
    assert [s.category for s in view.categories] == [
        "parameters",
        "gradients",
        "optimizer_state",
        "inputs",
        "activations",
        "other",
    ]
    assert view.total_bytes == 300 * 1024**2 and view.by_category["activations"] == 120 * 1024**2
    assert [s.where for s in view.sites] == [
        f"{USER}:41 in training_step",
        "<made before MemTrace started>",
        "<no stack: made outside the history window>",
    ]
    assert round(view.sites[0].percent) == 40 and view.moment == "forward, step 12"


def test_post_mortem_with_what_if_table(expected) -> None:
    """With a what-if table the general tip goes; advice that points at a category stays (the text is the table's)."""
    pm = _post_mortem("cuda:0")
    pm.requested_bytes, pm.reserved_bytes = 64 * 1024**2, pm.allocated_bytes  # no request or fragmentation advice
    pm.categories = {"parameters": 290 * 1024**2, "activations": 10 * 1024**2}  # activations: 3%, no advice
    pm.what_if = {
        "made": True,
        "text": "what if (today: peak 1.2 GiB, does not fit in 1.0 GiB ...):\n"
        "remedy     kind      peak     saved  fits  max batch  price\n"
        "bf16-true  measured  600 MiB  600 MiB  yes  8  bf16 weights and updates (precision loss)\n"
        'to fit 1.0 GiB: bf16-true -> 600 MiB (measured)\nsnippet:\n  Trainer(precision="bf16-true")',
    }
    text = render_post_mortem(pm)
    assert "what would fit (estimated on fake tensors" in text and "what to change:" not in text
    expected(text, "postmortem_what_if.txt")
    pm.categories["optimizer_state"] = 200 * 1024**2  # 40%: its advice comes back beside the table
    assert "Optimizer state holds 200.0 MiB" in render_post_mortem(pm)


def test_post_mortem_names_ddp_buckets(expected) -> None:
    """DDP's gradient buckets (counted in "other") get their tip where they hold 5% of live memory or more."""
    pm = _post_mortem("cuda:0")
    pm.categories = {**pm.categories, "other": 50 * 1024**2}
    pm.ddp_bucket_bytes = 50 * 1024**2  # a copy of the 50 MiB of gradients: 15% of the 320 MiB live
    expected(render_post_mortem(pm), "postmortem_ddp_buckets.txt")
    pm.ddp_bucket_bytes = 15 * 1024**2  # under 5%
    assert "DDP" not in render_post_mortem(pm)


def test_largest_blocks_of_a_cuda_snapshot_show_the_categories_memtrace_gave_them() -> None:
    from lightning_memtrace.analysis.postmortem import largest_blocks_from_snapshot

    blocks = [
        {"size": 4096, "requested_size": 4000, "state": "active_allocated", "category": "parameters"},
        {"size": 2048, "state": "active_allocated", "category": "unknown"},  # no naming saw it
        {"size": 8192, "state": "active_allocated", "category": "other"},
        {"size": 1024, "state": "active_allocated"},  # a snapshot without categories
        {"size": 65536, "state": "inactive"},
    ]
    largest = largest_blocks_from_snapshot({"segments": [{"blocks": blocks}], "device_traces": []})
    assert [(b.nbytes, b.category) for b in largest] == [(8192, "other"), (4000, "parameters"), (2048, ""), (1024, "")]
