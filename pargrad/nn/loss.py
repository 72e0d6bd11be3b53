"""Losses as modules, over ``pargrad.losses``: ``MSELoss`` and ``CrossEntropyLoss``.

>>> import pargrad
>>> loss_fn = pargrad.nn.CrossEntropyLoss()
>>> logits = pargrad.tensor([[2.0, 0.0], [0.0, 2.0]])
>>> round(loss_fn(logits, [0, 1]).item(), 4)
0.1269
"""

from __future__ import annotations

from typing import Any

from pargrad import losses
from pargrad.nn.module import Module
from pargrad.tensor import Tensor


class _Loss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in losses.REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be one of "
                             f"{losses.REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction


class MSELoss(_Loss):
    """``MSELoss(reduction="mean")``: ``pargrad.mse_loss(input, target, reduction)``,
    the squared error, averaged (``"sum"``: summed; ``"none"``: per element)."""

    def forward(self, input: Any, target: Any) -> Tensor:
        return losses.mse_loss(input, target, self.reduction)


class CrossEntropyLoss(_Loss):
    """``CrossEntropyLoss(reduction="mean")``: ``pargrad.cross_entropy(logits, target,
    axis, reduction)``, for integer class targets or class probabilities.

    The classes lie along ``axis``, the last by default, as everywhere in pargrad; for
    logits of shape ``(batch, classes)`` that is PyTorch's ``dim=1``, but for more axes
    PyTorch takes the classes along axis 1: pass ``axis=1`` there.
    """

    def __init__(self, reduction: str = "mean", *, axis: int = -1) -> None:
        super().__init__(reduction)
        self.axis = axis

    def forward(self, logits: Any, target: Any) -> Tensor:
        return losses.cross_entropy(logits, target, self.axis, self.reduction)
