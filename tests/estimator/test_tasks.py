"""Models of other tasks than causal LM from their config (``estimate_from_config(task=...)``, ``memtrace estimate
--task``): each estimate against MemTrace's measurement of a real Lightning CPU run of the same model and batch
(categories exact, every phase's peak within 3%)."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from estimate_checks import check_against_real, real_run
from torch.utils.data import DataLoader

from lightning_memtrace.cli.estimate import build_parser, main
from lightning_memtrace.estimator import estimate_from_config
from lightning_memtrace.estimator.tasks import Task, image_shape, prepare_config, task_batch
from lightning_memtrace.types import Category

_ENCODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
BERT = dict(_ENCODER, model_type="bert", vocab_size=1000, max_position_embeddings=256)
QWEN2 = dict(_ENCODER, model_type="qwen2", vocab_size=1000, max_position_embeddings=256, num_key_value_heads=2)
T5 = {"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16, "vocab_size": 1000,
      "decoder_start_token_id": 0, "pad_token_id": 0}  # fmt: skip
VIT = dict(_ENCODER, model_type="vit", image_size=32, patch_size=8, num_labels=10)
WHISPER = {"model_type": "whisper", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
           "decoder_ffn_dim": 128, "num_mel_bins": 80,
           "max_source_positions": 64, "max_target_positions": 32, "vocab_size": 1000, "decoder_start_token_id": 1,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
RESNET = {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
          "layer_type": "basic", "num_labels": 10}  # fmt: skip
BATCH, SEQ = 4, 64

#: (task, config, options of the estimate)
CASES = [
    ("masked-lm", BERT, {}),
    ("seq2seq-lm", T5, {"target_len": 16}),
    ("sequence-classification", dict(BERT, num_labels=3), {}),
    ("sequence-classification", QWEN2, {}),  # a decoder: the last token found by the padding id, which it lacks
    ("token-classification", dict(BERT, num_labels=5), {}),
    ("question-answering", BERT, {}),
    ("image-classification", VIT, {}),
    ("image-classification", RESNET, {"image_size": 48}),
    ("speech-seq2seq", WHISPER, {}),  # 80 x 128 audio features, labels of max_target_positions (32) tokens
]
UNTOKENIZED = ("image-classification", "speech-seq2seq")


class TaskModule(pl.LightningModule):
    """A task's model from a config dict as a user builds and trains it: ``AutoModelFor<Task>.from_config``, real
    random batches of the task's shapes, ``model(**batch).loss``."""

    def __init__(
        self,
        task: str,
        config: dict[str, Any],
        target_len: int | None = None,
        image_size: int | None = None,
        batch_size: int = BATCH,
        seq_len: int = SEQ,
    ):
        super().__init__()
        import transformers

        self.task = Task(task)
        hf_config = transformers.AutoConfig.for_model(**config)
        prepare_config(self.task, hf_config)  # what a user's run sets too (a decoder's padding id)
        self.model = getattr(transformers, self.task.auto_class).from_config(hf_config)
        self.batch_size, self.seq_len = batch_size, None if task in UNTOKENIZED else seq_len
        self.shapes = task_batch(self.task, hf_config, batch_size, self.seq_len, target_len, image_size)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        config = self.model.config
        tokens = (Task.MASKED_LM, Task.SEQ2SEQ_LM, Task.SPEECH_SEQ2SEQ)
        classes = config.vocab_size if self.task in tokens else config.num_labels

        def example() -> dict[str, torch.Tensor]:
            out = {}
            for name, spec in self.shapes.items():
                shape = spec.shape[1:]
                if spec.dtype.is_floating_point:
                    out[name] = torch.randn(shape, generator=generator)
                else:
                    positions = self.seq_len or 1
                    high = {"labels": classes, "start_positions": positions, "end_positions": positions}.get(name)
                    out[name] = torch.randint(0, high or config.vocab_size, shape, generator=generator)
            return out

        return DataLoader([example() for _ in range(4 * self.batch_size)], batch_size=self.batch_size)


@pytest.mark.parametrize("task, config, options", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_a_tasks_estimate_matches_a_real_run(tmp_path, task, config, options):
    module = TaskModule(task, config, **options)
    phases = real_run(tmp_path, module, allocation_backend="auto")
    seq_len = None if task in UNTOKENIZED else SEQ
    est = estimate_from_config(config, BATCH, seq_len, device="cpu", task=task, steps=3, **options)
    check_against_real(est, phases)
    real_peak = phases[phases.step >= 1].peak_bytes.max()
    assert abs(est.peak_bytes - real_peak) <= 0.03 * real_peak
    # the batch as the real run has it: every tensor, labels included
    batch_bytes = sum(t.nbytes for t in next(iter(module.train_dataloader())).values())
    assert int(est.to_dataframe().inputs_bytes.max()) == batch_bytes


def test_each_tasks_batch_and_model_class():
    (task_option,) = [a for a in build_parser()._actions if a.dest == "task"]
    assert list(task_option.choices) == [task.value for task in Task] and task_option.default == "causal-lm"
    vit = type("Config", (), {"image_size": 32, "num_channels": 3})()
    assert image_shape(vit) == (3, 32, 32) and image_shape(vit, 48) == (3, 48, 48)
    assert image_shape(type("Config", (), {})()) == (3, 224, 224)  # ResNet's configs: no image_size
    shapes = {name: spec.shape for name, spec in task_batch(Task.SEQ2SEQ_LM, None, 2, 64, 16).items()}
    assert shapes == {"input_ids": (2, 64), "labels": (2, 16)}
    shapes = {name: spec.shape for name, spec in task_batch(Task.SEQUENCE_CLASSIFICATION, None, 2, 64).items()}
    assert shapes == {"input_ids": (2, 64), "labels": (2,)}
    assert set(task_batch(Task.CAUSAL_LM, None, 2, 64)) == {"input_ids"}  # its labels: the same tensor
    shapes = {name: spec.shape for name, spec in task_batch(Task.QUESTION_ANSWERING, None, 2, 64).items()}
    assert shapes == {"input_ids": (2, 64), "start_positions": (2,), "end_positions": (2,)}
    whisper = type("Config", (), {"num_mel_bins": 128, "max_source_positions": 1500, "max_target_positions": 448})()
    shapes = {name: spec.shape for name, spec in task_batch(Task.SPEECH_SEQ2SEQ, whisper, 2, None).items()}
    assert shapes == {"input_features": (2, 128, 3000), "labels": (2, 448)}  # 30 s of audio, the longest labels
    with pytest.raises(ValueError, match="the masked-lm task needs a sequence length"):
        task_batch(Task.MASKED_LM, None, 2, None)
    est = estimate_from_config(dict(BERT, num_labels=3), 2, 32, device="cpu", task="sequence-classification")
    assert est.task == "sequence-classification" and "cpu, 32-true, AdamW, sequence-classification, batch 2" in (
        est.describe()
    )
    assert est.as_dict()["task"] == "sequence-classification"
    assert estimate_from_config(QWEN2, 2, 32, device="cpu").task == ""  # a causal LM: the default, not said


def test_the_command_estimates_a_task(tmp_path, capsys):
    config = tmp_path / "vit.json"
    config.write_text(json.dumps(VIT))
    assert main(["--config", str(config), "--task", "image-classification", "--batch-size", "4", "--device", "cpu",
                 "--json"]) == 0  # fmt: skip
    answer = json.loads(capsys.readouterr().out)["estimate"]
    assert answer["task"] == "image-classification (3 x 32 x 32 images)" and answer["seq_len"] is None
    expected = estimate_from_config(VIT, 4, None, device="cpu", task="image-classification")
    assert answer["peak_bytes"] == expected.peak_bytes
    for argv, message in [
        (["--task", "masked-lm", "--batch-size", "4"], "--seq-len is required for --task masked-lm"),
        (["--batch-size", "4", "--seq-len", "8", "--target-len", "4"], "--target-len goes with --task seq2seq-lm or"),
        (["--task", "image-classification", "--batch-size", "4", "--seq-len", "8"],
         "--seq-len does not go with --task image-classification: its inputs' shape comes from the config"),
        (["--batch-size", "4", "--seq-len", "8", "--image-size", "4"], "--image-size goes with --task image-class"),
    ]:
        assert main(["--config", str(config), *argv]) == 2
        assert message in capsys.readouterr().err
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps(BERT))
    assert main(["--config", str(bert), "--task", "image-classification", "--batch-size", "4"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("memtrace: error: cannot read the model config") and error.count("\n") == 1
    assert "for this kind of AutoModel: AutoModelForImageClassification" in error


#: peft's task type for each task whose head LoRA trains in full (its ``modules_to_save``).
PEFT_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "question-answering": "QUESTION_ANS"}


@pytest.mark.parametrize(
    "task, config",
    [("sequence-classification", dict(BERT, num_labels=3)), ("sequence-classification", QWEN2),
     ("question-answering", BERT)],  # fmt: skip
    ids=["bert-classifier", "qwen2-score", "bert-qa_outputs"],
)
def test_lora_trains_the_task_head_as_peft_does(tmp_path, request, task, config):
    """The what-if's LoRA on a task model keeps its head trainable, as peft's ``get_peft_model`` with the task type
    does (a copy of the head beside the frozen original): against a real run of a user's peft model, the
    categories are exact, the peak within 3%."""
    pytest.importorskip("peft")
    import peft

    case = request.node.callspec.id

    from lightning_memtrace.estimator.remedies import LORA_RANK, lora_heads, lora_targets
    from lightning_memtrace.estimator.what_if import what_if_from_config
    from lightning_memtrace.estimator.what_if_setups import lora_line

    result = what_if_from_config(config, BATCH, SEQ, device="cpu", task=task, steps=3, remedies=["lora"],
                                 max_batch=False)  # fmt: skip
    (row,) = [row for row in result.rows if row.remedy == "lora"]

    module = TaskModule(task, config)
    head_name = {"bert-classifier": "classifier", "qwen2-score": "score", "bert-qa_outputs": "qa_outputs"}[case]
    assert lora_heads(module) == [f"model.{head_name}"]
    targets = '["k_proj", "o_proj", "q_proj", "v_proj"]' if case == "qwen2-score" else '["key", "query", "value"]'
    assert lora_line(module) == (
        f"model = peft.inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules={targets}, "
        f'modules_to_save=["model.{head_name}"]), model)  # base frozen; or '
        "lightning_memtrace.estimator.remedies.apply_lora(model)"
    )
    head_bytes = sum(p.nbytes for p in getattr(module.model, head_name).parameters())
    lora = peft.LoraConfig(task_type=PEFT_TASK_TYPES[task], r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                           target_modules=lora_targets(module))  # fmt: skip
    module.model = peft.get_peft_model(module.model, lora)
    trainable = [p for p in module.parameters() if p.requires_grad]
    phases = real_run(tmp_path, module, allocation_backend="auto")
    real = phases[phases.phase.isin(["batch_start", "after_forward", "after_backward", "after_optimizer_step",
                                     "batch_end"]) & (phases.step >= 1)]  # fmt: skip
    assert row.categories["gradients"] == int(real.gradients_bytes.max()) == sum(p.nbytes for p in trainable)
    assert row.categories["gradients"] > head_bytes  # the head's copy is trained, with the adapters
    for category in ("parameters", "optimizer_state", "inputs"):
        assert row.categories[category] == int(real[f"{category}_bytes"].max()), category
    real_peak = int(real.peak_bytes.max())
    assert abs(row.peak_bytes - real_peak) <= 0.03 * real_peak, (row.peak_bytes, real_peak)


def test_what_a_module_has_already_is_not_offered_again():
    """A module fine-tuned with peft LoRA and Hugging Face's checkpointing on: the what-if skips both remedies
    ("already LoRA", "already on") and estimates today's run as it is (no second set of adapters, the user's own
    trainable parameters' gradients); it applied LoRA again and listed checkpointing as saving 0 B."""
    pytest.importorskip("peft")
    import peft

    from lightning_memtrace.estimator import estimate
    from lightning_memtrace.estimator.what_if import what_if_result

    module = TaskModule("sequence-classification", QWEN2)
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, target_modules=["q_proj", "v_proj"])
    module.model = peft.get_peft_model(module.model, lora)
    batch = next(iter(module.train_dataloader()))
    result = what_if_result(module, batch, device="cpu", max_batch=False, remedies=["lora", "gradient_checkpointing",
                                                                                   "half_micro_batch"])  # fmt: skip
    assert result.skipped == {"lora": "already LoRA", "gradient_checkpointing": "already on"}
    assert [row.remedy for row in result.rows] == ["half_micro_batch"]
    trainable = sum(p.nbytes for p in module.parameters() if p.requires_grad)
    assert result.estimate.category_bytes()[Category.GRADIENTS] == trainable
    assert result.estimate.peak_bytes == estimate(module, batch, device="cpu").peak_bytes


def test_lora_adapts_t5s_attention_as_peft_does(tmp_path):
    """T5 names its attention projections ``q``, ``k``, ``v``, ``o``: ``estimate_from_config(lora=True)`` adapts
    those 24 layers (self-attention in both stacks, cross-attention in the decoder), against a real run of peft's
    ``LoraConfig(target_modules=["k", "o", "q", "v"])``: categories exact, peaks within 3%. LoRA found no attention
    projection in T5 and was skipped."""
    pytest.importorskip("peft")
    import peft

    est = estimate_from_config(T5, BATCH, SEQ, device="cpu", task="seq2seq-lm", target_len=16, steps=3, lora=True)
    assert est.lora == "LoRA r=16 on 24 layers, base frozen"
    module = TaskModule("seq2seq-lm", T5, target_len=16)
    lora = peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=16, lora_alpha=32, target_modules=["k", "o", "q", "v"])
    module.model = peft.get_peft_model(module.model, lora)
    check_against_real(est, real_run(tmp_path, module, allocation_backend="auto"))
