"""Custom Functions (``pargrad.Function``), following torch.autograd.Function."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor


class MulAdd(pargrad.Function):
    """x * y + c, with c a plain constant."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, c: float) -> np.ndarray:
        ctx.save_for_backward(x, y)
        return x.data * y.data + c

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, Any, None]:
        x, y = ctx.saved_tensors
        gx = g * y if ctx.needs_input_grad[0] else None
        gy = g * x if ctx.needs_input_grad[1] else None
        return gx, gy, None


class SplitHalves(pargrad.Function):
    """Two outputs: the first and second half of a vector."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        n = x.shape[0] // 2
        return x.data[:n].copy(), x.data[n:].copy()

    @staticmethod
    def backward(ctx: Any, g1: Tensor, g2: Tensor) -> Tensor:
        return pargrad.concatenate([g1, g2])


def test_apply_records_a_node(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = pargrad.tensor([3.0, 4.0])
    out = MulAdd.apply(x, y, 10.0)
    assert isinstance(out, Tensor) and out.grad_fn.name() == "MulAddBackward"
    assert out.grad_fn.next_functions[1] == (None, 0)
    np.testing.assert_array_equal(out.data, [13.0, 18.0])
    out.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [3.0, 4.0])
    assert y.grad is None


def test_needs_input_grad(engine: pargrad.Engine) -> None:
    seen = []

    class Probe(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor, b: Any) -> np.ndarray:
            seen.append(ctx.needs_input_grad)
            return a.data * 1.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            return g, None

    Probe.apply(pargrad.tensor(1.0, requires_grad=True), pargrad.tensor(1.0))
    Probe.apply(pargrad.tensor(1.0), 3)
    assert seen == [(True, False), (False, False)]


def test_no_node_without_grad(engine: pargrad.Engine) -> None:
    out = MulAdd.apply(pargrad.tensor(1.0), pargrad.tensor(2.0), 0.0)
    assert out.grad_fn is None and not out.requires_grad
    with pargrad.no_grad():
        out = MulAdd.apply(pargrad.tensor(1.0, requires_grad=True), pargrad.tensor(2.0), 0.0)
    assert out.grad_fn is None


def test_forward_runs_without_grad(engine: pargrad.Engine) -> None:
    class Inner(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            assert not pargrad.is_grad_enabled()
            return x * 2  # a Tensor is fine too

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g * 2

    x = pargrad.tensor(1.0, requires_grad=True)
    Inner.apply(x).backward()
    assert x.grad.item() == 2.0


def test_several_outputs_and_unused_output(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    first, second = SplitHalves.apply(x)
    assert (first.output_nr, second.output_nr) == (0, 1)
    assert first.grad_fn is second.grad_fn
    (second * 3).sum().backward()  # first is unused: its gradient arrives as zeros
    np.testing.assert_array_equal(x.grad.data, [0, 0, 3, 3])
    x.grad = None
    first, second = SplitHalves.apply(x)
    pargrad.backward([first.sum(), (second * 2).sum()])
    np.testing.assert_array_equal(x.grad.data, [1, 1, 2, 2])


def test_integer_output_is_not_differentiable(engine: pargrad.Engine) -> None:
    class ArgMax(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
            return x.data * 1.0, np.argmax(x.data)

        @staticmethod
        def backward(ctx: Any, g: Tensor, g_index: Tensor) -> Tensor:
            return g

    x = pargrad.tensor([1.0, 5.0], requires_grad=True)
    values, index = ArgMax.apply(x)
    assert values.requires_grad and not index.requires_grad and index.item() == 1
    (values * 2).sum().backward()  # the int output's gradient arrives as zeros
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])


def test_wrong_number_of_gradients(engine: pargrad.Engine) -> None:
    class TooFew(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, y: Tensor) -> np.ndarray:
            return x.data + y.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    x, y = pargrad.tensor(1.0, requires_grad=True), pargrad.tensor(2.0, requires_grad=True)
    with pytest.raises(pargrad.BackwardError, match=r"TooFewBackward.*returned 1 gradients.*2"):
        TooFew.apply(x, y).backward()
    assert x.grad is None and y.grad is None


def test_wrong_gradient_shape(engine: pargrad.Engine) -> None:
    class BadShape(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.sum()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> np.ndarray:
            return np.ones(5)

    x = pargrad.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(pargrad.BackwardError,
                       match=r"BadShapeBackward.*shape \(5,\) for input 0.*shape \(3,\)"):
        BadShape.apply(x).backward()
    assert x.grad is None


def test_broadcast_gradient_is_summed_back(engine: pargrad.Engine) -> None:
    class Lazy(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, bias: Tensor) -> np.ndarray:
            return np.ones((4, 3)) + bias.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g  # shape (4, 3) for an input of shape (3,)

    bias = pargrad.tensor(np.zeros(3), requires_grad=True)
    Lazy.apply(bias).sum().backward()
    np.testing.assert_array_equal(bias.grad.data, [4.0, 4.0, 4.0])


def test_saved_tensors_are_freed(engine: pargrad.Engine) -> None:
    x = pargrad.tensor(2.0, requires_grad=True)
    out = MulAdd.apply(x, pargrad.tensor(3.0), 0.0)
    out.backward()
    with pytest.raises(pargrad.BackwardError, match=r"MulAddBackward.*retain_graph=True"):
        out.backward()
    with pytest.raises(RuntimeError, match="freed"):
        _ = out.grad_fn.ctx.saved_tensors


def test_gradcheck_of_a_custom_function() -> None:
    x = pargrad.tensor([0.5, -1.0], requires_grad=True)
    y = pargrad.tensor([2.0, 3.0], requires_grad=True)
    assert pargrad.gradcheck(lambda a, b: MulAdd.apply(a, b, 1.0), [x, y])


def test_a_gradient_that_is_not_an_array(engine: pargrad.Engine) -> None:
    class Strange(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data * 1.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> str:
            return "oops"

    x = pargrad.tensor(1.0, requires_grad=True)
    with pytest.raises(pargrad.BackwardError, match=r"StrangeBackward.*a str for input 0"):
        Strange.apply(x).backward()
    assert x.grad is None


def test_keyword_tensors_that_need_grad_are_refused() -> None:
    class Scale(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, *, factor: Any) -> np.ndarray:
            return x.data * np.asarray(factor)

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    x = pargrad.tensor(1.0, requires_grad=True)
    assert Scale.apply(x, factor=pargrad.tensor(2.0)).item() == 2.0
    with pytest.raises(TypeError, match="factor= requires grad"):
        Scale.apply(x, factor=pargrad.tensor(2.0, requires_grad=True))


def test_backward_may_return_a_list(engine: pargrad.Engine) -> None:
    class Both(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, y: Tensor) -> np.ndarray:
            return x.data + y.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> list[Tensor]:
            return [g, g * 2]

    x, y = pargrad.tensor(1.0, requires_grad=True), pargrad.tensor(1.0, requires_grad=True)
    Both.apply(x, y).backward()
    assert (x.grad.item(), y.grad.item()) == (1.0, 2.0)


def test_saved_tensor_given_new_data_is_refused(engine: pargrad.Engine) -> None:
    x = pargrad.tensor(2.0, requires_grad=True)
    out = MulAdd.apply(x, pargrad.tensor(3.0), 0.0)
    with pargrad.no_grad():
        x.data = x.data + 1
    with pytest.raises(pargrad.BackwardError, match=r"saved tensor 0 was given new \.data"):
        out.backward()
    assert x.grad is None


def test_a_ctx_kept_after_its_graph_is_gone_keeps_nothing_alive() -> None:
    """What forward saved dies with the node, even while the ctx lives elsewhere (the node
    holds it, the ctx only reaches it): the saved input and the graph above it are freed,
    and the ctx then refuses to hand them out. No Python code runs when the node dies."""
    import gc
    import weakref

    kept: list[Any] = []

    class Halve(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: pargrad.Tensor) -> np.ndarray:
            ctx.save_for_backward(x)
            kept.append(ctx)
            return x.data / 2

        @staticmethod
        def backward(ctx: Any, g: pargrad.Tensor) -> pargrad.Tensor:
            return g / 2

    leaf = pargrad.tensor([4.0, -2.0], requires_grad=True)
    middle = pargrad.exp(leaf)
    out = Halve.apply(middle)
    (saved,) = kept[0].saved_tensors
    assert saved is middle
    assert not hasattr(type(out.grad_fn), "__del__")  # no finalizer a Ctrl-C can land in
    middle_alive, node_alive = weakref.ref(middle), weakref.ref(middle.grad_fn)
    del out, middle, saved
    gc.collect()
    assert middle_alive() is None and node_alive() is None
    with pytest.raises(RuntimeError, match="saved tensors were freed"):
        _ = kept[0].saved_tensors
