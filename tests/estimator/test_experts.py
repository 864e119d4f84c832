"""Mixture-of-experts models, and steps whose shapes follow values.

Transformers 5 runs the experts as ``grouped_mm``, whose meta kernel accepts bfloat16 only: every float32 MoE model
(Mixtral, Qwen2-MoE) failed to estimate, printing torch's traceback of the meta kernel on the way. A step that asks a
fake tensor for a value (boolean-mask indexing, transformers 4's loop over the experts hit) failed with torch's bare
``DynamicOutputShapeException: aten.nonzero.default``; it now says what, where and what to do, in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from estimate_checks import check_against_real, real_run
from tiny_architectures import _DECODER, ConfigLM
from torch import nn

from lightning_memtrace.estimator import estimate, estimate_from_config
from lightning_memtrace.estimator.fake import fake_mode
from lightning_memtrace.estimator.grouped_mm import grouped_mm_in_every_dtype, output_shape

BATCH, SEQ = 4, 128
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
MIXTRAL = dict(_DECODER, model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE = dict(
    _DECODER,
    model_type="qwen2_moe",
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4 loops over the experts hit (see the test below)")
@pytest.mark.parametrize(
    "config, precision",
    [(MIXTRAL, "32-true"), (QWEN2_MOE, "32-true"), (MIXTRAL, "bf16-mixed"), (MIXTRAL, "bf16-true")],
    ids=["mixtral", "qwen2_moe", "mixtral-bf16-mixed", "mixtral-bf16-true"],
)
def test_mixture_of_experts_matches_real_run(tmp_path, config, precision):
    module = ConfigLM(config, BATCH, SEQ)
    assert module.model.config._experts_implementation == "grouped_mm"
    phases = real_run(tmp_path, module, precision=precision, allocation_backend="auto")
    est = estimate_from_config(config, BATCH, SEQ, device="cpu", precision=precision, steps=3)
    peaks = check_against_real(est, phases)
    assert peaks.error_percent.abs().max() <= 0.1


@pytest.mark.parametrize(
    "shape_a, shape_b, groups",
    [((12, 8), (3, 8, 4), 3), ((3, 5, 8), (3, 8, 4), None), ((8, 12), (12, 4), 3), ((3, 8, 12), (12, 4), 3)],
    ids=["2d-3d", "3d-3d", "2d-2d", "3d-2d"],
)
def test_grouped_output_is_laid_out_as_the_real_kernels(shape_a, shape_b, groups):
    """Against the real CPU kernel, in float32 (the dtype the meta kernel refuses): shape, strides and dtype."""
    mat_a, mat_b = torch.randn(shape_a), torch.randn(shape_b)
    offs = torch.tensor([4, 8, 12][:groups], dtype=torch.int32) if groups else None
    if mat_b.dim() == 2 and mat_a.dim() == 3:
        mat_a = mat_a.transpose(-2, -1).contiguous().transpose(-2, -1)
    try:
        real = torch.nn.functional.grouped_mm(mat_a, mat_b, offs=offs)
    except RuntimeError as error:
        pytest.skip(f"this torch's CPU kernel refuses the case: {error}")
    assert output_shape(mat_a, mat_b, offs) == list(real.shape)
    mode = fake_mode()
    fakes = [mode.from_tensor(t) if t is not None else None for t in (mat_a, mat_b, offs)]
    experts = nn.ParameterList([nn.Parameter(torch.zeros(2, 2, 2))])  # a weight stacked per expert turns the mode on
    with mode, grouped_mm_in_every_dtype(experts):
        fake = torch.nn.functional.grouped_mm(fakes[0], fakes[1], offs=fakes[2])
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.skipif(TRANSFORMERS_5, reason="transformers 5 runs the experts as grouped_mm")
def test_transformers_4_experts_loop_is_one_line_with_the_way_out():
    with pytest.raises(ValueError) as raised:
        estimate_from_config(MIXTRAL, 2, 64, device="cpu")
    message = str(raised.value)
    assert "aten.nonzero" in message and "modeling_mixtral.py:" in message
    assert "experts_implementation='grouped_mm'" in message


class _MaskedLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y[y > 0].sum()  # the line the message names


def test_a_shape_that_follows_values_is_one_line_naming_the_users_line():
    with pytest.raises(ValueError) as raised:
        estimate(_MaskedLoss(), torch.randn(4, 8), training_step=lambda model, batch: model(batch), device="cpu")
    message = str(raised.value)
    line = _MaskedLoss.forward.__code__.co_firstlineno + 2
    assert message.startswith("the training step needs tensor values, which an estimate on fake tensors does not have")
    assert f"(aten.nonzero.default, at {__file__}:{line} in forward)" in message
    assert "\n" not in message and "experts" in message and "experts_implementation" not in message


def test_the_command_says_it_in_one_line_without_torchs_traceback(tmp_path):
    config = tmp_path / "mixtral.json"
    eager = dict(MIXTRAL, experts_implementation="eager") if TRANSFORMERS_5 else MIXTRAL
    config.write_text(json.dumps(eager))
    out = subprocess.run(
        [sys.executable, "-m", "lightning_memtrace.cli", "estimate", "--config", str(config), "--batch-size", "2",
         "--seq-len", "32"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("memtrace: error: the training step needs tensor values") and "aten.nonzero" in line


def test_a_failing_meta_kernel_is_not_logged_on_the_console():
    """Torch logs a failing meta kernel's traceback (``E1206 ... fake_tensor.py ...`` lines) before raising it."""
    code = (
        "import torch\n"
        "from torch import nn\n"
        "from lightning_memtrace.estimator import estimate\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.linear = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return torch.mm(self.linear(x), torch.ones(3, 3, device=x.device)).sum()\n"
        "try:\n"
        "    estimate(M(), torch.randn(4, 8), training_step=lambda m, b: m(b), device='cpu')\n"
        "except RuntimeError as error:\n"
        "    print('raised:', error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised: a and b must have same reduction dim")
    assert "fake_tensor" not in out.stderr and "Traceback" not in out.stderr
