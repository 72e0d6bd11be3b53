"""Custom Functions (``pargrad.Function``) as a torch.autograd user relies on them: what
``apply`` passes in and hands back, what ``backward`` receives and may return, saved
tensors, ``once_differentiable``, ``set_materialize_grads``, ``mark_non_differentiable``
and ``mark_dirty``, and outputs that share memory with their inputs."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad import BackwardError, Function, Tensor, once_differentiable
from tests.parity.support import close, leaf
from tests.strategies import GraphRecipe, graph_recipes, nonempty_shapes, values

# pargrad reports a failing backward as a BackwardError that names the node and chains
# the original exception; PyTorch re-raises the original exception's type.
WRAPPED = ("a backward's exception reaches the caller as a BackwardError naming the node, "
           "the original exception as __cause__ (PyTorch re-raises its type)")


class Cut(Function):
    """An identity in forward whose backward always returns None: the tensor fed into it
    gets no gradient from this node, whatever gradient arrives here."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> None:
        return None


class Poly(Function):
    """x * x * y + k * y, k a Python number; notes the grad mode its backward ran in."""

    grad_modes: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, k: float) -> np.ndarray:
        ctx.k = k
        ctx.save_for_backward(x, y)
        return x.data * x.data * y.data + k * y.data

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, Any, None]:
        Poly.grad_modes.append(pargrad.is_grad_enabled())
        x, y = ctx.saved_tensors
        return g * 2 * x * y, g * (x * x + ctx.k), None


class OncePoly(Function):
    """Poly, with a backward that cannot itself be differentiated."""

    forward = Poly.forward

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Any, Any, None]:
        return Poly.backward(ctx, g)


# ----- what apply passes in and hands back -----


def test_forward_gets_the_tensors_themselves_and_other_arguments_as_given() -> None:
    seen: dict[str, Any] = {}

    class Shift(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, by: int, label: str) -> np.ndarray:
            seen.update(x=x, by=by, label=label, needs=ctx.needs_input_grad)
            ctx.by = by
            ctx.save_for_backward(x)
            return x.data + by

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Any, None, None]:
            seen.update(by_later=ctx.by, g=g, saved=ctx.saved_tensors)
            return g * 3, None, None

    x = leaf(1.0, 2.0)
    out = Shift.apply(x, 4, "label")
    close(out, [5.0, 6.0])
    out.sum().backward()
    assert seen["x"] is x
    assert type(seen["by"]) is int and seen["by"] == 4 and seen["label"] == "label"
    assert seen["needs"] == (True, False, False)
    # What forward leaves on ctx is there for backward, and gradients arrive as Tensors.
    assert seen["by_later"] == 4
    assert isinstance(seen["g"], Tensor) and isinstance(seen["saved"][0], Tensor)
    close(x.grad, [3.0, 3.0])


class Mixed(Function):
    """Tensors among values that are not: a tag, None, an int and a bool, plus the first
    input returned as it came."""

    received: ClassVar[list[tuple[Any, ...]]] = []

    @staticmethod
    def forward(ctx: Any, u: Tensor, k: int, v: Tensor) -> tuple[Any, ...]:
        ctx.k = k
        ctx.save_for_backward(u, v)
        w = u * v       # Tensors, not arrays: forward runs with grad mode off
        w *= k
        return "tag", w, None, 7, u + v, False, u

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple[Any, None, Any]:
        Mixed.received.append(grads)
        u, v = ctx.saved_tensors
        g_w, g_sum, g_u = grads[1], grads[4], grads[6]
        return g_w * ctx.k * v + g_sum + g_u, None, g_w * ctx.k * u + g_sum


def test_outputs_that_are_not_tensors_come_back_as_themselves_in_place() -> None:
    u, v = leaf(1.0, 2.0), pargrad.tensor([3.0, -4.0])
    out = Mixed.apply(u, 2, v)
    assert len(out) == 7
    assert out[0] == "tag" and out[2] is None and out[5] is False
    assert type(out[3]) is int and out[3] == 7
    close(out[1], [6.0, -16.0])
    close(out[4], [4.0, -2.0])
    close(out[6], [1.0, 2.0])
    assert all(out[i].grad_fn.name() == "MixedBackward" for i in (1, 4, 6))


def test_backward_gets_one_gradient_per_output_and_none_for_the_others() -> None:
    Mixed.received.clear()
    u, v = leaf(1.0, 2.0), pargrad.tensor([3.0, -4.0])
    out = Mixed.apply(u, 2, v)
    pargrad.backward([out[1], out[4], out[6]],
                     [np.array([1.0, 10.0]), np.array([0.5, 0.5]), np.array([-1.0, 2.0])])
    (grads,) = Mixed.received
    assert len(grads) == 7
    assert [i for i, g in enumerate(grads) if g is None] == [0, 2, 3, 5]
    close(grads[1], [1.0, 10.0])
    close(grads[6], [-1.0, 2.0])
    # du = g_w * 2v + g_sum + g_u; v needs no grad, so what backward returned for it goes
    # nowhere.
    close(u.grad, [1.0 * 6 + 0.5 - 1.0, 10.0 * -8 + 0.5 + 2.0])
    assert v.grad is None


@given(data=st.data(), k=st.integers(-3, 3))
def test_gradcheck_passes_through_a_function_with_non_tensor_outputs(
        data: st.DataObject, k: int) -> None:
    shape = data.draw(nonempty_shapes)
    u = pargrad.tensor(values(data.draw, shape), requires_grad=True)
    v = pargrad.tensor(values(data.draw, shape), requires_grad=True)

    def tensor_outputs(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        out = Mixed.apply(a, k, b)
        return out[1], out[4], out[6]

    assert pargrad.gradcheck(tensor_outputs, (u, v))


def test_apply_on_plain_numbers_returns_what_forward_returned() -> None:
    class Combine(Function):
        @staticmethod
        def forward(ctx: Any, p: float, q: float, scale: int) -> tuple[Any, ...]:
            return (p + q) * scale, "done", p * q, None

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise AssertionError("nothing requires grad: no backward to run")

    out = Combine.apply(0.5, 2.0, 3)
    assert out == (7.5, "done", 1.0, None)
    assert all(type(out[i]) is float for i in (0, 2))


# ----- first- and second-order gradients -----


@given(data=st.data(), k=st.integers(-3, 3))
def test_gradients_of_a_function_are_what_its_backward_says(
        data: st.DataObject, k: int) -> None:
    shape = data.draw(nonempty_shapes)
    xs, ys = values(data.draw, shape), values(data.draw, shape)
    x = pargrad.tensor(xs, requires_grad=True)
    y = pargrad.tensor(ys, requires_grad=True)
    Poly.apply(x, y, k).sum().backward()
    np.testing.assert_allclose(x.grad.data, 2 * xs * ys, rtol=1e-12)
    np.testing.assert_allclose(y.grad.data, xs * xs + k, rtol=1e-12)


def test_backward_under_create_graph_records_a_differentiable_graph() -> None:
    Poly.grad_modes.clear()
    x, y = leaf(1.0, 2.0), leaf(3.0, -1.0)
    go = pargrad.tensor(1.5, requires_grad=True)
    Poly.apply(x, y, 2).sum().backward(go, create_graph=True)
    assert Poly.grad_modes == [True]
    close(x.grad, [9.0, -6.0])        # go * 2xy
    close(y.grad, [4.5, 9.0])         # go * (x^2 + 2)
    assert x.grad.grad_fn is not None and y.grad.grad_fn is not None
    # sum(go * 2xy) differentiated again: go * 2y, go * 2x, and sum(2xy) for go itself.
    dx, dy, dgo = pargrad.grad(x.grad.sum(), [x, y, go])
    close(dx, [9.0, -3.0])
    close(dy, [3.0, 6.0])
    close(dgo, 2.0)


# ----- once_differentiable -----


@pytest.mark.parametrize(("fn", "create_graph", "grad_mode"), [
    (Poly, True, True), (Poly, False, False), (OncePoly, True, False), (OncePoly, False, False),
])
def test_backward_runs_with_grad_mode_on_only_when_recording_a_differentiable_graph(
        fn: type[Function], create_graph: bool, grad_mode: bool) -> None:
    Poly.grad_modes.clear()
    x, y = leaf(0.5), leaf(2.0)
    fn.apply(x, y, 1).sum().backward(create_graph=create_graph)
    assert Poly.grad_modes == [grad_mode]


def once_graph() -> tuple[Tensor, Tensor, Tensor]:
    """x, y and the incoming gradient, after a create_graph backward through OncePoly."""
    x, y = leaf(1.0, 2.0), leaf(3.0, -1.0)
    go = pargrad.tensor(1.5, requires_grad=True)
    OncePoly.apply(x, y, 2).sum().backward(go, create_graph=True)
    return x, y, go


def test_once_differentiable_backward_gives_exact_first_order_gradients() -> None:
    x, y, _ = once_graph()
    close(x.grad, [9.0, -6.0])
    close(y.grad, [4.5, 9.0])
    assert x.grad.grad_fn is not None and y.grad.grad_fn is not None


def test_once_differentiable_gradients_hang_off_an_error_node_over_every_leaf() -> None:
    x, y, go = once_graph()
    for gradient in (x.grad, y.grad):
        names, leaves = set(), []
        stack = [gradient.grad_fn]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            names.add(node.name())
            if isinstance(node, pargrad.AccumulateGrad):
                leaves.append(node.variable)
            stack.extend(n for n, _ in node.next_functions)
        assert "DelayedError" in names
        # It stands for the Function's inputs and for the gradient that flowed in.
        assert {id(t) for t in leaves} == {id(x), id(y), id(go)}


def test_differentiating_once_differentiable_gradients_raises() -> None:
    x, y, _ = once_graph()
    message = "OncePolyBackward.*@once_differentiable"
    with pytest.raises(BackwardError, match=message):
        pargrad.grad(x.grad.sum(), [x, y], allow_unused=True)
    with pytest.raises(RuntimeError, match=message):
        y.grad.sum().backward()


# ----- what backward may return -----


class Twice(Function):
    """forward hands back its input itself; backward doubles."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g * 2


@pytest.mark.parametrize("shape", [(), (1,), (2, 3)])
def test_returning_the_input_still_routes_its_gradient_through_backward(
        shape: tuple[int, ...]) -> None:
    x = pargrad.tensor(np.full(shape, 1.5), requires_grad=True)
    out = Twice.apply(x)
    assert out is not x and np.shares_memory(out.data, x.data)
    assert out.grad_fn.name() == "TwiceBackward"
    out.sum().backward()
    close(x.grad, np.full(shape, 2.0))
    x.grad = None
    Twice.apply(x * 3.0).sum().backward()    # a non-leaf input: the same
    close(x.grad, np.full(shape, 6.0))


class Opaque(Function):
    """A gradient of None for its only input, whatever comes in."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data - 1

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> None:
        return None


@pytest.mark.parametrize("build", [
    lambda x: Opaque.apply(x),
    lambda x: Opaque.apply(x * x),
    lambda x: Opaque.apply(x).sum(),
], ids=["on-the-leaf", "after-an-op", "before-an-op"])
def test_backward_returning_none_leaves_the_input_without_gradient(
        build: Callable[[Tensor], Tensor]) -> None:
    x = leaf(4.0)
    build(x).backward()
    assert x.grad is None
    assert pargrad.grad(build(x), x, allow_unused=True) == (None,)


def test_trailing_nones_beyond_the_inputs_are_ignored() -> None:
    class Half(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data / 2

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Any, None, None]:
            return g / 2, None, None

    x = leaf(1.0, 3.0)
    Half.apply(x).sum().backward()
    close(x.grad, [0.5, 0.5])


def test_an_extra_gradient_that_is_not_none_is_refused() -> None:
    class Half(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data / 2

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Any, Any]:
            return g / 2, g

    with pytest.raises(BackwardError, match="returned 2 gradients, but the forward had 1 input"):
        Half.apply(leaf(1.0, 3.0)).sum().backward()


def test_a_gradient_of_the_wrong_shape_is_refused_naming_both_shapes() -> None:
    class Total(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.sum()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> np.ndarray:
            return np.ones(4)

    x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(BackwardError, match=r"TotalBackward: .*shape \(4,\).*shape \(2, 3\)"):
        Total.apply(x).backward()
    assert x.grad is None


def boom(ctx: Any, g: Tensor) -> None:
    raise KeyError("wrecked on purpose")


@pytest.mark.differs(WRAPPED)
@pytest.mark.parametrize("backward", [boom, once_differentiable(boom)],
                         ids=["plain", "once-differentiable"])
def test_an_exception_in_backward_reaches_the_caller(backward: Callable[..., None]) -> None:
    Boom = type("Boom", (Function,), {
        "forward": staticmethod(lambda ctx, x: x.data * 3),
        "backward": staticmethod(backward),
    })
    x = leaf(1.0, 2.0)
    with pytest.raises(BackwardError, match="BoomBackward: KeyError: 'wrecked on purpose'") as e:
        Boom.apply(x * x).sum().backward()
    assert isinstance(e.value.__cause__, KeyError)
    assert x.grad is None


def test_a_function_without_forward_fails_at_apply() -> None:
    class OnlyBackward(Function):
        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    with pytest.raises(NotImplementedError, match="must define a static forward"):
        OnlyBackward.apply(leaf(1.0))


@pytest.mark.differs(WRAPPED)
def test_a_function_without_backward_fails_when_backward_reaches_it() -> None:
    class OnlyForward(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data + 1

    out = OnlyForward.apply(leaf(1.0))    # recording the node is fine
    close(out, [2.0])
    with pytest.raises(BackwardError, match=r"OnlyForwardBackward: .*must define a static "
                                            r"backward") as e:
        out.sum().backward()
    assert isinstance(e.value.__cause__, NotImplementedError)


# ----- save_for_backward -----


def test_saved_nones_come_back_as_none_around_the_saved_tensor() -> None:
    kinds: list[list[str]] = []

    class Cube(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            ctx.save_for_backward(None, x, None)
            return x.data ** 3

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            saved = ctx.saved_tensors
            kinds.append([type(s).__name__ for s in saved])
            return 3 * saved[1] ** 2 * g

    x = leaf(1.0, -2.0)
    Cube.apply(x).sum().backward()
    assert kinds == [["NoneType", "Tensor", "NoneType"]]
    close(x.grad, [3.0, 12.0])


def test_a_stashed_ctx_serves_saved_tensors_only_while_its_graph_lives() -> None:
    stash: list[Any] = []

    class ExpProduct(Function):
        @staticmethod
        def forward(ctx: Any, p: Tensor, q: Tensor) -> np.ndarray:
            ctx.save_for_backward(p, q)
            return p.data * np.exp(q.data)

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
            stash.append(ctx)
            p, q = ctx.saved_tensors
            return g * pargrad.exp(q), g * p * pargrad.exp(q)

    p = pargrad.tensor([[2.0, -1.0], [0.5, 3.0]], requires_grad=True)
    q = pargrad.tensor([[0.0, 1.0], [-1.0, 0.5]], requires_grad=True)
    out = ExpProduct.apply(p, q)
    out.backward(np.ones((2, 2)), retain_graph=True)
    close(q.grad, p.data * np.exp(q.data))
    (ctx,) = stash
    # Read outside any backward: the retained graph still owns what forward saved.
    kept_p, kept_q = ctx.saved_tensors
    close(kept_p, p.data)
    close(kept_q, q.data)
    del out
    gc.collect()
    with pytest.raises(RuntimeError, match="saved tensors were freed"):
        _ = ctx.saved_tensors


class Reciprocal(Function):
    """1 / x, saving both its input and its own output; ``from_output`` picks which one
    backward builds the derivative from: -1 / x**2, or -y**2 with y the output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, from_output: bool) -> Tensor:
        y = 1.0 / x
        ctx.from_output = from_output
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        x, y = ctx.saved_tensors
        if ctx.from_output:
            return -g * y * y, None
        return -g / (x * x), None


DERIVED_FROM = pytest.mark.parametrize("from_output", [False, True],
                                       ids=["from-input", "from-output"])


@DERIVED_FROM
def test_a_function_saving_its_own_output_passes_both_gradchecks(from_output: bool) -> None:
    x = leaf(0.8, -1.25, 2.0)
    assert pargrad.gradcheck(lambda t: Reciprocal.apply(t, from_output), [x])
    assert pargrad.gradgradcheck(lambda t: Reciprocal.apply(t, from_output), [x])


@DERIVED_FROM
def test_grad_through_a_function_saving_its_own_output_differentiates_again(
        from_output: bool) -> None:
    x = leaf(0.5, -2.0, 4.0)
    (first,) = pargrad.grad(Reciprocal.apply(x, from_output).sum(), x, create_graph=True)
    close(first, [-4.0, -0.25, -0.0625])       # -1 / x**2
    assert first.requires_grad
    (second,) = pargrad.grad(first.sum(), x)
    close(second, [16.0, -0.25, 0.03125])      # 2 / x**3


@DERIVED_FROM
def test_create_graph_keeps_a_saved_output_for_the_next_grad(from_output: bool) -> None:
    x = leaf(-0.5, 1.0, 2.5)
    y = Reciprocal.apply(x, from_output)
    go = np.array([2.0, -1.0, 0.5])
    (first,) = pargrad.grad(y, x, go, create_graph=True)
    (again,) = pargrad.grad(y, x, go)         # no retain_graph: create_graph implied it
    close(first, -go / x.data ** 2)
    close(again, first.data)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        pargrad.grad(y, x, go)                # the plain pass did free them


# ----- set_materialize_grads -----


class Probe(Function):
    """2x in a chosen float dtype; notes what its backward received."""

    received: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: type, materialize: bool) -> np.ndarray:
        ctx.set_materialize_grads(materialize)
        return (x.data * 2).astype(dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[Any, None, None]:
        Probe.received.append(g)
        return None if g is None else g * 2, None, None


@given(shape=nonempty_shapes, dtype=st.sampled_from([np.float32, np.float64]))
def test_backward_gets_zeros_like_an_output_that_got_no_gradient(
        shape: tuple[int, ...], dtype: type) -> None:
    Probe.received.clear()
    x = pargrad.tensor(np.ones(shape), requires_grad=True)
    Cut.apply(Probe.apply(x, dtype, True)).sum().backward()
    (g,) = Probe.received
    assert isinstance(g, Tensor) and g.shape == shape and g.dtype == dtype
    assert not g.data.any()
    close(x.grad, np.zeros(shape))


def test_without_materialized_grads_backward_gets_none() -> None:
    Probe.received.clear()
    x = leaf(1.0, 2.0)
    Cut.apply(Probe.apply(x, np.float64, False)).sum().backward()
    assert Probe.received == [None]
    assert x.grad is None


# ----- mark_non_differentiable -----


def test_a_mask_marked_non_differentiable_is_a_constant() -> None:
    class Positive(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            mask = x.data > 0
            ctx.mark_non_differentiable(mask)
            return mask

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Any:
            raise AssertionError("no gradient flows into a constant")

    x = leaf(-1.0, 2.0, -3.0)
    mask = Positive.apply(x)
    assert mask.dtype == bool and not mask.requires_grad and mask.grad_fn is None
    pargrad.where(mask, 0.0, x * x).sum().backward()
    close(x.grad, [-2.0, 0.0, -6.0])


def test_an_output_marked_non_differentiable_gets_zeros_beside_a_real_gradient() -> None:
    received: list[tuple[np.ndarray, np.ndarray]] = []

    class Bracket(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
            below, above = x.data - 1, x.data * 3
            ctx.mark_non_differentiable(below)
            return below, above

        @staticmethod
        def backward(ctx: Any, g_below: Tensor, g_above: Tensor) -> Tensor:
            received.append((g_below.data.copy(), g_above.data.copy()))
            return g_above * 3

    x = leaf(1.0, 2.0)
    below, above = Bracket.apply(x)
    assert not below.requires_grad and above.requires_grad
    (above * pargrad.tensor([2.0, 5.0])).sum().backward()
    ((g_below, g_above),) = received
    close(g_below, [0.0, 0.0])
    close(g_above, [2.0, 5.0])
    close(x.grad, [6.0, 15.0])


def test_a_lone_output_marked_non_differentiable_enters_later_ops_as_a_constant() -> None:
    class Floor(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            floored = np.floor(x.data)
            ctx.mark_non_differentiable(floored)
            return floored

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> None:
            return None

    x, w = leaf(1.5, -0.5, 2.25), leaf(4.0, 1.0, -1.0)
    floor = Floor.apply(x)
    assert not floor.requires_grad and floor.grad_fn is None
    close(floor, [1.0, -1.0, 2.0])
    (x * x * floor + w * floor).sum().backward()
    close(x.grad, [3.0, 1.0, 9.0])             # 2x * floor(x), floor(x) held fixed
    close(w.grad, [1.0, -1.0, 2.0])


def test_a_non_differentiable_side_output_weighs_another_function_as_a_constant() -> None:
    class WithSigns(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> tuple[Tensor, np.ndarray]:
            signs = np.sign(x.data)
            ctx.mark_non_differentiable(signs)
            return x, signs

        @staticmethod
        def backward(ctx: Any, g_x: Tensor, g_signs: Tensor) -> Tensor:
            return g_x

    class Weigh(Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor, weights: Tensor) -> np.ndarray:
            ctx.weights = weights.data.copy()
            return a.data * weights.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            return g * ctx.weights, None

    x = leaf(-3.0, 0.5, 2.0, -0.25)
    same, signs = WithSigns.apply(x)
    assert same.requires_grad and not signs.requires_grad
    doubled = signs * 2.0
    assert not doubled.requires_grad and doubled.grad_fn is None
    out = Weigh.apply(same, doubled)
    out.backward(np.array([1.0, 2.0, 3.0, 4.0]))
    close(x.grad, [-2.0, 4.0, 6.0, -8.0])      # g * 2 sign(x)


# ----- outputs sharing memory with an input, or with each other -----


def test_the_same_array_returned_twice_is_one_output_object() -> None:
    received: list[tuple[np.ndarray, np.ndarray]] = []

    class Both(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
            tripled = x.data * 3
            return tripled, tripled

        @staticmethod
        def backward(ctx: Any, g1: Tensor, g2: Tensor) -> Tensor:
            received.append((g1.data.copy(), g2.data.copy()))
            return (g1 + g2) * 3

    x = leaf(1.0, 2.0)
    first, second = Both.apply(x)
    assert first is second
    (first + second).sum().backward()
    # One output, used twice: its gradient arrives once, the repeat gets none of its own.
    ((g1, g2),) = received
    close(g1, [2.0, 2.0])
    close(g2, [0.0, 0.0])
    close(x.grad, [6.0, 6.0])
    t = leaf(0.5, -1.5)
    assert pargrad.gradcheck(lambda a: sum(Both.apply(a)), [t])
    assert pargrad.gradgradcheck(lambda a: sum(Both.apply(a)), [t])


def test_a_view_of_a_local_copy_changed_in_place_is_an_ordinary_output() -> None:
    class Tail(Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor, bump: bool) -> Tensor:
            tail = t.copy()[1:]
            if bump:
                tail += 5
            return tail

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[np.ndarray, None]:
            full = np.zeros(3)
            full[1:] = g.data
            return full, None

    t = leaf(1.0, 2.0, 3.0)
    for bump, expected in [(False, [2.0, 3.0]), (True, [7.0, 8.0])]:
        out = Tail.apply(t, bump)
        assert out.grad_fn.name() == "TailBackward"
        close(out, expected)
        t.grad = None
        (out * out).sum().backward()
        close(t.grad, [0.0, *(2 * np.array(expected))])
    close(t, [1.0, 2.0, 3.0])


class Flatten(Function):
    """Returns a view of its input's memory."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t.reshape(-1)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g.reshape(2, 2)


def add_into(view: Tensor, w: Tensor) -> None:
    view += w


def write_into(view: Tensor, w: Tensor) -> None:
    view[...] = w


def scale_into(view: Tensor, w: Tensor) -> None:
    view.mul_(w)


@pytest.mark.parametrize("change", [add_into, write_into, scale_into])
@pytest.mark.parametrize("source_needs_grad", [False, True])
def test_an_output_sharing_an_input_memory_cannot_take_a_graph_in_place(
        change: Callable[[Tensor, Tensor], None], source_needs_grad: bool) -> None:
    matrix = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=source_needs_grad)
    source = matrix * 1.0 if source_needs_grad else matrix
    flat = Flatten.apply(source)
    with pytest.raises(RuntimeError, match="an output of a custom Function that shares"):
        change(flat, leaf(5.0, 6.0, 7.0, 8.0))
    close(source, [[1.0, 2.0], [3.0, 4.0]])


def test_item_assignment_through_an_ordinary_view_is_recorded() -> None:
    row = pargrad.tensor([[1.0, 2.0, 3.0]])
    w = leaf(9.0)
    row[:, 1][...] = w * 2
    close(row, [[1.0, 18.0, 3.0]])
    assert row.grad_fn.name() == "CopySlicesBackward"
    (row * row).sum().backward()
    close(w.grad, [72.0])            # d(2w)^2/dw = 8w


# ----- mark_dirty -----


class Triple(Function):
    """Triples its input in place, returning it twice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        x.mul_(3)
        ctx.mark_dirty(x)
        return x, x

    @staticmethod
    def backward(ctx: Any, g1: Tensor, g2: Tensor) -> Tensor:
        return (g1 + g2) * 3


def test_a_dirty_input_returned_twice_comes_back_as_itself_twice() -> None:
    x = leaf(1.0, -2.0)
    h = x * 1.0
    first, second = Triple.apply(h)
    assert first is h and second is h
    assert h.grad_fn.name() == "TripleBackward"
    close(h, [3.0, -6.0])
    (first + second).sum().backward()
    close(x.grad, [6.0, 6.0])

    def doubled(t: Tensor) -> Tensor:
        a, b = Triple.apply(t.copy())
        return a + b

    assert pargrad.gradcheck(doubled, [x])
    assert pargrad.gradgradcheck(doubled, [x])


def test_marking_a_leaf_that_requires_grad_dirty_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"Triple\.forward \(mark_dirty\): a leaf tensor "
                                           "that requires grad"):
        Triple.apply(leaf(1.0))


def test_marking_a_view_of_a_leaf_that_requires_grad_dirty_is_refused() -> None:
    class Bump(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            x.add_(1)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    base = leaf(1.0, 2.0, 3.0)
    with pytest.raises(RuntimeError, match="a view of a leaf tensor that requires grad"):
        Bump.apply(base[1:])


class SubtractTwice(Function):
    """t -= 2 s, in place on t (marked dirty); notes each run of its backward."""

    calls: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, t: Tensor, s: Tensor) -> Tensor:
        t.sub_(s * 2.0)
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        SubtractTwice.calls.append(1)
        return g, g * -2.0


def test_a_dirty_input_that_needs_no_grad_takes_the_function_as_history() -> None:
    target, b = pargrad.tensor([1.0, 1.0]), leaf(10.0, 20.0)
    version = target._version
    out = SubtractTwice.apply(target, b)
    assert out is target and target._version > version
    assert target.requires_grad and target.grad_fn.name() == "SubtractTwiceBackward"
    close(target, [-19.0, -39.0])
    (target * pargrad.tensor([1.0, -1.0])).sum().backward()
    close(b.grad, [-2.0, 2.0])


@pytest.mark.parametrize("on_a_row", [False, True], ids=["whole-tensor", "row-view"])
def test_an_in_place_function_runs_its_backward_once_per_backward(on_a_row: bool) -> None:
    SubtractTwice.calls.clear()
    p = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    m = p * 3.0
    target = m[1] if on_a_row else m
    s = pargrad.tensor(np.linspace(-1.0, 1.0, target.size).reshape(target.shape),
                       requires_grad=True)
    shift = np.zeros((2, 2))
    shift[1 if on_a_row else slice(None)] = 2.0 * s.data
    assert SubtractTwice.apply(target, s) is target
    close(m, 3.0 * p.data - shift)             # the change reached m's memory
    weights = np.array([[1.0, -1.0], [2.0, 5.0]])
    loss = (m * weights).sum()
    for passes in (1, 2):
        loss.backward(retain_graph=True)
        assert SubtractTwice.calls == [1] * passes
        close(p.grad, passes * 3.0 * weights)
        close(s.grad, passes * -2.0 * (weights[1] if on_a_row else weights))


class MulIntoAndSquare(Function):
    """a *= b in place (a marked dirty), returned with a fresh second output: the
    square of a's new value. Notes each run of its backward."""

    calls: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> tuple[Tensor, np.ndarray]:
        ctx.old, ctx.b = a.data.copy(), b.data.copy()
        a.mul_(b)
        ctx.mark_dirty(a)
        return a, a.data ** 2

    @staticmethod
    def backward(ctx: Any, g_a: Tensor, g_square: Tensor) -> tuple[np.ndarray, np.ndarray]:
        MulIntoAndSquare.calls.append(1)
        new = ctx.old * ctx.b
        through_new = g_a.data + 2.0 * new * g_square.data
        return through_new * ctx.b, through_new * ctx.old


@pytest.mark.parametrize("negate_after", [False, True], ids=["as-returned", "then-neg_"])
def test_a_dirty_function_with_a_second_output_runs_its_backward_once(
        negate_after: bool) -> None:
    MulIntoAndSquare.calls.clear()
    a, b = leaf(1.0, -2.0, 0.5), leaf(3.0, 0.5, -4.0)
    h = a.copy()
    product, square = MulIntoAndSquare.apply(h, b)
    assert product is h and square.requires_grad
    if negate_after:
        product.neg_()
    sign = -1.0 if negate_after else 1.0
    u, v = np.array([1.0, 2.0, 3.0]), np.array([0.5, -1.0, 2.0])
    ((product * u).sum() + (square * v).sum()).backward()
    assert MulIntoAndSquare.calls == [1]
    new = a.data * b.data
    through_new = sign * u + 2.0 * new * v
    close(a.grad, through_new * b.data)
    close(b.grad, through_new * a.data)


def test_a_view_marked_dirty_by_a_function_with_several_outputs_is_refused() -> None:
    a, b = leaf(1.0, 2.0), leaf(10.0, 20.0)
    with pytest.raises(RuntimeError, match="view marked dirty by a Function with several"):
        MulIntoAndSquare.apply(a.copy()[:], b)


def test_an_input_marked_dirty_must_be_returned() -> None:
    class ReturnsACopy(Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor) -> np.ndarray:
            a.add_(1)
            ctx.mark_dirty(a)
            return a.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    with pytest.raises(RuntimeError, match="a tensor marked dirty must be returned"):
        ReturnsACopy.apply(leaf(1.0, 2.0).copy())


def test_only_inputs_can_be_marked_dirty() -> None:
    class MarksALocal(Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor) -> Tensor:
            local = a.copy()
            ctx.mark_dirty(local)
            return local

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    with pytest.raises(ValueError, match="mark_dirty takes input Tensors only"):
        MarksALocal.apply(leaf(1.0).copy())


# ----- custom Functions inside random graphs -----


class PassThrough(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


def leaf_gradients(recipe: GraphRecipe, wrap: bool) -> tuple[Any, ...]:
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    if wrap:
        roots = [PassThrough.apply(r) for r in roots]
    return pargrad.grad(roots, [t for t in leaves if t.requires_grad], list(recipe.root_grads),
                        materialize_grads=True)


@given(recipe=graph_recipes(max_steps=6))
def test_a_pass_through_function_at_every_root_changes_no_leaf_gradient(
        recipe: GraphRecipe) -> None:
    for plain, wrapped in zip(leaf_gradients(recipe, False), leaf_gradients(recipe, True)):
        np.testing.assert_allclose(wrapped.data, plain.data, rtol=1e-12, atol=1e-12)
