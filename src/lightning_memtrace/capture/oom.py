"""Out-of-memory capture: the state at the failed allocation, and the post-mortem written before the error goes on."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_memtrace.analysis.allocator_replay import expandable_segments_serve_the_oom
from lightning_memtrace.analysis.growth import records_growth
from lightning_memtrace.analysis.postmortem import (
    LiveBlock,
    PostMortem,
    largest_blocks_from_snapshot,
    render_post_mortem,
)
from lightning_memtrace.capture.categories import NamedStorages
from lightning_memtrace.capture.cuda_names import naming_of
from lightning_memtrace.capture.oom_errors import out_of_memory_in, requested_bytes_from_message
from lightning_memtrace.capture.outputs import RecorderFiles
from lightning_memtrace.capture.tracker import AllocationTracker, OutOfMemoryEvent
from lightning_memtrace.capture.window import HistoryWindow, cuda_allocated, cuda_reserved
from lightning_memtrace.files import oom_basename
from lightning_memtrace.schema import HEADER_KEY
from lightning_memtrace.types import Category, PhaseRecord


def say_what_if_runs(rank: int, budget_s: float, how_to_skip: str) -> None:
    """One line on stderr before the post-mortem's what-if: the error's traceback waits for it (up to ``budget_s``)."""
    prefix = f"[rank {rank}] " if rank else ""
    print(
        f"{prefix}MemTrace: out of memory; estimating what would fit for the post-mortem, for up to {budget_s:g} s "
        f"({how_to_skip} skips this)",
        file=sys.stderr,
        flush=True,
    )


@dataclasses.dataclass(eq=False)
class OomCapture:
    """Keeps what an out-of-memory error found (from the tracker's or CUDA's OOM listener, or from the exception)
    and writes ``oom_rank<R>_step<N>.pickle`` (the snapshot, with the post-mortem in its header) and ``.txt``.

    Args:
        device: The measured device.
        rank: Put in the post-mortem and the file names.
        tracker: The allocation tracker, or None.
        files: Where the post-mortem is written.
        window: Builds the snapshot and its header.
        classify: Names the live storages now.
        sync: Takes in the allocator's reports so far.
        where: ``(step, epoch, batch_idx, stage, dataloader_idx)`` of the recorder now.
        recent_rows: The rows the recorder still holds, oldest first: memory that rose batch after batch in them is
            named in the post-mortem (:attr:`PostMortem.growth`).
        ddp_bucket_bytes: DDP's gradient buckets beside the gradients (see :attr:`PostMortem.ddp_bucket_bytes`).
    """

    device: torch.device
    rank: int
    tracker: AllocationTracker | None
    files: RecorderFiles
    window: HistoryWindow
    classify: Callable[[], NamedStorages]
    sync: Callable[[], None]
    where: Callable[[], tuple[int, int, int, str, int]]
    recent_rows: Callable[[], Iterable[PhaseRecord]] = tuple
    ddp_bucket_bytes: int = 0
    _state: dict[str, Any] | None = dataclasses.field(default=None, init=False)
    last: PostMortem | None = dataclasses.field(default=None, init=False)

    def _live_blocks(self, limit: int = 10) -> list[LiveBlock]:
        """The largest live allocations, just after the live storages were named: one named nothing is ``other``."""
        if self.tracker is None:
            return []
        entries = sorted(self.tracker.live_allocations(), key=lambda e: e.nbytes, reverse=True)[:limit]
        other = Category.OTHER.value
        return [LiveBlock(e.nbytes, list(e.frames or []), e.metadata, e.category or other) for e in entries]

    def capture(self, requested: int | None, frames: list, device_free: int | None = None) -> None:
        """Keep the state now (called where the allocation failed, before the stack unwinds)."""
        self.sync()
        time_us = time.time_ns() // 1000
        named = self.classify()
        totals = {c.value: v for c, v in named.totals.items()}
        if self.tracker is not None:
            allocated = reserved = self.tracker.counters()[0]
            largest = self._live_blocks()
            snapshot = None
        else:
            allocated, reserved = cuda_allocated(self.device), cuda_reserved(self.device)
            # inside the window the naming just made is kept already (HistoryWindow.note_names)
            naming = None if self.window.is_open else naming_of(named, time_us)
            snapshot = self.window.snapshot_now(naming=naming) if self.device.type == "cuda" else None
            largest = largest_blocks_from_snapshot(snapshot) if snapshot else []
        totals[Category.OTHER.value] = max(0, allocated - sum(totals.values()))
        step, _, _, stage, _ = self.where()
        self._state = {
            "requested": requested,
            "frames": frames,
            "stage": stage,
            "step": step,
            "categories": totals,
            "allocated": allocated,
            "reserved": reserved,
            "largest": largest,
            "snapshot": snapshot,
            "device_free": device_free,
        }

    def forget(self) -> None:
        """Drop the state kept for an error the user's code caught (a batch skipped for being too large): the
        post-mortem of a later error must tell that error, and a snapshot taken on CUDA holds much host memory."""
        self._state = None

    def on_tracker_oom(self, event: OutOfMemoryEvent) -> None:
        self.capture(event.requested_bytes, event.frames)

    def on_cuda_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        if self.device.type == "cuda" and (self.device.index or 0) == device:
            self.capture(requested, [], device_free)

    def post_mortem(self, raised: BaseException) -> tuple[PostMortem, dict[str, Any] | None]:
        """What the post-mortem says (the state captured at the failure, else the state now), and the snapshot taken
        at the failure if any. ``raised``: the out-of-memory error, or an error raised from one (see
        :func:`~lightning_memtrace.capture.oom_errors.out_of_memory_in`), which the post-mortem names beside it."""
        exception = out_of_memory_in(raised, self.device) or raised
        raised_as = None
        if exception is not raised:
            first = str(raised).strip().splitlines()
            raised_as = f"{type(raised).__name__}: {first[0]}" if first else type(raised).__name__
        if self._state is None and self.tracker is not None and self.tracker.backend == "reports":
            self.tracker.note_oom(exception)  # its listener captures the state, with the stack from the traceback
        if self._state is None:
            self.capture(requested_bytes_from_message(str(exception)), [])
        state, self._state = self._state or {}, None
        step, epoch, batch_idx, stage, dataloader_idx = self.where()
        message = str(exception).strip().splitlines()
        requested = state.get("requested")
        if requested is None:
            requested = requested_bytes_from_message(str(exception))
        return PostMortem(
            rank=self.rank,
            device=str(self.device),
            step=int(state.get("step", step)),
            epoch=epoch,
            batch_idx=batch_idx,
            stage=str(state.get("stage", stage)),
            exception_type=type(exception).__name__,
            message=message[0] if message else "",
            requested_bytes=requested,
            allocated_bytes=int(state.get("allocated", 0)),
            reserved_bytes=int(state.get("reserved", 0)),
            categories=dict(state.get("categories", {})),
            largest=list(state.get("largest", [])),
            failing_frames=list(state.get("frames", [])),
            device_free_bytes=state.get("device_free"),
            dataloader_idx=dataloader_idx,
            growth=self._growth(),
            ddp_bucket_bytes=self.ddp_bucket_bytes,
            expandable_serves=self._expandable_serves(state.get("snapshot")),
            raised_as=raised_as,
        ), state.get("snapshot")

    def _expandable_serves(self, snapshot: dict[str, Any] | None) -> bool | None:
        """Whether expandable segments would have served the failed request (a CUDA snapshot's trace, served again by
        the caching allocator's model); None where it cannot tell."""
        if not snapshot or self.device.type != "cuda":
            return None
        return expandable_segments_serve_the_oom(snapshot, self.device.index or 0)

    def _growth(self) -> dict[str, Any] | None:
        try:
            found = records_growth(self.recent_rows())
        except Exception:  # noqa: BLE001 - the post-mortem stands without it
            return None
        return found.as_dict() if found is not None else None

    def write(
        self, exception: BaseException, what_if: Callable[[PostMortem], dict[str, Any] | None] | None = None
    ) -> list[Path]:
        """Write ``oom_rank<R>_step<N>.pickle`` and ``.txt``; returns the files written.

        Args:
            exception: The out-of-memory error, or the error raised from one.
            what_if: Called with the post-mortem once the state is kept: what would fit (plain data, see
                :attr:`PostMortem.what_if`), or None. A failure of it is one line in the text.
        """
        pm, snapshot = self.post_mortem(exception)
        snapshot = snapshot or self.window.snapshot_now()
        if what_if is not None:
            try:
                pm.what_if = what_if(pm)
            except Exception as error:  # noqa: BLE001 - the post-mortem stands without its what-if
                first = (str(error).splitlines() or [""])[0][:160]
                pm.what_if = {"made": False, "text": f"what-if: could not be made ({type(error).__name__}: {first})"}
        snapshot[HEADER_KEY] = self.window.header(pm.step, pm.step, 0)
        snapshot[HEADER_KEY]["post_mortem"] = pm.as_dict()
        base = self.files.unclaimed_base(oom_basename(self.rank, pm.step), (".pickle", ".txt"))
        paths = [self.files.write_snapshot(base + ".pickle", snapshot, rotate=False)]
        paths.append(self.files.write_text(base + ".txt", render_post_mortem(pm)))
        self.last = pm
        return [path for path in paths if path is not None]
