"""Updates during backward: ``Optimizer.step_in_backward`` puts on every parameter a
post-accumulate-grad hook that runs the optimizer's update of that parameter as soon as
its gradient is final, then frees the gradient (``.grad = None``).

Guarantees:
- Bit for bit what ``backward(); step(); zero_grad()`` gives: the hook runs the same
  ``Optimizer._update`` on the same ``.grad`` (final: every contribution of the backward
  added, and anything there before it), and when it runs every node of the backward
  that differentiates through the parameter has run already (docs/async.md).
- A backward that fails, or is cancelled, changes no parameter and no optimizer state.
  Before it changes anything, the hook copies the parameter's values and state and
  queues their restoration (``autograd.queue_undo``). The restoration also puts back
  the ``.grad`` the hook cleared, which the backward's own undo then sets to what it
  was before the backward. The parameter's version counter stays advanced: the update
  and the restoration are both in-place writes.
- Hooks of different parameters may run at once, on different engine threads: each
  changes only its own parameter, its own ``state`` entry, its own copy (``_Saved``)
  and its own ``.grad``, so no lock is needed (the ``state`` entry and the copy's
  holder exist before the backward starts).
- The copies are kept from one backward to the next while the handle is active, and
  dropped by ``remove()``: memory the size of the parameters and their state.
- A backward that would update a parameter while the undo of another backward that
  updated it may still run (that one has neither committed nor failed yet: two
  ``backward_async`` calls in flight at once) fails instead, with a RuntimeError from
  the hook, before it changes anything: its copy would overwrite the one the other's
  undo restores. The hook learns it from ``autograd.undo_may_run``, with no lock.
- An optimizer's update during backward and ``DataParallel`` do not combine (the
  update would use this rank's own gradient, before the average): whichever of
  ``step_in_backward()`` and ``DataParallel(...)`` comes second on a parameter raises
  RuntimeError (``takes_final_grad``, pargrad/hooks.py).

Assumptions: one backward at a time per optimizer while ``step_in_backward`` is on:
one that starts after another backward updated the same parameter fails as above,
but two whose hooks update one parameter at the very same moment race, as two
``step`` calls on two threads would. The optimizer's groups and options do not change
while a backward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from pargrad.autograd import queue_undo, undo_may_run
from pargrad.grad_mode import no_grad
from pargrad.hooks import RemovableHandle
from pargrad.tensor import Tensor

if TYPE_CHECKING:
    from pargrad.optim.optimizer import Group, Optimizer


class StepInBackward:
    """What ``Optimizer.step_in_backward()`` returns: the hooks that update the
    optimizer's parameters during backward. ``remove()`` unregisters them (idempotent);
    as a context manager it removes them when its block ends. Not thread-safe: make it
    and remove it on the thread that owns the optimizer, with no backward running.

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> w = pargrad.tensor([1.0], requires_grad=True)
    >>> opt = SGD([w], lr=0.5)
    >>> handle = opt.step_in_backward()
    >>> (w * 2).sum().backward()
    >>> handle.remove()
    >>> (w * 2).sum().backward()             # no longer updated: .grad is kept
    >>> w.data, w.grad
    (array([0.]), tensor([2.], dtype=float64))
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer: Optimizer | None = optimizer
        self._handles: list[RemovableHandle] = []
        try:
            for group in optimizer.param_groups:
                self.add(group)
        except BaseException:  # none of them, then
            self.remove()
            raise

    def add(self, group: Group) -> None:
        """Update the parameters of ``group`` (those that require grad) during backward.

        Raises RuntimeError, with none of the group's hooks registered, if a parameter
        has a hook that takes its final gradient already (``DataParallel``'s)."""
        optimizer = self._optimizer
        if optimizer is None:
            return
        added: list[RemovableHandle] = []
        try:
            for p in group["params"]:
                if p.requires_grad:
                    hook = _UpdateHook(optimizer, group, _Saved(p))
                    added.append(p.register_post_accumulate_grad_hook(hook))
        except BaseException:
            for handle in added:
                handle.remove()
            raise
        self._handles += added

    def remove(self) -> None:
        """Unregister the hooks: later backward calls leave ``.grad`` for ``step``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._optimizer is not None:
            self._optimizer._handle_removed(self)
            self._optimizer = None

    def __enter__(self) -> StepInBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _UpdateHook:
    """The post-accumulate-grad hook of one parameter: update it by its final
    ``.grad``, undoably; free the gradient."""

    __slots__ = ("group", "optimizer", "saved", "takes_final_grad")

    def __init__(self, optimizer: Optimizer, group: Group, saved: _Saved) -> None:
        self.optimizer, self.group, self.saved = optimizer, group, saved
        # (pargrad/hooks.py: no other hook may take this gradient too)
        self.takes_final_grad = (f"{type(optimizer).__name__}.step_in_backward() updates "
                                 f"the parameter with it as soon as it is final")

    def __call__(self, param: Tensor) -> None:
        grad = param.grad  # read without grad_lock, as any post-accumulate-grad hook may
        if grad is None:  # a hook registered before this one cleared it
            return
        saved, optimizer = self.saved, self.optimizer
        if saved.undo_pending():
            raise RuntimeError(
                f"{type(optimizer).__name__}.step_in_backward: a backward updates a "
                f"parameter (shape {param.shape}) that another backward updated and may "
                f"still undo (it has neither committed nor failed yet), which would then "
                f"restore the copy this backward takes instead of its own. Run one "
                f"backward at a time per optimizer: wait for the first (future.result()) "
                f"before starting the next")
        state = optimizer.state[param]
        saved.save(state)
        queue_undo(partial(saved.restore, grad, state))  # before anything changes
        saved.undo_pending = undo_may_run()
        with no_grad():
            optimizer._update(param, grad.data, self.group, state)
        param.grad = None


def _never() -> bool:
    return False


class _Saved:
    """A copy of one parameter's values and state, taken before each update during
    backward, and what puts them back if that backward fails: the values (an in-place
    write, so the version moves on), the state entry (the same dict, refilled), and the
    ``.grad`` the hook cleared.

    Its arrays are kept from one backward to the next and copied into, not made anew:
    fresh arrays of a parameter's size each step would cost their page faults every
    time (the allocator hands large blocks back to the system when they are freed).
    Only the hook of its parameter uses it, and the undo once that backward is over.
    ``undo_pending`` tells whether the undo of the last backward that saved into it may
    still run (what ``undo_may_run`` returned in that backward's hook; at first, never).
    It is read by the next backward's hook without a lock: one that runs at the very
    same moment may miss it (the race the module's Assumptions leave to the caller)."""

    __slots__ = ("param", "state", "undo_pending", "values")

    def __init__(self, param: Tensor) -> None:
        self.param = param
        self.values: np.ndarray | None = None
        self.state: dict[str, Any] = {}
        self.undo_pending: Callable[[], bool] = _never

    def save(self, state: dict[str, Any]) -> None:
        """Copy the parameter's values and ``state`` (its state entry)."""
        self.values = _copied_into(self.values, self.param.data)
        self.state = {key: _copied_into(self.state.get(key), value)
                      for key, value in state.items()}

    def restore(self, grad: Tensor, state: dict[str, Any]) -> None:
        """Put back what ``save`` copied, and ``grad`` as the parameter's ``.grad``."""
        with no_grad():
            self.param[...] = self.values
        state.clear()
        state.update(self.state)  # these arrays become the state's: copy anew next time
        self.state = {}
        self.param.grad = grad


def _copied_into(buffer: Any, value: Any) -> Any:
    """``value`` copied into ``buffer`` if that is an array of its shape and dtype, else
    into a new array (a value that is not an array as it is)."""
    if not isinstance(value, np.ndarray):
        return value
    if (isinstance(buffer, np.ndarray) and buffer.shape == value.shape
            and buffer.dtype == value.dtype):
        np.copyto(buffer, value)
        return buffer
    return value.copy()
