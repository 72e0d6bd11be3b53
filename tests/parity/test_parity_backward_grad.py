"""backward() and grad() as a ``torch.autograd`` user relies on them: how ``.grad``
accumulates, several roots, ``inputs=``, unused inputs, ``retain_graph``, the graph's
structure, ``requires_grad`` and ``detach``. Every test runs on every engine (conftest)."""

from __future__ import annotations

import itertools
import pickle
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad import Tensor
from tests.parity.support import leaf
from tests.strategies import GraphRecipe, broadcast_pair, graph_recipes, nonempty_shapes, values


def assert_grad(t: Tensor, expected: Any) -> None:
    """``t.grad`` exists and equals ``expected`` in shape and value."""
    assert t.grad is not None
    expected = np.asarray(expected, dtype=np.float64)
    assert t.grad.shape == expected.shape
    np.testing.assert_allclose(t.grad.data, expected, rtol=1e-12, atol=1e-12)


def reduced_to(full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo numpy broadcasting by summing: what an operand of ``shape`` receives."""
    out = full.sum(axis=tuple(range(full.ndim - len(shape))))
    return out.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


def recipe_leaves(recipe: GraphRecipe) -> list[Tensor]:
    return [pargrad.tensor(a, requires_grad=flag)
            for a, flag in zip(recipe.leaves, recipe.requires_grad)]


def grads_of(tensors: list[Tensor]) -> list[np.ndarray | None]:
    return [None if t.grad is None else t.grad.data.copy() for t in tensors]


def assert_same_grads(got: list[Any], expected: list[Any], factor: float = 1.0) -> None:
    """Pairwise: both None, or ``got == factor * expected`` (to rounding: the threaded
    engines may sum in another order)."""
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if e is not None:
            np.testing.assert_allclose(np.asarray(g), factor * e, rtol=1e-9, atol=1e-12)


def spy_identity(calls: list[str]) -> Any:
    """An identity Function whose backward notes each run in ``calls``."""

    class Spy(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            calls.append("spy ran")
            return g

    return Spy


# ----- accumulation into .grad -----


def test_second_backward_adds_into_the_grad_object_already_there() -> None:
    w = leaf(1.0, 2.0, 3.0)
    y = w * np.array([2.0, -1.0, 0.5])
    y.backward(np.array([1.0, 2.0, 3.0]), retain_graph=True)
    held = w.grad
    assert_grad(w, [2.0, -2.0, 1.5])
    y.backward(np.array([10.0, 10.0, 10.0]))
    # Accumulation is in place: whoever kept the old .grad sees the sum.
    assert w.grad is held
    assert_grad(w, [22.0, -12.0, 6.5])


def test_create_graph_accumulates_into_a_new_object_leaving_the_old_one_intact() -> None:
    w = leaf(1.0, -2.0)
    y = w * w
    y.backward(np.ones(2), retain_graph=True)
    held = w.grad
    assert held is not None
    y.backward(np.array([1.0, 3.0]), create_graph=True)
    assert w.grad is not held
    np.testing.assert_array_equal(held.data, [2.0, -4.0])
    assert_grad(w, [4.0, -16.0])
    assert w.grad.requires_grad  # the new .grad records how it was computed


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_grad_set_by_hand_is_kept_as_the_object_unless_create_graph(
        create_graph: bool) -> None:
    p = leaf(0.5, -1.0)
    p.grad = pargrad.tensor([4.0, 4.0])
    mine = p.grad
    p.backward(pargrad.tensor([2.0, 3.0]), create_graph=create_graph)
    assert_grad(p, [6.0, 7.0])
    assert (p.grad is mine) is (not create_graph)
    if create_graph:
        np.testing.assert_array_equal(mine.data, [4.0, 4.0])


@given(data=st.data(), shape=nonempty_shapes)
def test_a_leaf_as_the_root_receives_exactly_the_gradients_passed(
        data: st.DataObject, shape: tuple[int, ...]) -> None:
    t = pargrad.tensor(values(data.draw, shape), requires_grad=True)
    first, second = values(data.draw, shape), values(data.draw, shape)
    t.backward(first)
    np.testing.assert_array_equal(t.grad.data, first)
    t.backward(second)
    np.testing.assert_array_equal(t.grad.data, first + second)


def test_broadcasting_against_an_empty_axis_gives_empty_and_zero_gradients() -> None:
    empty = pargrad.tensor(np.zeros((0, 3)), requires_grad=True)
    row = pargrad.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    total = empty * row
    assert total.shape == (0, 3)
    total.sum().backward()
    assert_grad(empty, np.zeros((0, 3)))
    assert_grad(row, np.zeros((1, 3)))


@given(data=st.data(), pair=broadcast_pair())
def test_broadcast_operands_get_gradients_of_their_own_shape(
        data: st.DataObject, pair: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    # Sizes 0 included: an operand broadcast over nothing gets zeros, not an error.
    a = pargrad.tensor(values(data.draw, pair[0]), requires_grad=True)
    b = pargrad.tensor(values(data.draw, pair[1]), requires_grad=True)
    out = a * 3.0 + b
    out.sum().backward()
    assert_grad(a, reduced_to(np.full(out.shape, 3.0), a.shape))
    assert_grad(b, reduced_to(np.ones(out.shape), b.shape))


# ----- gradient values, one root or several -----


def test_gradient_of_a_quotient_expression_scaled_by_the_output_gradient() -> None:
    a, b, c = leaf(1.0, 2.0), leaf(3.0, -4.0), leaf(2.0, 0.5)
    f = a * b / c + c ** 2 * a
    g = np.array([1.0, -2.0])
    f.backward(g)
    # df/da = b/c + c^2, df/db = a/c, df/dc = -ab/c^2 + 2ac; each times g.
    assert_grad(a, [5.5, 15.5])
    assert_grad(b, [0.5, -8.0])
    assert_grad(c, [3.25, -68.0])


def test_two_roots_sum_into_the_subexpression_they_share() -> None:
    p, q, r, s = leaf(1.0, 2.0), leaf(-1.0, 4.0), leaf(0.5, 0.5), leaf(7.0, 8.0)
    shared = r * 3.0
    u = p * q + shared
    v = s - shared
    gu, gv = np.array([1.0, 2.0]), np.array([10.0, -1.0])
    pargrad.backward([u, v], [gu, gv])
    assert_grad(p, [-1.0, 8.0])
    assert_grad(q, [1.0, 4.0])
    assert_grad(s, [10.0, -1.0])
    assert_grad(r, [3.0 * (1.0 - 10.0), 3.0 * (2.0 + 1.0)])


def test_a_root_built_from_another_root_gets_both_paths() -> None:
    x = leaf(1.0, -2.0)
    y = x * 3.0
    z = y * y  # 9 x^2
    pargrad.backward([y, z], [np.array([1.0, 1.0]), np.array([2.0, 0.5])])
    # dx = 3 gy + 18 x gz
    assert_grad(x, [3.0 + 36.0, 3.0 - 18.0])


def test_a_root_passed_twice_counts_twice() -> None:
    a, b = leaf(2.0, 3.0), leaf(-1.0, 5.0)
    m = a * b
    g = np.array([1.0, 0.5])
    pargrad.backward([m, m], [g, g])
    assert_grad(a, 2 * g * b.data)
    assert_grad(b, 2 * g * a.data)


@given(recipe=graph_recipes())
def test_listing_every_root_twice_doubles_every_gradient(recipe: GraphRecipe) -> None:
    leaves = recipe_leaves(recipe)
    roots = recipe.build(leaves)
    pargrad.backward(roots, list(recipe.root_grads), retain_graph=True)
    once = grads_of(leaves)
    for t in leaves:
        t.grad = None
    pargrad.backward(roots + roots, list(recipe.root_grads) * 2)
    assert_same_grads(grads_of(leaves), once, factor=2.0)


def test_a_gradient_fanned_out_to_rescaled_branches_sums_exactly() -> None:
    # One gradient reaches h through four consumers, two of them via m: if any branch
    # scaled a buffer another branch still reads, the total would be off.
    x, y = leaf(1.0, 2.0), leaf(3.0, 4.0)
    h = x + 1.0
    m = h * 2.0
    out = m * 2.0 + m * 3.0 + h * 5.0 + h + (h + y) * 7.0
    out.sum().backward()
    assert_grad(x, [4.0 + 6.0 + 5.0 + 1.0 + 7.0] * 2)
    assert_grad(y, [7.0, 7.0])


def test_backward_through_one_split_piece_leaves_the_other_rows_zero() -> None:
    x = pargrad.tensor(np.arange(12.0).reshape(6, 2), requires_grad=True)
    pieces = x.split(3)
    (pieces[1] * 3.0 - 1.0).sum().backward()
    expected = np.zeros((6, 2))
    expected[2:4] = 3.0
    assert_grad(x, expected)

    x.grad = None
    g = np.array([[1.0, -1.0], [2.0, 0.5]])
    x.split(3)[2].backward(g)
    expected = np.zeros((6, 2))
    expected[4:] = g
    assert_grad(x, expected)


@pytest.mark.parametrize("exponent", [0, 0.0, "zeros like the base", "zero 0-d tensor"])
def test_zero_to_the_power_zero_has_zero_gradient(exponent: Any) -> None:
    base = pargrad.tensor(np.zeros((2, 2)), requires_grad=True)
    if exponent == "zeros like the base":
        exponent = pargrad.zeros((2, 2))
    elif exponent == "zero 0-d tensor":
        exponent = pargrad.tensor(0.0)
    (base ** exponent).sum().backward()
    assert_grad(base, np.zeros((2, 2)))  # 0 * 0**-1 would be nan


# ----- what backward() refuses -----


def test_backward_of_a_tensor_without_history_is_refused() -> None:
    plain = pargrad.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        plain.backward(np.ones(2))
    tracked = leaf(1.0, 2.0)
    with pytest.raises(RuntimeError, match=re.escape("tensors[1] does not require grad")):
        pargrad.backward([tracked * 2.0, plain * 2.0], [np.ones(2), np.ones(2)])
    assert tracked.grad is None


def test_an_implied_gradient_needs_a_one_element_root() -> None:
    x = leaf(1.0, 2.0)
    with pytest.raises(RuntimeError, match="only for a tensor with one element"):
        pargrad.backward([x * 2.0], [None])
    one = pargrad.tensor([[3.0]], requires_grad=True)
    (one * 2.0).backward()  # shape (1, 1): one element is enough
    assert_grad(one, [[2.0]])


def test_backward_with_an_empty_inputs_list_is_refused() -> None:
    x = leaf(1.0)
    with pytest.raises(RuntimeError, match="inputs must not be empty"):
        pargrad.backward(x * 2.0, np.ones(1), inputs=[])


# ----- backward(inputs=...) -----


def test_backward_inputs_choose_which_leaves_accumulate() -> None:
    a, b = leaf(1.0, 2.0), leaf(3.0, -1.0)

    def f() -> Tensor:
        return a * a * b + b  # da = 2ab, db = a^2 + 1

    pargrad.backward(f(), np.ones(2), inputs=[a, b])
    assert_grad(a, [6.0, -4.0])
    assert_grad(b, [2.0, 5.0])

    with pargrad.no_grad():  # zero_ keeps the objects, so later sums start from zero
        a.grad.zero_()
        b.grad.zero_()
    pargrad.backward(f(), np.ones(2), inputs=[a])
    assert_grad(a, [6.0, -4.0])
    assert_grad(b, [0.0, 0.0])

    a.grad = None
    f().backward(np.ones(2), inputs=b)  # a lone tensor, not a list
    assert a.grad is None
    assert_grad(b, [2.0, 5.0])


def test_scalar_root_with_a_single_input_tensor() -> None:
    t = pargrad.tensor(1.5, requires_grad=True)
    (t ** 3).backward(inputs=t)
    assert_grad(t, 3 * 1.5 ** 2)


def test_backward_inputs_may_name_a_non_leaf() -> None:
    x = leaf(1.0, -0.5)
    h = x * 2.0
    out = (h * h + x).sum()
    out.backward(inputs=[x, h])
    assert_grad(h, 2 * h.data)
    assert_grad(x, 8 * x.data + 1)


@pytest.mark.parametrize("create_graph", [False, True])
def test_backward_inputs_unrelated_to_the_root_stay_without_grad(create_graph: bool) -> None:
    x, stranger = leaf(2.0), leaf(9.0)
    (x * x).backward(np.ones(1), inputs=[stranger], create_graph=create_graph)
    assert stranger.grad is None
    assert x.grad is None


@given(data=st.data(), recipe=graph_recipes())
def test_backward_inputs_give_the_full_backward_restricted_to_them(
        data: st.DataObject, recipe: GraphRecipe) -> None:
    leaves = recipe_leaves(recipe)
    roots = recipe.build(leaves)
    pargrad.backward(roots, list(recipe.root_grads), retain_graph=True)
    full = grads_of(leaves)
    for t in leaves:
        t.grad = None
    tracked = [k for k, t in enumerate(leaves) if t.requires_grad]
    chosen = data.draw(st.lists(st.sampled_from(tracked), min_size=1, unique=True))
    pargrad.backward(roots, list(recipe.root_grads), inputs=[leaves[k] for k in chosen])
    expected = [full[k] if k in chosen else None for k in range(len(leaves))]
    assert_same_grads(grads_of(leaves), expected)


def test_only_nodes_leading_to_a_requested_tensor_run() -> None:
    calls: list[str] = []
    spy = spy_identity(calls)
    x, y, z, stranger = leaf(1.0, 2.0), leaf(3.0, 4.0), leaf(5.0, 6.0), leaf(0.0)
    branch = spy.apply(x * 2.0)  # leads on only to x
    loss = (branch * y).sum() + (z * z).sum()

    (gz,) = pargrad.grad(loss, [z], retain_graph=True)
    np.testing.assert_array_equal(gz.data, [10.0, 12.0])
    none, gz = pargrad.grad(loss, [stranger, z], allow_unused=True, retain_graph=True)
    assert none is None
    np.testing.assert_array_equal(gz.data, [10.0, 12.0])
    loss.backward(inputs=[y], retain_graph=True)
    assert_grad(y, [2.0, 4.0])
    assert calls == []
    assert x.grad is None and z.grad is None

    loss.backward(inputs=[x])  # now the spy is on the way
    assert calls == ["spy ran"]
    assert_grad(x, [6.0, 8.0])


def test_backward_with_inputs_past_a_skipped_branch_does_not_complain() -> None:
    calls: list[str] = []
    spy = spy_identity(calls)
    out = spy.apply(leaf(1.0) * 2.0)
    elsewhere = leaf(4.0)
    pargrad.backward(out, np.ones(1), inputs=(elsewhere,))
    assert elsewhere.grad is None
    assert calls == []


# ----- grad() -----


def test_grad_of_a_recorded_gradient_is_a_hessian_vector_product() -> None:
    x, y = leaf(1.0, 2.0), leaf(0.5, -1.0)
    (x * x * y).sum().backward(create_graph=True)
    assert_grad(x, [1.0, -4.0])  # 2xy
    assert_grad(y, [1.0, 4.0])  # x^2
    v = np.array([3.0, -1.0])
    s = (x.grad * v).sum()
    hx, hy = pargrad.grad(s, [x, y], retain_graph=True)
    np.testing.assert_allclose(hx.data, [3.0, 2.0])  # 2 y v
    np.testing.assert_allclose(hy.data, [6.0, -4.0])  # 2 x v
    assert_grad(x, [1.0, -4.0])  # grad() left .grad alone
    assert_grad(y, [1.0, 4.0])
    s.backward()  # while backward adds the same products to .grad
    assert_grad(x, [4.0, -2.0])
    assert_grad(y, [7.0, 0.0])


def test_grad_refuses_grad_outputs_of_another_shape() -> None:
    x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape(
            "grad_outputs[0] has shape (3,), but outputs[0] has shape (2, 3)")):
        pargrad.grad(x * 2.0, [x], grad_outputs=[np.ones(3)])


def test_grad_with_respect_to_a_non_leaf_along_differentiable_descent_steps() -> None:
    t0, w = leaf(0.0, 3.0), leaf(1.0, 2.0)
    c = np.array([1.0, -1.0])

    def f(t: Tensor) -> Tensor:
        return (w * (t - c) ** 2).sum()

    t, steps, losses = t0, 4, []
    for _ in range(steps):
        (g,) = pargrad.grad(f(t), t, create_graph=True)
        np.testing.assert_allclose(g.data, 2 * w.data * (t.data - c))
        assert t0.grad is None and w.grad is None
        losses.append(f(t).item())
        t = t - 0.1 * g
    losses.append(f(t).item())
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))

    # t_k - c = (1 - 0.2 w)^k (t0 - c): differentiate that in t0 and in w.
    t.backward(np.ones(2))
    shrink = 1 - 0.2 * w.data
    assert_grad(t0, shrink ** steps)
    np.testing.assert_allclose(
        w.grad.data, steps * shrink ** (steps - 1) * -0.2 * (t0.data - c), rtol=1e-12)


@pytest.mark.parametrize("create_graph", [False, True])
def test_grad_with_respect_to_sibling_outputs_of_one_split(create_graph: bool) -> None:
    x = pargrad.tensor(np.arange(6.0), requires_grad=True)
    fired: list[Any] = []
    x.register_hook(fired.append)
    p, q, r = x.split(3)
    out = p * 2.0 - q * 3.0 + r
    go = np.array([1.0, -2.0])
    gp, gq = pargrad.grad(out, [p, q], grad_outputs=go, create_graph=create_graph)
    np.testing.assert_array_equal(gp.data, 2 * go)
    np.testing.assert_array_equal(gq.data, -3 * go)
    assert fired == []  # x lies beyond what was asked for
    assert x.grad is None


def test_unused_inputs_give_none_or_materialized_zeros() -> None:
    t, s = pargrad.tensor(0.5, requires_grad=True), pargrad.tensor(2.0, requires_grad=True)
    (dt,) = pargrad.grad(t * s, t, create_graph=True)  # = s, free of t
    assert dt.item() == 2.0
    assert pargrad.grad(dt, t, retain_graph=True, allow_unused=True) == (None,)
    zero, ds = pargrad.grad(dt, [t, s], create_graph=True, materialize_grads=True)
    assert zero.item() == 0.0 and ds.item() == 1.0
    # Under create_graph the zeros require grad, so they can be differentiated again;
    # materialize_grads alone stands for allow_unused.
    assert zero.requires_grad
    (again,) = pargrad.grad(zero, t, materialize_grads=True)
    assert again.item() == 0.0


def test_materialize_grads_contradicting_allow_unused_is_refused() -> None:
    t = pargrad.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match=re.escape("materialize_grads=True needs allow_unused")):
        pargrad.grad(t * 3.0, t, allow_unused=False, materialize_grads=True)


def test_gradients_without_create_graph_do_not_require_grad() -> None:
    used, unused = leaf(1.0, 2.0), leaf(3.0, 4.0)
    g_used, g_unused = pargrad.grad((used ** 2).sum(), [used, unused], allow_unused=True,
                                    materialize_grads=True)
    np.testing.assert_array_equal(g_used.data, [2.0, 4.0])
    np.testing.assert_array_equal(g_unused.data, [0.0, 0.0])
    assert not g_used.requires_grad and not g_unused.requires_grad


@given(data=st.data())
def test_gradients_of_intermediates_fed_back_give_the_leaves_gradients(
        data: st.DataObject) -> None:
    leaves = [pargrad.tensor(values(data.draw, (3,)), requires_grad=True) for _ in range(4)]
    mids = [t * t + t * float(k) for k, t in enumerate(leaves)]
    loss = sum((m * float(k + 1) for k, m in enumerate(mids)), start=pargrad.tensor(0.0)).sum()
    # Ask for the intermediates' gradients two at a time over the retained graph ...
    d_mids = [g for first in range(0, 4, 2)
              for g in pargrad.grad(loss, mids[first:first + 2], retain_graph=True)]
    assert all(t.grad is None for t in leaves)
    # ... then finish the chain rule from them.
    pargrad.backward(mids, d_mids)
    for k, t in enumerate(leaves):
        np.testing.assert_allclose(t.grad.data, (k + 1) * (2 * t.data + k), rtol=1e-12)


@given(recipe=graph_recipes())
def test_grad_returns_what_backward_would_accumulate(recipe: GraphRecipe) -> None:
    leaves = recipe_leaves(recipe)
    roots = recipe.build(leaves)
    tracked = [t for t in leaves if t.requires_grad]
    got = pargrad.grad(roots, tracked, list(recipe.root_grads), retain_graph=True,
                       allow_unused=True)
    assert all(t.grad is None for t in leaves)
    pargrad.backward(roots, list(recipe.root_grads))
    assert_same_grads([None if g is None else g.data for g in got], grads_of(tracked))


def test_grad_needs_an_output_and_inputs_that_require_grad() -> None:
    plain = pargrad.tensor([1.0])
    tracked = leaf(2.0)
    with pytest.raises(RuntimeError, match=re.escape("outputs[0] does not require grad")):
        pargrad.grad(plain * 2.0, tracked)
    with pytest.raises(RuntimeError, match=re.escape("inputs[0] does not require grad")):
        pargrad.grad(tracked * plain, plain)
    (g,) = pargrad.grad(tracked * plain, tracked)
    np.testing.assert_array_equal(g.data, [1.0])


def test_grad_with_no_inputs_is_refused() -> None:
    x = leaf(1.0)
    with pytest.raises(ValueError, match="inputs must not be empty"):
        pargrad.grad(x * 2.0, [], grad_outputs=np.ones(1))


def test_inputs_that_do_not_reach_the_output_need_allow_unused() -> None:
    x, detour, stray = leaf(2.0, 3.0), leaf(1.0, 1.0), leaf(5.0)
    side = detour * 5.0  # a graph of its own, not under the output  # noqa: F841
    out = (x * 3.0).sum()
    gx, gd, gs = pargrad.grad(out, [x, detour, stray], allow_unused=True, retain_graph=True)
    np.testing.assert_array_equal(gx.data, [3.0, 3.0])
    assert gd is None and gs is None
    with pytest.raises(RuntimeError, match=re.escape("inputs[1] got no gradient")) as info:
        pargrad.grad(out, [x, detour])
    assert "allow_unused=True" in str(info.value)


# ----- hooks on the outputs of a multi-output node -----


def test_a_hook_on_one_split_piece_sees_none_when_a_sibling_drives_backward() -> None:
    x = leaf(1.0, 2.0, 3.0)
    pieces = x.split(3)
    for piece in pieces:
        piece.retain_grad()
    seen: list[Any] = []
    pieces[1].register_hook(seen.append)
    # (the piece that is the root, its gradient): one backward each, piece 1 first
    for driver, g in [(1, np.array([1.0])), (0, np.array([4.0])), (2, np.array([-2.0]))]:
        before = np.zeros(3) if x.grad is None else x.grad.data.copy()
        for piece in pieces:
            piece.grad = None
        pieces[driver].backward(g)
        assert [p.grad is not None for p in pieces] == [k == driver for k in range(3)]
        assert_grad(pieces[driver], g)
        arrived = x.grad.data - before
        np.testing.assert_array_equal(arrived, np.where(np.arange(3) == driver, g, 0.0))
    np.testing.assert_array_equal(seen[0].data, [1.0])
    assert seen[1:] == [None, None]  # the node ran, but nothing flowed into piece 1
    assert_grad(x, [4.0, 1.0, -2.0])


# ----- a second backward through the same graph -----


def index_put_graph(b: Tensor) -> Tensor:
    """c[[0, 1, 3]] = b[[2, 0, 0]] on zeros: only indexing nodes, b[0] read twice."""
    c = pargrad.zeros(4)
    c[[0, 1, 3]] = b[[2, 0, 0]]
    return c


GC = np.array([1.0, 2.0, 3.0, 4.0])


def test_a_retained_indexing_graph_can_be_run_again() -> None:
    b = leaf(1.0, 2.0, 3.0)
    c = index_put_graph(b)
    c.backward(GC, retain_graph=True)
    assert_grad(b, [6.0, 0.0, 1.0])
    c.backward(GC)
    assert_grad(b, [12.0, 0.0, 2.0])


@pytest.mark.differs("an indexing node holds nothing a backward frees (its index is its "
                     "own copy), so pargrad runs it again without retain_graph; PyTorch "
                     "refuses")
def test_an_indexing_graph_runs_again_without_retain_graph() -> None:
    b = leaf(1.0, 2.0, 3.0)
    c = index_put_graph(b)
    c.backward(GC)
    c.backward(GC)
    assert_grad(b, [12.0, 0.0, 2.0])


def test_a_node_whose_saved_values_were_freed_refuses_a_second_backward() -> None:
    b = leaf(1.0, 2.0, 3.0)
    c = pargrad.zeros(2)
    c[[0, 1]] = b[[0, 0]] * b[[1, 1]]  # the product saved both factors
    c.backward(np.ones(2))
    assert_grad(b, [4.0, 2.0, 0.0])
    with pytest.raises(pargrad.BackwardError, match=re.escape(
            "MultiplyBackward: trying to backward through the graph a second time")) as info:
        c.backward(np.ones(2))
    assert "pass retain_graph=True" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert_grad(b, [4.0, 2.0, 0.0])  # the failed call added nothing


def test_a_graph_that_saved_nothing_runs_again_without_retain_graph() -> None:
    b = leaf(1.0, 2.0, 3.0)
    c = b + 1.0
    c.backward(np.array([1.0, 0.0, 2.0]))
    c.backward(np.array([1.0, 0.0, 2.0]))
    assert_grad(b, [2.0, 0.0, 4.0])


# ----- the graph's structure -----


def test_next_functions_point_at_leaf_accumulators_and_producers() -> None:
    p, q = leaf(1.0, 2.0), leaf(3.0, 4.0)
    s = p * q
    edges = s.grad_fn.next_functions
    assert len(edges) == 2
    assert [type(node) for node, _ in edges] == [pargrad.AccumulateGrad] * 2
    assert [nr for _, nr in edges] == [0, 0]
    assert edges[0][0].variable is p and edges[1][0].variable is q

    # A constant operand has no node; a computed one has its producer's.
    assert (s - 5.0).grad_fn.next_functions == ((s.grad_fn, 0), (None, 0))
    assert (5.0 - s).grad_fn.next_functions == ((None, 0), (s.grad_fn, 0))
    fixed = pargrad.tensor([1.0, 1.0])
    assert (fixed * s).grad_fn.next_functions == ((None, 0), (s.grad_fn, 0))


def test_output_nr_survives_saving_and_restoring() -> None:
    class Halves(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
            return x.data[:2].copy(), x.data[2:].copy()

        @staticmethod
        def backward(ctx: Any, g_front: Tensor, g_back: Tensor) -> Tensor:
            return pargrad.concatenate([g_front, g_back])

    restored: list[int] = []

    class Triple(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> np.ndarray:
            ctx.save_for_backward(t)
            return t.data * 3.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (t,) = ctx.saved_tensors
            restored.append(t.output_nr)
            return g * 3.0

    x = leaf(1.0, 2.0, 3.0, 4.0)
    front, back = Halves.apply(x)
    assert (front.output_nr, back.output_nr) == (0, 1)
    Triple.apply(back).sum().backward()
    assert restored == [1]
    assert_grad(x, [0.0, 0.0, 3.0, 3.0])


# ----- requires_grad -----


@pytest.mark.parametrize(("left", "right"), list(itertools.product([False, True], repeat=2)))
def test_a_result_requires_grad_when_any_operand_does(left: bool, right: bool) -> None:
    a = pargrad.tensor([1.0, 2.0], requires_grad=left)
    b = pargrad.tensor([3.0, 4.0], requires_grad=right)
    out = a * b
    assert out.requires_grad == (left or right)
    assert (out.grad_fn is None) == (not (left or right))
    if out.requires_grad:
        out.sum().backward()
        for mine, other in ((a, b), (b, a)):
            if mine.requires_grad:
                assert_grad(mine, other.data)


def test_requires_grad_underscore_returns_the_tensor_and_sets_the_flag() -> None:
    off, on = pargrad.tensor([1.0]), leaf(2.0)
    for t in (off, on):
        assert t.requires_grad_() is t and t.requires_grad
        assert t.requires_grad_(True) is t and t.requires_grad
    product = off * on
    assert product.requires_grad_() is product and product.requires_grad
    assert product.requires_grad_(True) is product
    for t in (off, on):
        assert t.requires_grad_(False) is t and not t.requires_grad


def test_requires_grad_cannot_be_switched_off_on_a_computed_tensor() -> None:
    product = leaf(1.0) * leaf(2.0)
    with pytest.raises(RuntimeError, match="can only be changed on leaf tensors"):
        product.requires_grad_(False)
    assert product.requires_grad and product.grad_fn is not None


# ----- detach -----


def test_detach_gives_a_leaf_that_gradients_do_not_cross() -> None:
    x = leaf(1.0, 2.0)
    cut = (x * x).detach()
    assert not cut.requires_grad and cut.grad_fn is None and cut.is_leaf
    assert not (cut * 3.0).requires_grad
    (x * cut).sum().backward()
    assert_grad(x, [1.0, 4.0])  # d/dx of x * const(x^2), not 3x^2


def test_detach_in_place_stops_later_backward_but_keeps_earlier_gradients() -> None:
    x, y = leaf(1.0, 2.0), leaf(5.0, 7.0)
    m = x * 3.0
    (m * y).sum().backward(retain_graph=True)
    assert_grad(x, [15.0, 21.0])
    assert_grad(y, [3.0, 6.0])
    assert m.detach_() is m
    assert not m.requires_grad and m.grad_fn is None
    (m * y).sum().backward()
    assert_grad(x, [15.0, 21.0])
    assert_grad(y, [6.0, 12.0])


def test_detach_in_place_is_refused_on_a_view() -> None:
    x = leaf(1.0, 2.0, 3.0)
    window = x[1:]
    with pytest.raises(RuntimeError, match="cannot detach a view"):
        window.detach_()
    assert window.requires_grad and window.grad_fn is not None


def test_detaching_a_base_in_place_leaves_its_views_attached() -> None:
    x = pargrad.tensor(np.arange(6.0).reshape(3, 2), requires_grad=True)
    rows = x[1:]
    x.detach_()
    assert not x.requires_grad
    assert rows.requires_grad and rows.grad_fn is not None
    # Still a view of x: a change of x shows through it and moves its version too.
    x.add_(10.0)
    np.testing.assert_array_equal(rows.data, [[12.0, 13.0], [14.0, 15.0]])
    assert rows._version == x._version == 1


def test_an_in_place_change_through_a_detached_alias_breaks_backward() -> None:
    x = leaf(0.5, 1.0)
    y = x.sin()  # keeps x for cos(x)
    alias = x.detach()
    alias.mul_(2.0)
    assert x._version == 1
    np.testing.assert_array_equal(x.data, [1.0, 2.0])
    with pytest.raises(pargrad.BackwardError, match="changed by an in-place operation"):
        y.sum().backward()
    assert x.grad is None


# ----- pickling -----


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_keeps_values_dtype_and_requires_grad(protocol: int) -> None:
    tracked = pargrad.tensor(np.array([[1.5, -2.0], [0.25, 8.0]]), requires_grad=True)
    plain = pargrad.tensor(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    back_tracked, back_plain = pickle.loads(pickle.dumps([tracked, plain], protocol=protocol))
    for before, after in ((tracked, back_tracked), (plain, back_plain)):
        assert isinstance(after, Tensor)
        assert after.dtype == before.dtype and after.requires_grad == before.requires_grad
        np.testing.assert_array_equal(after.data, before.data)
    back_tracked.sum().backward()
    np.testing.assert_array_equal(back_tracked.grad.data, np.ones((2, 2)))
