"""Linear: the affine layer ``y = x @ weight.T + bias``.

>>> import pargrad
>>> layer = pargrad.nn.Linear(3, 2)
>>> layer.weight.shape, layer.bias.shape, layer(pargrad.ones((4, 3))).shape
((2, 3), (2,), (4, 2))
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pargrad import random
from pargrad.grad_mode import no_grad
from pargrad.nn import functional
from pargrad.nn.module import Module
from pargrad.nn.parameter import Parameter, empty_parameter
from pargrad.tensor import Tensor


class Linear(Module):
    """``Linear(in_features, out_features, bias=True)``: ``y = x @ weight.T + bias``, for
    ``x`` with ``in_features`` along its last axis.

    ``weight`` has shape ``(out_features, in_features)`` and ``bias`` ``(out_features,)``
    (None with ``bias=False``); both start uniform in ``±1/sqrt(in_features)``, PyTorch's
    default, drawn from ``pargrad.random``'s generator (``pargrad.random.seed(s)`` first
    makes the same layer again). ``dtype`` (float64 by default) and ``device`` are the
    parameters'.
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: Any = np.float64, device: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        self.bias = empty_parameter((out_features,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``weight`` and ``bias`` again, uniform in ``±1/sqrt(in_features)``."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        with no_grad():
            for param in (self.weight, self.bias):
                if param is not None:
                    param[...] = random.uniform(-bound, bound, param.shape, param.dtype).data

    def forward(self, x: Any) -> Tensor:
        return functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
