"""The plain-language summary written next to the snapshot when a run dies of out-of-memory."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_memtrace.analysis.growth import Growth
from lightning_memtrace.analysis.frames import format_frame, user_frame
from lightning_memtrace.analysis.view import post_mortem_view
from lightning_memtrace.capture.ddp_buckets import bucket_view_saving
from lightning_memtrace.schema import CATEGORY_FIELD, UNKNOWN_CATEGORY
from lightning_memtrace.types import Category, Frame, Stage
from lightning_memtrace.units import format_bytes, format_bytes_exact


@dataclasses.dataclass
class LiveBlock:
    """One live allocation at the moment of failure."""

    nbytes: int
    frames: list[Frame]
    metadata: str = ""
    category: str = ""


@dataclasses.dataclass
class PostMortem:
    """Everything the summary says. Bytes are integers."""

    rank: int
    device: str
    step: int
    epoch: int
    batch_idx: int
    stage: str
    exception_type: str
    message: str
    requested_bytes: int | None
    allocated_bytes: int
    reserved_bytes: int
    categories: dict[str, int]
    largest: list[LiveBlock]
    failing_frames: list[Frame] = dataclasses.field(default_factory=list)
    device_free_bytes: int | None = None
    #: What would fit, on fake tensors for this module and the batch it died on (the keys of
    #: :meth:`~lightning_memtrace.estimator.budget.BudgetedWhatIf.as_dict`: ``made``, ``text``, ``what_if`` rows,
    #: ``combination``, ``note``...), None where MemTrace made none.
    what_if: dict[str, Any] | None = None
    #: The validation dataloader of the batch (``batch_idx`` counts within it); 0 in training.
    dataloader_idx: int = 0
    #: Memory held between training batches that rose batch after batch in the rows before the error
    #: (:meth:`~lightning_memtrace.analysis.growth.Growth.as_dict`), None where it did not.
    growth: dict[str, Any] | None = None
    #: Bytes of DDP's gradient buckets, a second copy of the gradients (``gradient_as_bucket_view=False``), among the
    #: ``other`` bytes; 0 where the run is not DDP's or its gradients are views of the buckets.
    ddp_bucket_bytes: int = 0
    #: Whether the caching allocator's model, serving the snapshot's trace again with ``expandable_segments:True`` in
    #: the memory the GPU had, serves the request that failed (see
    #: :func:`~lightning_memtrace.analysis.allocator_replay.expandable_segments_what_if`); None where the snapshot
    #: holds no trace of the error that the model serves as the GPU did.
    expandable_serves: bool | None = None
    #: The error that ended the run where it is not the out-of-memory error itself but was raised from it (a
    #: compiler's ``BackendCompilerFailed``, a library's own error): its type and first line; None otherwise.
    raised_as: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _frames(value: Any) -> list[Frame]:
    return [frame for frame in value if isinstance(frame, dict)] if isinstance(value, list) else []


def _growth(value: Any) -> dict[str, Any] | None:
    """A growth dict that tells its sentence, else None (the header is untrusted data)."""
    if not isinstance(value, dict):
        return None
    try:
        Growth.from_dict(value).sentence()
    except Exception:  # noqa: BLE001 - not a growth this version can tell
        return None
    return value


def post_mortem_from_dict(values: Any) -> PostMortem | None:
    """The post-mortem a snapshot's header holds (:meth:`PostMortem.as_dict`), read field by field as a value of its
    type or its default (a snapshot is untrusted); None where ``values`` is not one (no ``step`` or ``message``)."""
    if not isinstance(values, dict) or _int(values.get("step")) is None or not isinstance(values.get("message"), str):
        return None

    def number(key: str) -> int:
        return _int(values.get(key)) or 0

    def text(key: str) -> str:
        value = values.get(key)
        return value if isinstance(value, str) else ""

    categories = values.get("categories") if isinstance(values.get("categories"), dict) else {}
    blocks = values.get("largest") if isinstance(values.get("largest"), list) else []
    largest = [
        LiveBlock(b["nbytes"], _frames(b.get("frames")), str(b.get("metadata") or ""), str(b.get("category") or ""))
        for b in blocks
        if isinstance(b, dict) and _int(b.get("nbytes")) is not None
    ]
    expandable = values.get("expandable_serves")
    return PostMortem(
        rank=number("rank"),
        device=text("device"),
        step=number("step"),
        epoch=number("epoch"),
        batch_idx=number("batch_idx"),
        stage=text("stage"),
        exception_type=text("exception_type"),
        message=text("message"),
        requested_bytes=_int(values.get("requested_bytes")),
        allocated_bytes=number("allocated_bytes"),
        reserved_bytes=number("reserved_bytes"),
        categories={str(k): v for k, v in categories.items() if _int(v) is not None},
        largest=largest,
        failing_frames=_frames(values.get("failing_frames")),
        device_free_bytes=_int(values.get("device_free_bytes")),
        what_if=values.get("what_if") if isinstance(values.get("what_if"), dict) else None,
        dataloader_idx=number("dataloader_idx"),
        growth=_growth(values.get("growth")),
        ddp_bucket_bytes=number("ddp_bucket_bytes"),
        expandable_serves=expandable if isinstance(expandable, bool) else None,
        raised_as=values.get("raised_as") if isinstance(values.get("raised_as"), str) else None,
    )


def _dataloader_text(pm: PostMortem) -> str:
    # said only where it tells batches apart: with several validation dataloaders, batch_idx starts again in each
    return f", dataloader_idx {pm.dataloader_idx}" if pm.dataloader_idx else ""


def _stage_text(stage: str) -> str:
    try:
        return Stage(stage).description
    except ValueError:
        return stage


#: A category below this share of live memory gets no advice: changing it could not make the run fit.
ADVICE_MIN_SHARE = 0.05


def advice(pm: PostMortem) -> list[str]:
    """What to change, with the numbers that point there; only for what holds at least :data:`ADVICE_MIN_SHARE` of
    live memory. Without such a number, one general tip, unless the post-mortem has a what-if table
    (:attr:`PostMortem.what_if`), which says more."""
    tips: list[str] = []
    total = max(1, sum(pm.categories.values()))
    share = {name: value / total for name, value in pm.categories.items()}

    def holds(category: Category, usual: float) -> bool:
        """A real share of live memory: ``usual`` or more, or enough to matter in the stage that allocates it."""
        value = share.get(category.value, 0)
        return value >= usual or value >= ADVICE_MIN_SHARE and pm.stage == _STAGE_OF[category]

    if pm.growth:
        sentence = Growth.from_dict(pm.growth).sentence()
        tips.append(f"{sentence[0].upper()}{sentence[1:]}.")
    if pm.requested_bytes and pm.allocated_bytes and pm.requested_bytes > 4 * max(pm.allocated_bytes, 1):
        tips.append(
            f"The failed request alone ({format_bytes(pm.requested_bytes)}) is over 4x everything live "
            f"({format_bytes(pm.allocated_bytes)}): look first at the line that asked for it ('failed at' above); a shape or "
            "dtype there is likely wrong, or one tensor (logits of a large vocabulary?) should be chunked."
        )
    if holds(Category.ACTIVATIONS, 0.3):
        tips.append(
            f"Activations saved for backward hold {format_bytes(pm.categories.get('activations', 0))}: turn on "
            "gradient checkpointing, lower the micro-batch (keep the effective batch with accumulate_grad_batches), "
            "or shorten the sequence."
        )
    if holds(Category.OPTIMIZER_STATE, 0.3):
        tips.append(
            f"Optimizer state holds {format_bytes(pm.categories.get('optimizer_state', 0))}: an 8-bit or "
            "factored optimizer, a sharded strategy (FSDP / DeepSpeed ZeRO) or fewer trainable parameters "
            "(LoRA) lowers it; foreach=False lowers the optimizer step's temporaries."
        )
    if share.get(Category.UNSHARDED_PARAMETERS.value, 0) >= ADVICE_MIN_SHARE:
        tips.append(
            f"Gathered (unsharded) parameters hold {format_bytes(pm.categories[Category.UNSHARDED_PARAMETERS.value])}: "
            "fully_shard each repeated block with reshard_after_forward=True (the default; the root keeps its own "
            "gathered until backward), so that each block's full parameters are freed after its forward and "
            "gathered again in backward (one more all-gather per block)."
        )
    if share.get(Category.GRADIENTS.value, 0) >= ADVICE_MIN_SHARE and pm.stage in (
        Stage.FORWARD.value,
        Stage.BACKWARD.value,
    ):
        tips.append(
            f"Gradients ({format_bytes(pm.categories['gradients'])}) are alive during this step's "
            f"{'forward' if pm.stage == Stage.FORWARD.value else 'backward'}: Lightning zeroes them after the forward."
        )
    if pm.ddp_bucket_bytes >= ADVICE_MIN_SHARE * total:
        tips.append(
            f"DDP keeps its gradient buckets ({format_bytes(pm.ddp_bucket_bytes)}, counted in other) beside the "
            f"gradients, a second copy of them: {bucket_view_saving(pm.ddp_bucket_bytes)}."
        )
    if pm.expandable_serves:
        tips.append(
            "Fragmentation ran it out: with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the process "
            "starts) the caching allocator's model, serving this run's recorded requests again in the memory the GPU "
            "had, serves this one."
        )
    elif pm.reserved_bytes > pm.allocated_bytes * 1.3 and pm.reserved_bytes > 0:
        outlook = (
            " (the caching allocator's model, serving this run's recorded requests again with it, runs out too)"
            if pm.expandable_serves is False
            else ""
        )
        tips.append(
            f"Reserved ({format_bytes(pm.reserved_bytes)}) exceeds allocated ({format_bytes(pm.allocated_bytes)}) by "
            f"{(pm.reserved_bytes / max(1, pm.allocated_bytes) - 1):.0%}: fragmentation; try "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True{outlook}."
        )
    if not tips and not has_what_if_table(pm):
        tips.append("Lower the micro-batch size or use a precision with fewer bytes per value (bf16-mixed).")
    return tips


def has_what_if_table(pm: PostMortem) -> bool:
    """Whether the post-mortem holds a what-if table (at least one remedy estimated)."""
    return bool(pm.what_if and pm.what_if.get("made"))


_STAGE_OF = {Category.ACTIVATIONS: Stage.FORWARD.value, Category.OPTIMIZER_STATE: Stage.OPTIMIZER_STEP.value}


def render_post_mortem(pm: PostMortem) -> str:
    lines = [
        f"MemTrace post-mortem: out of memory on {pm.device} (rank {pm.rank})",
        "",
        f"step:          {pm.step} (epoch {pm.epoch}, batch_idx {pm.batch_idx}{_dataloader_text(pm)})",
        f"died in:       {_stage_text(pm.stage)} [phase: {pm.stage}]",
        f"requested:     {format_bytes_exact(pm.requested_bytes) if pm.requested_bytes is not None else 'unknown'}",
        f"allocated:     {format_bytes_exact(pm.allocated_bytes)}",
        f"reserved:      {format_bytes_exact(pm.reserved_bytes)}",
    ]
    if pm.device_free_bytes is not None:
        lines.append(f"device free:   {format_bytes_exact(pm.device_free_bytes)}")
    lines.append(f"error:         {pm.exception_type}: {pm.message}")
    if pm.raised_as:
        lines.append(f"raised as:     {pm.raised_as}")
    if pm.failing_frames:
        lines.append(f"failed at:     {format_frame(user_frame(pm.failing_frames))}")
    view = post_mortem_view(pm)
    lines += ["", "live memory by category:"]
    lines += [
        f"  {share.category:<16} {format_bytes(share.bytes):>12}  ({share.bytes:,} B)" for share in view.categories
    ]
    lines += ["", f"{len(view.sites)} largest live allocations:"]
    for index, site in enumerate(view.sites, 1):
        made = f" [{site.note}]" if site.note else ""
        category = f" {site.category}" if site.category else ""
        lines.append(f"  {index:>2}. {format_bytes(site.bytes):>12}  ({site.bytes:,} B){category}{made}  {site.where}")
    if pm.what_if:
        lines += ["", "what would fit (estimated on fake tensors for this module and the batch it died on):"]
        lines += [f"  {line}".rstrip() for line in str(pm.what_if.get("text", "")).splitlines()]
    tips = advice(pm)
    if tips:
        lines += ["", "what to change:"]
        lines += [f"  - {tip}" for tip in tips]
    return "\n".join(lines) + "\n"


def _named_category(value: Any) -> str:
    """A block's category as the list of largest allocations shows it: none where MemTrace named it nothing."""
    category = str(value or "")
    return "" if category == UNKNOWN_CATEGORY else category


def largest_blocks_from_snapshot(snapshot: dict[str, Any], limit: int = 10) -> list[LiveBlock]:
    """The largest active blocks of a torch-format snapshot."""
    blocks = []
    for segment in snapshot.get("segments", []) or []:
        for block in segment.get("blocks", []) or []:
            if block.get("state") == "active_allocated":
                blocks.append(
                    LiveBlock(
                        nbytes=int(block.get("requested_size") or block.get("size") or 0),
                        frames=list(block.get("frames") or []),
                        metadata=str(block.get("user_metadata", "") or ""),
                        category=_named_category(block.get(CATEGORY_FIELD)),
                    )
                )
    blocks.sort(key=lambda b: b.nbytes, reverse=True)
    return blocks[:limit]
