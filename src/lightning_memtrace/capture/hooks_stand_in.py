"""MemTrace's saved-tensor hooks step aside for code that refuses to run under any (``torch.func.grad``, ``vjp``,
``jacrev``, ``hessian``).

torch.func's gradient transforms enter ``torch.autograd.graph.disable_saved_tensors_hooks``, which raises where any
saved-tensor hooks are pushed on the thread: a training step calling them would fail only because MemTrace's hooks are
pushed during its forward. While a recorder's hooks are pushed, :func:`disable_saved_tensors_hooks` stands in for
torch's: where MemTrace's hooks are the innermost on this thread, they are popped for the region and pushed again after
it, so that torch's own check sees exactly what it would see without MemTrace (a user's own hooks beneath still make it
raise, as they would without MemTrace). Tensors saved inside the region go unnoted: they count as other bytes, not as
activations. On other threads, and where MemTrace's hooks are not innermost, torch's function runs as it is. A torch
before 2.8 cannot tell which hooks are innermost: there the hooks MemTrace pushed last on the thread are taken to be.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_memtrace.capture import torch_private

#: Set (True) on the functions of MemTrace's pack hooks: each is pushed as a method of its :class:`HooksOwner`.
MARKER = "_memtrace_pack"


class HooksOwner(Protocol):
    def step_aside(self) -> None:
        """Pop the hooks (they are the innermost on this thread)."""

    def step_back(self) -> None:
        """Push them again."""


_lock = threading.Lock()
# The owners whose hooks each thread has pushed, oldest first (for a torch that cannot tell which hooks are in force).
_this_thread = threading.local()
# How many owners hold the stand-in in place (their hooks are pushed, on any thread), and the function it replaced
# (torch's, or what was in its place) which it calls.
_holders = 0
_replaced: Callable[[str], Any] = torch.autograd.graph.disable_saved_tensors_hooks


def owner_of(pack: Any) -> HooksOwner | None:
    """The owner of MemTrace's pack hook ``pack``, or None where ``pack`` is not MemTrace's."""
    return getattr(pack, "__self__", None) if getattr(pack, MARKER, False) else None


def innermost_owner() -> HooksOwner | None:
    """The owner of the saved-tensor hooks autograd applies now on this thread, where they are MemTrace's.

    A torch that cannot tell which hooks are in force: the owner whose hooks this thread pushed last, if any are
    pushed (hooks of the user's pushed after them are then not seen).
    """
    if not torch_private.can_tell_saved_tensors_hooks():
        pushed = getattr(_this_thread, "pushed", None)
        return pushed[-1] if pushed else None
    hooks = torch_private.saved_tensors_hooks_in_force()
    return owner_of(hooks[0]) if hooks is not None else None


def pushed_here() -> bool:
    """Whether an owner's hooks are pushed on this thread."""
    return bool(getattr(_this_thread, "pushed", None))


def note_pushed(owner: HooksOwner) -> None:
    """``owner`` pushed its hooks on this thread."""
    pushed = getattr(_this_thread, "pushed", None)
    if pushed is None:
        pushed = _this_thread.pushed = []
    pushed.append(owner)


def note_popped(owner: HooksOwner) -> None:
    """``owner`` popped its hooks on this thread."""
    pushed = getattr(_this_thread, "pushed", None)
    if pushed and owner in pushed:
        del pushed[len(pushed) - 1 - pushed[::-1].index(owner)]


def disable_saved_tensors_hooks(error_message: str) -> contextlib.AbstractContextManager[None]:
    """Stands in for ``torch.autograd.graph.disable_saved_tensors_hooks`` (same arguments) while MemTrace's hooks are
    pushed; see the module's description.

    A plain function returning a context manager (not a generator one): dynamo inlines it into a compiled
    ``torch.func`` transform on every torch, where it has a ``nullcontext``, since dynamo traces with every
    saved-tensor hook ignored (it knows torch's own function by identity only, and would break the graph at it).
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    owner = innermost_owner()
    if owner is None:
        return _replaced(error_message)
    return _SteppedAside(owner, _replaced(error_message))


class _SteppedAside:
    """torch's ``disable_saved_tensors_hooks`` entered with MemTrace's hooks popped, which are pushed again after."""

    def __init__(self, owner: HooksOwner, disabled: contextlib.AbstractContextManager[None]) -> None:
        self._owner = owner
        self._disabled = disabled

    def __enter__(self) -> None:
        self._owner.step_aside()
        try:
            self._disabled.__enter__()
        except BaseException:
            self._owner.step_back()
            raise

    def __exit__(self, *exc_info: Any) -> bool | None:
        try:
            return self._disabled.__exit__(*exc_info)
        finally:
            self._owner.step_back()


def hold() -> None:
    """Put the stand-in in place (if it is not already): an owner's hooks are pushed now."""
    global _holders, _replaced
    graph = torch.autograd.graph
    with _lock:
        if _holders == 0:
            current = graph.disable_saved_tensors_hooks
            if current is not disable_saved_tensors_hooks:
                _replaced = current
                graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks  # type: ignore[assignment]
        _holders += 1


def release() -> None:
    """An owner's hooks are popped: the last one to go puts torch's function back, unless someone else replaced the
    stand-in meanwhile (theirs is left in place)."""
    global _holders
    graph = torch.autograd.graph
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0 and graph.disable_saved_tensors_hooks is disable_saved_tensors_hooks:
            graph.disable_saved_tensors_hooks = _replaced  # type: ignore[assignment]
