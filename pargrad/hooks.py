"""Hooks: user functions that see, and may replace, gradients during a backward.

Where hooks live (as in PyTorch):
- a tensor's hooks (``Tensor.register_hook``) on the node that receives its gradient:
  its ``grad_fn`` for a non-leaf (one list per output), its ``AccumulateGrad`` for a leaf
  (the leaf and its accumulator share one ``NodeHooks``);
- ``Tensor.retain_grad`` marks a non-leaf output whose gradient the backward keeps;
- a node's pre-hooks and (post-)hooks (``Node.register_prehook`` / ``register_hook``);
- a leaf's post-accumulate-grad hooks, called after its ``.grad`` was updated;
- ``register_multi_grad_hook``: one function for the gradients of several tensors.

For one node, they fire in this order: tensor hooks (output by output, each in
registration order), then the gradient is kept for ``retain_grad`` / ``pargrad.grad``,
then pre-hooks, the node's backward, and post-hooks.

A post-accumulate-grad hook that takes its leaf's final gradient for itself (it uses
it during the backward, or replaces it after) says so with an attribute
``takes_final_grad``: a sentence saying what it does with it. Two such hooks on one
leaf would each see the gradient before the other is done with it (an optimizer's
update during backward, ``Optimizer.step_in_backward``, would use the local gradient
that ``DataParallel`` averages across ranks only after the backward), so registering a
second raises RuntimeError naming both, and registers nothing.

Thread-safety: registering and removing hooks is thread-safe, even while a backward
runs: writers replace a field's tuple (or dict) under ``_lock``, and a backward reads each
field once, so it sees the hooks as they were at some moment, never a half-written list.
Hooks themselves run on whichever thread runs their node (docs/autograd.md).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pargrad import callbacks

if TYPE_CHECKING:
    from pargrad.tensor import Tensor

Hook = Callable[..., Any]

# Guards the writers of every NodeHooks field, and _ids. Readers take no lock (above).
_lock = threading.Lock()
_ids = itertools.count()


class NodeHooks:
    """The hooks of one node (and, for an ``AccumulateGrad``, of its leaf)."""

    __slots__ = ("post", "post_accumulate", "pre", "retains", "tensor")

    def __init__(self) -> None:
        # Each field is replaced, never changed in place; entries are (id, hook).
        self.tensor: dict[int, tuple[tuple[int, Hook], ...]] = {}  # by output_nr
        self.retains: dict[int, weakref.ref[Tensor]] = {}  # output_nr -> tensor
        self.pre: tuple[tuple[int, Hook], ...] = ()
        self.post: tuple[tuple[int, Hook], ...] = ()
        self.post_accumulate: tuple[tuple[int, Hook], ...] = ()

    def add(self, field: str, hook: Hook, output_nr: int = 0) -> RemovableHandle:
        """Register ``hook`` in ``field`` (for ``tensor``: on ``output_nr``)."""
        if not callable(hook):
            raise TypeError(f"a hook must be callable, got {type(hook).__name__}")
        with _lock:
            if field == "post_accumulate":
                _check_one_taker(self.post_accumulate, hook)
            hid = next(_ids)
            if field == "tensor":
                tensor = dict(self.tensor)
                tensor[output_nr] = (*tensor.get(output_nr, ()), (hid, hook))
                self.tensor = tensor
            else:
                setattr(self, field, (*getattr(self, field), (hid, hook)))
        return RemovableHandle(self, field, hid)

    def retain(self, output_nr: int, tensor: Tensor) -> None:
        with _lock:
            self.retains = {**self.retains, output_nr: weakref.ref(tensor)}

    def release(self, output_nr: int) -> None:
        """Undo ``retain`` for ``output_nr``."""
        with _lock:
            self.retains = {nr: ref for nr, ref in self.retains.items() if nr != output_nr}

    def _remove(self, field: str, hid: int) -> None:
        with _lock:
            if field == "tensor":
                self.tensor = {nr: kept for nr, hooks in self.tensor.items()
                               if (kept := tuple(h for h in hooks if h[0] != hid))}
            else:
                setattr(self, field, tuple(h for h in getattr(self, field) if h[0] != hid))


def _check_one_taker(registered: tuple[tuple[int, Hook], ...], hook: Hook) -> None:
    """Raise RuntimeError if ``hook`` and one of the ``registered`` post-accumulate-grad
    hooks both take the leaf's final gradient (module docstring)."""
    mine = getattr(hook, "takes_final_grad", None)
    if mine is None:
        return
    for _, other in registered:
        theirs = getattr(other, "takes_final_grad", None)
        if theirs is not None:
            raise RuntimeError(
                f"two post-accumulate-grad hooks on one tensor would each act on its final "
                f"gradient, and they do not combine: {theirs}, and {mine}. Remove one first "
                f"(its handle's remove())")


class RemovableHandle:
    """What registering a hook returns: ``handle.remove()`` unregisters it (idempotent).

    Also a context manager that removes the hook on exit.
    """

    __slots__ = ("_field", "_hooks", "id")

    def __init__(self, hooks: NodeHooks, field: str, hid: int) -> None:
        self._hooks: NodeHooks | None = hooks
        self._field = field
        self.id = hid

    def remove(self) -> None:
        """Unregister the hook; later backward calls do not call it."""
        if self._hooks is not None:
            self._hooks._remove(self._field, self.id)
            self._hooks = None

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


# Its branches are those of the hook closure it makes (one per mode), counted with it.
def register_multi_grad_hook(tensors: Sequence[Tensor], fn: Hook, *,  # noqa: C901
                             mode: str = "all") -> MultiHandle:
    """Call ``fn`` once per backward with the gradients of several ``tensors``.

    ``mode="all"``: ``fn(grads)`` with one entry per tensor (None for those that got no
    gradient in that backward), once the backward has computed them all; it runs at the
    end of that backward (``queue_callback``), before ``.grad`` is committed: PyTorch
    calls it as soon as the last of them is ready. ``mode="any"``: ``fn(grad)`` with
    the first of them computed in each backward. Each backward (also when several run
    at once on different threads) calls ``fn`` at most once; a backward that fails does
    not call it in mode "all". Returns a handle whose ``remove()`` unregisters it.

    >>> import pargrad
    >>> a = pargrad.tensor(1.0, requires_grad=True)
    >>> b = pargrad.tensor(2.0, requires_grad=True)
    >>> seen = []
    >>> handle = pargrad.register_multi_grad_hook(
    ...     (a, b), lambda grads: seen.append([g is not None for g in grads]))
    >>> (a * 3).backward()
    >>> seen
    [[True, False]]
    """
    if mode not in ("all", "any"):
        raise ValueError(f"register_multi_grad_hook: mode must be 'all' or 'any', got {mode!r}")
    if not callable(fn):
        raise TypeError(f"a hook must be callable, got {type(fn).__name__}")
    count = len(tensors)
    # Guards calls: per backward (its Callbacks, dropped with it), the gradients seen
    # so far (mode "all") or that fn has run (mode "any").
    lock = threading.Lock()
    calls: weakref.WeakKeyDictionary[callbacks.Callbacks, list[Any]] = (
        weakref.WeakKeyDictionary())

    def seen(i: int, grad: Any) -> None:
        backward = callbacks.current()
        if backward is None:  # not inside a backward: cannot happen for a tensor hook
            raise RuntimeError("register_multi_grad_hook: a hook ran outside a backward")
        with lock:
            first = backward not in calls
            if first:
                calls[backward] = [None] * count
            if mode == "all":
                calls[backward][i] = grad
        if mode == "any":
            if first:
                fn(grad)
        elif first:
            backward.queue(lambda: fn(tuple(_pop(calls, lock, backward))))

    def hook_for(i: int) -> Hook:
        return lambda grad: seen(i, grad)

    return MultiHandle([t.register_hook(hook_for(i)) for i, t in enumerate(tensors)])


def _pop(calls: weakref.WeakKeyDictionary[Any, list[Any]], lock: threading.Lock,
         key: Any) -> list[Any]:
    with lock:
        return calls.pop(key)


class MultiHandle:
    """What ``register_multi_grad_hook`` returns: ``remove()`` unregisters it."""

    __slots__ = ("_handles",)

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Unregister the hook from every tensor (idempotent)."""
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> MultiHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
