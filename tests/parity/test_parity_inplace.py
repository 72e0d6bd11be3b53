"""In-place ops, item assignment, version counters and views, as a torch.autograd user
relies on them: what an in-place change does to gradients, what it invalidates, and what
is refused."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pargrad
from pargrad import Tensor
from tests.parity.support import close, grad_of, leaf
from tests.strategies import values

STALE = "changed by an in-place operation"
LEAF_REFUSED = "a leaf tensor that requires grad cannot be changed in place"
VIEW_REFUSED = "a view of a leaf tensor that requires grad cannot be changed in place"


# ----- in-place changes and the nodes that saved (or did not save) the tensor -----


def test_a_consumer_that_saved_nothing_keeps_its_gradient_after_an_in_place_change() -> None:
    a, b = leaf(1.0, -2.0), leaf(3.0, 0.5)
    h = a * 4.0 + b                       # h's history: d/da = 4, d/db = 1
    shifted = h - b                       # subtraction saves neither operand
    h.add_(100.0)
    h.exp_()                              # two changes, h now at version 2
    assert h._version == 2
    shifted.backward(np.array([1.0, 10.0]))
    close(a.grad, [4.0, 40.0])
    close(b.grad, [0.0, 0.0])             # +1 through h, -1 directly


@pytest.mark.parametrize("change", [
    pytest.param(lambda t, other: t.add_(1.0), id="add_-constant"),
    pytest.param(lambda t, other: t.add_(other), id="add_-tensor"),
    pytest.param(lambda t, other: t.exp_(), id="exp_"),
    pytest.param(lambda t, other: t.__setitem__(0, 9.0), id="setitem"),
])
def test_a_multiply_that_saved_the_tensor_refuses_after_it_changed(
        change: Callable[[Tensor, Tensor], Any]) -> None:
    a, b = leaf(1.0, 2.0), leaf(-1.0, 5.0)
    h = a * 2.0
    product = h * b                       # b's gradient reads h as it was
    change(h, b)
    with pytest.raises(pargrad.BackwardError, match=STALE) as caught:
        product.sum().backward()
    assert caught.value.node_name == "MultiplyBackward"
    assert "is at version 1, but was saved at version 0" in str(caught.value)
    assert a.grad is None and b.grad is None  # a refused backward commits nothing


def test_an_add_that_read_a_tensor_keeps_its_gradient_after_a_tensor_is_added_in() -> None:
    a, b, y = leaf(1.5, -2.0, 0.0), leaf(4.0, 1.0, -1.0), leaf(10.0, 20.0, 30.0)
    z = a * -3.0
    total = z + b                         # an add saves neither operand
    z.add_(y)                             # a tensor operand this time, not a number
    assert z._version == 1
    close(z, [5.5, 26.0, 30.0])
    total.backward(np.array([2.0, 1.0, -1.0]))
    close(a.grad, [-6.0, -3.0, 3.0])
    close(b.grad, [2.0, 1.0, -1.0])
    assert y.grad is None                 # y joined z after total was computed


def test_changing_a_leaf_copy_that_a_multiply_saved_is_caught() -> None:
    w = leaf(2.0, 3.0)
    c = w.copy()
    square = c * c
    c.mul_(0.5)
    with pytest.raises(RuntimeError, match=STALE):
        square.sum().backward()


def test_the_result_of_an_in_place_add_backprops_into_both_histories() -> None:
    a, b = leaf(2.0, -1.0), leaf(0.5, 4.0)
    h = a * b
    same = h.add_(b)                      # h = a*b + b
    assert same is h
    assert h.grad_fn is not None and h.grad_fn.name() == "AddBackward"
    h.backward(np.array([1.0, 3.0]))
    close(a.grad, [0.5, 12.0])            # b * g
    close(b.grad, [3.0, 0.0])             # (a + 1) * g


def test_in_place_exp_differentiates_through_its_own_output() -> None:
    x, y = leaf(0.0, 2.0), leaf(1.0, 1.0)
    h = x * 0.5 + y * 0.0
    before = h._version
    h.exp_()                              # h = exp(x / 2)
    assert h._version == before + 1
    close(h, np.exp([0.0, 1.0]))
    h.sum().backward()
    close(x.grad, 0.5 * np.exp([0.0, 1.0]))


def test_a_sibling_read_before_the_change_still_gets_the_old_gradient() -> None:
    x = leaf(4.0, 6.0)
    h = x / 2.0
    sibling = h * 3.0                      # reads only the constant 3.0
    h.exp_()
    sibling.sum().backward(retain_graph=True)
    close(x.grad, [1.5, 1.5])
    h.sum().backward()                     # accumulates: exp(x/2)/2 on top
    close(x.grad, 1.5 + 0.5 * np.exp([2.0, 3.0]))


def test_an_accumulated_grad_can_be_zeroed_in_place_under_no_grad() -> None:
    x = leaf(1.0, 2.0)
    (x * x).sum().backward()
    (x * x).sum().backward()
    close(x.grad, [4.0, 8.0])
    grad = x.grad
    assert grad is not None
    with pargrad.no_grad():
        grad.zero_()
    assert x.grad is grad
    close(x.grad, [0.0, 0.0])
    (x * 5.0).sum().backward()
    close(x.grad, [5.0, 5.0])


def test_adding_a_constant_in_place_passes_the_gradient_straight_through() -> None:
    w = leaf(1.0, -3.0)
    c = w.copy()
    c.add_(10.0)
    close(c, [11.0, 7.0])
    close(w, [1.0, -3.0])                  # the copy owns its memory
    (c * 3.0).sum().backward()
    close(w.grad, [3.0, 3.0])


# Each step as an in-place op and as its out-of-place twin. exp is scaled back down so
# that a chain of them stays finite (every step keeps |x| <= 1.5).
CHAIN_STEPS: dict[str, tuple[Callable[[Tensor], Any], Callable[[Tensor], Tensor]]] = {
    "exp": (lambda t: t.exp_().mul_(0.25), lambda t: pargrad.exp(t) * 0.25),
    "tanh": (Tensor.tanh_, pargrad.tanh),
    "sin": (Tensor.sin_, pargrad.sin),
    "sigmoid": (Tensor.sigmoid_, pargrad.sigmoid),
    "neg": (Tensor.neg_, lambda t: -t),
    "half": (lambda t: t.mul_(0.5), lambda t: t * 0.5),
}


@st.composite
def vectors(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(1, 4))
    return values(draw, (n,), low=-1.5, high=1.5)


@given(start=vectors(),
       steps=st.lists(st.sampled_from(list(CHAIN_STEPS)), min_size=1, max_size=5))
def test_a_chain_of_in_place_ops_has_the_out_of_place_gradient(
        start: np.ndarray, steps: list[str]) -> None:
    a, b = (pargrad.tensor(start, requires_grad=True) for _ in range(2))
    h = a * 1.0
    k = b * 1.0
    for name in steps:
        in_place, out_of_place = CHAIN_STEPS[name]
        in_place(h)
        k = out_of_place(k)
    assert h._version == len(steps) + steps.count("exp")
    assert np.all(np.isfinite(h.data))
    np.testing.assert_allclose(h.data, k.data, rtol=1e-12)
    weights = np.arange(1.0, len(start) + 1)
    (h * weights).sum().backward()
    (k * weights).sum().backward()
    np.testing.assert_allclose(grad_of(a), grad_of(b), rtol=1e-10, atol=1e-12)


# ----- item assignment -----

INDEXES = [
    pytest.param((4, 3), 2, id="int"),
    pytest.param((6,), [5, 0, 3], id="int-list"),
    pytest.param((1,), 0, id="single-element"),
    pytest.param((4, 3), ([3, 0], [1, 1]), id="pair-of-lists"),
    pytest.param((3, 4, 2), (slice(None), slice(None), [1]), id="list-last-axis"),
    pytest.param((3, 4, 2), (slice(None), [0, 3], slice(None)), id="list-middle-axis"),
    pytest.param((3, 4, 2), ([2, 0], slice(None), slice(None)), id="list-first-axis"),
    pytest.param((3, 4, 2), (slice(1, None), [1, 2], [0, 1]), id="slice-then-lists"),
    pytest.param((3, 4, 2), ([0, 2], [3, 1], slice(None)), id="lists-then-slice"),
    pytest.param((3, 4, 2), (np.array([1, 2]), [0, 3], 1), id="array-list-int"),
    pytest.param((6,), np.int64(4), id="numpy-integer"),
    pytest.param((6,), [[1, 2, 5]], id="nested-list"),
    pytest.param((3, 3), np.array([[True, False, True], [False, False, True],
                                   [True, True, False]]), id="mask-2d"),
    pytest.param((5,), np.array([False, True, True, False, True]), id="mask-1d"),
    pytest.param((1,), np.array([True]), id="mask-one-element"),
]


def upstream(shape: tuple[int, ...]) -> np.ndarray:
    """A gradient with a distinct value in every element, so misplaced ones show."""
    return np.arange(1.0, 1.0 + int(np.prod(shape))).reshape(shape)


def where_index(shape: tuple[int, ...], index: Any) -> np.ndarray:
    """True where ``a[index] = ...`` writes, for an array ``a`` of ``shape``."""
    hit = np.zeros(shape, dtype=bool)
    hit[index] = True
    return hit


@pytest.mark.parametrize(("shape", "index"), INDEXES)
def test_assigning_a_number_blocks_the_gradient_of_what_it_overwrote(
        shape: tuple[int, ...], index: Any) -> None:
    x = pargrad.tensor(np.full(shape, 2.0), requires_grad=True)
    h = x * 3.0
    version = h._version
    h[index] = -1.0
    assert h._version == version + 1
    g = upstream(shape)
    h.backward(g)
    close(x.grad, np.where(where_index(shape, index), 0.0, 3.0 * g))


@pytest.mark.parametrize(("shape", "index"), INDEXES)
def test_an_assigned_tensor_gets_the_gradient_of_the_slots_it_fills(
        shape: tuple[int, ...], index: Any) -> None:
    x = pargrad.tensor(np.full(shape, 2.0), requires_grad=True)
    h = x * 3.0
    slots = np.zeros(shape)[index]
    v = pargrad.tensor(np.full(np.shape(slots), 0.25), requires_grad=True)
    version = h._version
    h[index] = v
    assert h._version == version + 1
    g = upstream(shape)
    h.backward(g)
    close(x.grad, np.where(where_index(shape, index), 0.0, 3.0 * g))
    close(v.grad, g[index])


@given(data=st.data())
def test_assigning_through_any_mask_splits_the_gradient_between_old_and_new(
        data: st.DataObject) -> None:
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    mask = data.draw(hnp.arrays(np.bool_, shape))
    x = pargrad.tensor(np.ones(shape), requires_grad=True)
    v = pargrad.tensor(np.full(int(mask.sum()), 5.0), requires_grad=True)
    h = x * -2.0
    h[mask] = v
    g = upstream(shape)
    h.backward(g)
    close(x.grad, np.where(mask, 0.0, -2.0 * g))
    close(v.grad, g[mask])
    close(h, np.where(mask, 5.0, -2.0))


def test_a_value_broadcast_into_its_slot_gets_the_summed_gradient_of_its_shape() -> None:
    buffer = pargrad.tensor(np.zeros((3, 2, 3)))
    row = leaf(1.0, 2.0, 3.0)
    buffer[2] = row                        # one row written into both rows of buffer[2]
    assert buffer.requires_grad            # the buffer is part of the graph now
    g = upstream((3, 2, 3))
    buffer.backward(g)
    assert grad_of(row).shape == (3,)
    close(row.grad, g[2, 0] + g[2, 1])


@pytest.mark.parametrize("index", [
    pytest.param(np.array([True, False, True, True]), id="mask"),
    pytest.param([3, 1], id="int-list"),
])
def test_writing_a_read_of_a_tensor_back_into_it_keeps_the_read_differentiable(
        index: Any) -> None:
    w = leaf(1.0, 2.0, 3.0, 4.0)
    h = w * 1.0
    h[index] = h[index] * 10.0             # the read's node keeps only the index
    g = np.array([1.0, -1.0, 2.0, 0.5])
    h.backward(g)
    expected = g.copy()
    expected[index] *= 10.0
    close(w.grad, expected)


def test_assigning_grad_tensors_into_a_plain_tensor_records_a_graph() -> None:
    buffer = pargrad.tensor(np.zeros((3, 2)))
    p, q = leaf(1.0, 2.0), leaf(-1.0, 0.5)
    buffer[0] = p
    buffer[2] = q * -3.0
    assert buffer.requires_grad and buffer.grad_fn is not None
    close(buffer, [[1.0, 2.0], [0.0, 0.0], [3.0, -1.5]])
    weights = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    (buffer * weights).sum().backward()
    close(p.grad, [1.0, 2.0])
    close(q.grad, [-15.0, -18.0])


def test_assigning_into_a_parameter_under_no_grad_leaves_it_a_leaf() -> None:
    w = leaf(1.0, 2.0, 3.0)
    with pargrad.no_grad():
        w[1] = pargrad.tensor(7.0)
    assert w.requires_grad and w.grad_fn is None
    assert w._version == 1
    close(w, [1.0, 7.0, 3.0])
    (w * w).sum().backward()               # the graph recorded now sees the new value
    close(w.grad, [2.0, 14.0, 6.0])


# ----- version counters -----


def test_a_change_under_no_grad_still_invalidates_a_saved_tensor() -> None:
    w, u = leaf(1.0, 2.0), leaf(3.0, 4.0)
    loss = (w * u).sum()
    with pargrad.no_grad():
        w *= 2.0
    assert w._version == 1
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()
    assert u.grad is None


def test_in_place_ops_return_the_tensor_and_count_each_change() -> None:
    t = pargrad.tensor([1.0, 2.0])
    start = t._version
    result = t.add_(1.0).mul_(3.0).neg_()
    assert result is t
    assert t._version == start + 3
    close(t, [-6.0, -9.0])


VIEWS: dict[str, Callable[[Tensor], Tensor]] = {
    "slice": lambda base: base[1:],
    "row": lambda base: base[0],
    "reshape": lambda base: base.reshape((6,)),
    "transpose": lambda base: base.T,
}


@given(changes=st.lists(st.sampled_from(["base", *VIEWS]), min_size=1, max_size=6))
def test_a_base_and_its_views_share_one_version_counter(changes: list[str]) -> None:
    base = pargrad.tensor(np.zeros((2, 3)))
    views = {name: make(base) for name, make in VIEWS.items()}
    assert all(v._version == base._version for v in views.values())
    for count, name in enumerate(changes, start=1):
        (base if name == "base" else views[name]).add_(1.0)
        assert base._version == count
        assert all(v._version == count for v in views.values())
    # Every change landed in the shared memory: count how often each element was hit.
    hits = np.zeros((2, 3))
    for name in changes:
        if name == "base" or name in ("reshape", "transpose"):
            hits += 1
        elif name == "slice":
            hits[1:] += 1
        else:
            hits[0] += 1
    close(base, hits)


# ----- requires_grad and in-place changes -----


@pytest.mark.parametrize("target", [
    pytest.param(lambda: pargrad.tensor([1.0, 1.0]), id="leaf"),
    pytest.param(lambda: pargrad.tensor([0.5, 0.5]) * 2.0, id="non-leaf"),
])
def test_adding_a_grad_tensor_in_place_makes_the_target_require_grad(
        target: Callable[[], Tensor]) -> None:
    a = target()
    assert not a.requires_grad
    b = leaf(2.0, -2.0)
    a += b
    assert a.requires_grad and a.grad_fn is not None
    close(a, [3.0, -1.0])
    (a * np.array([5.0, 7.0])).sum().backward()
    close(b.grad, [5.0, 7.0])


@pytest.mark.parametrize("through_view", [False, True], ids=["direct", "through-view"])
def test_changes_made_before_requires_grad_was_set_are_not_part_of_the_graph(
        through_view: bool) -> None:
    a = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]])
    (a[:] if through_view else a).mul_(10.0)
    a.requires_grad = True
    assert a.grad_fn is None
    (a * a).sum().backward()
    close(a.grad, [[20.0, 40.0], [60.0, 80.0]])


def view_before_requires_grad() -> Tensor:
    base = pargrad.tensor([1.0, 2.0, 3.0])
    view = base[1:]
    base.requires_grad = True
    return view


@pytest.mark.parametrize(("make", "change", "message"), [
    pytest.param(lambda: leaf(1.0, 2.0, 3.0), lambda t: t.add_(1.0), LEAF_REFUSED,
                 id="leaf"),
    pytest.param(view_before_requires_grad, lambda t: t.add_(1.0), VIEW_REFUSED,
                 id="view-made-before-requires-grad"),
    pytest.param(lambda: leaf(1.0, 2.0, 3.0).reshape((3, 1)), lambda t: t.mul_(2.0),
                 VIEW_REFUSED, id="reshape-view"),
    pytest.param(lambda: leaf(1.0, -2.0, 3.0)[0:3], lambda t: t.relu_(), VIEW_REFUSED,
                 id="full-slice-relu_"),
    pytest.param(lambda: leaf(1.0, 2.0, 3.0)[1:], lambda t: t.__setitem__(0, 0.0),
                 VIEW_REFUSED, id="slice-setitem"),
])
def test_changing_a_parameter_or_its_view_with_grad_mode_on_is_refused(
        make: Callable[[], Tensor], change: Callable[[Tensor], Any], message: str) -> None:
    t = make()
    before = t.data.copy()
    version = t._version
    with pytest.raises(RuntimeError, match=message):
        change(t)
    close(t, before)                       # refused before anything was written
    assert t._version == version


# ----- views of non-leaf tensors -----


def test_a_result_of_a_changed_view_backprops_after_the_view_is_collected() -> None:
    p = pargrad.tensor([[0.5, 1.0, -0.5], [2.0, 0.0, 1.5]], requires_grad=True)
    base = p * 2.0
    column = base[:, 1]
    column.sin_()
    close(base.data[:, 1], np.sin(2.0 * p.data[:, 1]))   # written into base's memory
    later = column * np.array([3.0, -1.0])
    gone = weakref.ref(column)
    del column
    gc.collect()
    assert gone() is None
    later.sum().backward()
    expected = np.zeros((2, 3))
    expected[:, 1] = np.array([3.0, -1.0]) * 2.0 * np.cos(2.0 * p.data[:, 1])
    close(p.grad, expected)


def test_products_by_constants_survive_detach_and_rewrite_rounds() -> None:
    w = leaf(1.0, 2.0, 3.0, 4.0)
    buffer = w * 1.0
    # (slots written, multiplier of w written there, constant the buffer is then scaled by)
    rounds = [(slice(0, 2), 0.5, 3.0), (slice(1, 3), 2.0, -1.0), (slice(2, 4), -2.0, 4.0)]
    products = []
    expected = np.zeros(4)
    for slots, multiplier, constant in rounds:
        buffer.detach_()
        assert buffer.grad_fn is None and not buffer.requires_grad
        version = buffer._version
        buffer[slots] = w[slots] * multiplier  # changes what earlier products multiplied
        assert buffer._version == version + 1
        assert buffer.requires_grad and buffer.grad_fn is not None
        products.append(buffer * constant)    # a product by a number saves no tensor
        expected[slots] += multiplier * constant
    loss = products[0].sum()
    for product in products[1:]:
        loss = loss + product.sum()
    loss.backward()
    close(w.grad, expected)
