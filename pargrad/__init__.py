"""pargrad: reverse-mode automatic differentiation over numpy.

>>> import pargrad
>>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
>>> y = (x * x + 3 * x).sum()
>>> y.backward()
>>> x.grad
tensor([5., 7.], dtype=float64)
"""

from pargrad import fork as _fork  # noqa: F401  (registers the os.register_at_fork handlers)
from pargrad import memory, random, viz
from pargrad import nn as nn  # pargrad.nn: modules, layers and losses, as torch.nn
from pargrad import optim as optim  # pargrad.optim: optimizers and schedulers, as torch.optim
from pargrad.anomaly import (
    detect_anomaly,
    is_anomaly_check_nan_enabled,
    is_anomaly_enabled,
    set_detect_anomaly,
)
from pargrad.autograd import backward, backward_async, grad, grad_async
from pargrad.callbacks import queue_callback
from pargrad.checkpoint import checkpoint
from pargrad.creation import (
    arange,
    empty,
    eye,
    from_numpy,
    full,
    full_like,
    linspace,
    ones,
    ones_like,
    zeros,
    zeros_like,
)
from pargrad.devices import Device, device
from pargrad.engine import (
    BackwardRequest,
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
from pargrad.hooks import register_multi_grad_hook
from pargrad.losses import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss
from pargrad.memory import empty_cache, memory_stats
from pargrad.ops import (
    argmax,
    argmin,
    astype,
    broadcast_to,
    clip,
    concatenate,
    cumsum,
    dot,
    expand_dims,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    outer,
    prod,
    reshape,
    softmax,
    split,
    squeeze,
    stack,
    std,
    sum,
    swapaxes,
    to,
    transpose,
    var,
    where,
)

# The ops that are Op instances, as functions with their own signatures and docstrings.
from pargrad.ops.functions import (
    abs,
    add,
    copy,
    cos,
    divide,
    exp,
    expm1,
    log,
    log1p,
    matmul,
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
)
from pargrad.random import Generator, rand, randn
from pargrad.replay.step import CaptureStats, CaptureWarning, capture
from pargrad.tensor import Tensor, tensor

__version__ = "0.1.0"

__all__ = [
    "AccumulateGrad", "BackwardError", "BackwardFuture", "BackwardRequest", "Device", "Engine",
    "Function", "FunctionCtx", "Generator", "GradcheckError", "Node", "SequentialEngine", "Tensor",
    "ThreadedEngine", "abs", "add", "arange", "argmax", "argmin", "astype", "backward",
    "backward_async", "binary_cross_entropy_with_logits", "broadcast_to", "capture",
    "CaptureStats", "CaptureWarning", "checkpoint",
    "clip", "concatenate", "copy", "cos", "cross_entropy", "cumsum", "current_engine",
    "detect_anomaly", "device", "divide", "dot", "empty", "empty_cache", "enable_grad", "exp",
    "expand_dims", "expm1", "eye", "from_numpy", "full", "full_like", "get_default_engine",
    "grad", "grad_async", "gradcheck", "gradgradcheck", "is_anomaly_check_nan_enabled",
    "is_anomaly_enabled", "is_grad_enabled", "linspace", "log", "log1p", "log_softmax",
    "logsumexp", "matmul", "max", "maximum", "mean", "memory", "memory_stats", "min",
    "minimum", "mse_loss",
    "multiply", "negative", "nll_loss", "no_grad", "once_differentiable", "ones",
    "ones_like", "outer", "power", "prod", "profile", "queue_callback", "rand", "randn",
    "random", "register_multi_grad_hook", "relu", "reshape", "set_default_engine",
    "set_detect_anomaly", "set_grad_enabled", "sigmoid", "sin", "softmax", "softplus",
    "split", "sqrt", "square", "squeeze", "stack", "std", "subtract", "sum", "swapaxes",
    "tanh", "tensor", "to", "transpose", "use_engine", "var", "viz", "where", "zeros",
    "zeros_like",
]
