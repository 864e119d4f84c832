"""THE frame rule: one answer to "is this library code?" for the post-mortem, the replay, the report and summary."""

from __future__ import annotations

import sys

import pytest

from shared_files import ALL_FIXTURES, fixture_path

from lightning_memtrace.analysis.frames import (
    LIBRARY_PACKAGES,
    asking_frame,
    format_frame,
    is_library_file,
    normalize_path,
    user_frame,
)
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.postmortem import LiveBlock, PostMortem, render_post_mortem
from lightning_memtrace.analysis.stacks import SiteTable, analyze_frames, analyze_lists

USER = "/home/me/project/train.py"
LIBRARY = [
    "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
    "/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py",
    "/venv/lib/python3.11/site-packages/pytorch_lightning/trainer.py",
    "/venv/lib/python3.11/site-packages/lightning_fabric/fabric.py",
    "/venv/lib/python3.11/site-packages/lightning_utilities/core/rank_zero.py",
    "/venv/lib/python3.11/site-packages/torchmetrics/aggregation.py",  # the user's line is the metric's update call
    "/venv/lib/python3.11/site-packages/lightning_memtrace/recorder.py",
    "/venv/lib/python3.11/site-packages/accelerate/accelerator.py",
    "C:\\venv\\Lib\\site-packages\\accelerate\\accelerator.py",
    "C:\\venv\\Lib\\site-packages\\torch\\functional.py",
    "/usr/lib/python3.11/contextlib.py",
    "/usr/lib/python3/threading.py",
    "<frozen runpy>",
    "<string>",
    "",
    "??",
]
USER_FILES = [
    USER,
    "C:\\Users\\me\\train.py",
    "/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py",
    "/venv/lib/python3.11/dist-packages/mypackage/model.py",
    "/srv/torchvision_tools/train.py",  # "torch" only as part of a name
]


@pytest.mark.parametrize("filename", LIBRARY)
def test_library_files(filename: str) -> None:
    assert is_library_file(filename)


@pytest.mark.parametrize("filename", USER_FILES)
def test_user_files(filename: str) -> None:
    assert not is_library_file(filename)


def test_standard_library_of_this_interpreter_is_library() -> None:
    assert is_library_file(sys.base_prefix + "/lib/something.py") or is_library_file(
        sys.base_prefix.replace("\\", "/") + "/lib/something.py"
    )


def test_every_listed_package_is_library() -> None:
    assert "accelerate" in LIBRARY_PACKAGES
    for name in LIBRARY_PACKAGES:
        assert is_library_file(f"/site-packages/{name}/x.py"), name


def _frames(*files: str) -> list[dict]:
    return [{"filename": f, "line": 10 + k, "name": f"fn{k}"} for k, f in enumerate(files)]


def test_user_frame_skips_library_and_falls_back() -> None:
    frames = _frames(LIBRARY[0], LIBRARY[6], USER)
    assert user_frame(frames) is frames[2]
    only_library = _frames("??", LIBRARY[0])
    assert user_frame(only_library) is only_library[1]  # the innermost Python frame
    native = [{"filename": "??", "line": 0, "name": "c10::alloc"}]
    assert user_frame(native) is native[0]
    assert user_frame([]) is None
    assert format_frame(frames[2]) == f"{USER}:12 in fn2"
    assert format_frame(None) == "<unknown>"


def test_asking_frame_is_the_users_line_else_a_librarys_own_code_outside_torchs_machinery() -> None:
    site = "/venv/lib/python3.11/site-packages"
    machinery = [
        f"{site}/torch/_subclasses/fake_impls.py",
        f"{site}/torch/_subclasses/fake_tensor.py",
        f"{site}/torch/utils/_stats.py",
        f"{site}/torch/_ops.py",
        f"{site}/torch/_tensor.py",
        f"{site}/torch/overrides.py",
        "/src/lightning_memtrace/estimator/tensor_values.py",
    ]
    estimate_loop = "/src/lightning_memtrace/estimator/loop.py"
    fit_loop = f"{site}/lightning/pytorch/loops/fit_loop.py"
    # the optimizer's own code asked; the user's line beyond the loops only started the fit
    optimizer = _frames(*machinery, f"{site}/torch/optim/lbfgs.py", f"{site}/torch/optim/optimizer.py", fit_loop, USER)
    assert asking_frame(optimizer) is optimizer[len(machinery)]
    in_estimate = _frames(*machinery, f"{site}/torch/optim/asgd.py", estimate_loop, USER)
    assert asking_frame(in_estimate) is in_estimate[len(machinery)]
    # inside the step, the user's line is named, also where a library it called asked
    with_user = _frames(*machinery, f"{site}/torchmetrics/metric.py", USER, estimate_loop, "/home/me/run.py")
    assert asking_frame(with_user) is with_user[len(machinery) + 1] is user_frame(with_user)
    only_machinery = _frames(*machinery)
    assert asking_frame(only_machinery) is user_frame(only_machinery) is only_machinery[0]
    assert asking_frame([]) is None


def test_post_mortem_and_replay_blame_the_same_line() -> None:
    """accelerate (and every library package) is library code in both: the two name the same user line."""
    frames = _frames(LIBRARY[0], LIBRARY[6], USER, "/home/me/project/main.py")
    info = analyze_frames(frames)
    assert (info.site.file, info.site.line) == (USER, 12)
    pm = PostMortem(
        rank=0,
        device="cpu",
        step=1,
        epoch=0,
        batch_idx=1,
        stage="forward",
        exception_type="OutOfMemoryError",
        message="out of memory",
        requested_bytes=1024,
        allocated_bytes=4096,
        reserved_bytes=4096,
        categories={"activations": 4096},
        largest=[LiveBlock(4096, frames, "phase=forward step=1", "activations")],
        failing_frames=frames,
    )
    text = render_post_mortem(pm)
    assert f"failed at:     {USER}:12 in fn2" in text
    assert f"{USER}:12 in fn2" in text.split("largest live allocations:")[1]


def test_a_step_of_library_code_alone_is_blamed_on_that_code_not_on_the_fit_call() -> None:
    """Inside a Lightning step without a user line (an optimizer's step, a callback's weight averaging), the user's
    line beyond Lightning's loops is only ``trainer.fit(model)``: the site is the step's own library code."""
    site = "/venv/lib/python3.11/site-packages"
    fit = [f"{site}/lightning/pytorch/trainer/call.py", f"{site}/lightning/pytorch/loops/fit_loop.py", USER]
    ema = _frames(f"{site}/torch/_tensor.py", f"{site}/torch/optim/swa_utils.py",
                  f"{site}/lightning/pytorch/callbacks/weight_averaging.py", *fit)
    assert user_frame(ema) is ema[1]  # torch's machinery (torch/_tensor.py) is never the site
    with_user = _frames(f"{site}/torch/nn/modules/linear.py", "/home/me/project/model.py", *fit)
    assert user_frame(with_user) is with_user[1]  # a user line inside the step still wins
    machinery_only = _frames(f"{site}/torch/_tensor.py", *fit)
    assert user_frame(machinery_only) is machinery_only[-1]  # nothing else: the user's line, as before
    undriven = _frames(f"{site}/torch/optim/adamw.py", USER)
    assert user_frame(undriven) is undriven[1]  # a plain loop: the user's line, wherever it is
    stacks = [ema, with_user, machinery_only, undriven]
    table = SiteTable()
    _, codes, _ = analyze_lists(stacks, table)
    for frames, code in zip(stacks, codes.tolist()):
        picked = user_frame(frames)
        expected = (picked["filename"], picked["line"], picked["name"])
        one = analyze_frames(frames).site
        many = table.sites[code]
        assert (one.file, one.line, one.function) == (many.file, many.line, many.function) == expected


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_user_frame_names_the_site_the_replay_names_on_real_snapshots(name: str) -> None:
    """The post-mortem's and the report's largest blocks (``user_frame``) and the sites of ``summary`` and the report
    (``stacks``) name the same line for every stack of the real snapshots. Stacks recorded with C++ frames (torch's
    default ``stacks="all"``) start with torch's own ``memory_snapshot.cpp``, which ``user_frame`` took for the user's
    line: on kkaitlyn111's snapshot for all of its 19,342 stacks."""
    data = load_snapshot(fixture_path(name)).data
    stacks = [event["frames"] for trace in data.get("device_traces", []) for event in trace if event.get("frames")]
    for frames in stacks:
        site = analyze_frames(frames).site
        if site.file:  # a Python frame (else the replay names an autograd node or a C++ function)
            picked = user_frame(frames)
            assert (normalize_path(picked["filename"]), int(picked["line"])) == (site.file, site.line)
