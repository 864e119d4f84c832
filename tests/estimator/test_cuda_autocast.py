"""CUDA's autocast on CPU stand-ins: the dtypes are those of torch's own CUDA autocast kernels; the estimate follows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memtrace.estimator import estimate
from lightning_memtrace.estimator import cuda_autocast
from lightning_memtrace.estimator.cuda_autocast import cuda_autocast_policy, differing_ops

LOW = torch.bfloat16

#: Calls whose result dtype CPU's and CUDA's autocast lists may give differently: (name, call on tensors (bf16 x,
#: fp32 y, fp32 vector v, fp32 3-d z, int targets t)).
CALLS = {
    "softmax": lambda x, y, v, z, t: F.softmax(x, -1),
    "softmax with a dtype": lambda x, y, v, z, t: F.softmax(x, -1, dtype=LOW),
    "tensor softmax": lambda x, y, v, z, t: x.softmax(-1),
    "log_softmax": lambda x, y, v, z, t: F.log_softmax(x, -1),
    "layer_norm": lambda x, y, v, z, t: F.layer_norm(x, (8,)),
    "group_norm": lambda x, y, v, z, t: F.group_norm(x.view(2, 4, 8), 2),
    "rms_norm": lambda x, y, v, z, t: F.rms_norm(x, (8,)),
    "exp": lambda x, y, v, z, t: x.exp(),
    "pow": lambda x, y, v, z, t: x**2,
    "rsqrt": lambda x, y, v, z, t: torch.rsqrt(x),
    "sum": lambda x, y, v, z, t: x.sum(),
    "sum over a dim": lambda x, y, v, z, t: x.sum(-1),
    "mean": lambda x, y, v, z, t: x.mean(-1),
    "cumsum": lambda x, y, v, z, t: x.cumsum(0),
    "norm": lambda x, y, v, z, t: x.norm(),
    "normalize": lambda x, y, v, z, t: F.normalize(x, dim=-1),
    "logsumexp": lambda x, y, v, z, t: x.logsumexp(-1),
    "cosine_similarity": lambda x, y, v, z, t: F.cosine_similarity(x, x),
    "softplus": lambda x, y, v, z, t: F.softplus(x),
    "gelu": lambda x, y, v, z, t: F.gelu(x),
    "mm": lambda x, y, v, z, t: y @ y,
    "linear": lambda x, y, v, z, t: F.linear(y, y),
    "bmm": lambda x, y, v, z, t: torch.bmm(z, z),
    "mv": lambda x, y, v, z, t: torch.mv(y, v),
    "addmv": lambda x, y, v, z, t: torch.addmv(v, y, v),
    "addr": lambda x, y, v, z, t: torch.addr(y, v, v),
    "addcmul": lambda x, y, v, z, t: torch.addcmul(y, x, x),
    "cross_entropy": lambda x, y, v, z, t: F.cross_entropy(x, t),
    "mse_loss": lambda x, y, v, z, t: F.mse_loss(x, x),
    "interpolate": lambda x, y, v, z, t: F.interpolate(x.view(1, 1, 8, 8), scale_factor=2),
    "avg_pool3d": lambda x, y, v, z, t: F.avg_pool3d(x.view(1, 1, 4, 4, 4), 2),
    "reflection pad": lambda x, y, v, z, t: F.pad(x.view(1, 1, 8, 8), (1, 1, 1, 1), mode="reflect"),
}


def _dtypes(device: str) -> dict[str, torch.dtype]:
    def tensors():
        return (
            torch.randn(8, 8, device=device, dtype=LOW),
            torch.randn(8, 8, device=device),
            torch.randn(8, device=device),
            torch.randn(2, 8, 8, device=device),
            torch.randint(0, 8, (8,), device=device),
        )

    return {name: call(*tensors()).dtype for name, call in CALLS.items()}


def _cuda_dtypes() -> dict[str, torch.dtype]:
    """torch's own CUDA autocast kernels, run on fake CUDA tensors (no CUDA needed for dtypes without autograd)."""
    was_on, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", LOW)
        try:
            return _dtypes("cuda")
        finally:
            torch.set_autocast_enabled("cuda", was_on)
            torch.set_autocast_dtype("cuda", was_dtype)


def test_the_policy_gives_cuda_autocasts_dtypes_and_goes_away_after():
    # on fake CPU tensors, as the estimate runs them (CPU has no bfloat16 kernel for some, avg_pool3d among them)
    with FakeTensorMode(), torch.autocast("cpu", dtype=LOW):
        cpu = _dtypes("cpu")
        with cuda_autocast_policy() as changed:
            emulated = _dtypes("cpu")
        after = _dtypes("cpu")
    cuda = _cuda_dtypes()
    assert changed == len(differing_ops()) > 100
    assert emulated == cuda
    assert after == cpu
    # where the lists differ at all: the test would pass without the policy otherwise
    assert {name for name in CALLS if cpu[name] != cuda[name]} >= {
        "softmax", "layer_norm", "group_norm", "exp", "pow", "sum", "cumsum", "logsumexp", "mv", "addmv", "addr",
        "interpolate", "avg_pool3d", "reflection pad",
    }


def test_gradients_flow_through_the_policys_casts():
    x = torch.randn(4, 8, requires_grad=True)
    layer = nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=LOW), cuda_autocast_policy():
        probabilities = F.softmax(layer(x), -1)
        assert probabilities.dtype == torch.float32
        F.layer_norm(probabilities, (8,)).pow(2).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


class SoftmaxAttention(nn.Module):
    """Attention written by hand, as in many a user's model: softmax of bf16 scores, then a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.norm(F.softmax(h @ h.transpose(-1, -2), dim=-1) @ h)


BATCH, SEQ, WIDTH = 8, 256, 64


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_cuda_target_saves_what_cudas_autocast_saves(precision):
    batch = (torch.randn(BATCH, SEQ, WIDTH), torch.randn(BATCH, SEQ, WIDTH))
    cuda = estimate(SoftmaxAttention(), batch, training_step=_step, device="cuda", precision=precision)
    cpu = estimate(SoftmaxAttention(), batch, training_step=_step, device="cpu", precision=precision)
    low, fp32 = 2, 4
    scores = BATCH * SEQ * SEQ
    tokens = BATCH * SEQ * WIDTH
    # Saved for backward on CUDA: the projection's input cast to half precision (its weight's copy is not saved: the
    # batch needs no gradient); its output h (both bmms save it); softmax's float32 output, and its half-precision
    # copy for the second bmm; the LayerNorm's float32 copy of its input, its mean and rstd, and its float32 output
    # (mse_loss's input).
    expected = tokens * low + tokens * low + scores * (fp32 + low) + tokens * fp32 + 2 * BATCH * SEQ * fp32 + (
        tokens * fp32)
    steady = [r for r in cuda.records if r.step == cuda.steady_step and r.phase.value == "after_forward"][0]
    assert steady.activations_bytes == expected
    # CPU's lists keep softmax and the LayerNorm in half precision: a third less saved
    cpu_row = [r for r in cpu.records if r.step == cpu.steady_step and r.phase.value == "after_forward"][0]
    assert cpu_row.activations_bytes < 0.6 * expected


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


CLASSES = 4096


def test_cross_entropy_decomposes_as_on_cuda(monkeypatch):
    # CPU's autocast casts cross_entropy's input to float32 and takes its log_softmax there (saved: float32
    # log-probabilities). CUDA's has no kernel for it: cross_entropy runs log_softmax in the logits' half precision
    # (saved), then nll_loss casts those to float32 (saved too), and the float32 copy of the logits is never made.
    rows = 512
    batch = (torch.randn(rows, WIDTH), torch.randint(0, CLASSES, (rows,)))

    def step(model, b):
        return F.cross_entropy(model(b[0]), b[1])

    def forward_row(est):
        return [r for r in est.records if r.step == est.steady_step and r.phase.value == "after_forward"][0]

    cuda = forward_row(estimate(Classifier(), batch, training_step=step, device="cuda", precision="bf16-mixed"))
    monkeypatch.setattr(cuda_autocast, "KEEP_CPU_KERNEL", cuda_autocast.KEEP_CPU_KERNEL | {"cross_entropy_loss"})
    cuda_autocast.differing_ops.cache_clear()
    try:
        cpus = forward_row(estimate(Classifier(), batch, training_step=step, device="cuda", precision="bf16-mixed"))
    finally:
        cuda_autocast.differing_ops.cache_clear()
    logits = rows * CLASSES
    assert cuda.activations_bytes - cpus.activations_bytes == logits * 2
    assert cpus.peak_bytes - cuda.peak_bytes == logits * 2
