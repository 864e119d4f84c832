"""Quantized weights (bitsandbytes' 4-bit QLoRA and 8-bit LLM.int8 layers, as ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`` loads them, with peft's LoRA on top): MemTrace names their scales and
code tables as parameters, and the estimate of such a module (fake tensors) matches a real CPU run of it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from estimate_checks import check_against_real, real_run
from test_tasks import BATCH, QWEN2, SEQ, TaskModule

from lightning_memtrace.estimator import estimate

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _loaded(tmp_path, config: dict[str, Any], bits: int) -> TaskModule:
    """A Qwen2 classifier of ``config`` saved, then loaded back quantized on the CPU as a user loads a checkpoint:
    ``from_pretrained(..., quantization_config=...)`` (nf4 with double quantization, or int8), in training mode."""
    import transformers

    module = TaskModule("sequence-classification", config)
    module.model.save_pretrained(tmp_path / "saved")
    if bits == 4:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    else:
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        module.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "saved", quantization_config=quantization, device_map="cpu"
        )
    except Exception as error:  # a bitsandbytes without CPU kernels
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {error}")
    # from_pretrained leaves the model in eval mode, where bitsandbytes repacks 4-bit weights for CPU inference
    module.model.train()
    return module


def _quantized_module(tmp_path, bits: int) -> TaskModule:
    """The tiny Qwen2 classifier loaded quantized, with LoRA on ``q_proj`` and ``v_proj`` (peft's ``SEQ_CLS``: the
    head trained in full)."""
    module = _loaded(tmp_path, QWEN2, bits)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, target_modules=["q_proj", "v_proj"])
    module.model = peft.get_peft_model(module.model, lora)
    return module


def _weight_bytes(module: torch.nn.Module, bits: int) -> int:
    """Every parameter's memory and, read attribute by attribute, the quantized weights' scales and code tables: what
    MemTrace must count as parameters."""
    tensors: list[torch.Tensor] = list(module.parameters())
    for layer in module.modules():
        if bits == 4 and isinstance(layer, bnb.nn.Linear4bit):
            state = layer.weight.quant_state
            tensors += [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        elif bits == 8 and isinstance(layer, bnb.nn.Linear8bitLt):
            held = (layer.weight.CB, layer.weight.SCB, layer.state.CB, layer.state.SCB)
            tensors += [t for t in held if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("bits", [4, 8], ids=["nf4-qlora", "int8-lora"])
def test_a_quantized_modules_estimate_matches_a_real_run(tmp_path, bits):
    """Categories exact at every (step, phase) and peaks within 3%, against MemTrace's default tracker on a real run;
    the parameters are the packed weights and their scales, byte for byte. The estimate could not copy a 4-bit
    weight (it lost its ``quant_state``) nor an 8-bit layer's state, and MemTrace counted no scales."""
    module = _quantized_module(tmp_path, bits)
    batch = next(iter(module.train_dataloader()))
    est = estimate(module, batch, device="cpu", steps=3)
    phases = real_run(tmp_path / "run", module, allocation_backend="auto")
    check_against_real(est, phases)
    weights = _weight_bytes(module, bits)  # after the run: an 8-bit layer moves its scales at its first forward
    assert set(phases.parameters_bytes[phases.step >= 1]) == {weights}
    assert est.closed_form.parameters_bytes == weights
    packed = sum(p.nbytes for p in module.parameters() if p.dtype in (torch.uint8, torch.int8))
    assert weights > packed > 0  # the scales are there, beside the packed weights


def test_a_quantized_modules_estimate_runs_for_a_cuda_target(tmp_path):
    """The same 4-bit module estimated for CUDA on this machine (bitsandbytes' fake kernels), in bf16-mixed as QLoRA
    runs: its parameters as on the CPU, its scales included."""
    module = _quantized_module(tmp_path, 4)
    batch = next(iter(module.train_dataloader()))
    est: Any = estimate(module, batch, device="cuda", steps=2, precision="bf16-mixed")
    assert est.to_dataframe().parameters_bytes.iloc[0] == _weight_bytes(module, 4)
    assert est.peak_bytes > est.to_dataframe().allocated_bytes.iloc[0]


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_a_config_loaded_quantized_with_lora_matches_a_real_qlora_run(tmp_path, quantize):
    """``estimate_from_config(quantize=..., lora=True)`` (the command's ``--quantize nf4 --lora``: no weights, the
    meta model quantized by transformers' own quantizer and bitsandbytes' meta kernels) against a real CPU run of the
    same model saved, loaded with ``BitsAndBytesConfig`` and given LoRA by peft as the snippet says: categories exact,
    peaks within 3%. It also leaves bitsandbytes able to quantize real weights afterwards."""
    from lightning_memtrace.estimator import estimate_from_config
    from lightning_memtrace.estimator.remedies import LORA_RANK, lora_targets

    cached = dict(bnb.functional.name2qmap)
    est = estimate_from_config(QWEN2, BATCH, SEQ, device="cpu", task="sequence-classification", steps=3,
                               quantize=quantize, lora=True)  # fmt: skip
    assert bnb.functional.name2qmap.keys() == cached.keys()  # its code table is not left on the meta device
    kind = "4-bit nf4" if quantize == "nf4" else "8-bit"
    lora_text = "LoRA r=16 on 8 layers, base frozen"
    assert f"{kind} weights in 14 layers (bitsandbytes), {lora_text}" in est.describe()
    answer = est.as_dict()
    assert (answer["quantization"], answer["lora"]) == (f"{kind} weights in 14 layers (bitsandbytes)", lora_text)

    module = _loaded(tmp_path, QWEN2, 4 if quantize == "nf4" else 8)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                           target_modules=lora_targets(module))  # fmt: skip
    module.model = peft.get_peft_model(module.model, lora)
    phases = real_run(tmp_path / "run", module, allocation_backend="auto")
    check_against_real(est, phases)
    assert est.closed_form.parameters_bytes == _weight_bytes(module, 4 if quantize == "nf4" else 8)


def test_the_command_estimates_a_qlora_run(tmp_path, capsys):
    """``memtrace estimate --quantize nf4 --lora --json``: the estimate of :func:`estimate_from_config` with them; the
    what-if does not offer LoRA again; an unknown quantization is a one-line error."""
    import json

    from lightning_memtrace.cli.estimate import main
    from lightning_memtrace.estimator import estimate_from_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2))
    argv = ["--config", str(config), "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--quantize", "nf4",
            "--lora"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)["estimate"]
    expected = estimate_from_config(QWEN2, 2, 32, device="cpu", quantize="nf4", lora=True)
    assert answer["peak_bytes"] == expected.peak_bytes and answer["lora"] == "LoRA r=16 on 8 layers, base frozen"
    assert answer["quantization"] == "4-bit nf4 weights in 14 layers (bitsandbytes)"
    assert main([*argv, "--what-if", "--remedies", "lora,half_micro_batch", "--json"]) == 0
    what_if = json.loads(capsys.readouterr().out)
    assert what_if["skipped"]["lora"] == "already LoRA"
    assert main([*argv, "--fsdp", "2"]) == 2
    assert capsys.readouterr().err == (
        "memtrace: error: FSDP over quantized weights (FSDP-QLoRA, bnb_4bit_quant_storage) is not estimated: "
        "estimate --quantize on one device\n"
    )
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config), "--batch-size", "2", "--seq-len", "32", "--quantize", "fp8"])
    assert exited.value.code == 2
    assert "argument --quantize: invalid choice: 'fp8'" in capsys.readouterr().err


def test_the_qlora_remedy_and_its_snippet(tmp_path):
    """The what-if's ``qlora`` (a 4-bit base with LoRA) on a config: LoRA's gradients with the base's layers in 4 bits,
    against a real CPU run of the model saved and loaded so; its snippet loads the base as the estimate did, in the
    combination's precision; on a module with LoRA and 4-bit layers already, it is not offered again."""
    from lightning_memtrace.cli.estimate import REMEDIES
    from lightning_memtrace.estimator.remedies import LORA_RANK, Remedy, Settings, lora_targets
    from lightning_memtrace.estimator.what_if import what_if_from_config, what_if_result
    from lightning_memtrace.estimator.what_if_setups import ConfigSetup, snippet

    assert REMEDIES == tuple(remedy.value for remedy in Remedy)  # the command's choices, kept apart from torch
    result = what_if_from_config(QWEN2, BATCH, SEQ, device="cpu", task="sequence-classification", steps=3,
                                 remedies=["lora", "qlora"], max_batch=False)  # fmt: skip
    rows = {row.remedy: row for row in result.rows}
    assert rows["qlora"].categories["gradients"] == rows["lora"].categories["gradients"]
    assert rows["qlora"].categories["parameters"] < rows["lora"].categories["parameters"]
    module = _loaded(tmp_path, QWEN2, 4)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                           target_modules=lora_targets(module))  # fmt: skip
    module.model = peft.get_peft_model(module.model, lora)
    phases = real_run(tmp_path / "run", module, allocation_backend="auto")
    real = phases[phases.step >= 1]
    for category in ("parameters", "gradients", "optimizer_state"):
        assert rows["qlora"].categories[category] == int(real[f"{category}_bytes"].max()), category
    assert abs(rows["qlora"].peak_bytes - real.peak_bytes.max()) <= 0.03 * real.peak_bytes.max()

    setup = ConfigSetup(QWEN2, SEQ, Settings(batch_size=BATCH), device="cpu", task="sequence-classification")
    assert snippet(setup, [Remedy.BF16_MIXED, Remedy.QLORA]).splitlines()[1:] == [
        'model = AutoModelFor...from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, '
        'bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16, '
        'llm_int8_skip_modules=["score"]))',
        'model = peft.inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", '
        '"q_proj", "v_proj"], modules_to_save=["score"]), model)  # base frozen; or '
        "lightning_memtrace.estimator.remedies.apply_lora(model)",
    ]
    batch = next(iter(module.train_dataloader()))
    again = what_if_result(module, batch, device="cpu", max_batch=False, remedies=["lora", "qlora"])
    assert again.skipped == {"lora": "already LoRA", "qlora": "already quantized"}


def test_lora_of_another_shape_matches_a_real_run(tmp_path, capsys):
    """``--lora-rank 8 --lora-dropout 0.1 --lora-targets all-linear`` (a common QLoRA recipe): every linear layer but
    the head adapted, each keeping a dropped-out copy of its input for the backward; against a real CPU run of peft's
    ``LoraConfig(r=8, lora_dropout=0.1, target_modules="all-linear", task_type="SEQ_CLS")``: categories exact, peaks
    within 3%. A bad dropout, and LoRA options without ``--lora``, are one-line errors."""
    import json

    from lightning_memtrace.cli.estimate import main
    from lightning_memtrace.estimator import estimate_from_config
    from lightning_memtrace.estimator.remedies import LoraShape

    shape = LoraShape(rank=8, dropout=0.1, targets="all-linear")
    est = estimate_from_config(QWEN2, BATCH, SEQ, device="cpu", task="sequence-classification", steps=3, lora=shape)
    assert est.lora == "LoRA r=8 on 14 layers (dropout 0.1), base frozen"
    module = TaskModule("sequence-classification", QWEN2)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear")
    module.model = peft.get_peft_model(module.model, lora)
    phases = real_run(tmp_path / "run", module, allocation_backend="auto")
    check_against_real(est, phases)

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2))
    argv = ["--config", str(config), "--task", "sequence-classification", "--batch-size", str(BATCH), "--seq-len",
            str(SEQ), "--device", "cpu", "--json"]  # fmt: skip
    assert main([*argv, "--lora", "--lora-rank", "8", "--lora-dropout", "0.1", "--lora-targets", "all-linear"]) == 0
    answer = json.loads(capsys.readouterr().out)["estimate"]
    expected = estimate_from_config(QWEN2, BATCH, SEQ, device="cpu", task="sequence-classification", lora=shape)
    assert answer["peak_bytes"] == expected.peak_bytes and answer["lora"] == est.lora
    assert main([*argv, "--lora-rank", "8"]) == 2
    assert capsys.readouterr().err == "memtrace: error: --lora-rank, --lora-dropout and --lora-targets go with --lora\n"
    with pytest.raises(SystemExit):
        main([*argv, "--lora", "--lora-dropout", "1.5"])
    assert "argument --lora-dropout: not a probability from 0 to below 1: '1.5'" in capsys.readouterr().err


def test_a_classifier_head_is_left_unquantized_for_lora_to_train(tmp_path):
    """BERT's classifier has a bias, so transformers' default (the last parameter's layer) misses it and would
    quantize it, and peft could not then train it (``modules_to_save``): the estimate leaves task heads unquantized and
    the snippet says so (``llm_int8_skip_modules``). Against a real CPU run loaded that way, with peft's ``SEQ_CLS``
    LoRA: categories exact, peaks within 3%. (It failed: "only Tensors of floating point dtype can require
    gradients".)"""
    import transformers

    from lightning_memtrace.estimator import estimate_from_config
    from lightning_memtrace.estimator.inputs import Precision
    from lightning_memtrace.estimator.quantization import config_line
    from lightning_memtrace.estimator.remedies import LORA_RANK, lora_targets
    from lightning_memtrace.types import Quantization

    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 256, "num_labels": 3}  # fmt: skip
    est = estimate_from_config(bert, BATCH, SEQ, device="cpu", task="sequence-classification", steps=3,
                               quantize="nf4", lora=True)  # fmt: skip
    assert est.quantization == "4-bit nf4 weights in 13 layers (bitsandbytes)"  # the pooler's, not the classifier's
    module = TaskModule("sequence-classification", bert)
    assert config_line(Quantization.NF4, Precision.parse("32-true"), module) == (
        'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, '
        'bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["classifier"])'
    )
    module.model.save_pretrained(tmp_path / "saved")
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["classifier"],
    )  # fmt: skip
    module.model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "saved", quantization_config=quantization, device_map="cpu"
    )
    module.model.train()
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                           target_modules=lora_targets(module))  # fmt: skip
    module.model = peft.get_peft_model(module.model, lora)
    check_against_real(est, real_run(tmp_path / "run", module, allocation_backend="auto"))


def test_without_bitsandbytes_or_peft_the_command_says_what_to_install(tmp_path, capsys, monkeypatch):
    """``--quantize`` without bitsandbytes and ``--lora`` without peft: one line naming the package and the extra."""
    import builtins
    import json

    from lightning_memtrace.cli.estimate import main
    from lightning_memtrace.estimator import remedies

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'bitsandbytes'")

    monkeypatch.setattr(remedies, "import_bitsandbytes", missing)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2))
    argv = ["--config", str(config), "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]
    assert main([*argv, "--quantize", "nf4"]) == 2
    assert capsys.readouterr().err == (
        "memtrace: error: a quantized model needs bitsandbytes (pip install 'lightning-memtrace[whatif]'): "
        "No module named 'bitsandbytes'\n"
    )
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ModuleNotFoundError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    assert main([*argv, "--lora"]) == 2
    assert capsys.readouterr().err == (
        "memtrace: error: LoRA needs peft (pip install 'lightning-memtrace[whatif]'): No module named 'peft'\n"
    )
