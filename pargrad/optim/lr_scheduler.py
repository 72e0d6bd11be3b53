"""Learning-rate schedules: ``StepLR``, ``CosineAnnealingLR``, ``LambdaLR``, as
``torch.optim.lr_scheduler``'s. Each sets ``lr`` of every parameter group of an
optimizer, once per ``step()`` (an epoch, or an iteration: whatever the caller counts).

Making a scheduler sets each group's ``initial_lr`` (if it has none) and applies the
schedule's epoch 0, so ``last_epoch`` is 0 after it, as in PyTorch. ``StepLR`` and
``CosineAnnealingLR`` are recursive, as PyTorch documents them: each step computes the
new rate from the group's current one, so they compose with other changes to ``lr``;
``LambdaLR`` computes it from ``initial_lr`` alone.

Not thread-safe: step a scheduler between optimizer steps, on the thread that owns the
optimizer, never while a backward that updates parameters (``step_in_backward``) runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pargrad.optim.optimizer import Optimizer


class LRScheduler:
    """The base of the schedulers: ``step()``, ``get_last_lr()``, ``last_epoch``,
    ``base_lrs`` (each group's ``initial_lr``), ``state_dict()`` / ``load_state_dict()``.
    A subclass gives ``_lr(i, lr)``: the rate of group ``i`` at epoch ``last_epoch``,
    from its rate ``lr`` one epoch before.

    Raises TypeError if ``optimizer`` is not a pargrad Optimizer.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__}: optimizer must be a pargrad.optim "
                            f"Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = -1
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> None:
        """Move on one epoch: set each group's ``lr`` to the schedule's next value.

        Raises RuntimeError if the optimizer's number of groups changed since the
        scheduler was made."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.base_lrs):
            raise RuntimeError(f"{type(self).__name__}.step: the optimizer has {len(groups)} "
                               f"parameter groups, but this scheduler was made for "
                               f"{len(self.base_lrs)}; make a new scheduler")
        self.last_epoch += 1
        self._last_lr = [self._lr(i, group["lr"]) for i, group in enumerate(groups)]
        for group, lr in zip(groups, self._last_lr):
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        """The rates the last ``step()`` (or the constructor) set, one per group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer (and ``LambdaLR``'s functions): ``last_epoch``,
        ``base_lrs``, the last rates and the schedule's options, copied."""
        return {key: list(value) if isinstance(value, list) else value
                for key, value in vars(self).items() if key not in self._not_saved()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the state from ``state_dict()`` of a scheduler of the same kind; the
        next ``step()`` continues from its epoch. (The optimizer's ``lr`` values come
        from the optimizer's own ``load_state_dict``.)"""
        for key, value in state_dict.items():
            setattr(self, key, list(value) if isinstance(value, list) else value)

    def _not_saved(self) -> tuple[str, ...]:
        return ("optimizer",)

    def _lr(self, i: int, lr: float) -> float:
        raise NotImplementedError


class StepLR(LRScheduler):
    """Multiply each group's rate by ``gamma`` every ``step_size`` epochs:
    ``StepLR(optimizer, step_size, gamma=0.1)``. With nothing else changing ``lr``, the
    rate at epoch e is ``initial_lr * gamma ** (e // step_size)``.

    Raises ValueError unless ``step_size`` is a positive int. Not thread-safe (module
    docstring).

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> from pargrad.optim.lr_scheduler import StepLR
    >>> opt = SGD([pargrad.zeros(1, requires_grad=True)], lr=1.0)
    >>> scheduler = StepLR(opt, step_size=2, gamma=0.5)
    >>> rates = []
    >>> for epoch in range(5):
    ...     rates.append(scheduler.get_last_lr()[0])    # train with this rate, then:
    ...     scheduler.step()
    >>> rates, scheduler.last_epoch
    ([1.0, 1.0, 0.5, 0.5, 0.25], 5)
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1) -> None:
        if not (isinstance(step_size, int) and step_size > 0):
            raise ValueError(f"StepLR: step_size must be a positive int, got {step_size!r}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer)

    def _lr(self, i: int, lr: float) -> float:
        # The staircase initial_lr * gamma ** (e // step_size), taken as a recursion:
        # from epoch e - 1 to e the rate is multiplied by gamma once for every stair
        # begun in between (none or one), so a rate changed by hand keeps its change.
        epoch = self.last_epoch
        if epoch == 0:  # the rate the scheduler starts from
            return lr
        stairs = epoch // self.step_size - (epoch - 1) // self.step_size
        return lr * self.gamma if stairs else lr


class CosineAnnealingLR(LRScheduler):
    """Anneal each group's rate from ``initial_lr`` to ``eta_min`` along half a cosine
    over ``T_max`` epochs (then back up, and so on): ``CosineAnnealingLR(optimizer,
    T_max, eta_min=0)``. The recursion PyTorch documents, from epoch T_cur to T_cur + 1
    (η_max = ``initial_lr``)::

        η <- η_min + (η - η_min) (1 + cos((T_cur + 1) π / T_max)) / (1 + cos(T_cur π / T_max))
        η <- η + (η_max - η_min) (1 - cos(π / T_max)) / 2      when T_cur = (2k + 1) T_max

    With nothing else changing ``lr`` this is, to rounding,
    ``η_min + (η_max - η_min) (1 + cos(e π / T_max)) / 2`` at epoch e.

    Raises ValueError unless ``T_max`` is a positive int. Not thread-safe (module
    docstring).

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> from pargrad.optim.lr_scheduler import CosineAnnealingLR
    >>> opt = SGD([pargrad.zeros(1, requires_grad=True)], lr=1.0)
    >>> scheduler = CosineAnnealingLR(opt, T_max=4)
    >>> rates = []
    >>> for epoch in range(6):
    ...     scheduler.step()
    ...     rates.append(round(scheduler.get_last_lr()[0], 6))
    >>> rates
    [0.853553, 0.5, 0.146447, 0.0, 0.146447, 0.5]
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0) -> None:
        if not (isinstance(T_max, int) and T_max > 0):
            raise ValueError(f"CosineAnnealingLR: T_max must be a positive int, got {T_max!r}")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer)

    def _lr(self, i: int, lr: float) -> float:
        if self.last_epoch == 0:  # the rate the scheduler starts from
            return lr
        t_cur = self.last_epoch - 1  # the epoch ``lr`` belongs to; this step leaves it
        if t_cur % (2 * self.T_max) == self.T_max:
            # At a minimum of the cosine 1 + cos(T_cur π / T_max) is 0 and the ratio
            # below undefined: climb by the closed form's first step up instead.
            rise = (1 - math.cos(math.pi / self.T_max)) / 2
            return lr + rise * (self.base_lrs[i] - self.eta_min)
        ratio = (1 + self._cos(t_cur + 1)) / (1 + self._cos(t_cur))
        return self.eta_min + ratio * (lr - self.eta_min)

    def _cos(self, t: int) -> float:
        """cos(t π / T_max), the cosine of the schedule at epoch t."""
        return math.cos(math.pi * t / self.T_max)


class LambdaLR(LRScheduler):
    """Set each group's rate to ``initial_lr * lr_lambda(epoch)``: ``LambdaLR(optimizer,
    lr_lambda)``, with one function for every group or a list of one per group.

    ``state_dict()`` leaves the functions out (they are code, not state): a resumed
    scheduler keeps the ones it was made with. Raises ValueError if a list has not one
    function per group, TypeError if one is not callable. Not thread-safe (module
    docstring).

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> from pargrad.optim.lr_scheduler import LambdaLR
    >>> opt = SGD([pargrad.zeros(1, requires_grad=True)], lr=0.5)
    >>> scheduler = LambdaLR(opt, lambda epoch: 1 / (epoch + 1))
    >>> scheduler.step(); scheduler.step()
    >>> scheduler.get_last_lr(), opt.param_groups[0]["lr"]
    ([0.16666666666666666], 0.16666666666666666)
    """

    def __init__(self, optimizer: Optimizer,
                 lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]]) -> None:
        count = len(optimizer.param_groups) if isinstance(optimizer, Optimizer) else 0
        lambdas: list[Callable[[int], float]] = (
            list(lr_lambda) if isinstance(lr_lambda, (list, tuple))
            else [lr_lambda] * count)  # type: ignore[list-item]
        if len(lambdas) != count:
            raise ValueError(f"LambdaLR: got {len(lambdas)} functions for {count} parameter "
                             f"groups; give one function, or one per group")
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"LambdaLR: lr_lambda must be callable, got "
                                f"{type(fn).__name__}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer)

    def _not_saved(self) -> tuple[str, ...]:
        return ("optimizer", "lr_lambdas")

    def _lr(self, i: int, lr: float) -> float:
        return self.base_lrs[i] * self.lr_lambdas[i](self.last_epoch)
