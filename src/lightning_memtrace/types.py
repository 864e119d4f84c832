"""Phases, categories and the per-phase record that every part of MemTrace shares."""

from __future__ import annotations

import dataclasses
from enum import Enum


class Phase(str, Enum):
    """The moments of a step at which MemTrace takes a row."""

    BATCH_START = "batch_start"
    AFTER_FORWARD = "after_forward"
    AFTER_BACKWARD = "after_backward"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    VAL_BATCH_START = "val_batch_start"
    VAL_BATCH_END = "val_batch_end"

    def __str__(self) -> str:
        return self.value


class Stage(str, Enum):
    """The part of a step that is running between two rows: where an allocation is made or an OOM happens."""

    OUTSIDE = "outside"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"
    AFTER_STEP = "after_step"
    VALIDATION = "validation"

    def __str__(self) -> str:
        return self.value

    @property
    def description(self) -> str:
        return _STAGE_DESCRIPTIONS[self]


_STAGE_DESCRIPTIONS = {
    Stage.OUTSIDE: "outside a training batch",
    Stage.FORWARD: "the forward pass",
    Stage.BACKWARD: "the backward pass (or zero_grad just before it)",
    Stage.OPTIMIZER_STEP: "the optimizer step",
    Stage.AFTER_STEP: "the end of the batch, after the optimizer step",
    Stage.VALIDATION: "a validation batch",
}

#: The stage that starts when a row of this phase is taken.
STAGE_AFTER_PHASE = {
    Phase.BATCH_START: Stage.FORWARD,
    Phase.AFTER_FORWARD: Stage.BACKWARD,
    Phase.AFTER_BACKWARD: Stage.OPTIMIZER_STEP,
    Phase.AFTER_OPTIMIZER_STEP: Stage.AFTER_STEP,
    Phase.BATCH_END: Stage.OUTSIDE,
    Phase.VAL_BATCH_START: Stage.VALIDATION,
    Phase.VAL_BATCH_END: Stage.OUTSIDE,
}


class Category(str, Enum):
    """What a piece of live memory is for. Each storage belongs to exactly one category."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


#: Categories computed from storages, in the priority order used when a storage could be in two.
MEASURED_CATEGORIES = (
    Category.PARAMETERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.INPUTS,
    Category.ACTIVATIONS,
)


@dataclasses.dataclass(frozen=True)
class PhaseRecord:
    """One row of the per-phase table. Byte counts are integers; ``time_s`` is Unix time in seconds."""

    step: int
    epoch: int
    batch_idx: int
    rank: int
    phase: Phase
    time_s: float
    allocated_bytes: int
    reserved_bytes: int
    peak_bytes: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    inputs_bytes: int
    other_bytes: int

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, object]:
        row = dataclasses.asdict(self)
        row["phase"] = str(self.phase)
        return row

    def category_bytes(self) -> dict[Category, int]:
        return {c: getattr(self, f"{c.value}_bytes") for c in Category}


#: Counters of a row (CSV column without ``_bytes``), as used in logged metric keys.
COUNTERS = (
    "allocated",
    "reserved",
    "peak",
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "inputs",
    "other",
)

#: The phases of a training batch, in the order MemTrace takes their rows.
TRAIN_PHASES = (
    Phase.BATCH_START,
    Phase.AFTER_FORWARD,
    Phase.AFTER_BACKWARD,
    Phase.AFTER_OPTIMIZER_STEP,
    Phase.BATCH_END,
)
#: The phases of a validation batch.
VAL_PHASES = (Phase.VAL_BATCH_START, Phase.VAL_BATCH_END)


class ValueEnum(str, Enum):
    """A string enum whose ``str()`` is its value (``f"{Precision.FP32}"`` is ``32-true``): the base of option enums."""

    def __str__(self) -> str:
        return self.value
