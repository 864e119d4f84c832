"""What a model built from a Hugging Face config is trained for: the class a user's ``from_config`` builds for the
task, and the batch it trains on, as shapes.

Each task's batch holds its labels (``labels``; a question's ``start_positions`` and ``end_positions``), so the
model's own loss runs (``model(**batch).loss``), as a user's ``training_step`` calls it; a causal LM's batch is
``input_ids`` only, its labels the same tensor. Labels are fake tensors: their values are never read (the losses
need shapes and dtypes only).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memtrace.estimator.inputs import InputSpec, lm_batch
from lightning_memtrace.types import Task

#: The side of an image where the config does not say (ResNet's configs have no ``image_size``): ImageNet's crop.
DEFAULT_IMAGE_SIZE = 224

__all__ = ["DEFAULT_IMAGE_SIZE", "Task", "audio_shape", "image_shape", "prepare_config", "task_batch", "task_detail"]


def prepare_config(task: Task, hf_config: Any) -> None:
    """What the task's model needs of its config, where it leaves it unset and memory does not depend on it: a
    decoder's sequence classification finds each sequence's last token by its padding id (transformers refuses batches
    of more than one without one; a user's run sets it, usually to the end-of-sequence id)."""
    if task is Task.SEQUENCE_CLASSIFICATION and getattr(hf_config, "pad_token_id", None) is None:
        eos = getattr(hf_config, "eos_token_id", None)
        hf_config.pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) or 0


def image_shape(hf_config: Any, image_size: int | None = None) -> tuple[int, int, int]:
    """Channels, height and width of one image: ``image_size`` if given, else the config's (``image_size``, an int or
    a pair), else :data:`DEFAULT_IMAGE_SIZE`; channels from ``num_channels`` (3 where unset)."""
    channels = int(getattr(hf_config, "num_channels", None) or 3)
    size: Any = image_size if image_size is not None else getattr(hf_config, "image_size", None) or DEFAULT_IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    return channels, int(height), int(width)


def audio_shape(hf_config: Any) -> tuple[int, int]:
    """Mel bins and frames of one example's audio features as Whisper's encoder takes them: ``num_mel_bins`` by
    twice ``max_source_positions`` (its second convolution halves the frames; 80 x 3,000 for 30 s of audio)."""
    return int(getattr(hf_config, "num_mel_bins", None) or 80), 2 * int(
        getattr(hf_config, "max_source_positions", None) or 1500
    )


def task_batch(
    task: Task,
    hf_config: Any,
    batch_size: int,
    seq_len: int | None,
    target_len: int | None = None,
    image_size: int | None = None,
) -> dict[str, InputSpec]:
    """The batch of ``batch_size`` examples the task trains on, as shapes: token ids of ``seq_len`` (a seq2seq model's
    labels of ``target_len``, default ``seq_len``), images (see :func:`image_shape`) or audio features (see
    :func:`audio_shape`; labels of ``target_len`` tokens, default 448, Whisper's most), with their labels."""
    ids, batch = torch.int64, int(batch_size)
    if task is Task.IMAGE_CLASSIFICATION:
        return {
            "pixel_values": InputSpec((batch, *image_shape(hf_config, image_size)), torch.float32),
            "labels": InputSpec((batch,), ids),
        }
    if task is Task.SPEECH_SEQ2SEQ:
        target = int(target_len) if target_len is not None else int(getattr(hf_config, "max_target_positions", 448))
        return {
            "input_features": InputSpec((batch, *audio_shape(hf_config)), torch.float32),
            "labels": InputSpec((batch, target), ids),
        }
    if seq_len is None:
        raise ValueError(f"the {task} task needs a sequence length")
    tokens = (batch, int(seq_len))
    if task is Task.CAUSAL_LM:
        return lm_batch(batch, int(seq_len))
    if task is Task.SEQ2SEQ_LM:
        target = int(target_len) if target_len is not None else int(seq_len)
        return {"input_ids": InputSpec(tokens, ids), "labels": InputSpec((batch, target), ids)}
    if task is Task.SEQUENCE_CLASSIFICATION:
        return {"input_ids": InputSpec(tokens, ids), "labels": InputSpec((batch,), ids)}
    if task is Task.QUESTION_ANSWERING:
        return {
            "input_ids": InputSpec(tokens, ids),
            "start_positions": InputSpec((batch,), ids),
            "end_positions": InputSpec((batch,), ids),
        }
    return {"input_ids": InputSpec(tokens, ids), "labels": InputSpec(tokens, ids)}  # masked-lm, token-classification


def task_detail(task: Task, batch: dict[str, InputSpec]) -> str:
    """The task in words for the estimate's first line (empty for a causal LM, the default)."""
    if task is Task.CAUSAL_LM:
        return ""
    if task is Task.IMAGE_CLASSIFICATION:
        channels, height, width = batch["pixel_values"].shape[1:]
        return f"{task} ({channels} x {height} x {width} images)"
    if task is Task.SEQ2SEQ_LM:
        return f"{task} (targets of {batch['labels'].shape[1]} tokens)"
    if task is Task.SPEECH_SEQ2SEQ:
        bins, frames = batch["input_features"].shape[1:]
        return f"{task} ({bins} x {frames} audio features, targets of {batch['labels'].shape[1]} tokens)"
    return str(task)
