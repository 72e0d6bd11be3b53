"""``Adam`` and ``AdamW``: adaptive moments, with amsgrad and maximize, step for step as
PyTorch's implementation of ``torch.optim.Adam`` and ``torch.optim.AdamW`` computes them
(``Adam``'s docstring says where that differs from pseudo-code PyTorch has published).
They differ only in weight decay: Adam adds λθ to the gradient (L2), AdamW shrinks θ
itself (decoupled).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pargrad.optim.optimizer import Group, Optimizer, check_non_negative
from pargrad.tensor import Tensor


class Adam(Optimizer):
    """Adam: ``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
    amsgrad=False, maximize=False)``.

    Each step t (counted from 1, per parameter), per parameter θ with gradient g
    (``betas`` = (β1, β2); state ``step`` t, ``exp_avg`` m, ``exp_avg_sq`` v, and with
    amsgrad ``max_exp_avg_sq`` v_max, all starting at zero)::

        g <- -g                                    if maximize
        g <- g + weight_decay θ                    if weight_decay != 0
        m <- β1 m + (1 - β1) g
        v <- β2 v + (1 - β2) g²
        m̂ <- m / (1 - β1^t)
        v̂ <- v / (1 - β2^t), or with amsgrad: v_max <- max(v_max, v), v̂ <- v_max / (1 - β2^t)
        θ <- θ - lr m̂ / (sqrt(v̂) + eps)

    With amsgrad, v_max keeps the largest *raw* second moment v, bias-corrected after,
    as PyTorch's implementation does. Some versions of PyTorch's documentation take
    the maximum of the bias-corrected v̂ instead, which differs: the correction
    1 / (1 - β2^t) shrinks as t grows, so an old v̂ weighs more than its v. pargrad
    follows the implementation, so that its results agree with torch's to rounding.

    Options may differ per parameter group. Raises ValueError for a negative lr, eps or
    weight_decay, and for betas outside [0, 1). Thread-safety and blocking as
    ``Optimizer``.

    >>> import pargrad
    >>> from pargrad.optim import Adam
    >>> w = pargrad.tensor([1.0, -3.0], requires_grad=True)
    >>> opt = Adam([w], lr=0.1)
    >>> (w * w).sum().backward(); opt.step()
    >>> w.data.round(6)                       # the first step moves each by about lr
    array([ 0.9, -2.9])
    >>> opt.state[w]["step"], opt.state[w]["exp_avg"]
    (1, array([ 0.2, -0.6]))
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[Group], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": amsgrad,
                                  "maximize": maximize})

    def _check(self, group: Group) -> None:
        name = type(self).__name__
        check_non_negative(name, group, "lr", "eps", "weight_decay")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float, np.number)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas!r}")

    def _update(self, param: Tensor, grad: np.ndarray, group: Group,
                state: dict[str, Any]) -> None:
        g = self._direction(param, grad, group)
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(param.data)
            state["exp_avg_sq"] = np.zeros_like(param.data)
        state["step"] = t = state["step"] + 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # Line by line the algorithm of the docstring, computed into two scratch arrays
        # (out=) instead of a new array per operation: two fresh arrays a step, not
        # seven (each may fault its pages in again: in_backward._Saved says why).
        scratch, root = np.empty_like(param.data), np.empty_like(param.data)
        m *= beta1
        m += np.multiply(1 - beta1, g, out=scratch)
        v *= beta2
        v += np.multiply(1 - beta2, np.multiply(g, g, out=scratch), out=scratch)
        m_hat = np.divide(m, 1 - beta1 ** t, out=scratch)
        if group["amsgrad"]:
            v = state.setdefault("max_exp_avg_sq", np.zeros_like(param.data))
            np.maximum(v, state["exp_avg_sq"], out=v)
        v_hat = np.divide(v, 1 - beta2 ** t, out=root)
        denominator = np.add(np.sqrt(v_hat, out=root), group["eps"], out=root)
        param -= np.divide(np.multiply(group["lr"], m_hat, out=scratch), denominator,
                           out=scratch)


class AdamW(Adam):
    """Adam with decoupled weight decay: ``AdamW(params, lr=1e-3, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False)``.

    As ``Adam``, except that weight_decay does not enter the gradient: each step first shrinks the
    parameter, ``θ <- θ - lr weight_decay θ``, then takes Adam's step on the plain gradient. Raises
    as ``Adam``; thread-safety and blocking as ``Optimizer``.

    >>> import pargrad
    >>> from pargrad.optim import AdamW
    >>> w = pargrad.tensor([2.0], requires_grad=True)
    >>> opt = AdamW([w], lr=0.1, weight_decay=0.5)
    >>> (w * 0).sum().backward(); opt.step()  # no gradient: only the decay moves it
    >>> w                                     # 2 - 0.1 * 0.5 * 2
    tensor([1.9], dtype=float64, requires_grad=True)
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[Group], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)

    def _direction(self, param: Tensor, grad: np.ndarray, group: Group) -> np.ndarray:
        """Decoupled weight decay: the parameter itself shrinks first; the step follows
        the plain gradient (negated with ``maximize``)."""
        if group["weight_decay"] != 0:
            param -= group["lr"] * group["weight_decay"] * param.data
        return -grad if group["maximize"] else grad
