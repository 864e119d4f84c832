"""Storage-level helpers: MemTrace counts memory per storage, so views and tied weights count once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
_PLAIN_PARAMETER_TYPES = frozenset(PLAIN_TENSORS)


#: ``UntypedStorage._fix_weakref``, where this torch has it.
_FIX_WEAKREF = getattr(torch.UntypedStorage, "_fix_weakref", None)


def storage_of(ref: Any) -> torch.UntypedStorage | None:
    """The storage a weak reference points to (None where it is gone), safe to hold and use.

    On older torch (2.5, at least) a storage taken from a weak reference does not keep its memory alive unless told
    to (``_fix_weakref``): where the memory is freed meanwhile (a batch from a DataLoader worker, read a second later),
    using the storage raises or crashes the process. There, a storage whose memory is gone already (its object is
    "invalid") is taken for gone. Both cost about 60 ns.
    """
    storage = ref()
    if storage is None:
        return None
    try:
        if _FIX_WEAKREF is not None:
            _FIX_WEAKREF(storage)
        storage.data_ptr()
    except RuntimeError:  # "an invalid python storage" (older torch): its memory is gone already
        return None
    return storage


def layout_parts(tensor: Tensor) -> list[Tensor] | None:
    """The dense tensors a sparse tensor holds its memory in (a COO tensor's indices and values, a compressed one's
    index arrays and values), or None for a strided tensor, which holds its own.

    A sparse tensor has no storage of its own (``untyped_storage()`` raises): the gradient of an
    ``nn.Embedding(sparse=True)``, SGD's momentum for it. Other layouts without a storage (MKL-DNN) give no parts.
    """
    layout = tensor.layout
    if layout is torch.strided:
        return None
    if layout is torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout is torch.sparse_csr or layout is torch.sparse_bsr:
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout is torch.sparse_csc or layout is torch.sparse_bsc:
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return []


def wrapped_tensors(tensor: Tensor) -> list[Tensor] | None:
    """The tensors a wrapper subclass holds its memory in (a DTensor's local shard), or a sparse tensor (its indices
    and values), or None for a tensor that holds its own (plain tensors, fake tensors).

    A wrapper's own storage is no memory: reading its pointer fails, and its bytes are its inner tensors'.
    """
    if type(tensor) in PLAIN_TENSORS:
        return layout_parts(tensor)
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return layout_parts(tensor)
    try:
        names, _ = flatten()
        inner = [getattr(tensor, name) for name in names]
    except Exception:
        return []  # a wrapper that does not say what it holds: nothing of it can be counted safely
    out: list[Tensor] = []
    for item in inner:
        if isinstance(item, Tensor):
            nested = wrapped_tensors(item)
            out.extend(nested if nested is not None else [item])
    return out


def memory_tensors(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """The tensors that hold the memory of ``tensors``: each itself, or a wrapper's inner tensors."""
    for tensor in tensors:
        inner = wrapped_tensors(tensor) if isinstance(tensor, Tensor) else None
        if inner is None:
            yield tensor
        else:
            yield from inner


#: The public attributes of torch's own tensor subclasses (a fake tensor's mode, constant, the real tensor it stands
#: for): none is part of a weight.
_TORCH_TENSOR_FIELDS = frozenset({"fake_mode", "constant", "pytype", "dispatch_keys", "real_tensor"})


def is_quantized_weight(param: Tensor) -> bool:
    """Whether ``param`` is of a parameter subclass from outside torch (bitsandbytes' ``Params4bit``, ``Int8Params``),
    or a fake tensor that carries such a weight's attributes (the estimate's copy of one): a weight that may keep part
    of itself beside its data (see :func:`weight_state_tensors`)."""
    kind = type(param)
    if kind in _PLAIN_PARAMETER_TYPES:
        return False
    if not kind.__module__.startswith("torch"):
        return True
    return any(not name.startswith("_") and name not in _TORCH_TENSOR_FIELDS for name in getattr(param, "__dict__", ()))


def quantized(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is a quantized weight (:func:`is_quantized_weight`); cheap for plain parameters."""
    return not set(map(type, params)) <= _PLAIN_PARAMETER_TYPES and any(map(is_quantized_weight, params))


def weight_state_tensors(params: Iterable[Tensor], model: torch.nn.Module | None = None) -> Iterator[Tensor]:
    """The tensors a quantized weight keeps beside its data, which are part of it: in the attributes of a parameter
    subclass (bitsandbytes' 4-bit ``Params4bit``: the scale of each block in ``quant_state``, itself quantized with
    ``compress_statistics``, and the code tables; 8-bit ``Int8Params``: ``CB``, ``SCB``) and in the helper objects of
    the layer that holds it (``Linear8bitLt.state``, where the 8-bit weight's scales move at its first forward).
    Objects from outside torch are entered (three deep); modules, torch's own objects and private attributes are not.
    Nothing for plain parameters (checked first, at the cost of one set of their types)."""
    params = list(params)
    if not quantized(params):
        return
    holders = [param for param in params if is_quantized_weight(param)]
    for param in holders:
        yield from _object_state_tensors(getattr(param, "__dict__", {}), 0, top_tensors=True)
    if model is None:
        return
    for sub in model.modules():
        if any(is_quantized_weight(p) for p in sub._parameters.values() if p is not None):
            yield from _object_state_tensors(sub.__dict__, 0, top_tensors=False)


def _object_state_tensors(state: dict[str, Any], depth: int, top_tensors: bool) -> Iterator[Tensor]:
    for name, value in state.items():
        if name.startswith("_"):
            continue
        if isinstance(value, Tensor):
            if top_tensors and name not in _TORCH_TENSOR_FIELDS:
                yield value
        elif depth < 3 and not isinstance(value, (type, torch.nn.Module)):
            inner = getattr(value, "__dict__", None)
            if inner and not type(value).__module__.startswith("torch"):
                yield from _object_state_tensors(inner, depth + 1, top_tensors=True)


#: Module attributes that hold no tensors of the module's own state beside its buffers (parameters, buffers and
#: submodules are found apart; a LightningModule's Trainer or Fabric is not the module's).
_NOT_STATE = frozenset({"_parameters", "_buffers", "_modules", "_trainer", "_fabric"})


def _contained_tensors(value: Any, depth: int, whole_modules: bool) -> Iterator[Tensor]:
    """The strided tensors in ``value``: itself, or in its dicts, lists and plain tuples (three deep). With
    ``whole_modules``, a parameter counts like any tensor and a module gives all its tensors; without, parameters are
    left out (they are found apart) and modules are not entered."""
    if isinstance(value, Tensor):
        if (whole_modules or not isinstance(value, torch.nn.Parameter)) and value.layout == torch.strided:
            yield value
    elif whole_modules and isinstance(value, torch.nn.Module):
        yield from value.parameters()
        yield from value.buffers()
        yield from attribute_tensors(value)
    elif depth < 3 and (isinstance(value, list) or type(value) is tuple):
        for item in value:
            yield from _contained_tensors(item, depth + 1, whole_modules)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _contained_tensors(item, depth + 1, whole_modules)


def attribute_tensors(module: torch.nn.Module) -> Iterator[Tensor]:
    """Tensors the module's submodules keep as plain attributes, also in dicts, lists and plain tuples (three deep):
    torchmetrics' metric states and their defaults, a mask cached as ``self.mask = ...`` rather than a buffer.
    Parameters are left out. (Tuple subclasses are not entered: the estimate's in-place copy could not rebuild them.)"""
    for sub in module.modules():
        for name, value in sub.__dict__.items():
            if name not in _NOT_STATE:
                yield from _contained_tensors(value, 0, whole_modules=False)


def held_tensors(holder: object) -> Iterator[Tensor]:
    """Tensors an object (another callback) keeps in its attributes: plain tensors, also in dicts, lists and plain
    tuples (three deep), and every parameter, buffer and attribute tensor of a module it keeps (an averaged copy of
    the model). Objects of other kinds are not entered."""
    for value in list(getattr(holder, "__dict__", {}).values()):
        yield from _contained_tensors(value, 0, whole_modules=True)


def is_module_state(name: str) -> bool:
    """Whether a module attribute of this name may hold the module's own tensors (see :func:`attribute_tensors`)."""
    return name not in _NOT_STATE


def storage_key(tensor: Tensor) -> tuple[int, torch.UntypedStorage] | None:
    """The identity of a tensor's storage (its C++ object) and the storage, or None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        # Tensor subclasses (DTensor, sparse, nested) may have no plain storage.
        return None
    return storage._cdata, storage


def transferable_fields(obj: Any) -> dict[str, Any] | None:
    """The attributes of a batch object that Lightning moves to the device with the object's own ``.to()`` (its
    ``_TransferableDataType``: any object with a callable ``to``), such as a custom batch class; None for anything
    else: tensors, containers, modules, classes, objects without attributes of their own."""
    if isinstance(obj, (Tensor, torch.nn.Module, type)) or not callable(getattr(obj, "to", None)):
        return None
    fields = getattr(obj, "__dict__", None)
    return fields if isinstance(fields, dict) else None


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[Tensor]:
    """Every tensor inside nested containers (dicts, lists, tuples, sets, dataclasses, mappings such as BatchEncoding)
    and batch objects (see :func:`transferable_fields`)."""
    if _depth > 32:
        return
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict) or (hasattr(obj, "items") and hasattr(obj, "keys") and not isinstance(obj, type)):
        try:
            values = list(obj.values())
        except Exception:
            return
        for value in values:
            yield from iter_tensors(value, _depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            if isinstance(value, Tensor):  # the usual batch: a tuple of tensors, no generator for each
                yield value
            else:
                yield from iter_tensors(value, _depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, name, None), _depth + 1)
    else:
        fields = transferable_fields(obj)
        for value in list(fields.values()) if fields else ():
            yield from iter_tensors(value, _depth + 1)


def unique_storages(tensors: Iterable[Tensor], device: torch.device | None = None) -> dict[int, torch.UntypedStorage]:
    """Storages of the tensors, deduplicated, optionally only those on ``device``."""
    out: dict[int, torch.UntypedStorage] = {}
    for tensor in memory_tensors(tensors):
        if device is not None and not same_device(tensor.device, device):
            continue
        found = storage_key(tensor)
        if found is not None:
            out.setdefault(found[0], found[1])
    return out


def unique_storage_bytes(tensors: Iterable[Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind the tensors (a tied weight counts once)."""
    return sum(st.nbytes() for st in unique_storages(tensors, device).values())


def dense_layout(shape: Iterable[int], stride: Iterable[int]) -> bool:
    """Whether elements of this shape and stride fill their span of the storage without gaps or overlaps, in any order
    of dimensions (contiguous, channels-last, transposed)."""
    expected = 1
    for step, size in sorted((st, si) for si, st in zip(shape, stride) if si != 1):
        if step != expected:
            return False
        expected *= size
    return True


def dense(tensor: Tensor) -> bool:
    """:func:`dense_layout` of a tensor."""
    return dense_layout(tensor.shape, tensor.stride())


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return (a.index or 0) == (b.index or 0)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Tensors held in an optimizer's state, whatever its layout (nested dicts and lists are walked)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return
    try:
        values = list(state.values())
    except Exception:
        return
    for value in values:
        if type(value) is dict:  # the usual layout, {name: tensor or number}: no recursion per entry
            for item in value.values():
                if isinstance(item, Tensor):
                    yield item
                elif not isinstance(item, (int, float, bool, str)):
                    yield from iter_tensors(item, 1)
        else:
            yield from iter_tensors(value)
