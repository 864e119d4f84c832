"""Eleven Hugging Face architectures made tiny (hidden 64, 2 layers, 4 heads, vocab 1000), and a Lightning module that
trains one as a user would: ``AutoModelForCausalLM.from_config``, transformers' default attention.

Shared by ``test_estimate_attention.py`` and ``benchmarks/estimate_accuracy.py --architectures``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lm_helpers import RandomTokens
from torch.utils.data import DataLoader

_LAYERS: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}
_DECODER: dict[str, Any] = dict(_LAYERS, hidden_size=64, intermediate_size=128, max_position_embeddings=256)

#: Tiny configs, as dicts for ``AutoConfig.for_model``. BERT as a decoder is ``BertLMHeadModel``. Token ids within
#: the vocabulary where the defaults are not (GPT-2's 50256, Phi-3's 32000).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 1000,
        "n_positions": 256,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "llama": dict(_DECODER, model_type="llama", num_key_value_heads=4),
    "mistral": dict(_DECODER, model_type="mistral", num_key_value_heads=2, head_dim=16),
    "qwen2": dict(_DECODER, model_type="qwen2", num_key_value_heads=2),
    "gemma": dict(_DECODER, model_type="gemma", num_key_value_heads=1, head_dim=16),
    "gemma2": dict(_DECODER, model_type="gemma2", num_key_value_heads=2, head_dim=16, sliding_window=64),
    "phi3": dict(_DECODER, model_type="phi3", num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt_neox": dict(_DECODER, model_type="gpt_neox"),
    "bert": dict(_DECODER, model_type="bert", is_decoder=True),
    "opt": dict(
        _LAYERS, model_type="opt", hidden_size=64, ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64
    ),
    "falcon": dict(_LAYERS, model_type="falcon", hidden_size=64, new_decoder_architecture=False, multi_query=True),
}


class ConfigLM(pl.LightningModule):
    """A causal LM from a config dict, as a user builds it (default attention unless ``attn_implementation``)."""

    def __init__(
        self,
        config: dict[str, Any],
        batch_size: int = 4,
        seq_len: int = 128,
        gradient_checkpointing: bool = False,
        attn_implementation: str | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.for_model(**config)
        hf_config.use_cache = False
        attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = AutoModelForCausalLM.from_config(hf_config, **attention)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.batch_size, self.seq_len = batch_size, seq_len

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(4 * self.batch_size, self.seq_len, self.model.config.vocab_size), self.batch_size)
