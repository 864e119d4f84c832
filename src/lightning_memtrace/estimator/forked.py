"""Independent estimates side by side in forked worker processes (``memtrace estimate --what-if --jobs N``).

Each what-if remedy is one or more fake-tensor training steps of the whole model (seconds each for a 1.5B model), and
they do not depend on each other. Forked workers inherit the parent's state as it is (the model built on the meta
device, today's estimate, torch's fake-tensor dispatch cache), so nothing is pickled on the way in; only the results
come back. Forking is used only where it is safe: on Linux, with CUDA not initialised in this process, and never
inside a training run (the post-mortem's what-if runs in the process itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

#: The function the workers run, set just before they are forked (a fork copies it; nothing is pickled).
_TASK: Callable[[Any], Any] | None = None


def default_jobs() -> int:
    """Worker processes for ``--jobs`` left at its default: the CPUs this process may use, at most 4 (each worker
    holds its own fake step: a few hundred MiB for a 1.5B model)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def can_fork() -> bool:
    """Whether estimates may run in forked workers here (Linux, CUDA not initialised in this process)."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


def _one_thread() -> None:
    # as DataLoader workers do: a forked child must not use the parent's intra-op thread pool (and fake steps need
    # none)
    torch.set_num_threads(1)


def _call(item: Any) -> Any:
    assert _TASK is not None
    return _TASK(item)


def map_forked(task: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """``[task(item) for item in items]``, in ``jobs`` forked workers where :func:`can_fork` (else in this
    process, and again in this process if a worker dies). ``task`` must return picklable values and catch the errors
    it expects (an exception in a worker is raised here again)."""
    global _TASK
    jobs = min(int(jobs), len(items))
    if jobs <= 1 or not can_fork():
        return [task(item) for item in items]
    import multiprocessing

    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _TASK = task
    try:
        # every worker is forked at the first submit, before the executor starts its own thread
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"), initializer=_one_thread) as pool:
            return list(pool.map(_call, items))
    except BrokenProcessPool:
        # a worker died (the system's out-of-memory killer, a signal): the same work in this process instead
        return [task(item) for item in items]
    finally:
        _TASK = None
