"""Phases, stages, categories (and their orders) and the per-phase record that every part of MemTrace shares.

Every other module imports these names; none writes a phase or category list of its own.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

#: One stack frame in PyTorch's snapshot format: ``{"filename": str, "line": int, "name": str}``.
Frame = dict[str, Any]


class TextEnum(str, Enum):
    """An enum of strings that prints as its value (``str(Phase.BATCH_START) == "batch_start"``)."""

    def __str__(self) -> str:
        return self.value

class Phase(TextEnum):
    """The moments of a step at which MemTrace takes a row."""

    BATCH_START = "batch_start"
    AFTER_FORWARD = "after_forward"
    AFTER_BACKWARD = "after_backward"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    VAL_BATCH_START = "val_batch_start"
    VAL_BATCH_END = "val_batch_end"

#: The phases of a training batch, in the order they are taken (validation phases excluded).
TRAIN_PHASES: tuple[Phase, ...] = (
    Phase.BATCH_START,
    Phase.AFTER_FORWARD,
    Phase.AFTER_BACKWARD,
    Phase.AFTER_OPTIMIZER_STEP,
    Phase.BATCH_END,
)
#: The phases of a validation batch.
VAL_PHASES: tuple[Phase, ...] = (Phase.VAL_BATCH_START, Phase.VAL_BATCH_END)
#: Every phase, in table order (training phases, then validation).
PHASE_ORDER: tuple[Phase, ...] = tuple(Phase)


class Stage(TextEnum):
    """The part of a step that is running between two rows: where an allocation is made or an OOM happens.

    The recorder sets six of them; a replay also tells ``init`` (a module's construction) and ``zero_grad`` apart
    from stack frames. The member order is the code order of a replay's ``phase`` column.
    """

    OUTSIDE = "outside"
    INIT = "init"
    FORWARD = "forward"
    BACKWARD = "backward"
    ZERO_GRAD = "zero_grad"
    OPTIMIZER_STEP = "optimizer_step"
    AFTER_STEP = "after_step"
    VALIDATION = "validation"
    @property
    def description(self) -> str:
        """The stage in a sentence of the post-mortem (``died in: the forward pass``)."""
        return _STAGE_DESCRIPTIONS[self]

    @property
    def words(self) -> str:
        """The stage in a finding (``peak ... in the optimizer step of step 3``)."""
        return _STAGE_WORDS[self]


_STAGE_DESCRIPTIONS = {
    Stage.OUTSIDE: "outside a training batch",
    Stage.INIT: "model set-up",
    Stage.FORWARD: "the forward pass",
    Stage.BACKWARD: "the backward pass (or zero_grad just before it)",
    Stage.ZERO_GRAD: "zero_grad",
    Stage.OPTIMIZER_STEP: "the optimizer step",
    Stage.AFTER_STEP: "the end of the batch, after the optimizer step",
    Stage.VALIDATION: "a validation batch",
}
_STAGE_WORDS = {
    Stage.OUTSIDE: "outside a training pass",
    Stage.INIT: "model set-up",
    Stage.FORWARD: "forward",
    Stage.BACKWARD: "backward",
    Stage.ZERO_GRAD: "zero_grad",
    Stage.OPTIMIZER_STEP: "the optimizer step",
    Stage.AFTER_STEP: "the end of the step",
    Stage.VALIDATION: "validation",
}
#: Stage names, in :class:`Stage` order.
STAGES: tuple[str, ...] = tuple(s.value for s in Stage)

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


class Category(TextEnum):
    """What a piece of live memory is for. Each storage belongs to exactly one category."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    OTHER = "other"
    #: Full parameters gathered from their shards (FSDP2's all-gather outputs), alive between the all-gather and
    #: the reshard; 0 on an unsharded run.
    UNSHARDED_PARAMETERS = "unsharded_parameters"
    #: Full gradients of unsharded parameters, before their reduce-scatter into the sharded gradients.
    UNSHARDED_GRADIENTS = "unsharded_gradients"

#: Categories computed from storages, in the priority order used when a storage could be in two.
MEASURED_CATEGORIES = (
    Category.PARAMETERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.UNSHARDED_PARAMETERS,
    Category.UNSHARDED_GRADIENTS,
    Category.INPUTS,
    Category.ACTIVATIONS,
)

#: Categories that only sharded training fills: tables of an unsharded run leave them out.
SHARDED_CATEGORIES = (Category.UNSHARDED_PARAMETERS, Category.UNSHARDED_GRADIENTS)


class InferredCategory(TextEnum):
    """Categories beyond :class:`Category` that only a replay can tell apart."""

    OPTIMIZER_INTERMEDIATES = "optimizer_intermediates"
    INTERMEDIATES = "intermediates"
    PRE_EXISTING = "pre_existing"

#: Every category a replay can assign, in the stacking order of the charts (bottom first).
CATEGORIES: tuple[str, ...] = (
    InferredCategory.PRE_EXISTING.value,
    Category.PARAMETERS.value,
    Category.OPTIMIZER_STATE.value,
    Category.GRADIENTS.value,
    Category.UNSHARDED_PARAMETERS.value,
    Category.UNSHARDED_GRADIENTS.value,
    Category.INPUTS.value,
    Category.ACTIVATIONS.value,
    InferredCategory.INTERMEDIATES.value,
    InferredCategory.OPTIMIZER_INTERMEDIATES.value,
    Category.OTHER.value,
)
#: The categories of the phases table (:class:`Category`), in chart order.
RECORDED_CATEGORIES: tuple[str, ...] = tuple(c for c in CATEGORIES if c in {m.value for m in Category})

#: Readable names of categories, for reports.
CATEGORY_LABELS: dict[str, str] = {
    "pre_existing": "pre-existing",
    "parameters": "parameters",
    "optimizer_state": "optimizer state",
    "gradients": "gradients",
    "unsharded_parameters": "unsharded parameters",
    "unsharded_gradients": "unsharded gradients",
    "inputs": "inputs",
    "activations": "activations",
    "intermediates": "intermediates",
    "optimizer_intermediates": "optimizer intermediates",
    "other": "other",
}


def category_label(category: object) -> str:
    """The readable name of a category (the name itself when it is not one)."""
    return CATEGORY_LABELS.get(str(category), str(category))


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
    #: Which run the row belongs to (runs writing into one folder, or one CSV, are told apart by it); a resumed
    #: run keeps its id.
    run: str = ""
    #: Sharded training (FSDP2): the gathered full parameters and their full gradients alive at the row (the local
    #: shards stay in ``parameters_bytes`` and ``gradients_bytes``); 0 on an unsharded run.
    unsharded_parameters_bytes: int = 0
    unsharded_gradients_bytes: int = 0
    #: Which validation dataloader the batch came from (Lightning's ``dataloader_idx``; ``batch_idx`` counts within
    #: it); 0 for training rows and with one validation dataloader.
    dataloader_idx: int = 0

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, object]:
        row = dataclasses.asdict(self)
        row["phase"] = str(self.phase)
        return row

    def category_bytes(self) -> dict[Category, int]:
        return {c: getattr(self, f"{c.value}_bytes") for c in Category}


#: The per-phase table's columns, in file order.
PHASE_COLUMNS: list[str] = PhaseRecord.columns()
#: Its byte columns (``allocated_bytes``... ``other_bytes``).
BYTE_COLUMNS: list[str] = [c for c in PHASE_COLUMNS if c.endswith("_bytes")]
#: The categories of a row, in column order.
ROW_CATEGORIES: tuple[str, ...] = tuple(
    c[: -len("_bytes")] for c in BYTE_COLUMNS if c[: -len("_bytes")] in {m.value for m in Category}
)
#: Counters of a row (CSV column without ``_bytes``), as used in logged metric keys.
COUNTERS: tuple[str, ...] = tuple(c[: -len("_bytes")] for c in BYTE_COLUMNS)


class Task(TextEnum):
    """A training task of a Hugging Face model (``memtrace estimate --task``; its batch:
    :func:`~lightning_memtrace.estimator.tasks.task_batch`)."""

    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    SEQ2SEQ_LM = "seq2seq-lm"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    TOKEN_CLASSIFICATION = "token-classification"
    QUESTION_ANSWERING = "question-answering"
    IMAGE_CLASSIFICATION = "image-classification"
    SPEECH_SEQ2SEQ = "speech-seq2seq"

    @property
    def auto_class(self) -> str:
        """The ``transformers`` auto class that builds the model (``AutoModelForCausalLM``...)."""
        return _AUTO_CLASSES[self]

    @property
    def takes_tokens(self) -> bool:
        """Whether the batch is token ids (of ``seq_len`` tokens); else images or audio features, their shape from
        the model's config."""
        return self not in (Task.IMAGE_CLASSIFICATION, Task.SPEECH_SEQ2SEQ)

    @property
    def takes_target_len(self) -> bool:
        """Whether the labels are tokens of a length of their own (a seq2seq model's)."""
        return self in (Task.SEQ2SEQ_LM, Task.SPEECH_SEQ2SEQ)

    @property
    def takes_image_size(self) -> bool:
        """Whether the batch is images (of a side the config or ``--image-size`` gives)."""
        return self is Task.IMAGE_CLASSIFICATION


_AUTO_CLASSES = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
    Task.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
    Task.QUESTION_ANSWERING: "AutoModelForQuestionAnswering",
    Task.IMAGE_CLASSIFICATION: "AutoModelForImageClassification",
    Task.SPEECH_SEQ2SEQ: "AutoModelForSpeechSeq2Seq",
}


class Quantization(TextEnum):
    """How the base model's layers are loaded quantized by bitsandbytes (``memtrace estimate --quantize``; see
    :mod:`~lightning_memtrace.estimator.quantization`)."""

    #: 4-bit NormalFloat with double quantization (QLoRA's ``load_in_4bit=True``).
    NF4 = "nf4"
    #: LLM.int8 (``load_in_8bit=True``).
    INT8 = "int8"
