"""gradcheck itself: it passes right gradients and catches wrong ones, saying where."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor


class WrongAt(pargrad.Function):
    """Squares its input, but the backward is wrong at one flat index."""

    index = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        ctx.save_for_backward(x)
        return x.data ** 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> np.ndarray:
        (x,) = ctx.saved_tensors
        grad = 2 * x.data * g.data
        grad.reshape(-1)[WrongAt.index] += 0.5
        return grad


def test_passes_a_correct_gradient() -> None:
    x = pargrad.tensor(np.linspace(-1, 1, 6).reshape(2, 3), requires_grad=True)
    assert pargrad.gradcheck(lambda t: (t ** 3).sum(axis=0), x)


def test_full_jacobian_names_the_input_the_index_and_both_values() -> None:
    WrongAt.index = 4
    x = pargrad.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    c = pargrad.tensor(1.0, requires_grad=True)
    with pytest.raises(pargrad.GradcheckError) as info:
        pargrad.gradcheck(lambda s, t: WrongAt.apply(t) * s, [c, x])
    message = str(info.value)
    assert "input 1" in message and "index (1, 1)" in message
    assert "output element 0" in message
    assert "backward gives 0.5" in message and "finite differences give 0.0" in message


def test_random_directions_for_large_inputs() -> None:
    WrongAt.index = 1234
    x = pargrad.tensor(np.linspace(-1, 1, 3000), requires_grad=True)
    assert pargrad.gradcheck(lambda t: (t ** 3).sum(), x, full_jacobian_limit=100)
    with pytest.raises(pargrad.GradcheckError, match=r"input 0 at random direction 0"):
        pargrad.gradcheck(lambda t: WrongAt.apply(t) * 1.0, x, full_jacobian_limit=100)


def test_leaves_the_callers_tensors_alone() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x.grad = pargrad.tensor([5.0, 5.0])
    pargrad.gradcheck(lambda t: t * t, x)
    np.testing.assert_array_equal(x.grad.data, [5.0, 5.0])


def test_several_outputs_and_constants() -> None:
    x = pargrad.tensor([0.3, 0.7], requires_grad=True)
    assert pargrad.gradcheck(lambda t, k: (t * k, t.sin()), [x, 3.0])
