"""Bad input gets a clear error, and leaves every .grad as it was."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pargrad
from tests.helpers import Boom


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
    with pytest.raises(RuntimeError,
                       match=r"gradient has shape \(2,\).*the tensor has shape \(3,\)"):
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
    with pytest.raises(ValueError, match="2 gradients in grad_tensors= for 1 tensors"):
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


# ----- hints name the real parameter -----
def test_each_caller_names_its_own_gradient_parameter(x: pargrad.Tensor) -> None:
    y = x * 2
    with pytest.raises(RuntimeError, match=r"^Tensor\.backward: the tensor has shape \(3,\).*"
                                           r"pass gradient= "):
        y.backward()
    with pytest.raises(RuntimeError, match=r"^backward: tensors\[0\] has shape \(3,\).*"
                                           r"pass grad_tensors= "):
        pargrad.backward(y)
    with pytest.raises(RuntimeError, match=r"^grad: outputs\[0\] has shape \(3,\).*"
                                           r"pass grad_outputs= "):
        pargrad.grad(y, x)
    with pytest.raises(RuntimeError, match=r"^backward: grad_tensors\[0\] has shape \(2,\)"):
        pargrad.backward([y], [np.ones(2)])
    with pytest.raises(TypeError, match=r"^grad: grad_outputs\[0\] has dtype float32"):
        pargrad.grad([y], [x], [np.ones(3, np.float32)])
    with pytest.raises(ValueError, match=r"^grad: got 2 gradients in grad_outputs= for 1 "
                                         r"outputs"):
        pargrad.grad([y.sum()], [x], [None, None])
    unchanged(x)


# ----- the engine hint only on failures inside a node -----
HINT = "PARGRAD_ENGINE=sequential"


def test_the_engine_hint_is_not_added_to_the_callers_mistakes(x: pargrad.Tensor) -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        y = (x * x).sum()
        y.backward(engine=engine)
        with pytest.raises(pargrad.BackwardError, match="retain_graph=True") as twice:
            y.backward(engine=engine)
        assert HINT not in str(twice.value)
        h = x * 1.0
        z = (h * h).sum()
        h.add_(1.0)
        with pytest.raises(pargrad.BackwardError, match="changed by an in-place") as changed:
            z.backward(engine=engine)
        assert HINT not in str(changed.value)
        with pytest.raises(pargrad.BackwardError, match="returned a gradient of shape") as shape:
            WrongShape.apply(x).sum().backward(engine=engine)
        assert HINT not in str(shape.value)


def test_the_engine_hint_is_on_an_exception_raised_inside_a_node(x: pargrad.Tensor) -> None:
    with pargrad.ThreadedEngine(workers=1) as engine, \
            pytest.raises(pargrad.BackwardError, match=rf"boom; set {HINT}") as info:
        Boom.apply(x).sum().backward(engine=engine)
    assert isinstance(info.value.__cause__, ValueError)
    unchanged(x)


class WrongShape(pargrad.Function):
    @staticmethod
    def forward(ctx: pargrad.FunctionCtx, t: pargrad.Tensor) -> np.ndarray:
        return t.data * 2

    @staticmethod
    def backward(ctx: pargrad.FunctionCtx, g: np.ndarray) -> np.ndarray:
        return np.ones(5)


# ----- no doubled prefixes -----
def test_an_ops_name_is_said_once(x: pargrad.Tensor) -> None:
    with pytest.raises(ValueError, match=r"^matmul: Input operand 1 has a mismatch") as info:
        x @ np.ones((2, 2))
    assert "matmul: matmul:" not in str(info.value)
    with pytest.raises(ValueError) as info:
        np.matmul(x, np.ones((2, 2)))
    assert str(info.value).count("matmul:") == 1


# ----- pargrad.tensor refuses what it cannot hold -----
@pytest.mark.parametrize("data, dtype", [(["a", "b"], "<U1"), ([object()], "object"),
                                         ([1.0, "x"], "<U32"), (np.array([b"x"]), "|S1")])
def test_tensor_refuses_non_numeric_data(data: object, dtype: str) -> None:
    with pytest.raises(TypeError, match=rf"^pargrad.tensor takes numbers .* dtype {dtype}"):
        pargrad.tensor(data)


def test_tensor_takes_every_numeric_kind() -> None:
    for data in ([True], [1], np.array([1], np.uint8), [1.5], [1 + 2j]):
        assert pargrad.tensor(data).shape == (1,)


def test_tensor_refuses_a_list_of_tensors_that_require_grad(x: pargrad.Tensor) -> None:
    with pytest.raises(TypeError, match=r"lose their gradients; use pargrad\.stack"):
        pargrad.tensor([x, x])
    with pytest.raises(TypeError, match=r"pargrad\.stack"):
        pargrad.tensor([[x[0], 1.0]])
    # Tensors that require no grad lose nothing: their values are copied
    plain = pargrad.tensor([pargrad.tensor(1.0), pargrad.tensor(2.0)])
    assert plain.tolist() == [1.0, 2.0]


def test_tensor_of_a_tensor_that_requires_grad_warns_and_detaches(x: pargrad.Tensor) -> None:
    with pytest.warns(UserWarning, match=r"cut off from t's graph.*pargrad\.copy\(t\)") as w:
        t = pargrad.tensor(x * 2)
    assert w[0].filename == __file__  # the warning points at the caller's line
    assert t.is_leaf and not t.requires_grad and t.tolist() == [2.0, 4.0, 6.0]


# ----- torch idioms that cannot work say what to write -----
def test_updating_data_from_a_tensor_says_what_to_write() -> None:
    v = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (v * v).sum().backward()
    with pytest.raises(TypeError, match=r"with pargrad\.no_grad\(\): v -= lr \* v\.grad"):
        v.data -= 0.1 * v.grad
    assert v.tolist() == [1.0, 2.0]
    with pargrad.no_grad():  # what the message says works
        v -= 0.1 * v.grad
    np.testing.assert_allclose(v.data, [0.8, 1.6])
    v.data -= 0.1 * v.grad.data  # and so does the plain-array spelling
    np.testing.assert_allclose(v.data, [0.6, 1.2])


def test_reading_grad_of_a_non_leaf_warns_and_points_to_retain_grad(x: pargrad.Tensor) -> None:
    h = x * 2
    h.sum().backward()
    with pytest.warns(UserWarning, match=r"non-leaf.*\.retain_grad\(\)"):
        assert h.grad is None
    kept = x * 3
    kept.retain_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept.sum().backward()
        assert kept.grad is not None and x.grad is not None
        assert pargrad.tensor([1.0]).grad is None  # a leaf: no warning


def test_the_non_leaf_warning_shows_once_per_line(x: pargrad.Tensor) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            _ = (x * 2).grad
    assert len([w for w in caught if "non-leaf" in str(w.message)]) == 1
