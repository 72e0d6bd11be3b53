"""The ops that are ``Op`` instances, as plain Python functions for ``pargrad``'s namespace.

An ``Op`` is called as ``op(*args, **params)``, so ``help()`` and ``inspect.signature`` on
one show its class. Each function here is a real ``def`` with the op's own parameters and
a docstring that says what it computes and its gradient rule (``g`` is the incoming
gradient, ``ans`` the output); it calls the op (``Op.call``) with exactly those
arguments, so it adds one Python call and nothing else (no ``*args`` repacking).
Tensor's operators and methods, and the gradient rules, call the ops themselves.

>>> import pargrad
>>> import inspect
>>> inspect.signature(pargrad.tanh)
<Signature (x)>
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pargrad.ops import elementwise as _e
from pargrad.ops import linalg as _l
from pargrad.ops.core import NO_PARAMS, Op
from pargrad.tensor import Tensor

Function = Callable[..., Tensor]


def _function(op: Op, parameters: str, doc: str) -> Function:
    """A function named after ``op`` that takes ``parameters`` (Python source, positional
    data arguments only) and calls ``op`` with them."""
    name = op.name if op.name != "absolute" else "abs"
    namespace: dict[str, Any] = {"_call": op.call, "_none": NO_PARAMS}
    exec(f"def {name}({parameters}):\n    return _call(({parameters},), _none)\n", namespace)
    function: Function = namespace[name]
    function.__doc__ = doc
    function.__module__ = "pargrad"
    return function


# ----- arithmetic -----
add = _function(_e.add, "x, y", "x + y, elementwise, with numpy's broadcasting (np.add).\n\n"
                "Gradient: x̄ = g, ȳ = g (summed back over broadcast axes).")
subtract = _function(_e.subtract, "x, y", "x - y, elementwise (np.subtract).\n\n"
                     "Gradient: x̄ = g, ȳ = -g.")
multiply = _function(_e.multiply, "x, y", "x * y, elementwise (np.multiply).\n\n"
                     "Gradient: x̄ = g·y, ȳ = g·x.")
divide = _function(_e.divide, "x, y", "x / y, elementwise (np.divide).\n\n"
                   "Gradient: x̄ = g/y, ȳ = -g·x/y².")
negative = _function(_e.negative, "x", "-x, elementwise (np.negative).\n\nGradient: x̄ = -g.")
power = _function(_e.power, "x, y", "x ** y, elementwise (np.power).\n\n"
                  "Gradient: x̄ = g·y·x^(y-1), taken as 0 wherever y == 0 (even at x == 0); "
                  "ȳ = g·ans·ln(x), with ln(0) taken as 0.")

# ----- exponentials and powers -----
exp = _function(_e.exp, "x", "e ** x, elementwise (np.exp).\n\nGradient: x̄ = g·ans.")
log = _function(_e.log, "x", "Natural logarithm, elementwise (np.log).\n\nGradient: x̄ = g/x.")
sqrt = _function(_e.sqrt, "x", "Square root, elementwise (np.sqrt).\n\n"
                 "Gradient: x̄ = g/(2·ans) (infinite at 0).")
square = _function(_e.square, "x", "x ** 2, elementwise (np.square).\n\nGradient: x̄ = 2·g·x.")
log1p = _function(_e.log1p, "x", "log(1 + x), elementwise, accurate for small x (np.log1p)."
                  "\n\nGradient: x̄ = g/(1 + x).")
expm1 = _function(_e.expm1, "x", "exp(x) - 1, elementwise, accurate for small x (np.expm1)."
                  "\n\nGradient: x̄ = g·(ans + 1).")

# ----- piecewise -----
abs = _function(_e.abs, "x", "|x|, elementwise (np.absolute).\n\n"
                "Gradient: x̄ = g·sign(x); abs'(0) is taken as 0.")
relu = _function(_e.relu, "x", "max(x, 0), elementwise.\n\n"
                 "Gradient: x̄ = g·[x > 0]; relu'(0) is taken as 0.")
maximum = _function(_e.maximum, "x, y", "The larger of x and y, elementwise (np.maximum).\n\n"
                    "Gradient: g goes to the larger; ties share it evenly (g/2 each).")
minimum = _function(_e.minimum, "x, y", "The smaller of x and y, elementwise (np.minimum).\n\n"
                    "Gradient: g goes to the smaller; ties share it evenly (g/2 each).")

# ----- trigonometric, hyperbolic, logistic -----
sin = _function(_e.sin, "x", "Sine, elementwise (np.sin).\n\nGradient: x̄ = g·cos(x).")
cos = _function(_e.cos, "x", "Cosine, elementwise (np.cos).\n\nGradient: x̄ = -g·sin(x).")
tanh = _function(_e.tanh, "x", "Hyperbolic tangent, elementwise (np.tanh).\n\n"
                 "Gradient: x̄ = g·(1 - ans²).")
sigmoid = _function(_e.sigmoid, "x", "1 / (1 + exp(-x)), elementwise, without overflow.\n\n"
                    "Gradient: x̄ = g·ans·(1 - ans).")
softplus = _function(_e.softplus, "x", "log(1 + exp(x)), elementwise, without overflow.\n\n"
                     "Gradient: x̄ = g·sigmoid(x).")

# ----- copies and products -----
copy = _function(_e.copy, "x", "A copy with its own memory (np.copy).\n\nGradient: x̄ = g.")
matmul = _function(_l.matmul, "a, b", "Matrix product with numpy's semantics (np.matmul, @): "
                   "a 1-D a is a row, a 1-D b a column, batch axes broadcast.\n\n"
                   "Gradient: ā = g·bᵀ, b̄ = aᵀ·g (ᵀ swaps the last two axes).")

__all__ = [
    "abs", "add", "copy", "cos", "divide", "exp", "expm1", "log", "log1p", "matmul", "maximum",
    "minimum", "multiply", "negative", "power", "relu", "sigmoid", "sin", "softplus", "sqrt",
    "square", "subtract", "tanh",
]
