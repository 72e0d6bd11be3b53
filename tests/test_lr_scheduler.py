"""pargrad.optim.lr_scheduler: each schedule's rates against its closed form, per group;
what the optimizer then uses; the state dict (a resumed schedule continues exactly);
errors; PyTorch's schedulers as an optional cross-check."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad.optim import SGD, Adam, Optimizer
from pargrad.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR


def two_groups(lr: float = 1.0, second: float = 0.1) -> Optimizer:
    return SGD([{"params": [pargrad.zeros(1, requires_grad=True)]},
                {"params": [pargrad.zeros(2, requires_grad=True)], "lr": second}], lr=lr)


def rates(scheduler: LRScheduler, epochs: int) -> list[list[float]]:
    """The rates of epochs 0 .. epochs - 1: read, then step, as a training loop does."""
    seen = []
    for _ in range(epochs):
        seen.append(scheduler.get_last_lr())
        assert seen[-1] == [g["lr"] for g in scheduler.optimizer.param_groups]
        scheduler.step()
    return seen


def test_step_lr() -> None:
    opt = two_groups()
    scheduler = StepLR(opt, step_size=3, gamma=0.5)
    assert scheduler.last_epoch == 0 and scheduler.base_lrs == [1.0, 0.1]
    assert rates(scheduler, 7) == [[1.0, 0.1]] * 3 + [[0.5, 0.05]] * 3 + [[0.25, 0.025]]
    assert scheduler.last_epoch == 7
    assert [g["initial_lr"] for g in opt.param_groups] == [1.0, 0.1]


@given(t_max=st.integers(1, 12), eta_min=st.sampled_from([0.0, 1e-3, 0.05]),
       base=st.sampled_from([0.1, 1.0, 3.0]))
def test_cosine_annealing_follows_the_closed_form(t_max: int, eta_min: float,
                                                  base: float) -> None:
    scheduler = CosineAnnealingLR(two_groups(base, base / 2), T_max=t_max, eta_min=eta_min)
    for epoch, (first, second) in enumerate(rates(scheduler, 3 * t_max + 2)):
        for lr, top in ((first, base), (second, base / 2)):
            closed = eta_min + (top - eta_min) * (1 + math.cos(math.pi * epoch / t_max)) / 2
            assert lr == pytest.approx(closed, rel=1e-9, abs=1e-12), epoch


def test_cosine_annealing_by_hand() -> None:
    opt = two_groups(1.0, 0.5)
    scheduler = CosineAnnealingLR(opt, T_max=2, eta_min=0.1)
    assert [round(r[0], 12) for r in rates(scheduler, 5)] == [1.0, 0.55, 0.1, 0.55, 1.0]


def test_the_recursive_schedules_compose_with_other_changes() -> None:
    opt = two_groups()
    scheduler = StepLR(opt, step_size=2, gamma=0.5)
    scheduler.step()
    opt.param_groups[0]["lr"] = 0.3  # changed by hand (a warm-up, another scheduler)
    scheduler.step()
    assert scheduler.get_last_lr() == [0.15, 0.05]
    scheduler.step()  # epoch 3: no stair begins, the rate set by hand stays halved
    assert scheduler.get_last_lr() == [0.15, 0.05]


def test_cosine_annealing_composes_with_other_changes() -> None:
    # T_max = 4 from 1.0 (and 0.5): each step scales the distance to eta_min = 0 by
    # (1 + cos(e π/4)) / (1 + cos((e - 1) π/4)), whatever the rate was set to.
    c = math.cos(math.pi / 4)
    opt = two_groups(1.0, 0.5)
    scheduler = CosineAnnealingLR(opt, T_max=4)
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([(1 + c) / 2, (1 + c) / 4], rel=1e-15)
    opt.param_groups[0]["lr"] = 0.5  # changed by hand
    scheduler.step()  # epoch 2: cos(π/2) = 0
    assert scheduler.get_last_lr() == pytest.approx([0.5 / (1 + c), 0.25], rel=1e-14)
    scheduler.step()
    scheduler.step()  # epoch 4: the minimum, 1 + cos(π) = 0
    assert scheduler.get_last_lr() == pytest.approx([0.0, 0.0], abs=1e-16)
    opt.param_groups[0]["lr"] = 0.1  # by hand, at the minimum
    scheduler.step()  # epoch 5: up by (1 - cos(π/4)) / 2 of (initial_lr - eta_min)
    assert scheduler.get_last_lr() == pytest.approx([0.1 + (1 - c) / 2, (1 - c) / 4],
                                                    rel=1e-14)
    scheduler.step()  # epoch 6: the ratio again, from the rate the last step left
    ratio = (1 + math.cos(6 * math.pi / 4)) / (1 + math.cos(5 * math.pi / 4))
    assert scheduler.get_last_lr() == pytest.approx(
        [ratio * (0.1 + (1 - c) / 2), ratio * (1 - c) / 4], rel=1e-14)


def test_lambda_lr_one_function_or_one_per_group() -> None:
    opt = two_groups(2.0, 1.0)
    scheduler = LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    assert rates(scheduler, 3) == [[2.0, 1.0], [1.0, 0.5], [0.5, 0.25]]
    opt = two_groups(2.0, 1.0)
    opt.param_groups[0]["lr"] = 9.0  # initial_lr is taken when the first scheduler is made
    per_group = LambdaLR(opt, [lambda e: e + 1, lambda e: 10.0])
    assert rates(per_group, 2) == [[9.0, 10.0], [18.0, 10.0]]
    assert LambdaLR(opt, lambda e: 1.0).base_lrs == [9.0, 1.0]  # kept: the first's


def test_the_optimizer_steps_with_the_scheduled_rate() -> None:
    w = pargrad.tensor([0.0], requires_grad=True)
    opt = SGD([w], lr=1.0)
    scheduler = StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        (w * -1.0).sum().backward()  # gradient -1: each step adds lr
        opt.step()
        scheduler.step()
    assert w.data.tolist() == [1.0 + 0.5 + 0.25]


FACTORIES: dict[str, Callable[[Optimizer], LRScheduler]] = {
    "StepLR": lambda opt: StepLR(opt, step_size=2, gamma=0.3),
    "CosineAnnealingLR": lambda opt: CosineAnnealingLR(opt, T_max=5, eta_min=0.01),
    "LambdaLR": lambda opt: LambdaLR(opt, [lambda e: 1 / (1 + e), lambda e: 0.9 ** e]),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@given(before=st.integers(0, 12), after=st.integers(1, 12))
def test_a_resumed_schedule_continues_exactly(name: str, before: int, after: int) -> None:
    make = FACTORIES[name]
    opt = two_groups()
    scheduler = make(opt)
    for _ in range(before):
        scheduler.step()
    saved, saved_optimizer = scheduler.state_dict(), opt.state_dict()
    assert "optimizer" not in saved and "lr_lambdas" not in saved
    assert saved["last_epoch"] == before
    expected = rates(scheduler, after)

    resumed_opt = two_groups(5.0, 5.0)
    resumed = make(resumed_opt)
    resumed_opt.load_state_dict(saved_optimizer)
    resumed.load_state_dict(saved)
    assert rates(resumed, after) == expected


def test_errors() -> None:
    opt = two_groups()
    with pytest.raises(ValueError, match="step_size must be a positive int, got 0"):
        StepLR(opt, step_size=0)
    with pytest.raises(ValueError, match="T_max must be a positive int"):
        CosineAnnealingLR(opt, T_max=0)
    with pytest.raises(ValueError, match="got 3 functions for 2 parameter groups"):
        LambdaLR(opt, [lambda e: 1.0] * 3)
    with pytest.raises(TypeError, match="lr_lambda must be callable"):
        LambdaLR(opt, 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a pargrad\.optim Optimizer"):
        StepLR(object(), step_size=1)  # type: ignore[arg-type]
    scheduler = StepLR(opt, step_size=1)
    opt.add_param_group({"params": [pargrad.zeros(1, requires_grad=True)]})
    with pytest.raises(RuntimeError, match="has 3 parameter groups, but this scheduler"):
        scheduler.step()


TORCH_CASES: list[tuple[str, dict[str, Any]]] = [
    ("StepLR", {"step_size": 3, "gamma": 0.7}),
    ("CosineAnnealingLR", {"T_max": 4, "eta_min": 0.02}),
    ("LambdaLR", {"lr_lambda": lambda e: 0.95 ** e + 0.1 * (e % 3)}),
]


@pytest.mark.parametrize("name, options", TORCH_CASES)
@pytest.mark.parametrize("by_hand", [False, True])
def test_agrees_with_torch_schedulers(name: str, options: dict[str, Any],
                                      by_hand: bool) -> None:
    """Fourteen epochs; ``by_hand``: the rate is also set by hand at epochs 3 and 8
    (8 is the cosine's minimum)."""
    torch = pytest.importorskip("torch")
    w = torch.zeros(1, requires_grad=True)
    theirs = getattr(torch.optim.lr_scheduler, name)(torch.optim.Adam([w], lr=0.3), **options)
    ours = getattr(pargrad.optim.lr_scheduler, name)(
        Adam([pargrad.zeros(1, requires_grad=True)], lr=0.3), **options)
    for epoch in range(14):
        np.testing.assert_allclose(ours.get_last_lr(), theirs.get_last_lr(), rtol=1e-13)
        np.testing.assert_allclose(ours.optimizer.param_groups[0]["lr"],
                                   theirs.optimizer.param_groups[0]["lr"], rtol=1e-13)
        assert ours.last_epoch == theirs.last_epoch
        if by_hand and epoch in (3, 8):
            for scheduler in (ours, theirs):
                scheduler.optimizer.param_groups[0]["lr"] *= 0.4
        theirs.optimizer.step()
        ours.step()
        theirs.step()


def test_two_chained_schedulers_agree_with_torch() -> None:
    """StepLR and CosineAnnealingLR on one optimizer, both stepped every epoch: each
    works on the rate the other left."""
    torch = pytest.importorskip("torch")
    w = torch.zeros(1, requires_grad=True)
    torch_opt = torch.optim.SGD([w], lr=0.5)
    ours_opt = SGD([pargrad.zeros(1, requires_grad=True)], lr=0.5)
    schedulers = []
    for module, opt in ((torch.optim.lr_scheduler, torch_opt),
                        (pargrad.optim.lr_scheduler, ours_opt)):
        schedulers.append((module.StepLR(opt, step_size=3, gamma=0.5),
                           module.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)))
    (t_step, t_cos), (o_step, o_cos) = schedulers
    for _ in range(15):
        np.testing.assert_allclose(ours_opt.param_groups[0]["lr"],
                                   torch_opt.param_groups[0]["lr"], rtol=1e-13)
        for mine, their in ((o_step, t_step), (o_cos, t_cos)):
            np.testing.assert_allclose(mine.get_last_lr(), their.get_last_lr(), rtol=1e-13)
        torch_opt.step()
        for scheduler in (t_step, t_cos, o_step, o_cos):
            scheduler.step()
