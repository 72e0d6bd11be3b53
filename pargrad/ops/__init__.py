"""pargrad's differentiable operations, grouped by kind; see docs/ops.md for the table."""

from pargrad.ops.core import Op, constant, defop, dispatch_function, dispatch_ufunc
from pargrad.ops.elementwise import (
    abs,
    add,
    astype,
    clip,
    copy,
    cos,
    divide,
    exp,
    log,
    maximum,
    minimum,
    multiply,
    negative,
    power,
    relu,
    sigmoid,
    sin,
    sqrt,
    subtract,
    tanh,
    to,
    where,
)
from pargrad.ops.linalg import matmul, swapaxes, transpose
from pargrad.ops.nn import log_softmax, softmax
from pargrad.ops.reductions import logsumexp, max, mean, min, sum
from pargrad.ops.shape import (
    broadcast_to,
    concatenate,
    expand_dims,
    getitem,
    reshape,
    split,
    squeeze,
    stack,
)

__all__ = [
    "Op", "abs", "add", "astype", "broadcast_to", "clip", "concatenate", "constant", "copy", "cos",
    "defop", "dispatch_function", "dispatch_ufunc", "divide", "exp", "expand_dims", "getitem",
    "log", "log_softmax", "logsumexp", "matmul", "max", "maximum", "mean", "min", "minimum",
    "multiply", "negative", "power", "relu", "reshape", "sigmoid", "sin", "softmax", "split",
    "sqrt", "squeeze", "stack", "subtract", "sum", "swapaxes", "tanh", "to", "transpose",
    "where",
]
