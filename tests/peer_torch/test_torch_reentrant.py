"""Ports of PyTorch's TestAutograd: reentrant backward (priority, depth, errors), engine
callbacks (``queue_callback``), checkpointing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Function, once_differentiable
from tests.peer_torch._helpers import assert_equal, rand, randn, value


class _SimulateBackwardError(Function):
    @staticmethod
    def forward(ctx, input):  # type: ignore[no-untyped-def]
        return input.data.copy()

    @staticmethod
    @once_differentiable
    def backward(ctx, input):  # type: ignore[no-untyped-def]
        raise Exception("Simulate error on backward pass")


def test_simple_reentrant() -> None:
    y_data = value(randn(2, 2))

    class Reenter(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            with pargrad.enable_grad():
                ctx.x = pargrad.tensor(x.data, requires_grad=True)
                ctx.y = pargrad.tensor(y_data, requires_grad=True)
                ctx.output_var = ctx.x * ctx.y
            return ctx.output_var.detach()

        @staticmethod
        def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
            with pargrad.enable_grad():
                ctx.output_var.sum().backward()
            return ctx.x.grad * grad_output

    x = randn(2, 2, requires_grad=True)
    out = Reenter.apply(x)
    out.sum().backward()
    assert_equal(x.grad, y_data)


def test_reentrant_child_error() -> None:
    a = rand(3, 3, requires_grad=True)
    c = a * a
    b = rand(3, 3, requires_grad=True)
    e = b * b
    f = _SimulateBackwardError.apply(e)
    reentrant_root = f.sum()

    class ReentrantFunc(Function):
        @staticmethod
        def forward(ctx, inp):  # type: ignore[no-untyped-def]
            return inp.data.copy()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            reentrant_root.backward()
            return grad

    d = ReentrantFunc.apply(c)
    with pytest.raises(Exception, match="Simulate error"):
        d.sum().backward()


class _DeepReentrant(Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        with pargrad.enable_grad():
            ctx.x = pargrad.tensor(x.data, requires_grad=True)
            ctx.x = ctx.x - 1
        return ctx.x.detach()

    @staticmethod
    def backward(ctx, x):  # type: ignore[no-untyped-def]
        if ctx.x.item() < 0:
            return x
        with pargrad.enable_grad():
            _DeepReentrant.apply(ctx.x).sum().backward()
        return x


@pytest.mark.timeout(300)
def test_deep_reentrant() -> None:
    v = pargrad.tensor(2000.0, requires_grad=True)
    _DeepReentrant.apply(v).sum().backward()
    v2 = pargrad.tensor(200.0, requires_grad=True)
    _DeepReentrant.apply(v2).sum().backward()


def test_reentrant_priority(engine: pargrad.Engine, request: pytest.FixtureRequest) -> None:
    if isinstance(engine, pargrad.ThreadedEngine) and engine.handoff_threshold <= 1:
        # Not strict: a race by design. The ReadyQueue does take a nested backward's
        # nodes first, but MyFunction is ready before the nested backwards start, and an
        # idle thread runs it meanwhile (PyTorch runs a device's nodes on one thread).
        request.applymarker(pytest.mark.xfail(
            strict=False, reason="deliberate difference: with nodes handed to several "
            "threads, the parent's ready nodes run alongside a nested backward; "
            "docs/autograd.md"))
    order: list[str] = []

    class MyFunction(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x

        @staticmethod
        def backward(ctx, x):  # type: ignore[no-untyped-def]
            order.append("MyFunction")
            return x

    class Reentrant(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            with pargrad.enable_grad():
                ctx.x = pargrad.tensor(x.data, requires_grad=True)
                ctx.x = ctx.x - 1
            return ctx.x.detach()

        @staticmethod
        def backward(ctx, x):  # type: ignore[no-untyped-def]
            order.append("Reentrant")
            if ctx.x.item() < 0:
                return x
            with pargrad.enable_grad():
                Reentrant.apply(ctx.x).backward()
            return x

    a = MyFunction.apply(pargrad.tensor(6.0, requires_grad=True))
    b = Reentrant.apply(pargrad.tensor(9.0, requires_grad=True))
    v = a * b
    v.backward()
    assert len(order) == 11
    assert order.count("Reentrant") == 10
    assert order[-1] == "MyFunction"


def test_callback_adds_callback() -> None:
    called = [0]

    def callback_final() -> None:
        called[0] += 1

    def callback_adds_callback() -> None:
        called[0] += 1
        pargrad.queue_callback(callback_final)

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, input):  # type: ignore[no-untyped-def]
            return input

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            pargrad.queue_callback(callback_adds_callback)
            return grad

    a = rand(3, 3, requires_grad=True)
    b = MyFunc.apply(a)
    b.sum().backward()
    assert called[0] == 2


def _test_reentrant_with_callbacks(install_callbacks_in_depths: list[int]) -> dict[str, int]:
    counter = {"inner": 0, "outer": 0}

    def inc_inner_counter() -> None:
        counter["inner"] += 1

    def inc_outer_counter() -> None:
        counter["outer"] += 1

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, input):  # type: ignore[no-untyped-def]
            return input

        @staticmethod
        @once_differentiable
        def backward(ctx, input):  # type: ignore[no-untyped-def]
            if 1 in install_callbacks_in_depths:
                pargrad.queue_callback(inc_inner_counter)
            return input

    class MyReentrantFunc(Function):
        @staticmethod
        def forward(ctx, input):  # type: ignore[no-untyped-def]
            return input

        @staticmethod
        @once_differentiable
        def backward(ctx, input):  # type: ignore[no-untyped-def]
            if 0 in install_callbacks_in_depths:
                pargrad.queue_callback(inc_outer_counter)
            tmp_inp = input.detach().requires_grad_()
            with pargrad.enable_grad():
                tmp_out = (MyFunc.apply(tmp_inp)).sum()
            tmp_out.backward()
            return input

    t1 = rand(3, 3, requires_grad=True)
    t2 = MyReentrantFunc.apply(t1)
    t3 = t2.sum()
    pargrad.backward([t3])
    return counter


def test_reentrant_with_callbacks_depth_0() -> None:
    ret = _test_reentrant_with_callbacks([0])
    assert ret["outer"] == 1
    assert ret["inner"] == 0


def test_reentrant_with_callbacks_depth_1() -> None:
    ret = _test_reentrant_with_callbacks([1])
    assert ret["outer"] == 0
    assert ret["inner"] == 1


def test_reentrant_with_callbacks_both_depths() -> None:
    ret = _test_reentrant_with_callbacks([0, 1])
    assert ret["outer"] == 1
    assert ret["inner"] == 1


def test_checkpointing() -> None:
    # torch's proxy network (Linear 10 -> 1000 -> ReLU -> 10) on 2000 inputs, smaller.
    rng = np.random.default_rng(0)
    w1 = pargrad.tensor(rng.standard_normal((10, 100)) * 0.1, requires_grad=True)
    w2 = pargrad.tensor(rng.standard_normal((100, 10)) * 0.1, requires_grad=True)

    def module(x: Any, w1: Any, w2: Any) -> Any:
        return pargrad.relu(x @ w1) @ w2

    feat_combined = []
    for _ in range(20):
        data_r = pargrad.tensor(rng.random((1, 10)), requires_grad=True)
        feat_combined.append(pargrad.checkpoint(module, data_r, w1, w2))
    mean_combined = pargrad.stack(feat_combined).mean()
    mean_combined.backward()
    assert w1.grad is not None and w2.grad is not None


def test_checkpoint_valid_reset_on_error() -> None:
    # torch's first half (grad() through a reentrant checkpoint raises) does not apply:
    # pargrad's checkpoint supports grad(); the checkpoint must work afterwards as well.
    a = randn(2, 2, requires_grad=True)
    b = pargrad.checkpoint(pargrad.exp, a).sum()
    pargrad.grad(b, (a,))
    c = pargrad.checkpoint(pargrad.exp, a).sum()
    c.backward()
    assert_equal(a.grad, np.exp(value(a)))


def test_checkpointing_without_reentrant_correct_grad() -> None:
    a = randn(2, 2, requires_grad=True)
    b = pargrad.exp(a).sum()
    b.backward()
    b_grad = a.grad
    a.grad = None
    c = pargrad.checkpoint(pargrad.exp, a).sum()
    c.backward()
    c_grad = a.grad
    a.grad = None
    d = pargrad.checkpoint(pargrad.exp, a).sum()
    (d_grad,) = pargrad.grad(d, (a,))
    assert_equal(b_grad, c_grad)
    assert_equal(b_grad, d_grad)
