"""create_graph=True: the backward records a graph that can be differentiated again.

The rules are the first-order ones, run on Tensors; these tests check a few second
derivatives against closed forms (test_gradgradcheck.py checks every op against finite
differences).
"""

from __future__ import annotations

import numpy as np

import pargrad


def test_hessian_vector_product(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = (x ** 3).sum() + (x[0] * x[1])
    y.backward(create_graph=True)
    g = x.grad
    assert g.grad_fn is not None
    np.testing.assert_allclose(g.data, 3 * x.data ** 2 + [2.0, 1.0, 0.0])
    x.grad = None
    v = np.array([1.0, -1.0, 2.0])
    (g * v).sum().backward()
    hessian = np.diag(6 * x.data) + np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(x.grad.data, hessian @ v)


def test_second_derivatives_of_elementwise_ops(engine: pargrad.Engine) -> None:
    values = np.array([0.3, 0.9, 1.7])
    cases = {
        pargrad.exp: np.exp(values),
        pargrad.log: -1 / values ** 2,
        pargrad.sin: -np.sin(values),
        pargrad.tanh: -2 * np.tanh(values) * (1 - np.tanh(values) ** 2),
        pargrad.sqrt: -0.25 * values ** -1.5,
        pargrad.sigmoid: (lambda s: s * (1 - s) * (1 - 2 * s))(1 / (1 + np.exp(-values))),
    }
    for fn, second in cases.items():
        x = pargrad.tensor(values, requires_grad=True)
        fn(x).sum().backward(create_graph=True)
        first = x.grad
        x.grad = None
        first.sum().backward()
        np.testing.assert_allclose(x.grad.data, second, rtol=1e-10, err_msg=str(fn))


def test_third_derivative(engine: pargrad.Engine) -> None:
    x = pargrad.tensor(2.0, requires_grad=True)
    (x ** 4).backward(create_graph=True)
    d1 = x.grad
    x.grad = None
    d1.backward(create_graph=True)
    d2 = x.grad
    x.grad = None
    d2.backward()
    assert (d1.item(), d2.item(), x.grad.item()) == (32.0, 48.0, 48.0)


def test_second_derivative_through_matmul_softmax_and_reductions(
        engine: pargrad.Engine) -> None:
    rng = np.random.default_rng(0)
    w = pargrad.tensor(rng.standard_normal((3, 2)), requires_grad=True)
    a = rng.standard_normal((4, 3))
    v = rng.standard_normal((3, 2))

    def first_grad(weights: np.ndarray) -> np.ndarray:
        t = pargrad.tensor(weights, requires_grad=True)
        pargrad.log_softmax(a @ t, axis=1).max(axis=1).sum().backward()
        return t.grad.data

    (pargrad.log_softmax(a @ w, axis=1).max(axis=1).sum()).backward(create_graph=True)
    g = w.grad
    w.grad = None
    (g * v).sum().backward()
    eps = 1e-6
    numeric = (first_grad(w.data + eps * v) - first_grad(w.data - eps * v)) / (2 * eps)
    np.testing.assert_allclose(w.grad.data, numeric, rtol=1e-5, atol=1e-7)


def test_create_graph_grads_do_not_alias(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = pargrad.tensor([3.0, 4.0], requires_grad=True)
    g = np.array([1.0, 1.0])
    (x + y).backward(g, create_graph=True)
    assert x.grad is not y.grad
    assert not np.shares_memory(x.grad.data, y.grad.data)
    assert not np.shares_memory(x.grad.data, g)
    assert x.grad.requires_grad is False  # the gradient does not depend on x or y


def test_second_derivative_through_indexing_with_repeats(engine: pargrad.Engine) -> None:
    # The first derivative scatters with the differentiable `untake`; the second
    # differentiates that scatter (its rule gathers again).
    index = np.array([0, 2, 2, 1, 0])
    weights = np.array([1.0, -2.0, 0.5, 3.0, 1.5])

    def first_grad(values: np.ndarray, create_graph: bool = False) -> pargrad.Tensor:
        t = pargrad.tensor(values, requires_grad=True)
        (t[index] ** 3 * weights).sum().backward(create_graph=create_graph)
        return t

    x = np.array([0.5, -1.0, 2.0])
    t = first_grad(x, create_graph=True)
    expected = np.zeros(3)
    np.add.at(expected, index, 3 * x[index] ** 2 * weights)
    np.testing.assert_allclose(t.grad.data, expected)
    v = np.array([1.0, 0.5, -1.0])
    g = t.grad
    t.grad = None
    (g * v).sum().backward()
    eps = 1e-6
    numeric = (first_grad(x + eps * v).grad.data - first_grad(x - eps * v).grad.data) / (2 * eps)
    np.testing.assert_allclose(t.grad.data, numeric, rtol=1e-6)
