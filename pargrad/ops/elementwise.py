"""Elementwise ops and their gradient rules: ``rule(g, ans, *args)``, one per argument.

Broadcasting needs no care here: ``Node.apply`` sums each gradient back to its input's
shape and casts it to its input's dtype.

``cut=`` marks the forwards and rules that cost enough per element (transcendental
functions, several divisions) to run in chunks on idle threads when their arrays are
large (pargrad/parallel.py); arithmetic that only streams memory stays whole (measured
in docs/performance.md, "Intra-op parallelism").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import CPU, Device, device
from pargrad.ops import fused, large
from pargrad.ops.core import Op, defop, implements, nondifferentiable
from pargrad.tensor import Tensor

# Rules with several operators also have a one-buffer form for large arrays
# (pargrad/ops/large.py): the same arithmetic in the same order, so the same bits, except
# where a rule's comment says otherwise; tanh, sigmoid and relu first try their fused
# kernel (pargrad/ops/fused.py, with numba), which also gives the same bits.

def elementwise_op(name: str, forward: Any, *rules: Any, cut: tuple[str | int, ...] = (),
                   **options: Any) -> Op:
    """``defop`` for an op of this module: its rules named in ``cut`` (those that cost
    enough per element) are cut into chunks on large arrays whenever idle threads may
    help, every other rule while a thread is idle to help now (``"rules"``); ``cut``
    may name the forward too."""
    return defop(name, forward, *rules, cut=("rules", *cut), **options)


# ----- arithmetic -----
add = elementwise_op("add", np.add,
                     lambda g, ans, x, y: g,
                     lambda g, ans, x, y: g, needs_values=False)
subtract = elementwise_op("subtract", np.subtract,
                          lambda g, ans, x, y: g,
                          lambda g, ans, x, y: large.neg(g), needs_values=False)


def _times(g: Any, other: Any) -> Any:
    # A broadcast of one value (a sum's gradient) times a scalar stays a broadcast: the
    # same bits as g * other, without a pass over the array.
    if g.size >= large.OUT_MIN and type(g) is np.ndarray:
        if large.scalar(other) and (value := large.uniform(g)) is not None:
            return np.broadcast_to(value * other, g.shape)
        return large.fresh(np.multiply, g, other)
    return g * other


multiply = elementwise_op("multiply", np.multiply,
                          lambda g, ans, x, y: _times(g, y),
                          lambda g, ans, x, y: _times(g, x))


def _divide_divisor_rule(g: Any, ans: Any, x: Any, y: Any) -> Any:
    # Reads no ans: x /= y stays legal. Two buffers in the large form (y * y has y's shape).
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(np.negative, g)
        np.multiply(out, x, out=out)
        return np.divide(out, y * y, out=out)
    return -g * x / (y * y)


divide = elementwise_op("divide", np.divide,
                        lambda g, ans, x, y: large.over(g, y),
                        _divide_divisor_rule, cut=(1,))
negative = elementwise_op("negative", np.negative,
                          lambda g, ans, x: large.neg(g), needs_values=False)


def _power_base_rule(g: Any, ans: Any, x: Any, y: Any) -> Any:
    # d(x**y)/dx is 0 wherever y == 0, even at x == 0 (where y * x**(y-1) would be nan).
    if isinstance(y, (int, float)):
        return g * 0 if y == 0 else g * y * x ** (y - 1)
    return np.where(y == 0, 0, g * y * x ** np.where(y == 0, 1, y - 1))


# d(x**y)/dy takes log(x) as 0 at x == 0, so 0**y (y > 0) has gradient 0 in y.
power = elementwise_op("power", np.power,
                       _power_base_rule,
                       lambda g, ans, x, y: g * ans * np.log(np.where(x == 0, 1, x)),
                       cut=("forward", 0, 1))

# ----- exponentials and powers -----
def _sqrt_rule(g: Any, ans: Any, x: Any) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        out = large.fresh(np.multiply, 2, ans)
        return np.divide(g, out, out=out)
    return g / (2 * ans)


def _square_rule(g: Any, ans: Any, x: Any) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(np.multiply, g, 2)
        return np.multiply(out, x, out=out)
    return g * 2 * x


def _log1p_rule(g: Any, ans: Any, x: Any) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(np.add, 1, x)
        return np.divide(g, out, out=out)
    return g / (1 + x)


def _expm1_rule(g: Any, ans: Any, x: Any) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        out = large.fresh(np.add, ans, 1)
        return np.multiply(g, out, out=out)
    return g * (ans + 1)


exp = elementwise_op("exp", np.exp, lambda g, ans, x: large.times(g, ans), cut=("forward",))
log = elementwise_op("log", np.log, lambda g, ans, x: large.over(g, x), cut=("forward",))
sqrt = elementwise_op("sqrt", np.sqrt, _sqrt_rule)
square = elementwise_op("square", np.square, _square_rule)
log1p = elementwise_op("log1p", np.log1p, _log1p_rule, cut=("forward",))
expm1 = elementwise_op("expm1", np.expm1, _expm1_rule, cut=("forward",))

# ----- piecewise -----
# abs'(0) is taken as 0, relu'(0) as 0. maximum/minimum split g evenly on ties.
def _g_times(f: Any, g: Any, x: Any) -> Any:
    """``g * f(x)``: in the one buffer ``f`` makes, on large plain arrays."""
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(f, x)
        return np.multiply(g, out, out=out)
    return g * f(x)


def _abs_rule(g: Any, ans: Any, x: Any) -> Any:
    return _g_times(np.sign, g, x)


def _relu_rule(g: Any, ans: Any, x: Any) -> Any:
    # The mask is a byte an element (writing it into the result as 1.0 / 0.0 first
    # measured slower).
    if g.size >= large.OUT_MIN and large.plain(g, x):
        if (out := fused.elementwise("relu_backward", g, x)) is not None:
            return out
        return large.fresh(np.multiply, g, large.mask(np.greater, x, 0))
    return g * (x > 0)


abs = elementwise_op("absolute", np.absolute, _abs_rule)


def _relu(x: Any) -> Any:
    if type(x) is np.ndarray and x.size >= large.OUT_MIN:
        return large.fresh(np.maximum, x, 0)
    return np.maximum(x, 0)


relu = elementwise_op("relu", _relu, _relu_rule,
                      doc="max(x, 0), elementwise; its gradient at 0 is taken as 0.")
maximum = elementwise_op("maximum", np.maximum,
                         lambda g, ans, x, y: np.where(x == y, g / 2, g * (x > y)),
                         lambda g, ans, x, y: np.where(x == y, g / 2, g * (y > x)))
minimum = elementwise_op("minimum", np.minimum,
                         lambda g, ans, x, y: np.where(x == y, g / 2, g * (x < y)),
                         lambda g, ans, x, y: np.where(x == y, g / 2, g * (y < x)))
# clip is min(max(x, lo), hi): the gradient goes to x where lo <= x <= hi, else to the
# bound that was used (hi wherever lo > hi, as numpy then returns hi).
_clip = elementwise_op("clip", np.clip,
                       lambda g, ans, x, lo, hi: large.times(g, np.logical_and(x >= lo, x <= hi)),
                       lambda g, ans, x, lo, hi: g * np.logical_and(x < lo, lo <= hi),
                       lambda g, ans, x, lo, hi: g * np.logical_or(x > hi, lo > hi))
_where = elementwise_op("where", np.where,
                        nondifferentiable,
                        lambda g, ans, c, x, y: np.where(c, g, 0),
                        lambda g, ans, c, x, y: np.where(c, 0, g))

# ----- trigonometric and hyperbolic -----
def _sin_rule(g: Any, ans: Any, x: Any) -> Any:
    return _g_times(np.cos, g, x)


def _cos_rule(g: Any, ans: Any, x: Any) -> Any:
    # -(g * s) is (-g) * s: negation is exact.
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(np.sin, x)
        np.multiply(g, out, out=out)
        return np.negative(out, out=out)
    return -(g * np.sin(x))


def _tanh_rule(g: Any, ans: Any, x: Any) -> Any:
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        if (out := fused.elementwise("tanh_backward", g, ans)) is not None:
            return out
        out = large.fresh(np.multiply, ans, ans)
        np.subtract(1, out, out=out)
        return large.times_into(g, out)
    return g * (1 - ans * ans)


def _sigmoid_rule(g: Any, ans: Any, x: Any) -> Any:
    # Both forms compute g * (ans * (1 - ans)) (the one buffer holds 1 - ans first).
    if g.size >= large.OUT_MIN and large.plain(g, ans):
        if (out := fused.elementwise("sigmoid_backward", g, ans)) is not None:
            return out
        out = large.fresh(np.subtract, 1, ans)
        np.multiply(ans, out, out=out)
        return large.times_into(g, out)
    return g * (ans * (1 - ans))


def _softplus_rule(g: Any, ans: Any, x: Any) -> Any:
    # softplus' = sigmoid, written as sigmoid's forward so that it dispatches on Tensors.
    # Halved last (0.5 * (g * s) is (0.5 * g) * s unless g * s is subnormal).
    if g.size >= large.OUT_MIN and large.plain(g, x):
        out = large.fresh(np.multiply, 0.5, x)
        np.tanh(out, out=out)
        np.add(1, out, out=out)
        np.multiply(g, out, out=out)
        return np.multiply(out, 0.5, out=out)
    return g * (1 + np.tanh(0.5 * x)) * 0.5


sin = elementwise_op("sin", np.sin, _sin_rule, cut=("forward", 0))
cos = elementwise_op("cos", np.cos, _cos_rule, cut=("forward", 0))
tanh = elementwise_op("tanh", np.tanh, _tanh_rule, cut=("forward",))


def _sigmoid(x: Any) -> Any:
    # 0.5 * (1 + tanh(x / 2)) is sigmoid without overflow for large |x|. Large: the same
    # steps in the one buffer of the result.
    if type(x) is np.ndarray and x.size >= large.OUT_MIN and x.dtype.kind == "f":
        out = large.fresh(np.multiply, 0.5, x)
        np.tanh(out, out=out)
        np.add(1, out, out=out)
        return np.multiply(0.5, out, out=out)
    return 0.5 * (1 + np.tanh(0.5 * x))


sigmoid = elementwise_op("sigmoid", _sigmoid, _sigmoid_rule,
                         cut=("forward",),
                         doc="1 / (1 + exp(-x)), elementwise, without overflow.")


def _softplus(x: Any) -> Any:
    if type(x) is np.ndarray and x.size >= large.OUT_MIN:
        return large.fresh(np.logaddexp, 0, x)
    return np.logaddexp(0, x)


softplus = elementwise_op("softplus", _softplus, _softplus_rule,
                          cut=("forward", 0),
                          doc="log(1 + exp(x)), elementwise, without overflow.")

# ----- copies and dtype -----
copy = elementwise_op("copy", lambda x: np.array(x, copy=True), lambda g, ans, x: g,
                      needs_values=False, doc="A copy with its own memory (differentiable).")
_astype = elementwise_op("astype", lambda x, *, dtype: x.astype(dtype),
                         lambda g, ans, x, *, dtype: g.astype(x.dtype), needs_values=False)

implements(np.copy)(copy)

# ----- devices -----
# The rule returns the gradient on the source device: a plain array needs no move, a
# Tensor (a backward recording its graph) moves back with a recorded copy.
_to = defop("to", lambda x, *, device, source: np.array(x, copy=True),
            lambda g, ans, x, *, device, source: to(g, source) if isinstance(g, Tensor) else g,
            needs_values=False, moves_device=True)


def to(x: Any, device_: str | Device) -> Tensor:
    """``x`` on ``device_``: ``x`` itself if it is a Tensor already there, else a copy there.

    Differentiable: the gradient of the copy flows back to ``x`` on ``x``'s device.
    Raises ValueError / TypeError for a device name that is not understood.
    """
    target = device_ if type(device_) is Device else device(device_)
    if isinstance(x, Tensor):
        source = x._device
        if source is target:
            return x
    else:
        source = CPU
    return _to(x, device=target, source=source)



@implements(np.clip)
def clip(x: Any, a_min: Any = None, a_max: Any = None) -> Tensor:
    """Limit ``x`` to ``[a_min, a_max]`` (either bound may be None, not both). Gradient: to
    ``x`` where ``a_min <= x <= a_max``, else to the bound that was used."""
    if a_min is None and a_max is None:
        raise ValueError("clip: one of a_min and a_max must be given")
    return _clip(x, -np.inf if a_min is None else a_min, np.inf if a_max is None else a_max)


@implements(np.where)
def where(condition: Any, x: Any, y: Any) -> Tensor:
    """``x`` where ``condition`` holds, else ``y``. Gradient: ``g`` to ``x`` where the
    condition holds, to ``y`` elsewhere; none to the condition."""
    return _where(condition, x, y)


def astype(x: Any, dtype: Any) -> Tensor:
    """Cast to ``dtype``; the gradient is cast back to the input's dtype."""
    return _astype(x, dtype=np.dtype(dtype))
