"""What the parity suite's files share: leaves from numbers, and value checks."""

from __future__ import annotations

from typing import Any

import numpy as np

import pargrad
from pargrad import Tensor


def leaf(*numbers: float) -> Tensor:
    """A float64 leaf that requires grad, holding ``numbers``."""
    return pargrad.tensor(np.array(numbers, dtype=np.float64), requires_grad=True)


def close(actual: Any, expected: Any) -> None:
    """``actual`` (a Tensor or an array, not None) equals ``expected`` to rounding."""
    assert actual is not None, "expected a gradient, got None"
    data = actual.data if isinstance(actual, Tensor) else actual
    np.testing.assert_allclose(data, expected, rtol=1e-12, atol=1e-12)


def grad_of(t: Tensor) -> np.ndarray:
    """``t.grad``'s array (failing if there is none)."""
    assert t.grad is not None, "no gradient reached this tensor"
    return t.grad.data
