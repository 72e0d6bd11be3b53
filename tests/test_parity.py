"""Behaviours where pargrad once gave a wrong result or a confusing error next to
torch.autograd, each PyTorch's or a documented deliberate difference, with a test of its
own (the parity suite by area is tests/parity)."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Function, Tensor
from tests.helpers import Boom


def leaf(values: Any) -> Tensor:
    return pargrad.tensor(values, requires_grad=True)


# ----- silent wrong results -----

class CubeSavingOutput(Function):
    """y = x**3, saving its own output; backward reads y: dy/dx = 3y/x."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = x ** 3
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        x, y = ctx.saved_tensors
        return g * 3 * y / x


def test_a_saved_output_comes_back_with_its_node(engine: pargrad.Engine) -> None:
    x = leaf([1.5, -2.0])
    y = CubeSavingOutput.apply(x)
    (dy,) = pargrad.grad(y.sum(), x, create_graph=True)
    np.testing.assert_allclose(dy.data, 3 * x.data ** 2)
    (d2y,) = pargrad.grad(dy.sum(), x)
    np.testing.assert_allclose(d2y.data, 6 * x.data)  # was -6x before issue 14
    assert pargrad.gradgradcheck(CubeSavingOutput.apply, [leaf([0.7, 1.3])])

    class Same(Function):  # an input returned unchanged and saved: it stays the input
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> Tensor:
            ctx.save_for_backward(t)
            return t

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (t,) = ctx.saved_tensors
            ctx.seen = t
            return g

    out = Same.apply(x)
    out.sum().backward()
    assert out.grad_fn.ctx.seen is x


def test_grad_mode_decorators_apply_to_a_generators_body() -> None:
    @pargrad.no_grad()
    def numbers() -> Generator[bool, None, None]:
        for _ in range(3):
            yield pargrad.is_grad_enabled()

    @pargrad.enable_grad
    def enabled() -> Generator[bool, None, None]:
        yield pargrad.is_grad_enabled()

    assert list(numbers()) == [False, False, False]
    assert pargrad.is_grad_enabled()  # the caller's mode between the steps
    with pargrad.no_grad():
        assert list(enabled()) == [True]
        assert not pargrad.is_grad_enabled()


def test_set_grad_thread_local() -> None:
    # Grad mode is thread-local: no_grad in one thread leaves another recording.
    x = leaf(np.ones(2))
    seen: list[bool] = []
    barrier = threading.Barrier(2)

    def no_grad_thread() -> None:
        with pargrad.no_grad():
            barrier.wait()
            barrier.wait()

    def recording_thread() -> None:
        barrier.wait()
        seen.append((x * 2).requires_grad)
        barrier.wait()

    threads = [threading.Thread(target=no_grad_thread), threading.Thread(target=recording_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == [True]
    np.testing.assert_array_equal(x.data, np.ones(2))


def test_grad_mode_bare_decorators() -> None:
    x = leaf(1.0)

    @pargrad.no_grad
    def double(t: Tensor) -> Tensor:
        return t * 2

    assert not double(x).requires_grad and pargrad.is_grad_enabled()
    assert not pargrad.no_grad(lambda t: t * 2)(x).requires_grad


# ----- accumulation -----

def test_grad_accumulates_in_place_and_a_failure_leaves_it(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    (x * 3).sum().backward()
    kept = x.grad
    (x * x).sum().backward()
    assert x.grad is kept
    np.testing.assert_array_equal(kept.data, [5.0, 7.0])  # a reference sees the sum

    with pytest.raises(pargrad.BackwardError):
        (Boom.apply(x) + x).sum().backward()
    assert x.grad is kept
    np.testing.assert_array_equal(kept.data, [5.0, 7.0])  # all or nothing


# ----- hooks -----

def test_a_view_hook_does_not_fire_after_an_in_place_change_through_it(
        engine: pargrad.Engine) -> None:
    base = leaf([1.0, 2.0]).copy()
    view = base[:1]
    fired: list[Any] = []
    view.register_hook(lambda g: fired.append("old"))
    view.mul_(3.0)
    view.register_hook(lambda g: fired.append(g.data.tolist()))
    (view * 2).sum().backward()
    assert fired == [[2.0]]


def test_a_hook_on_an_output_without_gradient_sees_none(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0, 3.0])
    a, b, _ = x.split(3)
    seen: list[Any] = []
    a.register_hook(seen.append)
    b.backward()
    assert seen == [None]
    np.testing.assert_array_equal(x.grad.data, [0.0, 1.0, 0.0])


def test_accumulate_grad_pre_and_post_hooks(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    acc = (x * 1.0).grad_fn.next_functions[0][0]
    assert isinstance(acc, pargrad.AccumulateGrad)
    log: list[Any] = []
    acc.register_prehook(lambda grads: (log.append("pre"), (grads[0] * 10,))[1])
    acc.register_hook(lambda gi, go: log.append(("post", gi, go[0].data.tolist())))
    (x * 2).sum().backward()
    assert log == ["pre", ("post", (), [20.0, 20.0])]
    np.testing.assert_array_equal(x.grad.data, [20.0, 20.0])
    log.clear()
    pargrad.grad((x * 2).sum(), x)  # grad() accumulates nothing: they do not run
    assert log == []


def test_a_post_accumulate_grad_hook_returning_a_value_fails(engine: pargrad.Engine) -> None:
    x = leaf([1.0])
    x.register_post_accumulate_grad_hook(lambda t: t.grad)
    with pytest.raises(pargrad.BackwardError, match="should return None"):
        (x * 2).sum().backward()
    assert x.grad is None  # restored


def test_multi_grad_hook(engine: pargrad.Engine) -> None:
    a, b, c = leaf(1.0), leaf(2.0), leaf(3.0)
    got: list[Any] = []
    handle = pargrad.register_multi_grad_hook(
        (a, b, c), lambda grads: got.append([None if g is None else g.item() for g in grads]))
    (a * b).backward()
    assert got == [[2.0, 1.0, None]]
    handle.remove()
    (a * b).backward()
    assert len(got) == 1
    first: list[Any] = []
    pargrad.register_multi_grad_hook((a, c), lambda g: first.append(g.item()), mode="any")
    (a * 5 + c * 7).backward()
    assert len(first) == 1 and first[0] in (5.0, 7.0)


# ----- custom Function -----

class Mixed(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Any:
        y = x.data * 2
        return None, "name", 3, True, y, y

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.got = grads
        return grads[4] * 2, None, None  # extra trailing Nones are accepted


def test_function_outputs_that_are_not_tensors(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    out = Mixed.apply(x)
    assert out[:4] == (None, "name", 3, True)
    assert out[4] is out[5] and isinstance(out[4], Tensor)  # the same object twice
    out[4].sum().backward()
    ctx = out[4].grad_fn.ctx
    assert [g is None for g in ctx.got[:4]] == [True] * 4
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])


def test_materialized_grads_are_differentiable_under_create_graph(
        engine: pargrad.Engine) -> None:
    x, unused = leaf(0.5), leaf(1.0)
    y = x * 2
    _, z = pargrad.grad(y, (x, unused), create_graph=True, materialize_grads=True)
    assert z.requires_grad and z.is_leaf and z.item() == 0
    _, z = pargrad.grad(x * 2, (x, unused), materialize_grads=True)
    assert not z.requires_grad


# ----- errors -----

def test_wrong_shaped_gradients_and_empty_inputs_raise_runtime_error(
        engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match=r"shape \(3,\)"):
        pargrad.grad(x * 2, x, grad_outputs=np.ones(3))
    with pytest.raises(RuntimeError, match=r"shape \(3,\)"):
        pargrad.backward(x * 2, np.ones(3))
    with pytest.raises(RuntimeError, match="inputs must not be empty"):
        (x * 2).sum().backward(inputs=[])
    with pytest.raises(ValueError, match="inputs must not be empty"):  # as PyTorch's grad
        pargrad.grad((x * 2).sum(), [])


def test_the_caught_error_shows_the_failing_line(engine: pargrad.Engine) -> None:
    class Raises(Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> np.ndarray:
            return t.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            raise KeyError("the failing line")

    x = leaf([1.0, 2.0])
    try:
        Raises.apply(x).sum().backward()
    except pargrad.BackwardError:
        text = "".join(traceback.format_tb(sys.exc_info()[2]))
        assert 'raise KeyError("the failing line")' in text
    else:
        pytest.fail("no error")


# ----- reentrant backward and callbacks -----

class Nested(Function):
    """Identity whose backward runs a backward of ``depth`` levels more."""

    order: list[str] = []  # noqa: RUF012 (reset by each test)

    @staticmethod
    def forward(ctx: Any, x: Tensor, depth: int) -> np.ndarray:
        ctx.depth = depth
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        Nested.order.append(f"nested{ctx.depth}")
        if ctx.depth > 0:
            with pargrad.enable_grad():
                inner = leaf(1.0)
                Nested.apply(inner, ctx.depth - 1).backward()
        return g, None


class Mark(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        Nested.order.append("other")
        return g


@pytest.mark.parametrize("make", [pargrad.SequentialEngine, pargrad.ThreadedEngine],
                         ids=["sequential", "threaded"])
def test_a_nested_backward_runs_before_the_parents_other_work(make: Any) -> None:
    engine = make()
    try:
        Nested.order = []
        a = Mark.apply(leaf(1.0))  # created first: lower priority than b's node
        b = Nested.apply(leaf(2.0), 3)
        (a * b).backward(engine=engine)
    finally:
        if isinstance(engine, pargrad.ThreadedEngine):
            engine.shutdown()
    assert Nested.order == ["nested3", "nested2", "nested1", "nested0", "other"]


@pytest.mark.timeout(300)
def test_sequential_engine_survives_2000_nested_backwards() -> None:
    sys_limit = sys.getrecursionlimit()
    with pargrad.use_engine(pargrad.SequentialEngine()):
        Nested.order = []
        Nested.apply(leaf(1.0), 2000).backward()
    assert len(Nested.order) == 2001 and sys.getrecursionlimit() == sys_limit


def test_queue_callback_runs_at_the_end_of_the_current_backward(engine: pargrad.Engine) -> None:
    log: list[str] = []

    class Queues(Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> np.ndarray:
            return t.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            pargrad.queue_callback(lambda: log.append("callback"))
            log.append("node")
            return g

    x = leaf([1.0, 2.0])
    y = Queues.apply(x).exp()
    y.register_hook(lambda g: log.append("hook"))
    y.sum().backward()
    assert log == ["hook", "node", "callback"]
    with pytest.raises(RuntimeError, match="during the backward pass"):
        pargrad.queue_callback(lambda: None)
    log.clear()
    threads = [threading.Thread(target=lambda: Queues.apply(x).sum().backward())
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(log) == ["callback"] * 4 + ["node"] * 4


# ----- missing API -----

def test_detach_in_place(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    y = x * 2
    assert y.detach_() is y and y.is_leaf and not y.requires_grad
    with pytest.raises(RuntimeError, match="view"):
        (x * 2)[:1].detach_()


@pytest.mark.parametrize("name, fn, d", [
    ("exp_", np.exp, np.exp),
    ("tanh_", np.tanh, lambda v: 1 - np.tanh(v) ** 2),
    ("sigmoid_", lambda v: 1 / (1 + np.exp(-v)),
     lambda v: np.exp(-v) / (1 + np.exp(-v)) ** 2),
    ("relu_", lambda v: np.maximum(v, 0), lambda v: (v > 0) * 1.0),
    ("neg_", np.negative, lambda v: -np.ones_like(v)),
    ("clamp_", lambda v: np.clip(v, -0.5, 0.5), lambda v: (np.abs(v) < 0.5) * 1.0),
])
def test_in_place_unary_ops(engine: pargrad.Engine, name: str, fn: Any, d: Any) -> None:
    values = np.array([-1.0, -0.2, 0.3, 2.0])
    x = leaf(values)
    h = x * 1.0
    args = (-0.5, 0.5) if name == "clamp_" else ()
    out = getattr(h, name)(*args)
    assert out is h and h._version == 1
    np.testing.assert_allclose(h.data, fn(values))
    h.sum().backward()
    np.testing.assert_allclose(x.grad.data, d(values))


# ----- the decision on indexing nodes -----

def test_a_second_backward_through_indexing_is_allowed(engine: pargrad.Engine) -> None:
    # Deliberate difference (docs/autograd.md): PyTorch refuses without retain_graph.
    b = leaf([1.0, 2.0, 3.0])
    c = pargrad.tensor(np.zeros(3))
    c[[1, 2]] = b[[1, 1]]
    c.backward(np.ones(3))
    c.backward(np.ones(3))
    np.testing.assert_array_equal(b.grad.data, [0.0, 4.0, 0.0])
    y = (b * b)[[0, 2]]
    y.sum().backward()
    with pytest.raises(pargrad.BackwardError, match="retain_graph=True"):
        y.sum().backward()  # a node that saved values still refuses


def test_queue_callback_in_an_asynchronous_backward(engine: pargrad.Engine) -> None:
    log: list[str] = []

    class Queues(Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor, fail: bool) -> np.ndarray:
            ctx.fail = fail
            return t.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            def callback() -> None:
                log.append("callback")
                if ctx.fail:
                    raise KeyError("from the callback")

            pargrad.queue_callback(callback)
            return g, None

    x = leaf([1.0, 2.0])
    future = pargrad.backward_async(Queues.apply(x, False).sum())
    future.result(timeout=30)
    assert log == ["callback"]
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])
    future = pargrad.backward_async(Queues.apply(x, True).sum())
    with pytest.raises(KeyError, match="from the callback"):
        future.result(timeout=30)
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])  # nothing committed
