"""In-place operations: ``x.add_(y)`` and ``x += y``, ``x.exp_()`` and the other unary
ones, ``x[index] = v``, ``fill_``, ``zero_``.

Each writes into the tensor's memory and bumps its version counter, so a node that saved
the tensor for its backward refuses to run on the changed values (pargrad/versions.py).

Where a graph is being recorded (grad mode on, and the tensor or the value requires
grad) the change is differentiable, as in PyTorch: the op runs out of place on a stand-in
that carries the tensor's old history (and a copy of its old values, if the op's rules
read them), the result is written into the tensor's memory, and the tensor takes the
op's node as its ``grad_fn``. A view (pargrad/views.py) passes the change on to its
base: the base takes a ``CopySlicesBackward`` node (its old value, with the view's
region replaced by the result), and the view is made again from the new base.

Refused while recording, with a clear error: a leaf that requires grad, or a view of one
(its ``.grad`` would no longer be the gradient of what the graph read), and a custom
Function's output that shares an input's memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import common_device
from pargrad.grad_mode import enable_grad, is_grad_enabled
from pargrad.ops.core import Op, array_of, defop
from pargrad.ops.elementwise import astype
from pargrad.ops.shape import _normalize_index
from pargrad.tensor import Tensor
from pargrad.versions import VersionCounter, counter_of
from pargrad.views import Step, refresh, replay, replay_array


def _put(x: np.ndarray, value: Any, *, index: tuple[Any, ...]) -> np.ndarray:
    out = np.array(x, copy=True)
    out[index] = value
    return out


def _zero_at(g: Any, index: tuple[Any, ...]) -> Any:
    """``g`` with zeros where ``index`` wrote: the elements the old tensor lost."""
    if isinstance(g, Tensor):
        return _setitem(g, np.zeros((), g.dtype), index=index)
    return _put(g, 0, index=index)


def _value_grad(g: Any, value: Any, index: tuple[Any, ...]) -> Any:
    """The gradient of the value assigned by ``x[index] = value``: ``g[index]``, given the
    value's leading axes of length one that numpy drops when it assigns (Node.apply then
    sums away the axes the value was broadcast along)."""
    region = g[index]
    shape = tuple(region.shape)
    extra = len(value.shape) - len(shape)
    return np.reshape(region, (1,) * extra + shape) if extra > 0 else region


# x[index] = value, out of place.
_setitem = defop("setitem", _put,
                 lambda g, ans, x, value, *, index: _zero_at(g, index),
                 lambda g, ans, x, value, *, index: _value_grad(g, value, index),
                 needs_values=False)


def _copy_slices_forward(base: np.ndarray, value: Any, *, chain: tuple[Step, ...]) -> np.ndarray:
    out = np.array(base, copy=True)
    replay_array(out, chain)[...] = value
    return out


def _zero_view_region(g: Any, chain: tuple[Step, ...]) -> Any:
    """``g`` with zeros in the view's region: what the base kept of its old value."""
    if isinstance(g, Tensor):
        mask = np.ones(g.shape, g.dtype)
        replay_array(mask, chain)[...] = 0
        return g * mask
    out = np.array(g, copy=True)
    replay_array(out, chain)[...] = 0
    return out


def _view_region(g: Any, chain: tuple[Step, ...]) -> Any:
    """The view's region of ``g``: the gradient of the view's new value."""
    return replay(g, chain) if isinstance(g, Tensor) else np.array(replay_array(g, chain))


# The base of a view after the view was changed in place: the old base, with the view's
# region (reached from the base by the view ops of ``chain``) replaced by the new value.
_copy_slices = defop("copy_slices", _copy_slices_forward,
                     lambda g, ans, base, value, *, chain: _zero_view_region(g, chain),
                     lambda g, ans, base, value, *, chain: _view_region(g, chain),
                     needs_values=False)


def update(t: Tensor, name: str, op: Any, other: Any) -> Tensor:
    """``t <- op(t, other)`` in ``t``'s memory (``add_``, ``+=``...); returns ``t``.

    Raises ValueError if the result does not have ``t``'s shape, TypeError if it cannot
    be cast to ``t``'s dtype (``same_kind``), RuntimeError where a recorded change is
    refused (module docstring); ``t`` is unchanged then.
    """
    if not _records(t, other):
        _write(t, _fitted(t, op(t, other), name).data, name)
        return t
    check_recordable(t, name)
    source = _standin(t, copy=_reads_old_value(op, t, other))
    _commit(t, op(source, source if other is t else other), name)
    return t


def update_unary(t: Tensor, name: str, op: Any) -> Tensor:
    """``t <- op(t)`` in ``t``'s memory (``exp_``, ``relu_``...); returns ``t``. Raises
    as ``update``."""
    return update(t, name, _Unary(op), None)


class _Unary:
    """A unary op called as ``update`` calls binary ones: ``op(t, None)``."""

    __slots__ = ("op",)

    def __init__(self, op: Any) -> None:
        self.op = op

    def __call__(self, t: Any, _: None) -> Any:
        return self.op(t)


def _reads_old_value(op: Any, t: Tensor, other: Any) -> bool:
    """Whether the node of ``op(t, other)`` reads ``t``'s values (then the stand-in needs
    a copy of them, since ``t``'s memory is about to change)."""
    if not isinstance(op, Op):
        return True
    if not op.needs_values:
        return False
    live = int(t.grad_fn is not None) | int(isinstance(other, Tensor) and other.requires_grad) << 1
    read = op.plan(live).args
    return read is None or 0 in read


def setitem(t: Tensor, index: Any, value: Any, name: str) -> None:
    """``t[index] = value`` in ``t``'s memory, with numpy's indexing and casting."""
    if name == "fill_" and np.size(array_of(value)) != 1:
        raise ValueError(f"fill_: the value must be a number or a tensor with one element, "
                         f"got shape {np.shape(array_of(value))}; use x[...] = value")
    index = _normalize_index(index)
    if _records(t, value):
        check_recordable(t, name)
        _commit(t, _setitem(_standin(t, copy=False), value, index=index), name)
        return
    common_device((t, value), name)
    _check_writeable(t, name)
    try:
        t.data[index] = array_of(value)
    except (ValueError, IndexError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc} (tensor of shape {t.shape} and dtype "
                        f"{t.dtype})") from exc
    counter_of(t).bump()


def _records(t: Tensor, other: Any) -> bool:
    """Whether changing ``t`` is recorded: grad mode is on, and ``t`` (or the base it
    views, even through a view made under no_grad) or the value requires grad."""
    return is_grad_enabled() and (
        t.requires_grad or (t._view is not None and t._view.base.requires_grad)
        or (isinstance(other, Tensor) and other.requires_grad))


def check_recordable(t: Tensor, name: str) -> None:
    """Raise RuntimeError if ``t`` may not be changed in place while recording a graph."""
    view = t._view
    base = t if view is None else view.base
    if base.grad_fn is None and base._requires_grad:
        what = "a leaf tensor" if view is None else "a view of a leaf tensor"
        raise RuntimeError(
            f"{name}: {what} that requires grad cannot be changed in place while grad mode "
            f"is on; update it under pargrad.no_grad()"
        )
    if view is not None and view.chain is None:
        raise RuntimeError(
            f"{name}: this tensor is an output of a custom Function that shares the memory "
            f"of an input, and cannot be changed in place while a graph is recorded; change "
            f"a .copy() of it, or do it under pargrad.no_grad()"
        )
    # A view made under no_grad has no history of its base: make it (and a stale one).
    refresh(t, force=not t._requires_grad and base._requires_grad)


def _standin(t: Tensor, copy: bool) -> Tensor:
    """A tensor with ``t``'s old history, and its old values if ``copy``.

    For a view, that history is made again from its base: the change then reaches the
    base's old history through a node of its own, not through the view's ``grad_fn``,
    whose hooks (they saw the gradient of the view's old value) are left out of the new
    graph, as in PyTorch.
    """
    array = t.data.copy() if copy else t.data
    view = t._view
    if view is not None and view.chain is not None and t.grad_fn is not None:
        with enable_grad():
            fresh = replay(_standin(view.base, copy=False), view.chain)
        standin = Tensor._make(array, fresh.grad_fn, fresh.output_nr, t.device)
    else:
        standin = Tensor._make(array, t.grad_fn, t.output_nr, t.device)
    # Its own memory, its own counter; else ``t``'s (not one found from the history).
    standin._counter = VersionCounter() if copy else counter_of(t)
    return standin


def _fitted(t: Tensor, result: Tensor, name: str) -> Tensor:
    """``result`` checked to fit ``t`` in place, cast to ``t``'s dtype (recorded)."""
    if result.shape != t.shape:
        raise ValueError(f"{name}: cannot update a tensor of shape {t.shape} in place with a "
                         f"result of shape {result.shape}")
    if result.dtype != t.dtype:
        if not np.can_cast(result.dtype, t.dtype, "same_kind"):
            raise TypeError(f"{name}: cannot update a {t.dtype} tensor in place with a "
                            f"{result.dtype} result")
        result = astype(result, t.dtype)
    return result


def _check_writeable(t: Tensor, name: str) -> None:
    if not t.data.flags.writeable:
        raise ValueError(f"{name}: this tensor's memory is read-only (a broadcast_to view, "
                         f"or an array made read-only); change a .copy() instead")


def _write(t: Tensor, value: np.ndarray, name: str) -> None:
    """Write ``value`` (``t``'s shape and dtype) into ``t``'s memory; bump its version."""
    _check_writeable(t, name)
    np.copyto(t.data, value)
    counter_of(t).bump()


def _commit(t: Tensor, result: Tensor, name: str) -> None:
    """Write the recorded ``result`` into ``t``'s memory and give ``t`` its history (a
    view: give its base the history of the change, then remake the view from it)."""
    result = _fitted(t, result, name)
    view = t._view  # a Function's output (no chain) was refused by check_recordable
    if view is None:
        _write(t, result.data, name)
        t._rebase(result.grad_fn, result.output_nr)
        return
    _write(t, result.data, name)  # the view's region of the base: all that changes
    rebase_view(t, result)


def rebase_view(t: Tensor, result: Tensor) -> None:
    """Give the base of the view ``t``, whose memory already holds ``result``, the
    history of that change (``CopySlicesBackward``), then remake ``t`` from it."""
    view = t._view
    assert view is not None and view.chain is not None  # (check_recordable refused others)
    new_base = _copy_slices(_standin(view.base, copy=False), result, chain=view.chain)
    view.base._rebase(new_base.grad_fn, new_base.output_nr)
    refresh(t)
