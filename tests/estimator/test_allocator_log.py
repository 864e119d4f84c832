"""The allocator's log served again: under a capacity, and past the estimated steps until its state repeats."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.estimator import compare_estimate, estimate, estimate_from_config
from lightning_memtrace.estimator import allocator_log
from lightning_memtrace.estimator.allocator_log import AllocatorLog, StepRepeat

from tests.shared_files import config_path

MIB = 1 << 20

# A parameter placed before the first step (request 0); step 0 makes a gradient (1), a temporary (2) it frees and the
# optimizer's state (3) kept for good; step 1 makes a temporary (4) it frees, frees step 0's gradient and makes its own
# (5), which the run's end frees.
TWO_STEPS = [8 * MIB, 8 * MIB, 30 * MIB, -3, 16 * MIB, 30 * MIB, -5, -2, 8 * MIB, -6]
STEP_STARTS = [1, 5, 9]


def test_the_last_step_is_rewritten_to_be_served_after_itself() -> None:
    log = AllocatorLog(AllocatorSettings(), TWO_STEPS, STEP_STARTS)
    # its temporary, the free of its own request 0, the free of the one block carried from step 0, its gradient
    assert log.step_repeat == StepRepeat((30 * MIB, -1, StepRepeat.CARRIED, 8 * MIB), kept=(1,), first=4)


def test_served_on_the_steps_repeat_and_a_later_step_needs_more_than_the_estimated_ones() -> None:
    log = AllocatorLog(AllocatorSettings(), TWO_STEPS, STEP_STARTS)
    served = log.unhindered
    # a 20 MiB segment for the parameter and the gradient; the 30 MiB temporary's segment, which the state then
    # takes 16 MiB of; so step 1's temporary needs a second 30 MiB segment: 80 MiB from step 1 on
    assert served.max_reserved_bytes == 80 * MIB and served.reserved_from_step == 1
    # step 2 (the first served again) ends where step 2 started: step 3 would repeat it
    assert (served.served, served.steps, served.repeats_from) == (True, 3, 2)
    assert log.serves_within(80 * MIB) and not log.serves_within(78 * MIB)
    # without the step marks only the log itself is served, with the run's end: the same here
    unmarked = AllocatorLog(AllocatorSettings(), TWO_STEPS)
    assert unmarked.step_repeat is None and unmarked.unhindered.steps == 1
    assert unmarked.unhindered.max_reserved_bytes == 80 * MIB


@pytest.mark.parametrize(
    "last_step",
    [
        [30 * MIB, -5, -2, 8 * MIB, 1 * MIB],  # keeps one more block than it frees of the step before
        [30 * MIB, -5, -2, 4 * MIB],  # keeps a block of another size than it frees
    ],
)
def test_a_step_that_does_not_free_what_it_keeps_is_not_served_again(last_step: list[int]) -> None:
    ops = TWO_STEPS[:5] + last_step
    log = AllocatorLog(AllocatorSettings(), ops, [1, 5, len(ops)])
    assert log.step_repeat is None
    assert (log.unhindered.steps, log.unhindered.repeats_from) == (2, None)


def test_a_run_that_keeps_its_outputs_says_its_steady_step_is_not_served_on(monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    kept: list[torch.Tensor] = []

    def training_step(model: nn.Module, batch) -> torch.Tensor:
        kept.append(model(batch[0]))  # every step's output (and its graph) kept: memory grows step after step
        return F.mse_loss(kept[-1], batch[1])

    est = estimate(
        nn.Linear(1000, 1000),
        (torch.randn(64, 1000), torch.randn(64, 1000)),
        training_step=training_step,
        optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        device="cuda",
        steps=3,
    )
    assert est.allocator_log.step_repeat is None
    assert "the steady step could not be served on (it keeps more than it frees of the step before)" in est.table()
    assert est.long_run_reserved_bytes == est.peak_reserved_bytes


@pytest.fixture(scope="module")
def gpt2_estimates():
    """GPT-2 124M at 8 x 256 in fp32 for a CUDA target: estimated for 2 steps, and for 5."""
    config = config_path("gpt2-124m.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        patch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        patch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        return tuple(estimate_from_config(config, 8, 256, device="cuda", steps=steps) for steps in (2, 5))


def test_served_on_a_two_step_estimate_reserves_what_a_longer_one_does(gpt2_estimates) -> None:
    two, five = gpt2_estimates
    # the fake run itself: steps 1-3 reserve 5,470 MiB, step 4 5,864 MiB as blocks land elsewhere
    by_step = {r.step: r.reserved_bytes for r in five.records if r.phase.value == "batch_end"}
    assert by_step[3] == 5470 * MIB and by_step[4] == 5864 * MIB == five.peak_reserved_bytes
    assert two.peak_reserved_bytes == 5470 * MIB
    # the two-step estimate, served on, finds step 4's segments
    assert two.long_run_reserved_bytes == five.peak_reserved_bytes
    assert two.long_run.reserved_from_step == 4 and two.long_run.served
    assert two.as_dict()["long_run_reserved_bytes"] == 5864 * MIB and two.as_dict()["long_run_reserved_step"] == 4
    assert "it reserves 5.7 GiB (6,148,849,664 B) from step 4 on" in two.table()
    # and so needs what the five-step estimate needs, more than its own two steps alone would have said
    def alone(est):  # its own requests only, not served on
        return dataclasses.replace(est, allocator_log=AllocatorLog(est.allocator_log.settings, est.allocator_log.ops))

    needs = two.allocator_needs()
    assert needs == alone(five).allocator_needs() == 5654 * MIB
    assert alone(two).allocator_needs() < needs and not two.allocator_fits(alone(two).allocator_needs())


def test_a_longer_runs_reserved_bytes_are_compared_with_the_steps_served_on(gpt2_estimates) -> None:
    two, five = gpt2_estimates
    assert two.long_run.reserved_by_step[:6] == (3990 * MIB, 5470 * MIB, 5470 * MIB, 5470 * MIB, 5864 * MIB, 5864 * MIB)
    # the five-step estimate's rows stand in for a five-step run's: its step 4 reserved 5,864 MiB
    reserved = compare_estimate(two, five.to_dataframe()).set_index("category").loc["reserved"]
    assert (reserved.estimated_bytes, reserved.measured_bytes, reserved.error_bytes) == (5864 * MIB, 5864 * MIB, 0)
    # a run as long as the estimate: its own rows
    reserved = compare_estimate(two, two.to_dataframe()).set_index("category").loc["reserved"]
    assert reserved.estimated_bytes == reserved.measured_bytes == 5470 * MIB


def test_a_step_of_many_requests_is_served_on_for_fewer_steps(monkeypatch) -> None:
    log = AllocatorLog(AllocatorSettings(), TWO_STEPS, STEP_STARTS)  # its last step: 4 requests and frees
    assert log.steps_limit == allocator_log.STEP_LIMIT == 64
    monkeypatch.setattr(allocator_log, "OPS_LIMIT", 40)
    assert log.steps_limit == 10
    monkeypatch.setattr(allocator_log, "OPS_LIMIT", 8)
    assert log.steps_limit == allocator_log.MIN_STEPS == 4
