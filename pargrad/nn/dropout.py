"""Dropout: zero random elements in training, as a regulariser; nothing in evaluation.

>>> import pargrad
>>> drop = pargrad.nn.Dropout(0.25)
>>> x = pargrad.ones(8)
>>> drop.eval()(x) is x
True
"""

from __future__ import annotations

import functools
from typing import Any

from pargrad.nn import functional
from pargrad.nn.module import Module
from pargrad.replay import recorder
from pargrad.tensor import Tensor


class Dropout(Module):
    """``Dropout(p=0.5)``: in training mode, each element is zeroed with probability
    ``p`` and the others scaled by ``1/(1-p)``; after ``eval()`` the input passes
    through unchanged. The mask comes from ``pargrad.random``'s generator
    (``functional.dropout``).

    Raises ValueError for ``p`` outside ``[0, 1]``.
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p is a probability in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Any) -> Tensor:
        if recorder.active:  # pargrad.capture: train() / eval() records the step again
            recorder.guard(functools.partial(getattr, self, "training"), self.training)
        return functional.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
