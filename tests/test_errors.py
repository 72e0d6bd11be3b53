"""Bad input gets a clear error, and leaves every .grad as it was."""

from __future__ import annotations

import numpy as np
import pytest

import pargrad


@pytest.fixture
def x() -> pargrad.Tensor:
    t = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    t.grad = pargrad.tensor([7.0, 7.0, 7.0])
    return t


def unchanged(x: pargrad.Tensor) -> None:
    np.testing.assert_array_equal(x.grad.data, [7.0, 7.0, 7.0])


def test_non_scalar_backward_needs_a_gradient(x: pargrad.Tensor) -> None:
    with pytest.raises(RuntimeError, match=r"shape \(3,\).*pass gradient="):
        (x * 2).backward()
    unchanged(x)


def test_gradient_of_the_wrong_shape(x: pargrad.Tensor) -> None:
    with pytest.raises(RuntimeError, match=r"gradient 0 has shape \(2,\).*shape \(3,\)"):
        (x * 2).backward(np.ones(2))
    unchanged(x)


def test_gradient_of_the_wrong_dtype(x: pargrad.Tensor) -> None:
    with pytest.raises(TypeError, match=r"dtype float32.*dtype float64"):
        (x * 2).backward(np.ones(3, np.float32))
    unchanged(x)


def test_python_gradients_take_the_roots_dtype() -> None:
    x = pargrad.tensor([1.0, 2.0], dtype=np.float32, requires_grad=True)
    (x * 2).backward([1, 1])
    assert x.grad.dtype == np.float32


def test_backward_on_a_tensor_that_does_not_require_grad() -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        pargrad.tensor([1.0]).backward()
    with pytest.raises(TypeError, match="not a Tensor"):
        pargrad.backward([np.ones(1)])  # type: ignore[list-item]


def test_wrong_number_of_root_gradients(x: pargrad.Tensor) -> None:
    with pytest.raises(ValueError, match="2 gradients for 1 tensors"):
        pargrad.backward([x.sum()], [None, None])
    unchanged(x)


def test_incompatible_shapes_name_the_op(x: pargrad.Tensor) -> None:
    with pytest.raises(ValueError, match=r"add: operands could not be broadcast.*shape \(3,\).*"
                                         r"shape \(2,\)"):
        x + np.ones(2)
    with pytest.raises(ValueError, match=r"matmul: .*mismatch"):
        pargrad.matmul(x, np.ones((2, 2)))
    with pytest.raises(ValueError, match="reshape: cannot reshape"):
        x.reshape(2, 2)
    with pytest.raises(ValueError, match="sum: axis 3 is out of bounds"):
        x.sum(axis=3)
    with pytest.raises(ValueError, match="max: zero-size array"):
        pargrad.tensor(np.ones((0, 2))).max(axis=0)
    with pytest.raises(IndexError, match="getitem: index 5 is out of bounds"):
        x[5]
    unchanged(x)


def test_second_backward_through_a_released_graph(x: pargrad.Tensor) -> None:
    y = (x * x).sum()
    y.backward()
    grad = x.grad.data.copy()
    with pytest.raises(pargrad.BackwardError, match="retain_graph=True"):
        y.backward()
    np.testing.assert_array_equal(x.grad.data, grad)
