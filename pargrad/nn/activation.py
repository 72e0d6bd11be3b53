"""Activations as modules: ``ReLU``, ``Tanh``, ``Sigmoid`` (elementwise, no parameters),
for use in ``Sequential``.

>>> import pargrad
>>> pargrad.nn.ReLU()(pargrad.tensor([-1.0, 2.0]))
tensor([0., 2.], dtype=float64)
"""

from __future__ import annotations

from typing import Any

from pargrad.nn.module import Module
from pargrad.ops.functions import relu, sigmoid, tanh
from pargrad.tensor import Tensor


class ReLU(Module):
    """``max(x, 0)`` elementwise (gradient 0 at 0). ``inplace=True`` writes the result
    into ``x`` (``x.relu_()``), which must then be a Tensor whose old values no other
    node of the graph needs (pargrad raises at backward if one does)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: Any) -> Tensor:
        return x.relu_() if self.inplace else relu(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class Tanh(Module):
    """``tanh(x)`` elementwise."""

    def forward(self, x: Any) -> Tensor:
        return tanh(x)


class Sigmoid(Module):
    """``1 / (1 + exp(-x))`` elementwise, without overflow."""

    def forward(self, x: Any) -> Tensor:
        return sigmoid(x)
