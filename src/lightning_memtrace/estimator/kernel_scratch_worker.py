"""The process that measures a CPU kernel's memory for :mod:`~lightning_memtrace.estimator.kernel_scratch`.

Run as ``python -m lightning_memtrace.estimator.kernel_scratch_worker``. It reads one JSON request a line on stdin
(an operator, its arguments and keyword arguments; tensors as shape, stride and dtype, dtypes as
``{"torch_dtype": name}``) and answers one line, :data:`ANSWER_PREFIX` then JSON: ``{"bytes": N, "shapes": [...]}``,
the most the operator held beyond the bytes alive before it and its outputs, as the allocator reported it, and its
outputs' shapes; or ``{"error": "..."}``. Its own process, because a training process may already run the one
profiler session there can be (MemTrace's own, in a fit with ``estimate=True``), and the real tensors made here must
stay out of that run's rows.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO


#: Starts each answer line: what else reaches the stream (a ``.pth`` file or a startup script printing as Python
#: starts, before fd 1 is set aside) is not an answer.
ANSWER_PREFIX = "memtrace-kernel-memory "


def _answers_stream() -> TextIO:
    """The protocol's stream (the original stdout); fd 1 then points at the null device, so that what C++ libraries
    print there (the profiler's lines) cannot fall into the answers."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    return answers


def _tensor(spec: dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, spec["dtype"])
    return torch.zeros(1, dtype=dtype).new_empty_strided(spec["shape"], spec["stride"]).zero_()


def _decoded(value: Any) -> Any:
    if isinstance(value, dict) and "shape" in value:
        return _tensor(value)
    if isinstance(value, dict) and "torch_dtype" in value:
        import torch

        return getattr(torch, value["torch_dtype"])
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def measure(op_name: str, args: list[Any], kwargs: dict[str, Any], tracker: Any) -> tuple[int, list[Any]]:
    """The scratch bytes of ``torch.ops.aten.<op_name>`` on these arguments (its peak above the bytes alive before
    it, less what its outputs hold) and its outputs' shapes (None for an output that is no tensor)."""
    import torch

    from lightning_memtrace.capture.storages import iter_tensors, unique_storages

    packet, _, overload = op_name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")
    real_args = [_decoded(a) for a in args]
    real_kwargs = {k: _decoded(v) for k, v in kwargs.items()}
    inputs = unique_storages(iter_tensors(real_args))
    tracker.sync()
    before = tracker.allocated
    tracker.reset_peak()
    out = op(*real_args, **real_kwargs)
    tracker.sync()
    peak = tracker.peak
    held = sum(s.nbytes() for key, s in unique_storages(iter_tensors(out)).items() if key not in inputs)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    shapes = [list(o.shape) if isinstance(o, torch.Tensor) else None for o in outputs]
    del out, outputs
    return max(0, peak - before - held), shapes


def main(requests: TextIO = sys.stdin) -> int:
    answers = _answers_stream()
    import torch

    from lightning_memtrace.capture.tracker import AllocationTracker

    torch.set_num_threads(max(1, int(os.environ.get("MEMTRACE_SCRATCH_THREADS", "1"))))
    with AllocationTracker("cpu", backend="reports") as tracker:
        for line in requests:
            try:
                request = json.loads(line)
                args, kwargs = request["args"], request.get("kwargs", {})
                scratch, shapes = measure(request["op"], args, kwargs, tracker)
                answer: dict[str, Any] = {"bytes": scratch, "shapes": shapes}
            except Exception as error:  # one request's failure is its answer; the next one is measured as usual
                answer = {"error": f"{type(error).__name__}: {error}"[:300]}
            answers.write(ANSWER_PREFIX + json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
