"""Reductions (and the running sum ``cumsum``) and their gradient rules.

Every public reduction normalises ``axis`` to a sorted tuple of non-negative axes (or
None, for all axes), so a rule only has to put the reduced axes back (``_unreduce``) and broadcast.
Ties in ``max`` / ``min`` share the gradient evenly: each of k tied maxima gets g / k.
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from pargrad import memory
from pargrad.numpy_names import numpy_names
from pargrad.ops import large
from pargrad.ops.core import (
    Op,
    array_of,
    defop,
    implements,
    ndim_of,
    normalize_axes,
    normalize_axis,
)
from pargrad.ops.shape import reshape
from pargrad.replay import recorder
from pargrad.tensor import Tensor

Axis = tuple[int, ...] | None


def _unreduce(g: Any, axis: Axis, keepdims: bool) -> Any:
    """Give a reduced value back the reduced axes (as size 1), so it broadcasts to the input."""
    return g if axis is None or keepdims else np.expand_dims(g, axis)


def _spread(g: Any, shape: tuple[int, ...]) -> Any:
    """``np.broadcast_to(g, shape)``: for a plain 0-d array of numbers (a full reduction's
    gradient) the same read-only view made directly, in a fifth of broadcast_to's time."""
    if type(g) is np.ndarray and g.ndim == 0 and g.dtype.kind in "fc":
        view = np.ndarray(shape, g.dtype, g, 0, (0,) * len(shape))
        view.flags.writeable = False
        return view
    return np.broadcast_to(g, shape)


def _count(shape: tuple[int, ...], axis: Axis) -> int:
    return math.prod(shape) if axis is None else math.prod(shape[a] for a in axis)


def _share_extremum(g: Any, ans: Any, x: Any, *, axis: Axis, keepdims: bool) -> Any:
    mask = x == _unreduce(ans, axis, keepdims)
    # One buffer besides the mask in the large form (pargrad/ops/large.py).
    if x.size >= large.OUT_MIN and large.plain(x, g, ans):
        out = large.fresh(np.multiply, _unreduce(g, axis, keepdims), mask)
        return np.divide(out, np.sum(mask, axis=axis, keepdims=True), out=out)
    return _unreduce(g, axis, keepdims) * mask / np.sum(mask, axis=axis, keepdims=True)


def _logsumexp(x: np.ndarray, *, axis: Axis, keepdims: bool) -> np.ndarray:
    shift = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    shift = np.where(np.isfinite(shift), shift, 0)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the right answer for empty sums
        out = np.log(np.sum(np.exp(x - shift), axis=axis, keepdims=True)) + shift
    return out if keepdims else np.squeeze(out, axis=axis)


def _prod_rule(g: Any, ans: Any, x: Any, *, axis: Axis, keepdims: bool) -> Any:
    # prod'(x_i) is the product of the other elements, also where x has zeros, written
    # without dividing by a zero: the nonzero elements' product times the zeros' (0 if
    # there are any, but a factor that create_graph differentiates). A zero element gets
    # the nonzeros' product if it is the only zero in its slice, else 0; its second
    # derivative with respect to another zero is then taken as 0 (it is the product of
    # the rest).
    zero = x == 0
    zeros = np.sum(zero, axis=axis, keepdims=True)
    nonzeros = np.prod(np.where(zero, 1, x), axis=axis, keepdims=True)
    of_zeros = np.prod(np.where(zero, x, 1), axis=axis, keepdims=True)
    return _unreduce(g, axis, keepdims) * np.where(
        zero, nonzeros * (zeros == 1), nonzeros * of_zeros / np.where(zero, 1, x))


def _logsumexp_rule(g: Any, ans: Any, x: Any, *, axis: Axis, keepdims: bool) -> Any:
    # The same steps in one buffer in the large form (pargrad/ops/large.py).
    if x.size >= large.OUT_MIN and large.plain(x, g, ans):
        out = large.fresh(np.subtract, x, _unreduce(ans, axis, keepdims))
        np.exp(out, out=out)
        return np.multiply(_unreduce(g, axis, keepdims), out, out=out)
    return _unreduce(g, axis, keepdims) * np.exp(x - _unreduce(ans, axis, keepdims))


def _cumsum_rule(g: Any, ans: Any, x: Any, *, axis: int) -> Any:
    # The gradient of a running sum is the running sum of g from the other end: the total
    # minus the running sum up to each element, plus that element's own g.
    if g.size >= large.OUT_MIN and large.plain(g) and g.dtype.isnative:
        out = np.cumsum(g, axis=axis, out=memory.empty(g.shape, g.dtype))
        np.subtract(np.sum(g, axis=axis, keepdims=True), out, out=out)
        return np.add(out, g, out=out)
    return np.sum(g, axis=axis, keepdims=True) - np.cumsum(g, axis=axis) + g


# ----- reductions -----
# Both rules return a read-only broadcast (mean's divides the reduced g first: the same
# bits, no pass over the input's shape); later rules fold it (pargrad/ops/large.py).
_sum = defop("sum", lambda x, *, axis, keepdims: np.sum(x, axis=axis, keepdims=keepdims),
             lambda g, ans, x, *, axis, keepdims: _spread(_unreduce(g, axis, keepdims), x.shape),
             needs_values=False)
_mean = defop("mean", lambda x, *, axis, keepdims: np.mean(x, axis=axis, keepdims=keepdims),
              lambda g, ans, x, *, axis, keepdims:
                  _spread(_unreduce(g, axis, keepdims) / (_count(x.shape, axis) or 1), x.shape),
              needs_values=False)
_max = defop("max", lambda x, *, axis, keepdims: np.max(x, axis=axis, keepdims=keepdims),
             _share_extremum)
_min = defop("min", lambda x, *, axis, keepdims: np.min(x, axis=axis, keepdims=keepdims),
             _share_extremum)
_prod = defop("prod", lambda x, *, axis, keepdims: np.prod(x, axis=axis, keepdims=keepdims),
              _prod_rule)
_logsumexp_op = defop("logsumexp", _logsumexp, _logsumexp_rule)

# ----- scans -----
_cumsum = defop("cumsum", lambda x, *, axis: np.cumsum(x, axis=axis), _cumsum_rule,
                needs_values=False)


def _reduction(op: Op, x: Any, axis: Any, keepdims: bool) -> Tensor:
    axes = None if axis is None else tuple(sorted(normalize_axes(axis, ndim_of(x), op.name)))
    return op(x, axis=axes, keepdims=bool(keepdims))


@implements(np.sum)
@numpy_names
def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis`` (an int, a tuple, or None for all axes), as ``np.sum``. Gradient:
    ``g`` broadcast back to every element.

    Raises ValueError/TypeError naming ``sum`` for a bad axis.

    >>> import numpy as np, pargrad
    >>> x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    >>> pargrad.sum(x, axis=1, keepdims=True).shape
    (2, 1)
    """
    return _reduction(_sum, x, axis, keepdims)


@implements(np.mean)
@numpy_names
def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over ``axis`` (all axes if None). Gradient: ``g / N`` to every
    element, N the number of elements reduced."""
    return _reduction(_mean, x, axis, keepdims)


@implements(np.max, np.amax)
@numpy_names
def max(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis``; tied maxima share the gradient evenly."""
    return _reduction(_max, x, axis, keepdims)


@implements(np.min, np.amin)
@numpy_names
def min(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Minimum over ``axis``; tied minima share the gradient evenly."""
    return _reduction(_min, x, axis, keepdims)


@numpy_names
def logsumexp(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(x), axis))``, computed without overflow. Gradient: ``g·softmax(x)``
    along ``axis``."""
    return _reduction(_logsumexp_op, x, axis, keepdims)


@implements(np.prod)
@numpy_names
def prod(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Product over ``axis`` (all axes if None). The gradient of each element is the
    product of the others, zeros included (no division by ``x``)."""
    return _reduction(_prod, x, axis, keepdims)


@implements(np.var)
@numpy_names
def var(x: Any, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Variance over ``axis``: ``sum((x - mean(x))**2) / (N - ddof)``, as ``np.var``
    (``ddof=1`` for the unbiased estimate; torch's default is ``ddof=1``). Built from
    ``mean``, ``subtract`` and ``sum``, whose gradients it takes:
    ``x̄ = 2·g·(x - mean(x)) / (N - ddof)``."""
    centred = x - mean(x, axis=axis, keepdims=True)
    n = _count(np.shape(array_of(x)), None if axis is None
               else normalize_axes(axis, ndim_of(x), "var"))
    return sum(centred * centred, axis=axis, keepdims=keepdims) / builtins.max(n - ddof, 0)


@implements(np.std)
@numpy_names
def std(x: Any, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Standard deviation over ``axis``, ``sqrt(var(x, axis, keepdims, ddof))``; its
    gradient is infinite or NaN where the variance is 0 (as sqrt's at 0)."""
    return np.sqrt(var(x, axis=axis, keepdims=keepdims, ddof=ddof))


# ----- indices (no gradient) -----
@implements(np.argmax)
@numpy_names
def argmax(x: Any, axis: int | None = None, keepdims: bool = False) -> Any:
    """Indices of the maxima along ``axis`` (of the flattened ``x`` if None), as
    ``np.argmax`` returns them: an integer or an integer array, never a Tensor (indices
    have no gradient)."""
    if recorder.active:
        recorder.fail("argmax reads a tensor's values back into numpy")
    return np.argmax(array_of(x), axis=axis, keepdims=keepdims)


@implements(np.argmin)
@numpy_names
def argmin(x: Any, axis: int | None = None, keepdims: bool = False) -> Any:
    """Indices of the minima along ``axis``, as ``argmax`` (no gradient)."""
    if recorder.active:
        recorder.fail("argmin reads a tensor's values back into numpy")
    return np.argmin(array_of(x), axis=axis, keepdims=keepdims)


@implements(np.cumsum)
@numpy_names
def cumsum(x: Any, axis: int | None = None) -> Tensor:
    """Running sum along ``axis`` (over the flattened ``x`` if None), as ``np.cumsum``.
    Gradient: the running sum of ``g`` from the other end."""
    if axis is None:
        return _cumsum(reshape(x, -1), axis=0)
    return _cumsum(x, axis=normalize_axis(axis, ndim_of(x), "cumsum"))
