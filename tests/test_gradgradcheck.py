"""Second derivatives: gradgradcheck itself, every op of docs/ops.md under it, third
derivatives, and the recorded graph of a backward run by worker threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from pargrad.ops import getitem

RNG = np.random.default_rng(7)
A23 = np.array([[0.3, -0.8, 1.2], [0.5, 0.9, -1.4]])  # distinct, no ties, away from 0 and +-1
B23 = np.array([[1.1, 0.4, -0.6], [-0.2, 1.3, 0.7]])
P3 = np.array([0.4, 1.3, 2.2])  # positive
V3 = np.array([0.6, -1.1, 1.9])


def sq(t: Tensor) -> Tensor:
    """A nonlinear tail for linear ops, so that their rule runs in the double backward
    with gradients that depend on x."""
    return t * t


# name -> (function, inputs). Each input array becomes a float64 leaf that requires grad.
OPS: dict[str, tuple[Callable[..., Any], list[np.ndarray]]] = {
    # ----- elementwise -----
    "add": (lambda x, y: sq(x + y), [A23, V3]),
    "subtract": (lambda x, y: sq(x - y), [A23, V3]),
    "multiply": (lambda x, y: x * y, [A23, V3]),
    "divide": (lambda x, y: x / y, [A23, V3]),
    "negative": (lambda x: sq(-x), [V3]),
    "power": (lambda x, y: x ** y, [P3, V3]),
    "power_scalar_exponent": (lambda x: x ** 3, [V3]),
    "power_scalar_base": (lambda x: 2.0 ** x, [V3]),
    "power_sqrt": (lambda x: x ** 0.5, [P3]),
    "exp": (pargrad.exp, [V3]),
    "log": (pargrad.log, [P3]),
    "sqrt": (pargrad.sqrt, [P3]),
    "abs": (lambda x: sq(pargrad.abs(x)), [V3]),
    "relu": (lambda x: sq(pargrad.relu(x)), [V3]),
    "maximum": (lambda x, y: sq(pargrad.maximum(x, y)), [A23, B23]),
    "minimum": (lambda x, y: sq(pargrad.minimum(x, y)), [A23, B23]),
    "clip": (lambda x: sq(pargrad.clip(x, -1.0, 1.0)), [A23]),
    "clip_tensor_bounds": (lambda x, lo, hi: sq(pargrad.clip(x, lo, hi)),
                           [A23, np.array(-1.0), np.array(1.0)]),
    "where": (lambda x, y: sq(pargrad.where(A23 > 0, x, y)), [A23, B23]),
    "sin": (pargrad.sin, [V3]),
    "cos": (pargrad.cos, [V3]),
    "tanh": (pargrad.tanh, [V3]),
    "sigmoid": (pargrad.sigmoid, [V3]),
    "square": (pargrad.square, [V3]),
    "log1p": (pargrad.log1p, [P3]),
    "expm1": (pargrad.expm1, [V3]),
    "softplus": (pargrad.softplus, [V3]),
    "astype": (lambda x: sq(pargrad.astype(x, np.float64)), [V3]),
    "copy": (lambda x: sq(pargrad.copy(x)), [V3]),
    "to": (lambda x: sq(pargrad.to(x, "cpu:1")), [V3]),
    # ----- linear algebra -----
    "matmul": (pargrad.matmul, [A23, B23.T]),
    "matmul_vector_matrix": (pargrad.matmul, [V3, B23.T]),
    "matmul_matrix_vector": (pargrad.matmul, [A23, V3]),
    "matmul_batched": (pargrad.matmul, [RNG.standard_normal((2, 2, 3)), B23.T]),
    "dot": (lambda x, y: sq(pargrad.dot(x, y)), [A23, V3]),
    "outer": (lambda x, y: sq(pargrad.outer(x, y)), [V3, P3]),
    "transpose": (lambda x: sq(pargrad.transpose(x)), [A23]),
    "swapaxes": (lambda x: sq(pargrad.swapaxes(x, 0, 1)), [A23]),
    # ----- reductions -----
    "sum": (lambda x: sq(pargrad.sum(x, axis=1)), [A23]),
    "mean": (lambda x: sq(pargrad.mean(x, axis=0, keepdims=True)), [A23]),
    "max": (lambda x: sq(pargrad.max(x, axis=1)), [A23]),
    "min": (lambda x: sq(pargrad.min(x)), [A23]),
    "logsumexp": (lambda x: pargrad.logsumexp(x, axis=1), [A23]),
    "prod": (lambda x: pargrad.prod(x, axis=1), [A23]),
    "prod_with_a_zero": (lambda x: pargrad.prod(x), [np.array([0.0, 1.3, -0.7])]),
    "var": (lambda x: pargrad.var(x, axis=0, ddof=1), [A23]),
    "std": (lambda x: pargrad.std(x, axis=1), [A23]),
    "cumsum": (lambda x: sq(pargrad.cumsum(x, axis=1)), [A23]),
    # argmax / argmin give plain indices (no gradient); here they pick what is summed
    "argmax": (lambda x: sq(getitem(x, pargrad.argmax(x))), [V3]),
    "argmin": (lambda x: sq(getitem(x, pargrad.argmin(x, axis=0))), [V3]),
    # ----- neural-network ops -----
    "softmax": (lambda x: pargrad.softmax(x, axis=1), [A23]),
    "log_softmax": (lambda x: pargrad.log_softmax(x, axis=0), [A23]),
    # ----- shape ops -----
    "reshape": (lambda x: sq(pargrad.reshape(x, (3, 2))), [A23]),
    "squeeze": (lambda x: sq(pargrad.squeeze(x)), [A23.reshape(2, 1, 3)]),
    "expand_dims": (lambda x: sq(pargrad.expand_dims(x, 1)), [A23]),
    "broadcast_to": (lambda x: sq(pargrad.broadcast_to(x, (2, 3))), [V3]),
    "concatenate": (lambda x, y: sq(pargrad.concatenate([x, y], axis=0)), [A23, B23]),
    "stack": (lambda x, y: sq(pargrad.stack([x, y], axis=1)), [A23, B23]),
    "split": (lambda x: tuple(sq(p) for p in pargrad.split(x, [1], axis=1)), [A23]),
    "split_unused_output": (lambda x: sq(pargrad.split(x, 3, axis=1)[1]), [A23]),
    "getitem_basic": (lambda x: sq(getitem(x, (slice(None), 1))), [A23]),
    "getitem_repeated": (lambda x: sq(getitem(x, np.array([0, 2, 2, 1]))), [V3]),
    # ----- in-place ops (on a non-leaf copy; pargrad/ops/inplace.py) -----
    "setitem": (lambda x, v: sq(_put(x * 1.0, (slice(None), 1), v)), [A23, V3[:2]]),
    "setitem_broadcast_value": (lambda x, v: sq(_put(x * 1.0, np.array([0, 2]), v)),
                                [V3, np.array(0.7)]),
    "inplace_add": (lambda x, y: sq((x * 1.0).add_(y)), [A23, V3]),
    "inplace_sub": (lambda x, y: sq((x * 1.0).sub_(y)), [A23, V3]),
    "inplace_mul": (lambda x, y: (x * 1.0).mul_(y), [A23, V3]),
    "inplace_mul_self": (lambda x: (x * 1.0).mul_(x * 1.0), [V3]),
    "inplace_div": (lambda x, y: (x * 1.0).div_(y), [A23, V3]),
    "inplace_fill_tensor": (lambda x, v: sq(x * (x * 1.0).fill_(v)), [V3, np.array(0.7)]),
    "inplace_zero": (lambda x: sq(x + (x * 1.0).zero_()), [V3]),
}


def _put(x: Tensor, index: Any, value: Tensor) -> Tensor:
    x[index] = value
    return x


def test_every_op_is_in_the_table() -> None:
    exported = {name for name in pargrad.ops.__all__
                if name not in {"Op", "constant", "defop", "dispatch_function", "dispatch_ufunc"}}
    exported |= {"setitem", "inplace"}
    covered = {name.split("_")[0] for name in OPS} | {name for name in OPS}
    assert exported <= covered, exported - covered


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_second_derivatives(name: str, engine: pargrad.Engine) -> None:
    fn, arrays = OPS[name]
    inputs = [pargrad.tensor(a, requires_grad=True) for a in arrays]
    assert pargrad.gradgradcheck(fn, inputs, atol=1e-6, rtol=1e-4)


class DetachesInBackward(pargrad.Function):
    """x ** 3 whose backward reads x's array: right first derivative, but the recorded
    graph loses its dependence on x, so the second derivative in x comes out 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        ctx.save_for_backward(x)
        return x.data ** 3

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x.data ** 2


def test_catches_a_wrong_second_derivative_and_says_where() -> None:
    x = pargrad.tensor([0.5, 1.5, -1.0], requires_grad=True)
    assert pargrad.gradcheck(DetachesInBackward.apply, x)  # first order is right
    with pytest.raises(pargrad.GradcheckError) as info:
        pargrad.gradgradcheck(DetachesInBackward.apply, x)
    message = str(info.value)
    assert message.startswith("gradgradcheck: derivative of the gradient of input 0 at index "
                              "(0,) with respect to input 0 at index (0,): double backward "
                              "gives 0.0, finite differences give ")
    u = np.random.default_rng(0).standard_normal(3)  # the grad_outputs drawn with seed 0
    assert float(message.rsplit(" ", 1)[1]) == pytest.approx(6 * 0.5 * u[0], rel=1e-4)
    big = pargrad.tensor(np.linspace(0.1, 1.0, 80), requires_grad=True)
    with pytest.raises(pargrad.GradcheckError, match=r"with respect to input 0 along random "
                                                     r"direction 0 \(u \. J v\)"):
        pargrad.gradgradcheck(DetachesInBackward.apply, big, full_jacobian_limit=100)


def test_given_grad_outputs_and_several_outputs_and_constants(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.3, 0.7], requires_grad=True)
    y = pargrad.tensor([1.5, -0.4], requires_grad=True)
    fn = lambda a, k, b: (a.sin() * b * k, (a * b).exp().sum())
    assert pargrad.gradgradcheck(fn, [x, 3.0, y])
    us = [pargrad.tensor([1.0, -2.0]), pargrad.tensor(0.5)]  # constants: only x and y checked
    assert pargrad.gradgradcheck(fn, [x, 3.0, y], us)
    with pytest.raises(ValueError, match="got 1 grad_outputs for 2 outputs"):
        pargrad.gradgradcheck(fn, [x, 3.0, y], us[:1])


def test_leaves_every_grad_alone(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([2.0, 3.0], requires_grad=True)  # used by fn, not checked
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x.grad = pargrad.tensor([5.0, 5.0])
    assert pargrad.gradgradcheck(lambda t: (t * t * w).sum(), x)
    np.testing.assert_array_equal(x.grad.data, [5.0, 5.0])
    assert w.grad is None


def test_third_derivatives(engine: pargrad.Engine) -> None:
    values = np.array([0.3, -1.2, 2.0])
    x = pargrad.tensor(values, requires_grad=True)
    x.sin().sum().backward(create_graph=True)
    d1, x.grad = x.grad, None
    d1.sum().backward(create_graph=True)
    d2, x.grad = x.grad, None
    d2.sum().backward()
    np.testing.assert_allclose(d1.data, np.cos(values), rtol=1e-12)
    np.testing.assert_allclose(d2.data, -np.sin(values), rtol=1e-12)
    np.testing.assert_allclose(x.grad.data, -np.cos(values), rtol=1e-12)

    # Third order, checked by finite differences: gradgradcheck of a gradient function.
    def gradient(t: Tensor) -> Tensor:
        (t ** 4 * t.sin()).sum().backward(create_graph=True)
        g, t.grad = t.grad, None
        return g

    assert pargrad.gradgradcheck(gradient, pargrad.tensor(values, requires_grad=True),
                                 atol=1e-5, rtol=1e-4)


SEEN: list[tuple[str, str, bool]] = []  # (node, thread, grad mode) of each logged backward
SEEN_LOCK = threading.Lock()


def log(node: str) -> None:
    with SEEN_LOCK:
        SEEN.append((node, threading.current_thread().name, pargrad.is_grad_enabled()))


class Square(pargrad.Function):
    """x * x; its backward is differentiable: it returns g * Double(x), so that the graph
    a create_graph backward records holds a DoubleBackward for the next backward. The
    backward takes a while, so that idle workers take the other branches meanwhile."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        ctx.save_for_backward(x)
        return x.data ** 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        log("Square")
        time.sleep(0.002)
        (x,) = ctx.saved_tensors
        return g * Double.apply(x)


class Double(pargrad.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data * 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        log("Double")
        return g * 2


def branches(x: Tensor) -> Tensor:
    return pargrad.stack([Square.apply(pargrad.sin(x * k)) for k in range(1, 9)]).sum()


def test_recorded_graph_runs_on_worker_threads() -> None:
    # sum_k sin(k x)^2: first derivative sum_k k sin(2 k x), Hessian diagonal 2 k^2 cos(2 k x).
    values = np.linspace(-1.0, 1.0, 4)
    ks = np.arange(1, 9)[:, None]
    first_derivative = (ks * np.sin(2 * ks * values)).sum(axis=0)
    hessian_times_values = (2 * ks ** 2 * np.cos(2 * ks * values)).sum(axis=0) * values
    with pargrad.ThreadedEngine(workers=4, handoff_threshold=2) as engine:
        for _ in range(5):
            SEEN.clear()
            x = pargrad.tensor(values, requires_grad=True)
            branches(x).backward(create_graph=True, engine=engine)
            first = list(SEEN)
            g, x.grad = x.grad, None
            (g * values).sum().backward(engine=engine)
            second = SEEN[len(first):]
            np.testing.assert_allclose(g.data, first_derivative, rtol=1e-12)
            np.testing.assert_allclose(x.grad.data, hessian_times_values, rtol=1e-12)
            # Grad mode follows the task onto every thread: on while recording, then off.
            assert [(n, mode) for n, _, mode in first] == [("Square", True)] * 8
            assert [(n, mode) for n, _, mode in second] == [("Double", False)] * 8
            recorded_on_workers = [t for _, t, _ in first if t.startswith("pargrad-cpu-")]
            if recorded_on_workers:
                break
        assert recorded_on_workers, first
