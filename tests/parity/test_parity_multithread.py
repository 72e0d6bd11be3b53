"""Several Python threads calling backward or grad at the same time: each on its own
graph, into one leaf, or through one graph that is freed or retained; a custom backward
that raises; and multi-grad hooks that must tell the concurrent calls apart."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given

import pargrad
from pargrad import Function, Tensor
from tests.parity.support import close, grad_of
from tests.strategies import GraphRecipe, graph_recipes

WAIT = 30.0  # seconds any thread of a test may take before the test fails instead of hanging


def in_threads(fn: Callable[[int], Any], n: int) -> list[Any]:
    """Run ``fn(0)`` ... ``fn(n - 1)`` on ``n`` threads released together; return what
    each returned or raised, in thread order."""
    start = threading.Barrier(n)
    outcomes: list[Any] = [None] * n
    finished = [threading.Event() for _ in range(n)]

    def run(i: int) -> None:
        try:
            start.wait(WAIT)
            outcomes[i] = fn(i)
        except BaseException as exc:  # handed back to the test, whatever it is
            outcomes[i] = exc
        finally:
            finished[i].set()

    for i in range(n):
        threading.Thread(target=run, args=(i,), name=f"caller-{i}", daemon=True).start()
    for i, event in enumerate(finished):
        assert event.wait(WAIT), f"thread {i} of {n} did not finish in {WAIT} s"
    return outcomes


def succeeded(outcomes: list[Any]) -> list[Any]:
    """The results, raising the first exception a thread raised."""
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


# ----- separate graphs, shared leaves -----


def test_threads_with_graphs_of_their_own_each_get_their_own_gradient() -> None:
    def train(i: int) -> np.ndarray:
        x = pargrad.tensor(np.full(3, float(i)), requires_grad=True)
        y = (x + 3.0) * (x - 1.0) * 0.5       # dy/dx = x + 1
        y.sum().backward()
        return grad_of(x)

    for i, grad in enumerate(succeeded(in_threads(train, 10))):
        close(grad, np.full(3, i + 1.0))


def test_concurrent_backward_calls_into_one_leaf_add_up() -> None:
    x = pargrad.tensor([1.0, -2.0, 0.5], requires_grad=True)

    def train(i: int) -> None:
        ((x * x) * (i + 1.0)).sum().backward()

    succeeded(in_threads(train, 10))
    close(x.grad, 2 * x.data * sum(range(1, 11)))   # no update lost


def test_concurrent_grad_calls_each_get_their_own_result_and_touch_no_grad() -> None:
    x = pargrad.tensor([1.0, 3.0], requires_grad=True)

    def differentiate(i: int) -> tuple[Tensor | None, ...]:
        return pargrad.grad(((x + 3.0) * (x + 4.0) * (i + 1.0)).sum(), x)

    for i, grads in enumerate(succeeded(in_threads(differentiate, 10))):
        assert len(grads) == 1
        close(grads[0], (2 * x.data + 7.0) * (i + 1.0))
    assert x.grad is None


@given(recipe=graph_recipes(max_steps=8))
def test_concurrent_backward_through_one_retained_graph_counts_every_call(
        recipe: GraphRecipe) -> None:
    leaves = [pargrad.tensor(a, requires_grad=r)
              for a, r in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    grads = list(recipe.root_grads)
    pargrad.backward(roots, grads, retain_graph=True)
    once = [None if t.grad is None else t.grad.data.copy() for t in leaves]
    for t in leaves:
        t.grad = None
    succeeded(in_threads(lambda i: pargrad.backward(roots, grads, retain_graph=True), 4))
    for t, single in zip(leaves, once):
        if single is None:
            assert t.grad is None
        else:
            np.testing.assert_allclose(grad_of(t), 4 * single, rtol=1e-10, atol=1e-12)


# ----- a shared part of the graph, freed or retained -----


def derivative(x: np.ndarray) -> np.ndarray:
    """d/dx sum(y + y**2) with y = x + x**2."""
    return (1 + 2 * x) * (1 + 2 * (x + x ** 2))


def test_threads_racing_through_a_freed_graph_one_wins_the_rest_are_told_to_retain() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    shared = x + x ** 2

    def train(i: int) -> str:
        own = shared + shared ** 2            # each thread's own nodes on top
        try:
            own.sum().backward()
        except RuntimeError as error:
            assert "retain_graph=True" in str(error), error
            return "refused"
        return "ok"

    outcomes = succeeded(in_threads(train, 5))
    wins = outcomes.count("ok")
    assert wins >= 1
    # A refused backward commits nothing, so each win adds exactly one gradient.
    close(x.grad, wins * derivative(x.data))


def test_threads_through_a_retained_shared_graph_all_succeed() -> None:
    x = pargrad.tensor([0.5, -1.0, 2.0], requires_grad=True)
    shared = x + x ** 2

    def train(i: int) -> None:
        (shared + shared ** 2).sum().backward(retain_graph=True)

    succeeded(in_threads(train, 5))
    close(x.grad, 5 * derivative(x.data))


# ----- errors -----


class Faulty(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise LookupError("lost inside the custom backward")


@pytest.mark.parametrize("caller", ["main thread", "other thread"])
def test_an_error_in_a_custom_backward_keeps_the_raising_line_in_its_traceback(
        caller: str) -> None:
    t = pargrad.tensor([1.0, 2.0], requires_grad=True)
    loss = (Faulty.apply(t) * 2.0).sum()
    if caller == "main thread":
        with pytest.raises(pargrad.BackwardError) as caught:
            loss.backward()
        error: BaseException = caught.value
    else:
        (error,) = in_threads(lambda i: loss.backward(), 1)
        assert isinstance(error, pargrad.BackwardError)
    assert "lost inside the custom backward" in str(error)
    cause = error.__cause__
    assert isinstance(cause, LookupError)
    frames = "".join(traceback.format_tb(cause.__traceback__))
    assert 'raise LookupError("lost inside the custom backward")' in frames


# ----- multi-grad hooks under concurrent backward calls -----


def fails_once() -> type[Function]:
    """An identity whose backward raises the first time it runs (whichever call that
    is), and passes the gradient on after that."""
    lock = threading.Lock()  # guards calls
    calls = [0]

    class FailsOnce(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            with lock:
                calls[0] += 1
                first = calls[0] == 1
            if first:
                raise ArithmeticError("the first call through this node fails")
            return g

    return FailsOnce


class Seen:
    """What a multi-grad hook was called with, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards calls
        self.calls: list[Any] = []

    def add(self, grads: Any) -> None:
        with self._lock:
            self.calls.append(grads)


def four_leaves() -> list[Tensor]:
    return [pargrad.tensor(np.array([1.0, 2.0]) * k, requires_grad=True) for k in (1, 2, 3, 4)]


def scale_of(grad: Tensor, other: Tensor) -> float:
    """The factor of a backward's root gradient, read off a multiply's gradient."""
    ratio = grad.data / other.data
    assert np.allclose(ratio, ratio[0])
    return float(ratio[0])


def test_a_multi_grad_hook_sees_each_concurrent_backwards_own_gradients() -> None:
    t1, t2, t3, t4 = four_leaves()
    seen = Seen()
    handle = pargrad.register_multi_grad_hook((t1, t2, t3, t4), seen.add)
    out = t2 * t3

    def train(i: int) -> None:
        out.backward(np.full(2, i + 1.0), inputs=(t2, t3), retain_graph=True)

    succeeded(in_threads(train, 5))
    assert len(seen.calls) == 5
    scales = []
    for g1, g2, g3, g4 in seen.calls:
        assert g1 is None and g4 is None
        scales.append(scale_of(g2, t3))
        assert scale_of(g3, t2) == scales[-1]   # both from the same backward
    assert sorted(scales) == [1.0, 2.0, 3.0, 4.0, 5.0]
    close(t2.grad, 15 * t3.data)
    handle.remove()
    out.backward(np.ones(2), inputs=(t2, t3))
    assert len(seen.calls) == 5


def test_a_multi_grad_hook_in_mode_all_is_not_called_for_a_failed_backward() -> None:
    t1, t2, t3, t4 = four_leaves()
    seen = Seen()
    pargrad.register_multi_grad_hook((t1, t2, t3, t4), seen.add)
    out = fails_once().apply(t2) * t3

    def train(i: int) -> None:
        out.backward(np.full(2, i + 1.0), inputs=(t2, t3), retain_graph=True)

    outcomes = in_threads(train, 5)
    failed = [i for i, o in enumerate(outcomes) if o is not None]
    assert len(failed) == 1
    error = outcomes[failed[0]]
    assert isinstance(error, pargrad.BackwardError)
    assert "the first call through this node fails" in str(error)
    assert len(seen.calls) == 4
    assert all(g1 is None and g4 is None for g1, _, _, g4 in seen.calls)
    expected = sorted(i + 1.0 for i in range(5) if i != failed[0])
    assert sorted(scale_of(g3, t2) for _, _, g3, _ in seen.calls) == expected
    close(t3.grad, sum(expected) * t2.data)  # the failed call committed nothing


def test_a_multi_grad_hook_in_mode_any_fires_once_per_backward_even_one_that_fails() -> None:
    t1, t2, t3, t4 = four_leaves()
    seen = Seen()
    pargrad.register_multi_grad_hook((t1, t2, t3, t4), seen.add, mode="any")
    out = fails_once().apply(t2) * t3         # t3's gradient is complete before that node

    def train(i: int) -> None:
        out.backward(np.full(2, i + 1.0), inputs=(t2, t3), retain_graph=True)

    outcomes = in_threads(train, 5)
    assert sum(isinstance(o, pargrad.BackwardError) for o in outcomes) == 1
    assert sum(o is None for o in outcomes) == 4
    assert len(seen.calls) == 5
    assert sorted(scale_of(g, t2) for g in seen.calls) == [1.0, 2.0, 3.0, 4.0, 5.0]
