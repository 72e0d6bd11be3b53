"""Reductions and their gradient rules.

Every public reduction normalises ``axis`` to a sorted tuple of non-negative axes (or
None, for all axes), so a rule only has to put the reduced axes back (``_unreduce``) and broadcast.
Ties in ``max`` / ``min`` share the gradient evenly: each of k tied maxima gets g / k.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pargrad.ops.core import Op, defop, implements, ndim_of, normalize_axes
from pargrad.tensor import Tensor

Axis = tuple[int, ...] | None


def _unreduce(g: Any, axis: Axis, keepdims: bool) -> Any:
    """Give a reduced value back the reduced axes (as size 1), so it broadcasts to the input."""
    return g if axis is None or keepdims else np.expand_dims(g, axis)


def _count(shape: tuple[int, ...], axis: Axis) -> int:
    return math.prod(shape) if axis is None else math.prod(shape[a] for a in axis)


def _share_extremum(g: Any, ans: Any, x: Any, *, axis: Axis, keepdims: bool) -> Any:
    mask = x == _unreduce(ans, axis, keepdims)
    return _unreduce(g, axis, keepdims) * mask / np.sum(mask, axis=axis, keepdims=True)


def _logsumexp(x: np.ndarray, *, axis: Axis, keepdims: bool) -> np.ndarray:
    shift = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    shift = np.where(np.isfinite(shift), shift, 0)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the right answer for empty sums
        out = np.log(np.sum(np.exp(x - shift), axis=axis, keepdims=True)) + shift
    return out if keepdims else np.squeeze(out, axis=axis)


# ----- reductions -----
_sum = defop("sum", lambda x, *, axis, keepdims: np.sum(x, axis=axis, keepdims=keepdims),
             lambda g, ans, x, *, axis, keepdims:
                 np.broadcast_to(_unreduce(g, axis, keepdims), x.shape),
             needs_values=False)
_mean = defop("mean", lambda x, *, axis, keepdims: np.mean(x, axis=axis, keepdims=keepdims),
              lambda g, ans, x, *, axis, keepdims:
                  np.broadcast_to(_unreduce(g, axis, keepdims), x.shape)
                  / (_count(x.shape, axis) or 1),
              needs_values=False)
_max = defop("max", lambda x, *, axis, keepdims: np.max(x, axis=axis, keepdims=keepdims),
             _share_extremum)
_min = defop("min", lambda x, *, axis, keepdims: np.min(x, axis=axis, keepdims=keepdims),
             _share_extremum)
_logsumexp_op = defop("logsumexp", _logsumexp,
                      lambda g, ans, x, *, axis, keepdims:
                          _unreduce(g, axis, keepdims)
                          * np.exp(x - _unreduce(ans, axis, keepdims)))


def _reduction(op: Op, x: Any, axis: Any, keepdims: bool) -> Tensor:
    axes = None if axis is None else tuple(sorted(normalize_axes(axis, ndim_of(x), op.name)))
    return op(x, axis=axes, keepdims=bool(keepdims))


@implements(np.sum)
def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis`` (an int, a tuple, or None for all axes), as ``np.sum``.

    Raises ValueError/TypeError naming ``sum`` for a bad axis.

    >>> import numpy as np, pargrad
    >>> x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    >>> pargrad.sum(x, axis=1, keepdims=True).shape
    (2, 1)
    """
    return _reduction(_sum, x, axis, keepdims)


@implements(np.mean)
def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over ``axis`` (all axes if None)."""
    return _reduction(_mean, x, axis, keepdims)


@implements(np.max, np.amax)
def max(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis``; tied maxima share the gradient evenly."""
    return _reduction(_max, x, axis, keepdims)


@implements(np.min, np.amin)
def min(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Minimum over ``axis``; tied minima share the gradient evenly."""
    return _reduction(_min, x, axis, keepdims)


def logsumexp(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(x), axis))``, computed without overflow."""
    return _reduction(_logsumexp_op, x, axis, keepdims)
