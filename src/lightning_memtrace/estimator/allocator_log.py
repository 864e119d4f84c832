"""The caching allocator's requests and frees of an estimated run, served again: under a capacity, under other
settings, and past the estimated steps.

An estimate runs two or three optimizer steps, but a run's reserved bytes can still grow later: the same requests,
served step after step, leave their free blocks in other places until a request finds none that fits (GPT-2 at
8 x 256 in fp32: 5,470 MiB reserved over steps 1-3, 5,864 MiB from step 4 on). So the last estimated step is served
again, step after step, until the allocator's state at a step's start repeats the state at an earlier step's start:
from there on every step repeats one already served, and no later step can reserve more or run out where the
served ones did not. That holds however long the run is, for the run the estimate made.

The last step can be served again where what it frees of earlier steps (the previous step's gradients, a batch
fetched ahead) is matched, size for size and in the order they were made, by what it makes and keeps to its end:
the next step frees those where it freed these. A step that keeps more than it frees of the previous one (a list
that grows, a first step that makes the optimizer's state) is not served again.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Hashable, Sequence

from lightning_memtrace.analysis.allocator_blocks import Block
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import CachingAllocatorModel, SimulatedOutOfMemory

#: Steps served past the estimated ones at most, where the allocator's state does not repeat before.
STEP_LIMIT = 64
#: Requests and frees served past the estimated steps at most (fewer steps where a step makes many: each
#: verdict of ``allocator_needs()``'s bisection serves them again), though always :data:`MIN_STEPS` steps.
OPS_LIMIT = 300_000
MIN_STEPS = 4
#: Steps without growth after which reserved bytes are taken as grown to their most, where the state does not repeat.
STABLE_STEPS = 16

_FREED_BLOCK = -2
_UNMAPPED_RANGE = -3
_KEPT_BLOCK = -1


@dataclasses.dataclass(frozen=True)
class Served:
    """How the caching allocator served a run's requests. Its steps are counted from 0, one per optimizer step's
    batches (the run's own numbers: :meth:`AllocatorLog.step_number`).

    Attributes:
        served: Every request was served (within the capacity, the cache freed where it had to be).
        max_reserved_bytes: The most it reserved (``torch.cuda.max_memory_reserved()``), up to where it stopped.
        reserved_from_step: The step in which it first reserved that much.
        steps: Optimizer steps served, the estimated ones and those served again.
        repeats_from: The step whose starting state the last served step's end repeats (every later step repeats
            one served); None where the steps were not served again, or another limit came first.
        reserved_by_step: Per step served, the most reserved up to its end.
    """

    served: bool
    max_reserved_bytes: int
    reserved_from_step: int
    steps: int
    repeats_from: int | None
    reserved_by_step: tuple[int, ...] = ()

    def reserved_through(self, step: int) -> int:
        """The most reserved up to the end of ``step`` (past the steps served: :attr:`max_reserved_bytes`)."""
        if step < 0 or not self.reserved_by_step:
            return 0
        return self.reserved_by_step[min(step, len(self.reserved_by_step) - 1)]


@dataclasses.dataclass(frozen=True)
class StepRepeat:
    """The last estimated step, in terms that serve it again after itself.

    Attributes:
        ops: Per call: a request's bytes (``>= 0``), ``-1 - j`` for the free of the step's own request ``j``, or
            ``CARRIED - i`` for the free of the ``i``-th block the previous step kept.
        kept: The step's own requests (by number in the step) alive at its end that the next step frees, in the
            order of the blocks of the previous step that this step frees.
        first: The run's number of the step's first request.
    """

    CARRIED = -(1 << 40)

    ops: tuple[int, ...]
    kept: tuple[int, ...]
    first: int


@dataclasses.dataclass(frozen=True)
class AllocatorLog:
    """The requests and frees a model served, in order, to serve them again.

    Attributes:
        settings: The settings they were served with.
        ops: One number per call: a request's bytes (requests are numbered from 0 in order), or ``-1 - n`` for
            the free of request ``n``.
        step_starts: Where in ``ops`` each optimizer step's first batch starts, then where the last step ends (what
            follows is the run's end). Empty: the steps are not known, nothing is served past the log.
        step_numbers: Beside each of ``step_starts``, the run's number of that step (``global_step``; at the end, the
            step that would come next): :class:`Served` counts steps from 0, one per step window, where Lightning
            counts every optimizer step (two a batch for two optimizers stepped by hand). Empty: the same.
    """

    settings: AllocatorSettings
    ops: Sequence[int]
    step_starts: Sequence[int] = ()
    step_numbers: Sequence[int] = ()
    _unhindered: dict[AllocatorSettings, Served] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def serves_within(self, capacity: int, settings: AllocatorSettings | None = None) -> bool:
        """Whether the allocator, able to reserve ``capacity`` bytes at most, serves every request, the steps served
        again included (freeing its cache where it must, as torch's does before an out-of-memory error); under
        other ``settings`` if given. The steps are served again as far as :meth:`unhindered` served them."""
        return self.serve(capacity, settings, self.unhindered_with(settings).steps).served

    @property
    def unhindered(self) -> Served:
        """:meth:`serve` with nothing making the allocator free its cache, under the log's settings."""
        return self.unhindered_with(None)

    def unhindered_with(self, settings: AllocatorSettings | None) -> Served:
        """:meth:`serve` with nothing making the allocator free its cache, under ``settings`` (None: the log's)."""
        settings = settings or self.settings
        if settings not in self._unhindered:
            self._unhindered[settings] = self.serve(settings=settings)
        return self._unhindered[settings]

    def serve(
        self, capacity: int | None = None, settings: AllocatorSettings | None = None, steps: int | None = None
    ) -> Served:
        """Serve the log under ``capacity`` and ``settings`` where given, then its last step again: until ``steps``
        steps are served where given; else until the allocator's state at a step's start repeats an earlier one (see
        the module's docstring) or its reserved bytes have not grown for
        :data:`STABLE_STEPS` steps (and for as many steps as it took to grow to them), or :attr:`steps_limit` more
        steps are served."""
        model = CachingAllocatorModel(settings or self.settings, capacity=None if capacity is None else int(capacity))
        repeat = self.step_repeat
        # the module's state placed before the first step counts in step 0; without a repeat, the run's end in the last
        stops = list(self.step_starts[1:]) or [len(self.ops)]
        if repeat is None:
            stops[-1] = len(self.ops)
        blocks: list[Block | None] = []
        peaks = _StepPeaks(model)
        step = 0
        try:
            start = 0
            for step, stop in enumerate(stops):
                for op in self.ops[start:stop]:
                    if op >= 0:
                        blocks.append(model.malloc(op))
                    else:
                        block = blocks[-1 - op]
                        blocks[-1 - op] = None
                        if block is not None:
                            model.free(block)
                peaks.end_step(step)
                start = stop
            if repeat is None:
                return peaks.served(True, len(stops), None)
            carried = [blocks[repeat.first + j] for j in repeat.kept]
            carried_ids = {id(b) for b in carried}
            kept_for_good = [b for b in blocks if b is not None and id(b) not in carried_ids]
            # a given number of steps (a capped pass of the bisection) is served whole: no state is compared
            unbounded = steps is None
            seen = {_state(model, carried, kept_for_good): len(stops)} if unbounded else {}
            last = len(stops) + self.steps_limit if unbounded else max(int(steps or 0), len(stops))
            for step in range(len(stops), last):
                if unbounded and step - peaks.reserved_step > max(STABLE_STEPS, peaks.reserved_step):
                    return peaks.served(True, step, None)
                carried = _serve_step(model, repeat, carried)
                peaks.end_step(step)
                if unbounded:
                    state = _state(model, carried, kept_for_good)
                    if state in seen:
                        return peaks.served(True, step + 1, seen[state])
                    seen[state] = step + 1
            return peaks.served(True, last, None)
        except SimulatedOutOfMemory:
            peaks.end_step(step)
            return peaks.served(False, step + 1, None)

    def step_number(self, step: int) -> int:
        """The run's number of :class:`Served`'s step ``step`` (counted from 0): the estimated steps' own, the steps
        served on after them numbered on with the last one's stride."""
        numbers = self.step_numbers
        if step < len(numbers):
            return numbers[step]
        if len(numbers) < 2:
            return step
        return numbers[-1] + (step - len(numbers) + 1) * self._stride

    def served_step(self, number: int) -> int:
        """:class:`Served`'s step (counted from 0) in which the run's step ``number`` falls: the last at most it."""
        numbers = self.step_numbers
        if len(numbers) < 2:
            return number
        if number >= numbers[-1]:
            return len(numbers) - 1 + (number - numbers[-1]) // self._stride
        return max(0, bisect.bisect_right(numbers, number) - 1)

    @property
    def _stride(self) -> int:
        return max(1, self.step_numbers[-1] - self.step_numbers[-2])

    @property
    def steps_limit(self) -> int:
        """Steps served past the estimated ones at most: :data:`STEP_LIMIT`, fewer where the step makes so many
        requests that they would pass :data:`OPS_LIMIT` (at least :data:`MIN_STEPS`)."""
        repeat = self.step_repeat
        per_step = len(repeat.ops) if repeat is not None else 1
        return min(STEP_LIMIT, max(MIN_STEPS, OPS_LIMIT // max(1, per_step)))

    @functools.cached_property
    def step_repeat(self) -> StepRepeat | None:
        """The last estimated step, to serve again; None where it cannot be (see the module's docstring) or the
        steps are not known."""
        if len(self.step_starts) < 2:
            return None
        start, end = self.step_starts[-2], self.step_starts[-1]
        step = self.ops[start:end]
        first = sum(1 for op in self.ops[:start] if op >= 0)
        sizes = [op for op in self.ops[:end] if op >= 0]
        carried_in = sorted(-1 - op for op in step if op < 0 and -1 - op < first)
        position = {n: i for i, n in enumerate(carried_in)}
        own_freed = {-1 - op - first for op in step if op < 0 and -1 - op >= first}
        kept = [j for j in range(len(sizes) - first) if j not in own_freed]
        if [sizes[first + j] for j in kept] != [sizes[n] for n in carried_in]:
            return None
        ops = [
            op if op >= 0 else op + first if -1 - op >= first else StepRepeat.CARRIED - position[-1 - op]
            for op in step
        ]
        return StepRepeat(tuple(ops), tuple(kept), first)


def _serve_step(model: CachingAllocatorModel, repeat: StepRepeat, carried: list[Block]) -> list[Block]:
    own: list[Block] = []
    for op in repeat.ops:
        if op >= 0:
            own.append(model.malloc(op))
        elif op > StepRepeat.CARRIED:
            model.free(own[-1 - op])
        else:
            model.free(carried[StepRepeat.CARRIED - op])
    return [own[j] for j in repeat.kept]


def _state(model: CachingAllocatorModel, carried: Sequence[Block], kept: Sequence[Block]) -> Hashable:
    """The allocator's layout as its later choices see it: every block by segment (numbered in address order, as
    only the order of addresses decides), offset and size, and what it holds (the ``i``-th block carried into the
    next step, a block kept for good, nothing, or unmapped address space)."""
    tags: dict[int, int] = {id(b): i for i, b in enumerate(carried)}
    tags.update((id(b), _KEPT_BLOCK) for b in kept)
    everything = [*carried, *kept]
    everything.extend(model.cached_blocks())
    out = []
    segment, base = -1, 0
    for block in sorted(everything, key=lambda b: b.addr):
        if block.prev is None:
            segment, base = segment + 1, block.addr
        tag = tags.get(id(block), _FREED_BLOCK if block.mapped else _UNMAPPED_RANGE)
        out.append((segment, block.addr - base, block.size, tag))
    return tuple(out)


class _StepPeaks:
    """Which step first reserved the most."""

    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model
        self.reserved = 0
        #: The step in which the reserved bytes last grew.
        self.reserved_step = 0
        self.by_step: list[int] = []

    def end_step(self, step: int) -> None:
        if self.model.max_reserved > self.reserved:
            self.reserved, self.reserved_step = self.model.max_reserved, step
        del self.by_step[step:]
        self.by_step.append(self.reserved)

    def served(self, served: bool, steps: int, repeats_from: int | None) -> Served:
        return Served(served, self.reserved, self.reserved_step, steps, repeats_from, tuple(self.by_step))
