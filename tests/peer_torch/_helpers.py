"""What the ports use in place of torch's tensor factories and ``assertEqual``."""

from __future__ import annotations

from typing import Any

import numpy as np

import pargrad

_rng = np.random.default_rng(0)


def randn(*shape: int, requires_grad: bool = False) -> pargrad.Tensor:
    return pargrad.tensor(_rng.standard_normal(shape), requires_grad=requires_grad)


def rand(*shape: int, requires_grad: bool = False) -> pargrad.Tensor:
    return pargrad.tensor(_rng.random(shape), requires_grad=requires_grad)


def ones(*shape: int, requires_grad: bool = False) -> pargrad.Tensor:
    return pargrad.tensor(np.ones(shape), requires_grad=requires_grad)


def zeros(*shape: int, requires_grad: bool = False) -> pargrad.Tensor:
    return pargrad.tensor(np.zeros(shape), requires_grad=requires_grad)


def full(shape: tuple[int, ...], value: float) -> pargrad.Tensor:
    return pargrad.tensor(np.full(shape, value))


def value(x: Any) -> np.ndarray:
    return np.asarray(x.data if isinstance(x, pargrad.Tensor) else x)


def assert_equal(actual: Any, expected: Any) -> None:
    """torch's ``assertEqual`` for our tensors: same shape, values close."""
    a, e = value(actual), value(expected)
    if e.ndim:  # a Python number (0-d) compares with every element, as in torch
        assert a.shape == e.shape, (a.shape, e.shape)
    np.testing.assert_allclose(a, np.broadcast_to(e, a.shape), rtol=1e-7, atol=1e-7)
