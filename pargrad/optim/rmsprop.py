"""``RMSprop``: steps scaled by a running average of squared gradients, with momentum,
the centered variant, weight decay and maximize, step for step as PyTorch's
implementation of ``torch.optim.RMSprop`` computes it (its documented pseudo-code has no
maximize; the implementation negates the gradient first, as here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pargrad.optim.optimizer import Group, Optimizer, check_non_negative
from pargrad.tensor import Tensor


class RMSprop(Optimizer):
    """RMSprop: ``RMSprop(params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0,
    momentum=0, centered=False, maximize=False)``.

    Each step, per parameter θ with gradient g (state ``step``, ``square_avg`` v,
    ``grad_avg`` a when centered, ``momentum_buffer`` b when momentum > 0, all starting
    at zero)::

        g <- -g                                    if maximize
        g <- g + weight_decay θ                    if weight_decay != 0
        v <- alpha v + (1 - alpha) g²
        ṽ <- v, or when centered: a <- alpha a + (1 - alpha) g, ṽ <- v - a²
        if momentum > 0: b <- momentum b + g / (sqrt(ṽ) + eps), θ <- θ - lr b
        else:            θ <- θ - lr g / (sqrt(ṽ) + eps)

    Options may differ per parameter group. Raises ValueError for a negative lr,
    alpha, eps, weight_decay or momentum. Thread-safety and blocking as ``Optimizer``.

    >>> import pargrad
    >>> from pargrad.optim import RMSprop
    >>> w = pargrad.tensor([1.0], requires_grad=True)
    >>> opt = RMSprop([w], lr=0.01, alpha=0.75, eps=0.0)
    >>> (w * 4).sum().backward(); opt.step()  # v = 0.25 * 16 = 4: θ - 0.01 * 4 / 2
    >>> w
    tensor([0.98], dtype=float64, requires_grad=True)
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[Group], lr: float = 1e-2,
                 alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(params, {"lr": lr, "alpha": alpha, "eps": eps,
                                  "weight_decay": weight_decay, "momentum": momentum,
                                  "centered": centered, "maximize": maximize})

    def _check(self, group: Group) -> None:
        check_non_negative("RMSprop", group, "lr", "alpha", "eps", "weight_decay",
                           "momentum")

    def _update(self, param: Tensor, grad: np.ndarray, group: Group,
                state: dict[str, Any]) -> None:
        g = self._direction(param, grad, group)
        alpha = group["alpha"]
        if not state:
            state["step"] = 0
            state["square_avg"] = np.zeros_like(param.data)
        state["step"] += 1
        v = state["square_avg"]
        # Computed into two scratch arrays (out=), as Adam's: every new array of the
        # parameter's size could cost its page faults again (in_backward._Saved).
        scratch, root = np.empty_like(param.data), np.empty_like(param.data)
        v *= alpha
        v += np.multiply(1 - alpha, np.multiply(g, g, out=scratch), out=scratch)
        v_tilde = v
        if group["centered"]:
            average = state.setdefault("grad_avg", np.zeros_like(param.data))
            average *= alpha
            average += np.multiply(1 - alpha, g, out=scratch)
            v_tilde = np.subtract(v, np.multiply(average, average, out=scratch), out=scratch)
        denominator = np.add(np.sqrt(v_tilde, out=root), group["eps"], out=root)
        if group["momentum"] > 0:
            buffer = state.setdefault("momentum_buffer", np.zeros_like(param.data))
            buffer *= group["momentum"]
            buffer += np.divide(g, denominator, out=scratch)
            param -= np.multiply(group["lr"], buffer, out=scratch)
        else:
            param -= np.divide(np.multiply(group["lr"], g, out=scratch), denominator,
                               out=scratch)
