"""``SGD``: stochastic gradient descent, with momentum, dampening, Nesterov momentum,
weight decay (L2) and maximize, step for step as PyTorch's implementation of
``torch.optim.SGD`` computes it (the class docstring says where that differs from
pseudo-code PyTorch has published).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pargrad.optim.optimizer import Group, Optimizer, check_non_negative
from pargrad.tensor import Tensor


class SGD(Optimizer):
    """Stochastic gradient descent: ``SGD(params, lr, momentum=0, dampening=0,
    weight_decay=0, nesterov=False, maximize=False)``.

    Each step, per parameter θ with gradient g (state ``momentum_buffer`` b)::

        g <- -g                                    if maximize
        g <- g + weight_decay θ                    if weight_decay != 0
        if momentum != 0:
            b <- g at the first step, else momentum b + (1 - dampening) g
            g <- g + momentum b if nesterov, else b
        θ <- θ - lr g

    This is the order of PyTorch's implementation: maximize negates the gradient
    *before* weight decay is added, so the decay still pulls θ towards zero. Some
    versions of PyTorch's documentation write maximize as the last line instead
    (θ <- θ + lr g, the decay added to the gradient itself), which moves θ otherwise
    when weight_decay != 0. pargrad follows the implementation, so that its results
    agree with torch's to rounding.

    Options may differ per parameter group. Raises ValueError for a negative lr,
    momentum, dampening or weight_decay, and for ``nesterov=True`` without momentum or
    with dampening. Thread-safety and blocking as ``Optimizer``.

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> w = pargrad.tensor([1.0, -2.0], requires_grad=True)
    >>> opt = SGD([w], lr=0.1, momentum=0.5)
    >>> for _ in range(2):
    ...     opt.zero_grad()
    ...     (w * w).sum().backward()           # g = 2 w
    ...     opt.step()
    >>> w                                      # 0.8 - 0.1 (0.5 * 2 + 1.6), and for -2
    tensor([ 0.54, -1.08], dtype=float64, requires_grad=True)
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[Group], lr: float,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, maximize: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov,
                                  "maximize": maximize})

    def _check(self, group: Group) -> None:
        check_non_negative("SGD", group, "lr", "momentum", "dampening", "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"SGD: nesterov=True needs momentum > 0 and dampening = 0, got "
                             f"momentum={group['momentum']!r}, "
                             f"dampening={group['dampening']!r}")

    def _update(self, param: Tensor, grad: np.ndarray, group: Group,
                state: dict[str, Any]) -> None:
        g = self._direction(param, grad, group)
        momentum = group["momentum"]
        if momentum != 0:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                # (np.array, not g.copy(): for a 0-d parameter g may be a numpy scalar,
                # which the in-place steps below could not change)
                buffer = state["momentum_buffer"] = np.array(g, copy=True)
            else:
                buffer *= momentum
                buffer += (1 - group["dampening"]) * g
            g = g + momentum * buffer if group["nesterov"] else buffer
        param -= group["lr"] * g
