"""The estimate of a sharded run: FSDP2 over N ranks, measured on one rank in this process.

torch's ``fake`` process group stands in for the other ranks (its collectives return at once; torchtitan's
``scripts/estimate/estimation.py`` estimates its models the same way): the fake-tensor copy of the module is
``fully_shard``-ed as a real run would be (each repeated block, then the root, with ``fully_shard``'s defaults: blocks
reshard after forward, the root keeps its parameters gathered for backward), and the steps run on rank zero's shards,
gathered parameters and reduce-scatters included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_memtrace.estimator.remedies import repeated_blocks


@contextlib.contextmanager
def fake_world(world_size: int, device_type: str = "cpu") -> Iterator[Any]:
    """torch's fake process group of ``world_size`` ranks, this process as rank zero, and a 1-D device mesh over it.

    Raises:
        RuntimeError: A process group is already initialized here (a real distributed run): estimate before
            initializing it, or from another process.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process: estimate a sharded run from another one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh(device_type, (world_size,))
    finally:
        dist.destroy_process_group()


def shard_like_the_run(model: nn.Module, mesh: Any, reshard_after_forward: bool | None = None) -> int:
    """``fully_shard`` each repeated block of ``model``, then ``model`` itself; the number of blocks sharded.

    ``reshard_after_forward`` goes to every call; None is ``fully_shard``'s own default (True for the blocks, False for
    the root), which is what a run that passes nothing gets.
    """
    from torch.distributed.fsdp import fully_shard

    # the blocks a run shards one by one: the children of the largest ModuleList (a transformer's layers)
    blocks = repeated_blocks(model, sequential=False)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return len(blocks)


def sharded_already(module: nn.Module) -> str | None:
    """How ``module`` is sharded in this process already (``"FSDP2 (fully_shard)"``, ``"FSDP"``, ``"DTensor
    parameters"``), or None: such a module cannot be copied onto fake tensors, and its real process group leaves no
    room for the estimate's fake one."""
    fsdp2 = _classes(("torch.distributed.fsdp", "FSDPModule"), ("torch.distributed._composable.fsdp", "FSDPModule"))
    fsdp1 = _classes(("torch.distributed.fsdp", "FullyShardedDataParallel"))
    dtensor = _classes(("torch.distributed.tensor", "DTensor"), ("torch.distributed._tensor", "DTensor"))
    for sub in module.modules():
        if fsdp2 and isinstance(sub, fsdp2):
            return "FSDP2 (fully_shard)"
        if fsdp1 and isinstance(sub, fsdp1):
            return "FSDP"
    if dtensor and any(isinstance(p, dtensor) for p in module.parameters()):
        return "DTensor parameters"
    return None


def _classes(*places: tuple[str, str]) -> tuple[type, ...]:
    """The classes found at ``(module, name)`` places in this torch (they moved between versions; a torch without
    ``torch.distributed`` has none)."""
    import importlib

    found = []
    for module_name, name in places:
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def sharding_label(world_size: int, blocks: int) -> str:
    """How the estimate sharded the module, in words (``""`` unsharded)."""
    if world_size <= 1:
        return ""
    return f"FSDP2 over {world_size} ranks ({blocks} blocks, then the root; fully_shard's defaults), rank 0 shown"


def check_world_size(world_size: int) -> int:
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"the number of ranks to shard over must be at least 1, not {world_size}")
    if world_size > 1 and not torch.distributed.is_available():
        raise RuntimeError("this torch has no torch.distributed: a sharded run cannot be estimated")
    return world_size
