"""The estimate against a real CUDA run: a GPT-2-sized model (124M), AdamW, fp32 and bf16-mixed.

Skipped without CUDA. The estimate counts what PyTorch allocates through its caching allocator, as
``torch.cuda.max_memory_allocated`` does; the gap between the two is made of:

- cuBLAS workspaces (allocated through the caching allocator, per thread and stream): estimated, one for the
  forward's thread and one for the backward's (:mod:`lightning_memtrace.estimator.blas_workspace`), checked below;
- the caching allocator's rounding: modelled (:mod:`lightning_memtrace.analysis.caching_allocator`: blocks of 512 B,
  the whole blocks it does not cut, and the segments it reserves, checked below against ``max_memory_reserved``);
- kernels that allocate workspaces of their own (cuDNN, fused or flash/memory-efficient attention: the reference
  configs use eager attention, so none here) and autocast's weight cache under ``bf16-mixed``.

The CUDA context (hundreds of MiB of driver memory) is outside ``max_memory_allocated`` and outside the estimate:
``nvidia-smi`` shows it on top of both.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lm_helpers import OffloadedStack, PositionLoop, RandomTokens, trainer
from torch.utils.data import DataLoader

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.estimator import compare_phase_peaks, estimate_for_module, estimate_from_config
from lightning_memtrace.models import build_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from shared_files import CONFIGS
GPT2 = CONFIGS / "gpt2-124m.json"
GPT2_PARAM_BYTES = 497_759_232
BATCH, SEQ = 8, 256


class ConfigLM(pl.LightningModule):
    def __init__(
        self, config=GPT2, batch_size: int = BATCH, seq_len: int = SEQ, attention: str | None = "eager"
    ) -> None:
        super().__init__()
        self.model = build_causal_lm(config, attn_implementation=attention)
        self.model.config.use_cache = False
        self.batch_size, self.seq_len = batch_size, seq_len

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(
            RandomTokens(8 * self.batch_size, self.seq_len, self.model.config.vocab_size), batch_size=self.batch_size
        )


def _fresh_cuda() -> int:
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # as in a fresh process: the run makes its own (and the estimate holds them)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _max_memory_allocated(tmp_path, precision: str, attention: str | None) -> int:
    """A plain 3-step run (no callback: MemTrace resets the peak statistics at every row)."""
    base = _fresh_cuda()
    module = ConfigLM(attention=attention)
    trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=3, precision=precision).fit(module)
    return torch.cuda.max_memory_allocated() - base


def _memtrace_run(tmp_path, precision: str, attention: str | None):
    _fresh_cuda()
    module = ConfigLM(attention=attention)
    callback = MemTrace(history=False)
    trainer(tmp_path, [callback], accelerator="gpu", devices=1, max_steps=3, precision=precision).fit(module)
    return load_phases(callback.output_dir), module


# eager: the attention build_causal_lm gives; None: transformers' default (SDPA), on the fused kernel CUDA picks
@pytest.mark.parametrize("attention", ["eager", None])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gpt2_estimate_within_10_percent_of_max_memory_allocated(tmp_path, precision, attention):
    estimate = estimate_from_config(
        GPT2, BATCH, SEQ, optimizer="adamw", precision=precision, device="cuda", steps=3, attn_implementation=attention
    )
    assert estimate.category_bytes()["parameters"] == GPT2_PARAM_BYTES
    assert estimate.category_bytes()["optimizer_state"] == 2 * GPT2_PARAM_BYTES
    peak = _max_memory_allocated(tmp_path / "plain", precision, attention)
    error = (estimate.peak_bytes - peak) / peak
    print(
        json.dumps(
            {
                "precision": precision,
                "attention": estimate.attention,
                "estimate": estimate.peak_bytes,
                "max_memory_allocated": peak,
                "error_percent": 100 * error,
            }
        )
    )
    assert abs(error) <= 0.10
    # per category, MemTrace's CUDA rows and the estimate agree exactly on model states
    phases, module = _memtrace_run(tmp_path / "memtrace", precision, attention)
    assert (phases.parameters_bytes == GPT2_PARAM_BYTES).all()
    assert phases.optimizer_state_bytes.max() == estimate.category_bytes()["optimizer_state"]
    assert phases.gradients_bytes.max() == estimate.category_bytes()["gradients"]
    # and per phase, the peaks agree within 10%
    module.cpu()
    batch = next(iter(module.train_dataloader()))
    from_module = estimate_for_module(module, batch, precision=precision, device="cuda", steps=3)
    peaks = compare_phase_peaks(from_module, phases)
    print(peaks.to_string())
    assert len(peaks) == 15
    assert (peaks.error_percent.abs() <= 10.0).all(), peaks.to_string()


def test_gradients_summed_in_place_on_cuda_are_estimated_so(tmp_path):
    """Autograd sums the gradients of a loop's slices into the hidden state's in place on CUDA as on CPU; the estimate
    made every sum out of place (one more 8 MiB hidden state at the backward peak here)."""
    hidden_bytes = 16 * 64 * 2048 * 4
    base = _fresh_cuda()
    trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=2).fit(PositionLoop(16, 64, 2048))
    real = torch.cuda.max_memory_allocated() - base
    module = PositionLoop(16, 64, 2048)
    est = estimate_for_module(module, next(iter(module.train_dataloader())), device="cuda", steps=2)
    # the caching allocator rounds each block up to 512 B (the loop's scalars): far below one hidden state
    assert abs(est.peak_bytes - real) < hidden_bytes // 8, (est.peak_bytes, real)


def test_save_on_cpu_copies_are_host_memory_in_a_cuda_estimate(tmp_path):
    """``save_on_cpu`` moves what a step saves for backward to (pinned) host memory; the estimate counted the copies
    as device memory. What offloading saves on the device, run against estimate (cuBLAS's workspace cancels)."""
    rows = 8192
    hidden_bytes = rows * 256 * 4
    peaks = {}
    for offload in (False, True):
        base = _fresh_cuda()
        trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=2).fit(OffloadedStack(offload, rows=rows))
        real = torch.cuda.max_memory_allocated() - base
        module = OffloadedStack(offload, rows=rows)
        est = estimate_for_module(module, next(iter(module.train_dataloader())), device="cuda", steps=2)
        peaks[offload] = (real, est.peak_bytes)
    real_saving = peaks[False][0] - peaks[True][0]
    estimated_saving = peaks[False][1] - peaks[True][1]
    assert real_saving > 4 * hidden_bytes
    assert abs(real_saving - estimated_saving) < hidden_bytes // 4, peaks


def test_a_cuda_step_holds_the_estimates_cublas_workspaces():
    from torch import nn

    from lightning_memtrace.estimator import estimate

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))

    def step(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    batch = (torch.randn(64, 256), torch.randn(64, 256))
    expected = estimate(make(), batch, training_step=step, device="cuda").blas_workspace_bytes
    assert expected == 2 * torch.backends.cuda.cublas_workspace_size()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # as a fresh process: no workspace yet
    cuda_batch = tuple(t.cuda() for t in batch)
    before = torch.cuda.memory_allocated()
    model = make().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        step(model, cuda_batch).backward()
        optimizer.step()
    # every tensor here is a multiple of the allocator's 512 B blocks; AdamW's step counters stay on the host
    state = sum(p.numel() * 4 for p in model.parameters()) * 4  # parameters, gradients, exp_avg, exp_avg_sq
    assert torch.cuda.memory_allocated() - before - state == expected


@pytest.mark.parametrize("attention", ["eager", None])
def test_the_estimate_a_machine_without_a_gpu_makes_meets_the_gpu_run(tmp_path, attention):
    """The estimate a laptop makes for this GPU (no CUDA visible: CPU tensors stand in, CUDA's autocast op lists, this
    GPU's cuBLAS workspace size given as CUBLAS_WORKSPACE_CONFIG) against a plain bf16-mixed run here."""
    size = torch.backends.cuda.cublas_workspace_size()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CUBLAS_WORKSPACE_CONFIG": f":{size // 1024}:1"}
    code = (
        "import sys; from lightning_memtrace.estimator import estimate_from_config; "
        f"e = estimate_from_config({str(GPT2)!r}, {BATCH}, {SEQ}, precision='bf16-mixed', device='cuda', steps=3, "
        f"attn_implementation={attention!r}); print(e.peak_bytes, e.blas_workspace_bytes)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    laptop, workspaces = map(int, done.stdout.split()[-2:])
    assert workspaces == 2 * size
    peak = _max_memory_allocated(tmp_path, "bf16-mixed", attention)
    error = (laptop - peak) / peak
    print(json.dumps({"attention": attention, "laptop_estimate": laptop, "max_memory_allocated": peak,
                      "error_percent": 100 * error}))
    assert abs(error) <= 0.05


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_estimates_reserved_bytes_meet_the_gpu_runs(tmp_path, monkeypatch, conf):
    """The caching allocator's model (the estimate's ``reserved_bytes``) against the GPU's allocator: a plain 3-step
    run's ``max_memory_reserved``, with torch's default settings and with expandable segments."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    estimate = estimate_from_config(
        GPT2, BATCH, SEQ, optimizer="adamw", device="cuda", steps=3, attn_implementation="eager"
    )
    assert estimate.allocator == ("expandable segments" if conf else "defaults")
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{bool(conf)}")
    try:
        base = _fresh_cuda()
        before = torch.cuda.memory_reserved()
        module = ConfigLM(attention="eager")
        trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=3).fit(module)
        reserved = torch.cuda.max_memory_reserved() - before
        allocated = torch.cuda.max_memory_allocated() - base
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        del module
        _fresh_cuda()
    error = (estimate.peak_reserved_bytes - reserved) / reserved
    print(json.dumps({"conf": conf, "estimated_reserved": estimate.peak_reserved_bytes, "max_memory_reserved": reserved,
                      "estimated_peak": estimate.peak_bytes, "max_memory_allocated": allocated,
                      "allocator_needs": estimate.allocator_needs(), "error_percent": 100 * error}))
    assert abs(error) <= 0.05


def test_the_long_run_reserved_bytes_meet_a_longer_gpu_run(tmp_path, monkeypatch):
    """Reserved bytes after the estimated steps: a 2-step estimate served on (``long_run_reserved_bytes``) against a
    plain 12-step run's ``max_memory_reserved`` with torch's default settings."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    estimate = estimate_from_config(GPT2, BATCH, SEQ, optimizer="adamw", device="cuda", steps=2,
                                    attn_implementation="eager")
    base = _fresh_cuda()
    before = torch.cuda.memory_reserved()
    module = ConfigLM(attention="eager")
    try:
        trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=12).fit(module)
        reserved = torch.cuda.max_memory_reserved() - before
        allocated = torch.cuda.max_memory_allocated() - base
    finally:
        del module
        _fresh_cuda()
    error = (estimate.long_run_reserved_bytes - reserved) / reserved
    print(json.dumps({"estimated_reserved_estimated_steps": estimate.peak_reserved_bytes,
                      "estimated_reserved_long_run": estimate.long_run_reserved_bytes,
                      "long_run_from_step": estimate.long_run.reserved_from_step,
                      "max_memory_reserved_12_steps": reserved, "max_memory_allocated": allocated,
                      "error_percent": 100 * error}))
    assert abs(error) <= 0.05


#: A ViT-Small-sized image classifier and a 6-layer BERT-base-wide sequence classifier, from config.
_VIT_SMALL = {"model_type": "vit", "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
              "intermediate_size": 1536, "image_size": 224, "patch_size": 16, "num_labels": 100}  # fmt: skip
_BERT_6 = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12,
           "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512, "num_labels": 3}  # fmt: skip


@pytest.mark.parametrize(("task", "config", "batch_size", "seq_len"), [
    ("image-classification", _VIT_SMALL, 32, None),
    ("sequence-classification", _BERT_6, 16, 256),
])  # fmt: skip
def test_a_tasks_cuda_estimate_meets_the_gpu_run(tmp_path, task, config, batch_size, seq_len):
    """``estimate_from_config(task=...)`` for CUDA against a plain 3-step GPU run of the same model and batch."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "estimator"))
    from test_tasks import TaskModule

    estimate = estimate_from_config(config, batch_size, seq_len, device="cuda", task=task, steps=3)
    base = _fresh_cuda()
    module = TaskModule(task, config, batch_size=batch_size, seq_len=seq_len or 0)
    try:
        trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=3).fit(module)
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        del module
        _fresh_cuda()
    error = (estimate.peak_bytes - peak) / peak
    print(json.dumps({"task": task, "estimate": estimate.peak_bytes, "max_memory_allocated": peak,
                      "error_percent": 100 * error}))
    assert abs(error) <= 0.10


_QWEN2_SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000,
                "max_position_embeddings": 1024, "num_labels": 3}  # fmt: skip


def test_a_qlora_modules_cuda_estimate_meets_the_gpu_run(tmp_path):
    """A 4-bit (nf4, double quantization) Qwen2 classifier with LoRA, loaded on the GPU as QLoRA runs load it, in
    bf16-mixed: the estimate for CUDA made from the loaded module (fake tensors, bitsandbytes' fake kernels) against a
    plain 3-step GPU run's ``max_memory_allocated``; its parameters (packed weights, scales) against the real ones."""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "estimator"))
    from test_tasks import TaskModule

    saved = TaskModule("sequence-classification", _QWEN2_SMALL, batch_size=8, seq_len=256)
    saved.model.save_pretrained(tmp_path / "saved")
    del saved
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip

    def loaded() -> TaskModule:
        module = TaskModule("sequence-classification", _QWEN2_SMALL, batch_size=8, seq_len=256)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "saved", quantization_config=quantization, device_map={"": 0}
        )
        lora = peft.LoraConfig(task_type="SEQ_CLS", r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        module.model = peft.get_peft_model(model, lora)
        module.model.train()
        return module

    base = _fresh_cuda()
    module = loaded()
    weights = torch.cuda.memory_allocated() - base
    batch = next(iter(module.train_dataloader()))
    estimate = estimate_for_module(module, batch, precision="bf16-mixed", steps=3)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in module.modules())
    # memory_allocated counts 512-byte blocks and the rotary table, a buffer: within 2 % of the parameters' bytes
    assert abs(int(estimate.to_dataframe().parameters_bytes.iloc[0]) - weights) <= 0.02 * weights
    try:
        trainer(tmp_path, [], accelerator="gpu", devices=1, max_steps=3, precision="bf16-mixed").fit(module)
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        del module
        _fresh_cuda()
    error = (estimate.peak_bytes - peak) / peak
    # the same run from the config alone (`memtrace estimate --quantize nf4 --lora`): no weights, no checkpoint
    from_config = estimate_from_config(
        _QWEN2_SMALL, 8, 256, device="cuda", task="sequence-classification", precision="bf16-mixed", steps=3,
        quantize="nf4", lora=True,
    )  # fmt: skip
    config_error = (from_config.peak_bytes - peak) / peak
    print(json.dumps({"qlora_estimate": estimate.peak_bytes, "from_config": from_config.peak_bytes,
                      "max_memory_allocated": peak, "error_percent": 100 * error,
                      "from_config_error_percent": 100 * config_error}))  # fmt: skip
    assert abs(error) <= 0.10 and abs(config_error) <= 0.10
