"""Under MemTrace's dispatch mode, autograd sums two gradients of one tensor in place where it would without the mode.

A tensor used more than once (a slice of it in every step of a loop, a residual stream, weights tied between the
embedding and the output layer) gets one gradient from each use, which autograd's engine sums as they arrive. It sums
``old.add_(new)`` in place where it holds the last reference to ``old`` (and ``old`` is a plain dense tensor), else
``old + new`` into a new buffer. While any dispatch mode is active it always sums into a new buffer, and so it does for
a tensor subclass (the estimate's fake tensors are one): under MemTrace's dispatch mode (the ``dispatch`` tracker, the
CPU history window, the estimate's fake run) backward held one more full-size gradient at each such sum than the same
run without MemTrace. The estimate of a loop over a sequence's positions was 40 % high at its peak.

:class:`GradSums` makes those sums in place again, where the engine would without the mode. A sum by the engine is told
from an operator's own ``add`` by what it adds: a gradient the node that just ran returned (the post-hook of each node
that hands a gradient to an input another node hands one to as well notes them; the pre-hook of each node it hands
gradients to forgets them). That the engine holds the last reference to ``old`` is told by ``old``'s
reference counts seen from the mode on top of the stack, against those of a sum the engine is known to make in place,
measured on a probe graph of the same kind of tensor (:meth:`GradSums.probe`).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture import torch_private
from lightning_memtrace.capture.storages import dense

#: The engine's out-of-place sum, and the in-place one it makes where it holds the last reference.
SUM = torch.ops.aten.add.Tensor
SUM_IN_PLACE = torch.ops.aten.add_.Tensor

# (tensor type) -> the reference counts of a buffer the engine alone holds, seen from the top mode; None: unknown
_LAST_REFERENCE: dict[type, tuple[int, int, int] | None] = {}


def graph_nodes(root: Tensor) -> list[Any]:
    """Every autograd node ``root``'s backward runs (its graph from ``root.grad_fn``)."""
    nodes, seen, pending = [], set(), [root.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def summing_nodes(nodes: list[Any]) -> tuple[list[tuple[Any, tuple[int, ...]]], set[Any]]:
    """Of ``nodes``, those that hand a gradient to an input another node hands one to as well (where the engine sums),
    each with the positions of those gradients among its outputs, and the nodes they hand gradients to."""
    edges = [(node, node.next_functions) for node in nodes]
    incoming = Counter(edge for _, targets in edges for edge in targets if edge[0] is not None)
    summing, consumers = [], set()
    for node, targets in edges:
        positions = tuple(i for i, edge in enumerate(targets) if edge[0] is not None and incoming[edge] > 1)
        if positions:
            summing.append((node, positions))
            consumers.update(target for target, _ in targets if target is not None)
    return summing, consumers


class GradSums:
    """The engine's sums of one backward, made in place where the engine would make them so without a mode.

    Args:
        tensor_type: The type of tensor the run's gradients are (``torch.Tensor``; the estimate's ``FakeTensor``).
        last_reference: The reference counts of a buffer the engine alone holds, seen from the mode (see
            :meth:`probe`); None while the probe measures them (into :attr:`probed`, every sum left as it is).
    """

    def __init__(self, tensor_type: type, last_reference: tuple[int, int, int] | None) -> None:
        self.tensor_type = tensor_type
        self.last_reference = last_reference
        #: ids of the gradients bound for a sum that the node that ran last returned (each dropped when summed, all
        #: once a node they are handed to starts).
        self.returned: set[int] = set()
        self._handles: list[Any] = []
        self.probed: list[tuple[int, int, int] | None] = []  # the probe's counts

    @classmethod
    def probe(cls) -> GradSums | None:
        """A :class:`GradSums` for the tensors made here now (under the modes active: fake tensors in the estimate),
        its reference counts measured once per tensor type on a probe graph: a tensor used twice, each use's gradient
        new (``sin`` and ``cos``), which the engine sums in place. Call it before entering the mode (the probe's
        tensors are on the meta device: nothing real is allocated). None where it cannot be told on this torch."""
        try:
            # Anomaly mode (``Trainer(detect_anomaly=True)``) would check the meta gradients for NaN, fail, and show
            # the user a warning with this probe's traceback.
            with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_detect_anomaly(False):
                leaf = torch.empty(8, device="meta", requires_grad=True)
                tensor_type = type(leaf)
                if tensor_type not in _LAST_REFERENCE:
                    _LAST_REFERENCE[tensor_type] = _probe_counts(leaf)
        except Exception:
            return None
        counts = _LAST_REFERENCE[tensor_type]
        return None if counts is None else cls(tensor_type, counts)

    # ------------------------------------------------------------------------------------------------ backward
    def attach(self, loss: Tensor) -> None:
        """Before ``loss.backward()``: note what each node of its graph returns (a node that takes no hooks leaves
        the sums of the whole backward out of place, as the mode makes them)."""
        self.detach()
        if getattr(loss, "grad_fn", None) is None:
            return
        try:
            summing, consumers = summing_nodes(graph_nodes(loss))
            # Hooks only where the engine sums (a Python hook per node costs about as much as the node's own work): what
            # a summing node returned is noted, and forgotten when one of the nodes it hands gradients to starts.
            for node, positions in summing:
                self._handles.append(node.register_hook(functools.partial(self._node_returned, positions)))
            for node in consumers:
                self._handles.append(node.register_prehook(self._node_starts))
        except Exception:
            self.detach()

    def detach(self) -> None:
        """After the backward (or where it failed): the graph's hooks removed."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.returned = set()

    def _node_returned(self, positions: tuple[int, ...], grad_inputs: tuple, grad_outputs: tuple) -> None:
        # Only the gradients bound for a sum, each taken once: an id noted of a gradient that is then dropped could
        # be a new tensor's later.
        self.returned = {id(grad_inputs[i]) for i in positions if i < len(grad_inputs) and grad_inputs[i] is not None}

    def _node_starts(self, grad_outputs: tuple) -> None:
        self.returned = set()

    # -------------------------------------------------------------------------------------------- in the mode
    def in_place(self, args: tuple, kwargs: dict | None) -> bool:
        """Whether ``add(*args, **kwargs)`` is a sum the engine makes in place without a mode."""
        if kwargs or len(args) != 2 or id(args[1]) not in self.returned or torch.is_grad_enabled():
            return False
        self.returned.discard(id(args[1]))
        try:
            return self._would_sum_in_place(*args)
        except Exception:  # inside the user's backward: a tensor this cannot read is summed as the mode makes it
            return False

    def _would_sum_in_place(self, old: Any, new: Any) -> bool:
        tensor_type = self.tensor_type
        if type(old) is not tensor_type or type(new) is not tensor_type:
            return False
        if old.is_nested or old._is_zerotensor() or old.shape != new.shape or old.dtype != new.dtype:
            return False
        if not dense(old):
            return False
        counts = torch_private.reference_counts(old)
        if self.last_reference is None:
            self.probed.append(counts)
            return False
        return counts is not None and counts == self.last_reference


class _ProbeMode(torch_private.TorchDispatchMode):
    def __init__(self, sums: GradSums) -> None:
        super().__init__()
        self.sums = sums

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is SUM:
            self.sums.in_place(args, kwargs)
        return func(*args, **(kwargs or {}))


def _probe_counts(leaf: Tensor) -> tuple[int, int, int] | None:
    sums = GradSums(type(leaf), None)
    try:
        used_twice = leaf * 2
        loss = used_twice.sin().sum() + used_twice.cos().sum()
        sums.attach(loss)
        with _ProbeMode(sums):
            loss.backward()
    except Exception:  # an engine or hooks unlike this module's reading of them: sums stay as the mode makes them
        return None
    finally:
        sums.detach()
    return sums.probed[0] if len(sums.probed) == 1 else None
