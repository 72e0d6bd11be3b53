"""Neural-network ops: softmax and log_softmax along one axis, numerically stable."""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.numpy_names import numpy_names
from pargrad.ops import fused, large
from pargrad.ops.core import defop, ndim_of, normalize_axis
from pargrad.ops.reductions import _logsumexp
from pargrad.tensor import Tensor


def _softmax(x: np.ndarray, *, axis: int) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, *, axis: int) -> np.ndarray:
    return x - _logsumexp(x, axis=(axis,), keepdims=True)


def _softmax_rule(g: Any, ans: Any, x: Any, *, axis: int) -> Any:
    # Fused (pargrad/ops/fused.py), or the same steps in one buffer (pargrad/ops/large.py).
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        if (out := fused.rows("softmax_backward", g, ans, axis)) is not None:
            return out
        out = large.fresh(np.multiply, g, ans)
        total = np.sum(out, axis=axis, keepdims=True)
        np.subtract(g, total, out=out)
        return np.multiply(ans, out, out=out)
    return ans * (g - np.sum(g * ans, axis=axis, keepdims=True))


def _log_softmax_rule(g: Any, ans: Any, x: Any, *, axis: int) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        if (out := fused.rows("log_softmax_backward", g, ans, axis)) is not None:
            return out
        total = np.sum(g, axis=axis, keepdims=True)
        out = large.fresh(np.exp, ans)
        np.multiply(out, total, out=out)
        return np.subtract(g, out, out=out)
    return g - np.exp(ans) * np.sum(g, axis=axis, keepdims=True)


# ----- normalisers -----
_softmax_op = defop("softmax", _softmax, _softmax_rule)
_log_softmax_op = defop("log_softmax", _log_softmax, _log_softmax_rule)


@numpy_names
def softmax(x: Any, axis: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x), axis)``, shifted by the maximum so it never overflows.
    Gradient: ``ans·(g - sum(g·ans, axis))``.

    >>> import pargrad
    >>> pargrad.softmax(pargrad.tensor([0.0, 1000.0]))
    tensor([0., 1.], dtype=float64)
    """
    return _softmax_op(x, axis=normalize_axis(axis, ndim_of(x), "softmax"))


@numpy_names
def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """``x - logsumexp(x, axis)``: the log of ``softmax`` without its underflow.
    Gradient: ``g - softmax(x)·sum(g, axis)``."""
    return _log_softmax_op(x, axis=normalize_axis(axis, ndim_of(x), "log_softmax"))
