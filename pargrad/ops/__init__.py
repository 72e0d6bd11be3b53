"""pargrad's differentiable operations, grouped by kind; see docs/ops.md for the table."""

import sys

from pargrad import tensor as _tensor
from pargrad.ops import inplace as _inplace
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
    expm1,
    log,
    log1p,
    maximum,
    minimum,
    multiply,
    negative,
    power,
    relu,
    sigmoid,
    sin,
    softplus,
    sqrt,
    square,
    subtract,
    tanh,
    to,
    where,
)
from pargrad.ops.linalg import dot, matmul, outer, swapaxes, transpose
from pargrad.ops.nn import log_softmax, softmax
from pargrad.ops.reductions import (
    argmax,
    argmin,
    cumsum,
    logsumexp,
    max,
    mean,
    min,
    prod,
    std,
    sum,
    var,
)
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

# Tensor's operators (``x + y``, ``x.sum()``, ``x += y``) delegate to this package and to
# the in-place ops; tensor.py sits below the ops and cannot import them, so they are bound
# here, once every op above exists.
_tensor.bind_ops(sys.modules[__name__], _inplace)

__all__ = [
    "Op", "abs", "add", "argmax", "argmin", "astype", "broadcast_to", "clip", "concatenate",
    "constant", "copy", "cos", "cumsum", "defop", "dispatch_function", "dispatch_ufunc", "divide",
    "dot", "exp", "expand_dims", "expm1", "getitem", "log", "log1p", "log_softmax", "logsumexp",
    "matmul", "max", "maximum", "mean", "min", "minimum", "multiply", "negative", "outer", "power",
    "prod", "relu", "reshape", "sigmoid", "sin", "softmax", "softplus", "split", "sqrt", "square",
    "squeeze", "stack", "std", "subtract", "sum", "swapaxes", "tanh", "to", "transpose", "var",
    "where",
]
