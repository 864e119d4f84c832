"""What live memory is made of: parameters, gradients, optimizer state, inputs and saved activations, per storage."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtrace.capture import cuda_history, hooks_stand_in, torch_private
from lightning_memtrace.capture.storages import (
    PLAIN_TENSORS,
    iter_tensors,
    layout_parts,
    memory_tensors,
    optimizer_state_tensors,
    same_device,
    storage_key,
    storage_of,
    weight_state_tensors,
    wrapped_tensors,
)
from lightning_memtrace.types import Category

StorageMap = dict[int, torch.UntypedStorage]
_PLAIN_TYPES = frozenset(PLAIN_TENSORS)
_IS_CPU = operator.attrgetter("is_cpu")
_GRAD = operator.attrgetter("grad")
_CDATA = operator.attrgetter("_cdata")
_UNTYPED_STORAGE = Tensor.untyped_storage
_NBYTES = torch.UntypedStorage.nbytes
#: Every category, in order (iterating the enum class itself runs a generator on every row).
_CATEGORIES = tuple(Category)


class _Saved:
    """What autograd keeps for one tensor saved under MemTrace's hooks: the tensor (or what the user's own hooks made
    of it) and its version then. Weakly referenced by the recorder: once autograd lets go of it (the backward that used
    it is done, or the graph is dropped), its storage no longer counts as saved, though the storage may live on (a
    batch norm's running statistics, an output the step returns)."""

    __slots__ = ("packed", "version", "__weakref__")

    def __init__(self, packed: Any, version: int | None) -> None:
        self.packed = packed
        self.version = version


class SavedTensorsRecorder:
    """Remembers the storages autograd saves for backward, through ``saved_tensors_hooks``, while autograd keeps them.

    The hooks are pushed with :meth:`push` before a forward and popped with :meth:`pop` after it; the tensors' data is
    untouched and kept no longer than autograd keeps it (see :meth:`_pack`), and only weak references to their storages
    and to what autograd holds for them are kept here.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = normalize_device(device)
        self._on_cpu = self.device.type == "cpu"
        #: storage key -> (the storage, what holds it for a backward: autograd's saved objects, SAC's wrappers)
        self._saved: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}
        self._hooks: Any = None
        # The user's hooks in force beneath MemTrace's, which its own hand each tensor on to.
        self._outer: tuple[Any, Any] | None = None
        self._holds_stand_in = False
        self.unavailable_reason: str | None = None

    @property
    def pushed(self) -> bool:
        return self._hooks is not None

    def clear(self) -> None:
        self._saved.clear()

    def _note(self, tensor: Tensor, holder: Any) -> None:
        """``tensor`` is saved for a backward for as long as ``holder`` lives."""
        try:
            # `is_cpu` reads a flag where `.device` builds a device object (this runs for every saved tensor).
            if tensor.is_cpu if self._on_cpu and type(tensor) in PLAIN_TENSORS else tensor.device == self.device:
                storage = tensor.untyped_storage()
                key = storage._cdata
                entry = self._saved.get(key)
                if entry is None or entry[0]() is not storage:
                    self._saved[key] = (weakref.ref(storage), [weakref.ref(holder)])
                else:
                    entry[1].append(weakref.ref(holder))
        except Exception:  # noqa: S110
            # Runs inside autograd for every saved tensor of the user's forward: an odd tensor (no storage, a
            # subclass) is left unmeasured rather than failing the forward.
            pass

    def _pack(self, tensor: Tensor) -> tuple[Tensor, int | None]:
        """What autograd keeps for ``tensor``: the tensor, cut from its autograd history, and its version now.

        Cut, because autograd holds what a pack hook returns: a tensor that is the saving node's own output (ReLU's,
        sigmoid's) would hold that node back, a cycle that only a backward through the node breaks, so a graph never
        backpropagated (a branch computed only to be logged, a skipped step, SWA's batch-norm epoch) would stay alive
        for good. Autograd itself keeps such outputs without their history. The version: under hooks autograd no longer
        checks that a saved tensor was not modified in place, so :meth:`_unpack` checks it as autograd would have.
        """
        try:
            version = tensor._version
            if tensor.requires_grad and not tensor.is_leaf:
                tensor = tensor.detach()  # the same storage and version counter, no history
        except Exception:  # an inference tensor has no version counter: kept as it is, unchecked
            version = None
        saved = _Saved(tensor, version)
        self._note(tensor, saved)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> Tensor:
        # runs on the thread that runs the backward: a CUDA backward's allocations get the phase tag there too
        cuda_history.carry_allocation_tag()
        tensor, version = saved.packed, saved.version
        if version is not None and tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{tensor.type()} {list(tensor.shape)}], is at version {tensor._version}; expected version {version} "
                "instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
                "with torch.autograd.set_detect_anomaly(True, check_nan=False)."
            )
        return tensor

    def _pack_then_theirs(self, tensor: Tensor) -> Any:
        # The user's hooks get the tensor as autograd hands it over (and under theirs autograd checks no version).
        saved = _Saved(self._outer[0](tensor), None)
        self._note(tensor, saved)
        return saved

    def _unpack_theirs(self, saved: _Saved) -> Any:
        cuda_history.carry_allocation_tag()
        return self._outer[1](saved.packed)

    def push(self) -> bool:
        """Push the hooks; where saved-tensor hooks of the user's are in force already (``save_on_cpu`` around the
        fit, say), they go on applying: MemTrace's pack notes the tensor and hands it to theirs (autograd applies only
        the innermost hooks). While they are pushed, code that refuses to run under saved-tensor hooks (``torch.func``'s
        gradient transforms) runs with MemTrace's popped (see :mod:`~lightning_memtrace.capture.hooks_stand_in`)."""
        if self._hooks is not None:
            return True
        if not self._enter_hooks():
            return False
        hooks_stand_in.hold()
        self._holds_stand_in = True
        return True

    def _enter_hooks(self) -> bool:
        outer = torch_private.saved_tensors_hooks_in_force()
        if outer is not None and hooks_stand_in.owner_of(outer[0]) is not None:
            outer = None  # another recorder's (an estimate inside a running fit): not the user's, not handed on
        elif (
            outer is None
            and not torch_private.can_tell_saved_tensors_hooks()
            and not hooks_stand_in.pushed_here()
            and torch_private.saved_tensors_hooks_pushed()
        ):
            # The user's hooks (save_on_cpu around the fit) would stop applying under MemTrace's: theirs come first.
            self.unavailable_reason = (
                "saved-tensor hooks of your own (save_on_cpu, say) are in force, and this torch (before 2.8) cannot "
                "tell MemTrace which to hand each tensor on to, so it leaves them to work alone"
            )
            return False
        self._outer = outer
        if outer is None:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_then_theirs, self._unpack_theirs)
        try:
            hooks.__enter__()
        except RuntimeError as error:
            # e.g. "Saved tensors default hooks are disabled" under some compiled regions.
            self.unavailable_reason = str(error).splitlines()[0]
            return False
        self._hooks = hooks
        hooks_stand_in.note_pushed(self)
        torch_private.note_sac_saves(self._note)
        return True

    def pop(self) -> None:
        self.step_aside()
        if self._holds_stand_in:
            self._holds_stand_in = False
            hooks_stand_in.release()

    def step_aside(self) -> None:
        """Pop the hooks, leaving the stand-in held (see :meth:`push`)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            torch_private.stop_noting_sac_saves(self._note)
            hooks_stand_in.note_popped(self)
            hooks.__exit__(None, None, None)

    def step_back(self) -> None:
        """Push the hooks again after :meth:`step_aside`; where that fails, they stay off until the next push."""
        if self._holds_stand_in and self._hooks is None and not self._enter_hooks():
            self._holds_stand_in = False
            hooks_stand_in.release()

    def live_storages(self) -> StorageMap:
        """The storages saved for a backward now: alive, and held for it still."""
        out: StorageMap = {}
        dead = []
        for key, (ref, holders) in self._saved.items():
            storage = storage_of(ref) if any(holder() is not None for holder in holders) else None
            if storage is None:
                dead.append(key)
            else:
                out[key] = storage
        for key in dead:
            self._saved.pop(key, None)
        return out


# Marks MemTrace's own pack hooks: a recorder pushed later (an estimate inside a fit) does not hand on to them, and the
# step-aside stand-in finds the recorder to pop.
for _pack_hook in (SavedTensorsRecorder._pack, SavedTensorsRecorder._pack_then_theirs):
    setattr(_pack_hook, hooks_stand_in.MARKER, True)


class CategoryCounter:
    """Assigns every storage it can name to one category, on one device, and sums their bytes.

    Priority when a storage is in two places: parameters, gradients, optimizer state, unsharded parameters and
    gradients (FSDP2), inputs, activations. So a weight that autograd saves for backward stays a parameter (a gathered
    one an unsharded parameter), and a batch tensor saved for backward stays an input.
    """

    def __init__(self, device: torch.device, model: nn.Module | None = None, optimizers: Sequence[Any] = ()) -> None:
        self.device = normalize_device(device)
        self.model = model
        self.optimizers: list[Any] = list(optimizers)
        self._params: list[Tensor] | None = None
        self._fsdp_params: list[Any] | None = None

    def refresh(self) -> None:
        """Forget the cached parameter list (called once per batch: modules may swap their parameters).

        FSDP2's records of the sharded parameters are kept: ``fully_shard`` is applied before training starts, and
        finding them walks every module.
        """
        self._params = None

    def _unsharded(self) -> tuple[list[Tensor], list[Tensor]]:
        """FSDP2's gathered full parameters and full gradients alive now (none on an unsharded run)."""
        if self._fsdp_params is None:
            self._fsdp_params = torch_private.fsdp2_params(self.model)
        if not self._fsdp_params:
            return [], []
        return torch_private.fsdp2_unsharded_tensors(self._fsdp_params)

    def parameters(self) -> list[Tensor]:
        if self._params is None:
            seen: set[int] = set()
            params: list[Tensor] = []
            candidates: list[Any] = list(self.model.parameters()) if self.model is not None else []
            for optimizer in self.optimizers:
                for group in getattr(optimizer, "param_groups", []):
                    candidates.extend(group.get("params", []))
            for tensor in candidates:
                if isinstance(tensor, Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    params.append(tensor)
            # a quantized weight's scales and code tables are part of it (bitsandbytes' 4-bit and 8-bit weights)
            for tensor in list(weight_state_tensors(params, self.model)):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    params.append(tensor)
            self._params = params
        return self._params

    def _collect(self, tensors: Iterable[Tensor], into: NamedStorages, category: Category) -> None:
        """Name the storages of ``tensors`` (this device's only) ``category``, where no earlier category did."""
        into.add(self._storages_of(tensors), category)

    def _storages_of(self, tensors: Iterable[Tensor]) -> StorageMap:
        """The distinct storages of ``tensors`` on this device (a wrapper's: its inner tensors'), first seen first."""
        tensors = tensors if type(tensors) is list else list(tensors)
        if self.device.type == "cpu" and set(map(type, tensors)) <= _PLAIN_TYPES and all(map(_IS_CPU, tensors)):
            # The usual case, on every row: plain CPU tensors, read a field at a time at C speed.
            try:
                storages = list(map(_UNTYPED_STORAGE, tensors))
            except (RuntimeError, NotImplementedError, AttributeError):
                storages = None  # a sparse or nested tensor among them: one at a time below
            if storages is not None:
                return dict(zip(map(_CDATA, storages), storages))
        out: StorageMap = {}
        device = self.device
        on_cpu = device.type == "cpu"
        for tensor in tensors:
            plain = type(tensor) in PLAIN_TENSORS
            if not plain:
                if not isinstance(tensor, Tensor):
                    continue
                inner = wrapped_tensors(tensor)
                if inner is not None:  # a DTensor: its memory is its local shard
                    for key, storage in self._storages_of(inner).items():
                        out.setdefault(key, storage)
                    continue
            # `is_cpu` reads a flag where `.device` builds a device object (this runs for every tensor of every row);
            # subclasses (fake tensors) may report a device of their own.
            if on_cpu and plain:
                if not tensor.is_cpu:
                    continue
            elif tensor.device != device:
                continue
            found = storage_key(tensor)
            if found is not None:
                out.setdefault(found[0], found[1])
            elif plain:  # a sparse tensor (an `Embedding(sparse=True)`'s gradient): its indices and values
                for key, storage in self._storages_of(layout_parts(tensor) or []).items():
                    out.setdefault(key, storage)
        return out

    def name(self, inputs: StorageMap | None = None, saved: StorageMap | None = None) -> NamedStorages:
        """Every storage nameable now, and the bytes of each category.

        Args:
            inputs: The batch's storages, by key (this device's only, as :func:`input_storages` gives them).
            saved: Storages saved for backward, by key (this device's only, as :class:`SavedTensorsRecorder` keeps
                them).
        """
        named = NamedStorages()
        params = self.parameters()
        self._collect(params, named, Category.PARAMETERS)
        self._collect([grad for grad in map(_GRAD, params) if grad is not None], named, Category.GRADIENTS)
        for optimizer in self.optimizers:
            self._collect(optimizer_state_tensors(optimizer), named, Category.OPTIMIZER_STATE)
        unsharded_params, unsharded_grads = self._unsharded()
        self._collect(unsharded_params, named, Category.UNSHARDED_PARAMETERS)
        self._collect(unsharded_grads, named, Category.UNSHARDED_GRADIENTS)
        if inputs:
            named.add(inputs, Category.INPUTS)
        if saved:
            named.add(saved, Category.ACTIVATIONS)
        return named


class NamedStorages:
    """Storages named at one moment: each once, under the first category that named it, and each category's bytes.

    Attributes:
        storages: Storage key -> (category, storage), in the order they were named.
        totals: Bytes of the storages of each category.
    """

    __slots__ = ("storages", "totals")

    def __init__(self) -> None:
        self.storages: dict[int, tuple[Category, torch.UntypedStorage]] = {}
        self.totals: dict[Category, int] = dict.fromkeys(_CATEGORIES, 0)

    def add(self, storages: StorageMap, category: Category) -> None:
        """Name ``storages`` (key -> storage) ``category``, but for those named already."""
        named = self.storages
        if named:
            taken = storages.keys() & named.keys()
            if taken:
                storages = {key: storage for key, storage in storages.items() if key not in taken}
        if storages:
            # Runs for every storage of every row: whole columns at C speed.
            named.update(zip(storages.keys(), zip(repeat(category), storages.values())))
            self.totals[category] += sum(map(_NBYTES, storages.values()))


def normalize_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so that ``tensor.device == device`` compares exactly."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        try:
            module = getattr(torch, device.type)
            return torch.device(device.type, module.current_device())
        except Exception:
            return torch.device(device.type, 0)
    return device


def input_storages(batch: Any, device: torch.device) -> StorageMap:
    out: StorageMap = {}
    for tensor in memory_tensors(iter_tensors(batch)):
        if same_device(tensor.device, device):
            found = storage_key(tensor)
            if found is not None:
                out.setdefault(found[0], found[1])
    return out
