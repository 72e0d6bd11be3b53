"""pargrad: reverse-mode automatic differentiation over numpy.

>>> import pargrad
>>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
>>> y = (x * x + 3 * x).sum()
>>> y.backward()
>>> x.grad
tensor([5., 7.], dtype=float64)
"""

from pargrad import fork as _fork  # noqa: F401  (registers the os.register_at_fork handlers)
from pargrad import viz
from pargrad.anomaly import (
    detect_anomaly,
    is_anomaly_check_nan_enabled,
    is_anomaly_enabled,
    set_detect_anomaly,
)
from pargrad.autograd import backward, backward_async, grad, grad_async
from pargrad.checkpoint import checkpoint
from pargrad.devices import Device, device
from pargrad.engine import (
    Engine,
    SequentialEngine,
    ThreadedEngine,
    current_engine,
    get_default_engine,
    set_default_engine,
    use_engine,
)
from pargrad.engine.trace import profile
from pargrad.function import Function, FunctionCtx, once_differentiable
from pargrad.futures import BackwardFuture
from pargrad.grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from pargrad.gradcheck import GradcheckError, gradcheck, gradgradcheck
from pargrad.graph import AccumulateGrad, BackwardError, Node
from pargrad.ops import (
    abs,
    add,
    astype,
    broadcast_to,
    clip,
    concatenate,
    copy,
    cos,
    divide,
    exp,
    expand_dims,
    log,
    log_softmax,
    logsumexp,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    multiply,
    negative,
    power,
    relu,
    reshape,
    sigmoid,
    sin,
    softmax,
    split,
    sqrt,
    squeeze,
    stack,
    subtract,
    sum,
    swapaxes,
    tanh,
    to,
    transpose,
    where,
)
from pargrad.tensor import Tensor, tensor

__version__ = "0.1.0"

__all__ = [
    "AccumulateGrad", "BackwardError", "BackwardFuture", "Device", "Engine", "Function",
    "FunctionCtx", "GradcheckError", "Node", "SequentialEngine", "Tensor", "ThreadedEngine", "abs",
    "add", "astype", "backward", "backward_async", "broadcast_to", "checkpoint", "clip",
    "concatenate", "copy", "cos", "current_engine", "detect_anomaly", "device", "divide",
    "enable_grad", "exp", "expand_dims", "get_default_engine", "grad", "grad_async", "gradcheck",
    "gradgradcheck", "is_anomaly_check_nan_enabled", "is_anomaly_enabled", "is_grad_enabled", "log",
    "log_softmax", "logsumexp", "matmul", "max", "maximum", "mean", "min", "minimum", "multiply",
    "negative", "no_grad", "once_differentiable", "power", "profile", "relu", "reshape",
    "set_default_engine", "set_detect_anomaly", "set_grad_enabled", "sigmoid", "sin", "softmax",
    "split", "sqrt", "squeeze", "stack", "subtract", "sum", "swapaxes", "tanh", "tensor", "to",
    "transpose", "use_engine", "viz", "where",
]
