"""Optimizers from other libraries as a user's ``configure_optimizers`` returns them, estimated on fake tensors.

bitsandbytes': an 8-bit optimizer computes its quantization maps' codes from values in its constructor, which fake
tensors do not have: ``MemTrace(estimate=True)`` with ``bnb.optim.AdamW8bit`` said "could not estimate this run
(DataDependentOutputException ...)", and ``estimate(...)`` raised it. A paged optimizer keeps the state of each
parameter of 100,000 elements or more in CUDA managed memory, which the caching allocator never counts: a CUDA
target's estimate counted it as device memory.

Schedule-free optimizers (``schedulefree``'s) step only after ``optimizer.train()``, which the module calls in a hook:
the estimate, which does not run those hooks, said "could not estimate this run (Exception: Optimizer was not in
train mode when step is called ...)".
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from estimate_checks import check_against_real, real_run
from lm_helpers import MLP
from torch import nn

from lightning_memtrace.estimator import estimate, estimate_for_module

try:
    import bitsandbytes as bnb
except ImportError:  # the tests of bitsandbytes' optimizers skip (see needs_bnb)
    bnb = None
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs bitsandbytes")

OPTIMIZERS = {
    "AdamW8bit": lambda params: bnb.optim.AdamW8bit(params, lr=1e-3),
    "PagedAdamW8bit": lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-3),
    "Lion8bit": lambda params: bnb.optim.Lion8bit(params, lr=1e-4),
    "AdEMAMix8bit": lambda params: bnb.optim.AdEMAMix8bit(params, lr=1e-3),
    "SGD8bit": lambda params: bnb.optim.SGD8bit(params, lr=1e-2, momentum=0.9),
}


class Bnb8bitMLP(MLP):
    def __init__(self, optimizer: str) -> None:
        super().__init__(width=128)
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@needs_bnb
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_8bit_optimizer_of_the_module_is_estimated_as_the_run_measures_it(tmp_path, name):
    module = Bnb8bitMLP(name)
    phases = real_run(tmp_path, module)
    batch = next(iter(module.train_dataloader()))
    est = estimate_for_module(Bnb8bitMLP(name), batch, steps=3)
    check_against_real(est, phases)
    # the run's own optimizer after its steps: 8-bit moments for the 128 x 128 layer (16,384 elements, above
    # bitsandbytes' min_8bit_size of 4,096), 32-bit ones for the smaller tensors
    state = _state_bytes(module.trainer.optimizers[0])
    assert est.category_bytes()["optimizer_state"] == state
    assert state < 4 * sum(p.numel() for p in module.parameters())  # less than one float32 moment per parameter


def _paged_net() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 16))  # 131,072 weights: paged on CUDA


def _step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


@needs_bnb
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_paged_state_is_off_a_cuda_targets_device(device):
    batch = torch.randn(8, 512)
    plain = estimate(_paged_net(), batch, optimizer_factory=lambda m: bnb.optim.AdamW(m.parameters()),
                     training_step=_step, device=device)
    paged = estimate(_paged_net(), batch, optimizer_factory=lambda m: bnb.optim.PagedAdamW(m.parameters()),
                     training_step=_step, device=device)
    plain_state, paged_state = plain.category_bytes()["optimizer_state"], paged.category_bytes()["optimizer_state"]
    if device == "cpu":  # bitsandbytes pages nothing on a CPU: the same state as the plain optimizer's
        assert paged_state == plain_state
        assert paged.peak_bytes == plain.peak_bytes
    else:  # the first layer's two float32 moments are CUDA managed memory, the rest stays on the device
        paged_out = 2 * 4 * 512 * 256
        assert plain_state - paged_state == paged_out
        assert plain.peak_bytes - paged.peak_bytes == paged_out


_FACTORY_IMPORTS_BNB = """
import json, sys, torch
from torch import nn
from lightning_memtrace.estimator import estimate

def factory(model):
    import bitsandbytes  # first imported here, inside the estimate
    return bitsandbytes.optim.AdamW8bit(model.parameters())

assert "bitsandbytes" not in sys.modules
net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
est = estimate(net, torch.randn(4, 64), optimizer_factory=factory, training_step=lambda m, b: m(b).square().mean())
print(json.dumps({"optimizer": est.optimizer, "state": est.category_bytes()["optimizer_state"]}))
"""


@needs_bnb
def test_a_factory_that_imports_bitsandbytes_itself_is_estimated():
    done = subprocess.run([sys.executable, "-c", _FACTORY_IMPORTS_BNB], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["optimizer"] == "AdamW8bit"
    # the 64 x 128 weight (8,192 elements) in 8 bits: two 1-byte moments and one float32 absmax per 256-element
    # block each, and the two 256-code quantization maps; the other tensors' two moments in float32
    eight_bit = 2 * 8192 + 2 * 4 * (8192 // 256) + 2 * 256 * 4
    float32 = 2 * 4 * (128 + 128 + 1)
    assert answer["state"] == eight_bit + float32


def test_an_optimizer_that_reads_values_when_made_is_said_in_one_line():
    class ScaledSGD(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.scale = float(torch.linspace(0, 1, 5).sum())  # a value: fake tensors have none

    with pytest.raises(ValueError, match=r"^the optimizer reads tensor values when it is made") as raised:
        estimate(nn.Linear(4, 4), torch.randn(2, 4), optimizer_factory=lambda m: ScaledSGD(m.parameters()),
                 training_step=lambda m, b: m(b).sum())
    assert "test_user_optimizers.py" in str(raised.value) and "__init__" in str(raised.value)
    assert "\n" not in str(raised.value)


class TrainModeSGD(torch.optim.Optimizer):
    """Schedule-free's contract in a few lines: groups say ``train_mode`` (off when made), ``train()``/``eval()`` switch
    it, a step out of train mode raises; the state is one ``z`` buffer per parameter."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr, train_mode=False))

    def train(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = True

    def eval(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.param_groups[0]["train_mode"]:
            raise Exception("Optimizer was not in train mode when step is called.")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    z = self.state[param].setdefault("z", param.clone())
                    z.sub_(param.grad, alpha=group["lr"])
                    param.lerp_(z, 0.1)
        return loss


class ScheduleFreeMLP(MLP):
    def __init__(self, schedulefree: bool = False) -> None:
        super().__init__(width=128)
        self.schedulefree = schedulefree

    def configure_optimizers(self):
        if self.schedulefree:
            import schedulefree

            return schedulefree.AdamWScheduleFree(self.parameters(), lr=1e-3)
        return TrainModeSGD(self.parameters())

    def on_train_epoch_start(self) -> None:
        self.trainer.optimizers[0].train()  # as schedulefree's documentation has it


@pytest.mark.parametrize("schedulefree", [False, True], ids=["train-mode-sgd", "schedulefree"])
def test_optimizer_stepping_only_in_train_mode_is_estimated(tmp_path, schedulefree):
    if schedulefree:
        pytest.importorskip("schedulefree")
    module = ScheduleFreeMLP(schedulefree)
    phases = real_run(tmp_path, module)
    batch = next(iter(module.train_dataloader()))
    est = estimate_for_module(ScheduleFreeMLP(schedulefree), batch, steps=3)
    check_against_real(est, phases)
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert est.category_bytes()["parameters"] == param_bytes
    if not schedulefree:  # one z buffer per parameter
        assert est.category_bytes()["optimizer_state"] == param_bytes == _state_bytes(module.trainer.optimizers[0])
