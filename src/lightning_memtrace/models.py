"""Causal LMs built from a Hugging Face config with no download and no weights (needs ``transformers``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_utilities.core.imports import RequirementCache

TRANSFORMERS_AVAILABLE = RequirementCache("transformers")

#: ``shared/reference/configs/qwen2-tiny.json``: a 3,428,608-parameter Qwen2 (tied embeddings) for demos and tests.
TINY_QWEN2_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 2048,
}


#: A model's ``config.json`` is a few KiB (a few hundred with long vocab-sized lists); anything larger is not one.
CONFIG_MAX_BYTES = 16 * 1024**2


def load_config_dict(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A config as a dict, from a dict, a ``config.json`` file or a folder holding one."""
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a folder without a config.json")
        path = path / "config.json"
    if path.exists() and not path.is_file():  # a device or a pipe: /dev/zero would be read without end
        raise ValueError(f"{path} is not a regular file")
    with open(path, encoding="utf-8") as handle:
        text = handle.read(CONFIG_MAX_BYTES + 1)
    if len(text) > CONFIG_MAX_BYTES:
        raise ValueError(f"{path} is over {CONFIG_MAX_BYTES // 1024**2} MiB: not a model config")
    data = json.loads(text)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path} is not a Hugging Face model config (no 'model_type')")
    return data


def build_causal_lm(
    config: str | os.PathLike | dict[str, Any], attn_implementation: str | None = "eager", **overrides: Any
) -> Any:
    """``AutoModelForCausalLM.from_config`` on a local config, with random weights (nothing is downloaded).

    Args:
        config: A config dict, a ``config.json`` or a folder holding one.
        attn_implementation: ``"eager"`` by default: the same code path on every machine, and the one whose saved
            tensors people expect. ``None``: what transformers picks for the model (SDPA for most), as a user's
            ``from_config`` / ``from_pretrained`` gets.
        overrides: Config fields to change.
    """
    if not TRANSFORMERS_AVAILABLE:
        raise ModuleNotFoundError(str(TRANSFORMERS_AVAILABLE))
    from transformers import AutoConfig, AutoModelForCausalLM

    data = load_config_dict(config)
    data.update(overrides)
    hf_config = AutoConfig.for_model(**data)
    if attn_implementation is None:
        return AutoModelForCausalLM.from_config(hf_config)
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
