"""Custom Function extras, as in torch.autograd.Function: mark_non_differentiable,
set_materialize_grads, once_differentiable, mark_dirty, and outputs that are views of
inputs or inputs returned unchanged; on every engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import FunctionCtx, Tensor


class SortWithIndices(pargrad.Function):
    """Sorted values (differentiable) and the float positions they came from (not)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(x.data)
        positions = order.astype(np.float64)
        ctx.mark_non_differentiable(positions)
        ctx.order = order  # type: ignore[attr-defined]
        return x.data[order], positions

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor, g_positions: Tensor) -> np.ndarray:
        ctx.seen = g_positions  # type: ignore[attr-defined]
        out = np.zeros_like(g.data)
        out[ctx.order] = g.data  # type: ignore[attr-defined]
        return out


def test_mark_non_differentiable(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([3.0, 1.0, 2.0], requires_grad=True)
    values, positions = SortWithIndices.apply(x)
    assert values.requires_grad and not positions.requires_grad and positions.grad_fn is None
    np.testing.assert_array_equal(positions.data, [1.0, 2.0, 0.0])
    (values * pargrad.tensor([1.0, 10.0, 100.0])).sum().backward()
    np.testing.assert_array_equal(x.grad.data, [100.0, 1.0, 10.0])
    ctx = values.grad_fn.ctx
    np.testing.assert_array_equal(ctx.seen.data, np.zeros(3))  # zeros for it, as in PyTorch


class TwoOutputs(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, materialize: bool) -> tuple[np.ndarray, np.ndarray]:
        ctx.set_materialize_grads(materialize)
        ctx.seen = []  # type: ignore[attr-defined]
        return x.data * 2, x.data * 3

    @staticmethod
    def backward(ctx: FunctionCtx, ga: Tensor | None, gb: Tensor | None) -> Any:
        ctx.seen.append((ga, gb))  # type: ignore[attr-defined]
        total = 0
        if ga is not None:
            total = total + ga * 2
        if gb is not None:
            total = total + gb * 3
        return total, None


@pytest.mark.parametrize("materialize", [True, False])
def test_set_materialize_grads(materialize: bool, engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    a, _ = TwoOutputs.apply(x, materialize)
    a.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])
    (ga, gb) = a.grad_fn.ctx.seen[0]
    np.testing.assert_array_equal(ga.data, [1.0, 1.0])
    if materialize:
        np.testing.assert_array_equal(gb.data, [0.0, 0.0])
    else:
        assert gb is None


class OnceSquare(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> np.ndarray:
        ctx.save_for_backward(x)
        return x.data ** 2

    @staticmethod
    @pargrad.once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> np.ndarray:
        (x,) = ctx.saved_tensors
        ctx.grad_mode = pargrad.is_grad_enabled()  # type: ignore[attr-defined]
        return 2 * x.data * g.data


def test_once_differentiable(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, -2.0], requires_grad=True)
    y = OnceSquare.apply(x)
    (g,) = pargrad.grad(y.sum(), x, create_graph=True)  # first order works under create_graph
    np.testing.assert_array_equal(g.data, [2.0, -4.0])
    assert y.grad_fn.ctx.grad_mode is False  # its backward ran without recording
    assert g.requires_grad and g.grad_fn is not None
    with pytest.raises(pargrad.BackwardError,
                       match=r"DelayedError: OnceSquareBackward has a backward marked "
                             r"@once_differentiable, so the gradients it computed have no "
                             r"derivative"):
        pargrad.grad(g.sum(), x)
    x2 = pargrad.tensor([1.0, -2.0], requires_grad=True)
    OnceSquare.apply(x2).sum().backward()  # and plainly without create_graph
    np.testing.assert_array_equal(x2.grad.data, [2.0, -4.0])
    assert OnceSquare.backward.__name__ == "backward"  # functools.wraps


class AddOneInPlace(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, mark: bool = True, give_back: bool = True) -> Any:
        x.data += 1.0
        if mark:
            ctx.mark_dirty(x)
        return x if give_back else x.data * 1.0

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor) -> Tensor:
        return g * 1.0


def test_mark_dirty(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = w * 3.0
    out = AddOneInPlace.apply(h)
    assert out is h and h._version == 1 and h.grad_fn.name() == "AddOneInPlaceBackward"
    np.testing.assert_array_equal(h.data, [4.0, 7.0])
    (h * h).sum().backward()
    np.testing.assert_array_equal(w.grad.data, [3 * 2 * 4.0, 3 * 2 * 7.0])
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        AddOneInPlace.apply(w)
    with pytest.raises(RuntimeError, match="must be returned as an output"):
        AddOneInPlace.apply(w * 1.0, True, False)
    with pargrad.no_grad():  # no graph to record: the version still moves on
        c = w * 1.0
        assert AddOneInPlace.apply(c) is c and c._version == 1 and c.grad_fn is None


def test_a_saved_tensor_changed_by_a_dirty_function(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = w * 1.0
    y = pargrad.exp(h) * h  # MultiplyBackward saves h
    AddOneInPlace.apply(h)
    with pytest.raises(pargrad.BackwardError, match=r"MultiplyBackward: .*argument 1"):
        y.sum().backward()


class Identity(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor) -> Tensor:
        return g * 5.0  # not the identity's gradient, to show that this backward runs


class Tail(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> np.ndarray:
        return x.data[1:]  # a view of the input's memory

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor) -> np.ndarray:
        return np.concatenate([[0.0], g.data])


def test_outputs_that_are_inputs_or_views(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    same = Identity.apply(w)
    tail = Tail.apply(w)
    for out in (same, tail):
        assert out is not w and out._counter is w._counter
        assert out._view is not None and out._view.base is w and out._view.chain is None
    assert np.shares_memory(same.data, w.data) and np.shares_memory(tail.data, w.data)
    (same.sum() + (tail * tail).sum()).backward()
    np.testing.assert_array_equal(w.grad.data, [5.0, 5.0 + 4.0, 5.0 + 6.0])
    with pytest.raises(RuntimeError, match="output of a custom Function that shares the memory"):
        Tail.apply(w * 1.0).mul_(2)
    h = w * 1.0
    y = pargrad.exp(Identity.apply(h))  # ExpBackward saves its output, not the view
    z = (Identity.apply(h) * 2.0).sum()
    with pargrad.no_grad():
        Identity.apply(h).add_(1)  # a change through the view is a change of h
    assert h._version == 1
    y.sum().backward(retain_graph=True)  # neither node read a value that changed
    z.backward()
    with pytest.raises(pargrad.BackwardError, match=r"MultiplyBackward: .*argument 0"):
        _saved_through_view(h)


def _saved_through_view(h: Tensor) -> None:
    h2 = h * 1.0
    view = Identity.apply(h2)
    loss = (view * view).sum()  # MultiplyBackward saves the view
    with pargrad.no_grad():
        h2.add_(1)  # ... whose memory is h2's
    loss.backward()


def test_function_sees_the_saved_tensor_check(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * 1.0
    y = OnceSquare.apply(h)
    with pargrad.no_grad():
        h[0] = 5.0
    with pytest.raises(pargrad.BackwardError,
                       match=r"OnceSquareBackward: .*saved tensor 0 \(shape \(2,\), dtype "
                             r"float64\) is at version 1, but was saved at version 0"):
        y.sum().backward()
    assert x.grad is None


class TensorTail(pargrad.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return x[1:]  # a Tensor view made in forward

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor) -> np.ndarray:
        return np.concatenate([[0.0], g.data])


def test_a_tensor_view_made_in_forward_is_a_view_of_the_input() -> None:
    h = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True) * 1.0
    out = TensorTail.apply(h)
    assert out._counter is h._counter and out._view is not None and out._view.base is h
    w = pargrad.tensor([5.0, 6.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="output of a custom Function"):
        out.mul_(w)
    h.mul_(2.0)  # its base's history changes: recording through it now says so
    repr(out)  # reading it is fine
    with pytest.raises(RuntimeError, match="apply the Function again"):
        out * 1.0


def test_mark_dirty_bumps_the_version_even_when_apply_refuses() -> None:
    w = pargrad.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        AddOneInPlace.apply(w)
    assert w.data.tolist() == [2.0] and w._version == 1  # forward did change it
    with pytest.raises(RuntimeError, match="a view of a leaf tensor that requires grad"):
        AddOneInPlace.apply(w[:1])
    assert w.data.tolist() == [3.0] and w._version == 2


def test_mark_dirty_on_a_view_gives_its_base_the_change() -> None:
    # (issue 14) A view marked dirty while recording: as an in-place op through a view,
    # its base takes a CopySlicesBackward and the view is made again from it.
    w = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    h = w * 2.0
    v = h[1:]
    out = AddOneInPlace.apply(v)
    assert out is v and v.data.tolist() == [5.0, 7.0] and h.data.tolist() == [2.0, 5.0, 7.0]
    assert h.grad_fn.name() == "CopySlicesBackward" and v.grad_fn is not None
    (h * pargrad.tensor([1.0, 10.0, 100.0])).sum().backward()
    assert w.grad.data.tolist() == [2.0, 20.0, 200.0]
