"""In-place operations: ``x.add_(y)`` and ``x += y``, ``x[index] = v``, ``fill_``, ``zero_``.

Each writes into the tensor's memory and bumps its version counter, so a node that saved
the tensor for its backward refuses to run on the changed values (pargrad/versions.py).

Where a graph is being recorded (grad mode on, and the tensor or the value requires
grad) the change is differentiable, as in PyTorch: the op runs out of place on a stand-in
that carries the tensor's old history (and a copy of its old values, if the op's rules
read them), the result is written into the tensor's memory, and the tensor takes the
op's node as its ``grad_fn``. Refused while recording, with a clear error: a leaf that
requires grad (its ``.grad`` would no longer be the gradient of what the graph read),
and a view made by a view op (the tensor it views would not see the change in its
history; PyTorch rewrites the viewed tensor's history there, pargrad does not).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import common_device
from pargrad.grad_mode import is_grad_enabled
from pargrad.graph import Node
from pargrad.ops.core import array_of, defop
from pargrad.ops.elementwise import astype
from pargrad.ops.shape import _normalize_index
from pargrad.tensor import Tensor


def _put(x: np.ndarray, value: Any, *, index: tuple[Any, ...]) -> np.ndarray:
    out = np.array(x, copy=True)
    out[index] = value
    return out


def _zero_at(g: Any, index: tuple[Any, ...]) -> Any:
    """``g`` with zeros where ``index`` wrote: the elements the old tensor lost."""
    if isinstance(g, Tensor):
        return _setitem(g, np.zeros((), g.dtype), index=index)
    return _put(g, 0, index=index)


# x[index] = value, out of place. The value's gradient is g[index], summed back to its
# shape by Node.apply where the value was broadcast.
_setitem = defop("setitem", _put,
                 lambda g, ans, x, value, *, index: _zero_at(g, index),
                 lambda g, ans, x, value, *, index: g[index],
                 needs_values=False)


def update(t: Tensor, name: str, op: Any, other: Any) -> Tensor:
    """``t <- op(t, other)`` in ``t``'s memory (``add_``, ``+=``...); returns ``t``.

    Raises ValueError if the result does not have ``t``'s shape, TypeError if it cannot
    be cast to ``t``'s dtype (``same_kind``), RuntimeError where a recorded change is
    refused (module docstring); ``t`` is unchanged then.
    """
    records = _records(t, other)
    source = t
    if records:
        check_recordable(t, name)
        source = _standin(t, copy=getattr(op, "needs_values", True))
        if other is t:
            other = source
    result = op(source, other)
    _write(t, result, name, records)
    return t


def setitem(t: Tensor, index: Any, value: Any, name: str) -> None:
    """``t[index] = value`` in ``t``'s memory, with numpy's indexing and casting."""
    index = _normalize_index(index)
    if _records(t, value):
        check_recordable(t, name)
        _write(t, _setitem(_standin(t, copy=False), value, index=index), name, True)
        return
    common_device((t, value), name)
    try:
        t.data[index] = array_of(value)
    except (ValueError, IndexError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc} (tensor of shape {t.shape} and dtype "
                        f"{t.dtype})") from exc
    t._counter.bump()


def _records(t: Tensor, other: Any) -> bool:
    return is_grad_enabled() and (
        t._requires_grad or (isinstance(other, Tensor) and other._requires_grad))


def check_recordable(t: Tensor, name: str) -> None:
    """Raise RuntimeError if ``t`` may not be changed in place while recording a graph."""
    if t.grad_fn is None and t._requires_grad:
        raise RuntimeError(
            f"{name}: a leaf tensor that requires grad cannot be changed in place while "
            f"grad mode is on; update it under pargrad.no_grad()"
        )
    if t._is_view:
        raise RuntimeError(
            f"{name}: this tensor is a view of another tensor's memory (made by reshape, "
            f"indexing, transpose...), and changing a view in place while recording a graph "
            f"is not supported: the tensor it views would not see the change in its "
            f"history. Change that tensor instead (base[index] = value), or a .copy() of "
            f"the view, or do it under pargrad.no_grad()"
        )


def _standin(t: Tensor, copy: bool) -> Tensor:
    """A tensor with ``t``'s old history, and its old values if ``copy``."""
    return Tensor._make(t.data.copy() if copy else t.data, t.grad_fn, t.output_nr, t.device)


def _write(t: Tensor, result: Tensor, name: str, records: bool) -> None:
    value = result.data
    if value.shape != t.shape:
        raise ValueError(f"{name}: cannot update a tensor of shape {t.shape} in place with a "
                         f"result of shape {value.shape}")
    if value.dtype != t.dtype:
        if not np.can_cast(value.dtype, t.dtype, "same_kind"):
            raise TypeError(f"{name}: cannot update a {t.dtype} tensor in place with a "
                            f"{value.dtype} result")
        if records:
            result = astype(result, t.dtype)
    if not t.data.flags.writeable:
        raise ValueError(f"{name}: this tensor's memory is read-only (a broadcast_to view, "
                         f"or an array made read-only); change a .copy() instead")
    np.copyto(t.data, value, casting="same_kind")
    t._counter.bump()
    if records:
        rebase(t, result.grad_fn, result.output_nr)


def rebase(t: Tensor, grad_fn: Node | None, output_nr: int) -> None:
    """Give ``t`` the history ``(grad_fn, output_nr)``; a ``retain_grad`` mark moves
    along (tensor hooks stay where they were: they see the gradient of the old value, as
    in PyTorch)."""
    old, old_nr = t.grad_fn, t.output_nr
    t.grad_fn, t.output_nr = grad_fn, output_nr
    t._requires_grad = grad_fn is not None
    hooks = None if old is None else old._hooks
    if hooks is not None and old_nr in hooks.retains and grad_fn is not None:
        hooks.release(old_nr)
        grad_fn._hooks_made().retain(output_nr, t)
