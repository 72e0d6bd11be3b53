"""Anomaly mode: the NaN / Inf check on every node's gradients, its ``check_nan`` switch,
and the forward stack that errors carry (pargrad hands that stack over on the error
itself, as ``error.forward_trace`` and a note, where PyTorch only warns with it)."""

from __future__ import annotations

import re
import traceback
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad import BackwardError, Tensor
from tests.parity.support import leaf
from tests.strategies import GraphRecipe, graph_recipes, nonempty_shapes

CHECK_FAILED = "returned nan or inf values in its gradient for input"
STACK_ON_ERROR = ("the stack of the call that created the node is attached to the raised "
                  "error (forward_trace and a note); PyTorch emits it through warnings")


def _poisoned(g: Any, index: tuple[int, ...], bad: float = np.nan) -> np.ndarray:
    """A writable float copy of ``g`` with ``bad`` at ``index``."""
    out = np.array(np.asarray(g), dtype=np.float64)
    out[index] = bad
    return out


def _formatted(trace: traceback.StackSummary) -> str:
    return "".join(traceback.format_list(trace))


# ----- one Function with a faulty backward -----
class _Blend(pargrad.Function):
    """a + b elementwise; backward spoils one entry of one input's gradient with
    ``bad``, as chosen by ``fault = (input, index, bad)`` (or ``None``: no fault)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, fault: Any) -> np.ndarray:
        ctx.fault = fault
        return a.data + b.data

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, Any, None]:
        grads = [np.array(g.data), np.array(g.data)]
        if ctx.fault is not None:
            which, index, bad = ctx.fault
            grads[which] = _poisoned(grads[which], index, bad)
        return grads[0], grads[1], None


WEIGHTS = np.array([1.0, 10.0, 100.0])


def _blend_loss(a: Tensor, b: Tensor, fault: Any) -> Tensor:
    # d loss / d a = d loss / d b = WEIGHTS, but for the spoiled entry
    return (_Blend.apply(a, b, fault) * WEIGHTS).sum()


def test_nan_gradient_goes_through_unchecked_without_anomaly_mode() -> None:
    a, b = leaf(1.0, 2.0, 3.0), leaf(4.0, 5.0, 6.0)
    assert not pargrad.is_anomaly_enabled()
    _blend_loss(a, b, (0, 2, np.nan)).backward()
    np.testing.assert_array_equal(a.grad.data, [1.0, 10.0, np.nan])
    np.testing.assert_array_equal(b.grad.data, WEIGHTS)


@pytest.mark.parametrize(("which", "index"), [(0, 0), (0, 2), (1, 1)])
def test_anomaly_check_names_the_node_the_input_and_the_entry(which: int, index: int) -> None:
    a, b = leaf(1.0, 2.0, 3.0), leaf(4.0, 5.0, 6.0)
    loss = _blend_loss(a, b, (which, index, np.nan))  # the graph is made outside the mode
    with pargrad.detect_anomaly(), pytest.raises(BackwardError) as caught:
        loss.backward()
    assert isinstance(caught.value, RuntimeError)
    assert caught.value.node_name == "_BlendBackward"
    assert str(caught.value) == (
        f"_BlendBackward: {CHECK_FAILED} {which} (nan at index ({index},))")
    # the backward failed as a whole: no gradient reached either leaf
    assert a.grad is None
    assert b.grad is None


@given(shape=nonempty_shapes, which=st.integers(0, 1), data=st.data())
def test_check_reports_the_first_bad_entry_of_any_shape(
        shape: tuple[int, ...], which: int, data: st.DataObject) -> None:
    size = int(np.prod(shape))
    flat = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=3, unique=True))
    index = np.unravel_index(min(flat), shape)  # row-major order decides "first"

    class Spoil(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor, b: Tensor) -> np.ndarray:
            return a.data * b.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[np.ndarray, np.ndarray]:
            grads = [np.zeros(shape), np.zeros(shape)]
            for k in flat:
                grads[which][np.unravel_index(k, shape)] = np.nan
            return grads[0], grads[1]

    a = pargrad.tensor(np.ones(shape), requires_grad=True)
    b = pargrad.tensor(np.ones(shape), requires_grad=True)
    with pargrad.detect_anomaly():
        out = Spoil.apply(a, b).sum()
        with pytest.raises(BackwardError) as caught:
            out.backward()
    where = tuple(int(i) for i in index)
    assert str(caught.value).endswith(f"input {which} (nan at index {where})")


def test_a_nan_for_the_second_input_is_named_when_the_first_input_gets_none() -> None:
    class SecondOnly(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, a: Tensor, b: Tensor) -> np.ndarray:
            return a.data - b.data

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[None, np.ndarray]:
            return None, _poisoned(-g.data, (1, 0))

    a = pargrad.tensor(np.ones((2, 2)), requires_grad=True)
    b = pargrad.tensor(np.full((2, 2), 3.0), requires_grad=True)
    with pargrad.detect_anomaly():
        loss = SecondOnly.apply(a, b).sum()
        with pytest.raises(BackwardError) as caught:
            loss.backward()
    assert str(caught.value) == f"SecondOnlyBackward: {CHECK_FAILED} 1 (nan at index (1, 0))"
    assert a.grad is None and b.grad is None
    # Unchecked, the None goes through as no gradient and the NaN as a value.
    SecondOnly.apply(a, b).sum().backward()
    assert a.grad is None
    np.testing.assert_array_equal(b.grad.data, [[-1.0, -1.0], [np.nan, -1.0]])


@pytest.mark.differs("pargrad also reports an infinite gradient; torch checks NaN only")
def test_anomaly_check_reports_infinite_gradients_too() -> None:
    a, b = leaf(1.0, 2.0, 3.0), leaf(4.0, 5.0, 6.0)
    with pargrad.detect_anomaly():
        loss = _blend_loss(a, b, (1, 0, -np.inf))
        with pytest.raises(BackwardError, match=re.escape("input 1 (inf at index (0,))")):
            loss.backward()


# ----- the forward stack on the error -----
@pytest.mark.differs(STACK_ON_ERROR)
def test_error_carries_the_stack_of_the_forward_call_that_made_the_node() -> None:
    a, b = leaf(1.0, 2.0, 3.0), leaf(4.0, 5.0, 6.0)
    with pargrad.detect_anomaly():
        loss = _blend_loss(a, b, (0, 1, np.nan))
        with pytest.raises(BackwardError, match=f"{CHECK_FAILED} 0") as caught:
            loss.backward()
    trace = caught.value.forward_trace  # type: ignore[attr-defined]
    # innermost frame: the user's line that called apply (pargrad's frames trimmed)
    assert trace[-1].name == "_blend_loss"
    assert "_Blend.apply(a, b, fault)" in _formatted(trace)
    assert trace[-2].name == "test_error_carries_the_stack_of_the_forward_call_that_made_the_node"
    (note,) = caught.value.__notes__
    assert note.startswith("Traceback of the forward call that created _BlendBackward, "
                           "the node that failed")
    assert "_Blend.apply(a, b, fault)" in note


@pytest.mark.differs("pargrad says on the error that the node's forward stack is unknown")
def test_error_says_when_the_failing_node_was_made_outside_anomaly_mode() -> None:
    loss = _blend_loss(leaf(1.0, 2.0, 3.0), leaf(0.0, 0.0, 0.0), (1, 2, np.nan))
    with pargrad.detect_anomaly(), pytest.raises(BackwardError) as caught:
        loss.backward()
    assert caught.value.forward_trace is None  # type: ignore[attr-defined]
    (note,) = caught.value.__notes__
    assert "_BlendBackward was created outside anomaly mode" in note


# ----- a faulty Function inside a gradient's graph (double backward) -----
class _Product(pargrad.Function):
    """3 * p * q; its backward spoils entry ``fault[1]`` of input ``fault[0]``."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, q: Tensor, fault: Any) -> np.ndarray:
        ctx.fault = fault
        ctx.save_for_backward(p, q)
        return 3.0 * p.data * q.data

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, Any, None]:
        p, q = ctx.saved_tensors
        grads = [3.0 * g * q, 3.0 * g * p]
        if ctx.fault is not None:
            which, index = ctx.fault
            grads[which] = _poisoned(grads[which].data, index)
        return grads[0], grads[1], None


class _SumOfCubes(pargrad.Function):
    """sum(x**3), whose backward builds 3 x**2 g out of ``_Product`` (so a gradient
    recorded under create_graph has a ``_ProductBackward`` node in it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fault: Any) -> np.ndarray:
        ctx.fault = fault
        ctx.save_for_backward(x)
        return np.sum(x.data ** 3)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, None]:
        (x,) = ctx.saved_tensors
        return _Product.apply(x, x * g, ctx.fault), None


def _grad_of_gradient(x: Tensor, fault: Any) -> None:
    """Backward through the gradient of sum(x**3): x.grad gets 6 x."""
    (first,) = pargrad.grad(_SumOfCubes.apply(x, fault), x, create_graph=True)
    first.sum().backward()


def test_nan_in_a_recorded_gradient_goes_through_unchecked_without_anomaly_mode() -> None:
    x = leaf(1.0, 2.0, -1.0)
    _grad_of_gradient(x, (1, 2))
    # 6 x = 3 q + 3 p with p = q = x; the spoiled entry reached q's share
    np.testing.assert_array_equal(x.grad.data, [6.0, 12.0, np.nan])
    clean = leaf(1.0, 2.0, -1.0)
    _grad_of_gradient(clean, None)
    np.testing.assert_array_equal(clean.grad.data, [6.0, 12.0, -6.0])


@pytest.mark.parametrize("which", [0, 1])
def test_anomaly_check_covers_nodes_recorded_by_a_backward(which: int) -> None:
    x = leaf(1.0, 2.0, -1.0)
    (first,) = pargrad.grad(_SumOfCubes.apply(x, (which, 0)), x, create_graph=True)
    np.testing.assert_array_equal(first.data, [3.0, 12.0, 3.0])  # the first pass is clean
    with pargrad.detect_anomaly(), pytest.raises(BackwardError) as caught:
        first.sum().backward()
    assert str(caught.value) == f"_ProductBackward: {CHECK_FAILED} {which} (nan at index (0,))"
    assert x.grad is None


@pytest.mark.differs(STACK_ON_ERROR)
def test_node_made_inside_a_backward_carries_the_stack_of_that_backward() -> None:
    x = leaf(1.0, 2.0, -1.0)
    with pargrad.detect_anomaly(), pytest.raises(BackwardError) as caught:
        _grad_of_gradient(x, (1, 1))
    assert str(caught.value).startswith(f"_ProductBackward: {CHECK_FAILED} 1")
    trace = caught.value.forward_trace  # type: ignore[attr-defined]
    # made by _SumOfCubes.backward, running in the first pargrad.grad
    assert trace[-1].name == "backward"
    assert "_Product.apply(x, x * g, ctx.fault)" in _formatted(trace)


# ----- the check_nan switch -----
class _AllNan(pargrad.Function):
    """Identity forward; backward gives x's gradient as NaN everywhere but entry 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> np.ndarray:
        out = np.full(g.shape, np.nan)
        out[0] = 2.0
        return out


def test_check_nan_false_skips_the_check_until_a_nested_block_turns_it_on() -> None:
    x = leaf(5.0, 6.0)
    with pargrad.detect_anomaly(check_nan=False):
        assert pargrad.is_anomaly_enabled()
        assert not pargrad.is_anomaly_check_nan_enabled()
        loss = _AllNan.apply(x).sum()
        loss.backward(retain_graph=True)
        with pargrad.detect_anomaly(check_nan=True):
            assert pargrad.is_anomaly_check_nan_enabled()
            with pytest.raises(BackwardError, match=re.escape(
                    f"_AllNanBackward: {CHECK_FAILED} 0 (nan at index (1,))")):
                loss.backward(retain_graph=True)
        assert not pargrad.is_anomaly_check_nan_enabled()
        loss.backward()  # the retained graph, unchecked again
    assert not pargrad.is_anomaly_enabled()
    # two backward calls went through and added up; the checked one added nothing
    np.testing.assert_array_equal(x.grad.data, [4.0, np.nan])


# ----- other errors under anomaly mode -----
@pytest.mark.differs("the note and forward stack come with the error, not as warnings")
def test_in_place_error_names_the_saving_node_and_its_forward_line() -> None:
    x = leaf(0.5, 1.5)
    with pargrad.detect_anomaly():
        h = x * 2.0
        s = h.sin()  # sin keeps h for its backward
        h.mul_(3.0)
        with pytest.raises(RuntimeError, match="changed by an in-place operation") as caught:
            pargrad.grad(s.sum(), x)
    error = caught.value
    assert str(error).startswith("SinBackward: ")
    assert "at version 1, but was saved at version 0" in str(error)
    trace = error.forward_trace  # type: ignore[attr-defined]
    assert trace[-1].name == "test_in_place_error_names_the_saving_node_and_its_forward_line"
    assert "s = h.sin()" in _formatted(trace)
    assert error.__notes__[0].startswith("Traceback of the forward call that created SinBackward")


# ----- switching the mode -----
def test_set_detect_anomaly_switches_at_once_and_blocks_restore_even_on_error() -> None:
    assert not pargrad.is_anomaly_enabled()
    pargrad.set_detect_anomaly(True)
    try:
        assert pargrad.is_anomaly_enabled()
        assert pargrad.is_anomaly_check_nan_enabled()
        with pytest.raises(ZeroDivisionError), pargrad.detect_anomaly(check_nan=False):
            assert not pargrad.is_anomaly_check_nan_enabled()
            _ = 1 / 0
        assert pargrad.is_anomaly_check_nan_enabled()  # the block put it back
        with pargrad.set_detect_anomaly(False):
            assert not pargrad.is_anomaly_enabled()
        assert pargrad.is_anomaly_enabled()
    finally:
        pargrad.set_detect_anomaly(False)
    assert not pargrad.is_anomaly_enabled()


@given(recipe=graph_recipes(max_steps=8))
def test_anomaly_mode_leaves_finite_gradients_unchanged(recipe: GraphRecipe) -> None:
    def gradients() -> list[np.ndarray]:
        leaves = [pargrad.tensor(a, requires_grad=True) for a in recipe.leaves]
        roots = recipe.build(leaves)
        grads = pargrad.grad(roots, leaves, grad_outputs=list(recipe.root_grads),
                             materialize_grads=True)
        return [g.data for g in grads]

    plain = gradients()
    with pargrad.detect_anomaly():
        checked = gradients()
    for p, c in zip(plain, checked):
        # threaded engines may sum fan-in in another order from one run to the next
        np.testing.assert_allclose(c, p, rtol=1e-12, atol=1e-12)
