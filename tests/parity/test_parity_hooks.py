"""Hooks: tensor hooks, node pre- and post-hooks, the hooks of a leaf's accumulator,
post-accumulate-grad hooks, multi-grad hooks and ``retain_grad``: what each one sees,
the order they fire in, which of them ``grad`` and ``backward(inputs=...)`` run, how they
follow in-place changes, and hooks that run a backward of their own."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad import Function, Tensor
from tests.parity.support import leaf
from tests.strategies import GraphRecipe, graph_recipes

Log = list[tuple[Any, ...]]
NOT_ON_A_NON_LEAF = "post-accumulate-grad hooks can only be registered on leaf"
MUST_RETURN_NONE = "post-accumulate-grad hooks should return None"



def _assert_values(t: Tensor | None, expected: Any) -> None:
    assert t is not None
    np.testing.assert_allclose(t.data, np.asarray(expected, dtype=float), rtol=1e-12)


def _recorder(log: Log, tag: str) -> Callable[..., None]:
    """A hook that appends ``(tag, *its arguments)`` to ``log`` and changes nothing."""
    def hook(*args: Any) -> None:
        log.append((tag, *args))
    return hook


def _scaling(log: Log, tag: str, factor: float) -> Callable[[Tensor], Tensor]:
    """A tensor hook that logs ``tag`` and multiplies the gradient by ``factor``."""
    def hook(grad: Tensor) -> Tensor:
        log.append((tag, grad))
        return grad * factor
    return hook


def _scaling_pre(log: Log, tag: str, factor: float) -> Callable[[tuple[Any, ...]], Any]:
    """A node pre-hook that logs ``tag`` and multiplies every gradient by ``factor``."""
    def hook(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append((tag, *grads))
        return tuple(None if g is None else g * factor for g in grads)
    return hook


def _tags(log: Log) -> list[Any]:
    return [entry[0] for entry in log]


def _node(t: Tensor) -> pargrad.Node:
    assert t.grad_fn is not None
    return t.grad_fn


def _grad(t: Tensor) -> Tensor:
    assert t.grad is not None
    return t.grad


def _accumulator(t: Tensor) -> pargrad.Node:
    """The AccumulateGrad node of the leaf that ``t``'s node was applied to."""
    node = _node(t).next_functions[0][0]
    assert node is not None and node.name() == "AccumulateGrad"
    return node


# ----- custom Functions used as nodes -----
class Triple(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data * 3

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g * 3


class Spread(Function):
    """Two outputs from one input: ``(2x, 3x)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        return x.data * 2, x.data * 3

    @staticmethod
    def backward(ctx: Any, g_double: Tensor, g_triple: Tensor) -> Tensor:
        return g_double * 2 + g_triple * 3


# The same node, as a built-in op and as a custom Function: node hooks work on both.
TRIPLERS: dict[str, Callable[[Tensor], Tensor]] = {
    "op": lambda x: x * 3,
    "function": Triple.apply,
}


# ----- tensor hooks -----
def test_tensor_hooks_see_the_gradient_of_their_tensor_as_a_tensor() -> None:
    x = leaf(1.0, -2.0, 0.5)
    h = x * 3 + 1                                  # [4, -5, 2.5]
    log: Log = []
    h.register_hook(_recorder(log, "h"))
    x.register_hook(_recorder(log, "x"))
    (h * h).sum().backward()
    # x's gradient needs h's, so h's hook is first on every engine.
    assert _tags(log) == ["h", "x"]
    assert all(isinstance(grad, Tensor) for _, grad in log)
    _assert_values(log[0][1], [8.0, -10.0, 5.0])   # 2h
    _assert_values(log[1][1], [24.0, -30.0, 15.0])  # 6h
    _assert_values(x.grad, [24.0, -30.0, 15.0])


def test_hooks_fire_once_per_backward_from_registration_until_removal() -> None:
    w = leaf(2.0, -1.0)
    u = w * w
    loss = u.sum()
    calls: list[str] = []
    first = u.register_hook(lambda g: calls.append("first"))
    loss.backward(retain_graph=True)
    assert calls == ["first"]
    second = u.register_hook(lambda g: calls.append("second"))
    loss.backward(retain_graph=True)
    assert calls == ["first", "first", "second"]
    first.remove()
    loss.backward(retain_graph=True)
    assert calls == ["first", "first", "second", "second"]
    second.remove()
    loss.backward()
    assert len(calls) == 4
    _assert_values(w.grad, [16.0, -8.0])  # four backward calls of 2w: the hooks changed nothing


def test_hook_on_a_non_leaf_replaces_the_gradient_every_leaf_gets_through_it() -> None:
    x = leaf(1.0, 2.0)
    y = leaf(3.0, -1.0)
    z = x * y + y                                  # dz/dx = y, dz/dy = x + 1
    z.register_hook(lambda g: g * 3)
    loss = z.sum()
    loss.backward(retain_graph=True)
    _assert_values(x.grad, [9.0, -3.0])
    _assert_values(y.grad, [6.0, 9.0])
    with pargrad.no_grad():
        _grad(x).zero_()
        _grad(y).zero_()
    # A leaf's own hook composes with z's, and changes that leaf's gradient only.
    y.register_hook(lambda g: g * 0.5)
    loss.backward()
    _assert_values(x.grad, [9.0, -3.0])
    _assert_values(y.grad, [3.0, 4.5])


class _Scale:
    """A hook with no ``__name__``: an instance with ``__call__``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, grad: Tensor) -> Tensor:
        return grad * self.factor


def test_any_callable_object_can_be_a_hook() -> None:
    x = leaf(1.0, 4.0)
    h = x * 2
    assert not hasattr(_Scale(1.0), "__name__")
    h.register_hook(_Scale(-1.0))
    x.register_hook(_Scale(10.0))
    h.sum().backward()
    _assert_values(x.grad, [-20.0, -20.0])


class _HalfDifferentiable(Function):
    """Two outputs; the backward gives the second input no gradient."""

    needs: tuple[bool, ...] = ()

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor) -> tuple[np.ndarray, np.ndarray]:
        _HalfDifferentiable.needs = tuple(ctx.needs_input_grad)
        return x.data * 2, y.data + 1

    @staticmethod
    def backward(ctx: Any, g_x: Tensor, g_y: Tensor) -> tuple[Tensor, None]:
        return g_x * 2, None


def test_hooks_on_both_outputs_of_a_function_get_gradients_when_one_input_needs_none() -> None:
    x = leaf(1.0, 2.0)
    y = pargrad.tensor([5.0, 6.0])
    from_x, from_y = _HalfDifferentiable.apply(x, y)
    assert _HalfDifferentiable.needs == (True, False)
    log: Log = []
    from_x.register_hook(_recorder(log, "from_x"))
    from_y.register_hook(_recorder(log, "from_y"))
    (from_x + from_y * 3).sum().backward()
    assert sorted(_tags(log)) == ["from_x", "from_y"]
    seen = {entry[0]: entry[1] for entry in log}
    _assert_values(seen["from_x"], [1.0, 1.0])
    _assert_values(seen["from_y"], [3.0, 3.0])
    _assert_values(x.grad, [2.0, 2.0])
    assert y.grad is None


class _PassThrough(Function):
    """Returns its first input itself, and ``a + 2b``."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> tuple[Tensor, np.ndarray]:
        return a, a.data + 2 * b.data

    @staticmethod
    def backward(ctx: Any, g_same: Tensor, g_mix: Tensor) -> tuple[Tensor, Tensor]:
        return g_same + g_mix, g_mix * 2


def test_an_input_returned_as_an_output_gets_hooks_of_its_own() -> None:
    x = leaf(1.0, 2.0, 3.0)
    y = leaf(0.5, 0.5, 0.5)
    same, mix = _PassThrough.apply(x, y)
    assert same is not x and same.grad_fn is not None
    log: Log = []
    same.register_hook(_recorder(log, "same"))
    (same * 5 + mix + x).sum().backward()
    # What flows into the output only, not x's direct use in the loss.
    assert _tags(log) == ["same"]
    _assert_values(log[0][1], [5.0, 5.0, 5.0])
    _assert_values(x.grad, [7.0, 7.0, 7.0])   # 5 + 1 through the Function, 1 directly
    _assert_values(y.grad, [2.0, 2.0, 2.0])


# ----- node pre-hooks and post-hooks -----
@pytest.mark.parametrize("kind", list(TRIPLERS))
def test_node_prehooks_chain_then_the_backward_then_its_posthooks(kind: str) -> None:
    a = leaf(1.5, -0.5)
    b = TRIPLERS[kind](a)
    node = _node(b)
    log: Log = []

    def posthook(grads_in: tuple[Any, ...], grads_out: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append(("post", grads_in[0], grads_out[0]))
        return grads_in                            # unchanged: allowed

    def same_tuple(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append(("same", *grads))
        return grads

    # A post-hook registered before the pre-hooks still runs after all of them.
    node.register_hook(posthook)
    node.register_prehook(_scaling_pre(log, "x2", 2.0))
    node.register_prehook(lambda grads: log.append(("none", *grads)))  # None: keeps them
    node.register_prehook(_scaling_pre(log, "x5", 5.0))
    node.register_prehook(same_tuple)
    node.register_hook(posthook)
    b.sum().backward()
    assert _tags(log) == ["x2", "none", "x5", "same", "post", "post"]
    # Each pre-hook got what the one before it returned.
    for entry, expected in zip(log[:4], [1.0, 2.0, 2.0, 10.0]):
        _assert_values(entry[1], [expected, expected])
    for _, grad_in, grad_out in log[4:]:
        _assert_values(grad_out, [10.0, 10.0])
        _assert_values(grad_in, [30.0, 30.0])     # the backward ran on the hooked gradient
    _assert_values(a.grad, [30.0, 30.0])


@pytest.mark.parametrize("kind", list(TRIPLERS))
def test_a_removed_prehook_stops_firing_and_removing_twice_is_harmless(kind: str) -> None:
    a = leaf(2.0, 1.0, 0.0)
    b = TRIPLERS[kind](a)
    calls: list[int] = []

    def counting(grads: tuple[Any, ...]) -> None:
        calls.append(1)

    removed = _node(b).register_prehook(counting)
    _node(b).register_prehook(counting)       # the same function, a second handle
    removed.remove()
    removed.remove()
    b.sum().backward()
    assert len(calls) == 1
    _assert_values(a.grad, [3.0, 3.0, 3.0])        # a pre-hook returning None changes nothing


@pytest.mark.parametrize("kind", list(TRIPLERS))
def test_a_prehook_removed_during_a_backward_still_runs_in_that_backward(kind: str) -> None:
    a = leaf(1.0, -1.0)
    b = TRIPLERS[kind](a)
    loss = b.sum()
    calls: list[str] = []
    handles: dict[str, Any] = {}

    def remover(grads: tuple[Any, ...]) -> None:
        calls.append("remover")
        handles["later"].remove()
        handles["gone"].remove()                   # already removed: no error

    _node(b).register_prehook(remover)
    handles["later"] = _node(b).register_prehook(lambda grads: calls.append("later"))
    handles["gone"] = _node(b).register_prehook(lambda grads: calls.append("gone"))
    handles["gone"].remove()
    # A backward uses the node's hooks as they were when the node started.
    loss.backward(retain_graph=True)
    assert calls == ["remover", "later"]
    loss.backward()
    assert calls == ["remover", "later", "remover"]
    _assert_values(a.grad, [6.0, 6.0])


class _ScaleAround(Function):
    """Three outputs: ``(k x, k, (k + 1) y)``; the middle one is a plain int."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: int, y: Tensor) -> tuple[Any, ...]:
        ctx.k = k
        return x.data * k, k, y.data * (k + 1)

    @staticmethod
    def backward(ctx: Any, g_x: Tensor, g_k: Any, g_y: Tensor) -> tuple[Any, ...]:
        return g_x * ctx.k, None, g_y * (ctx.k + 1)


def test_prehook_of_a_multi_output_function_sees_none_for_a_non_tensor_output() -> None:
    a = leaf(1.0, 2.0)
    b = leaf(-1.0, 4.0)
    scaled_a, k, scaled_b = _ScaleAround.apply(a, 2, b)
    assert k == 2
    log: Log = []
    _node(scaled_a).register_prehook(_scaling_pre(log, "pre", 10.0))
    (scaled_a + scaled_b).sum().backward()
    assert len(log) == 1                           # once per backward, not once per output
    _, g_a, g_k, g_b = log[0]
    assert g_k is None
    _assert_values(g_a, [1.0, 1.0])
    _assert_values(g_b, [1.0, 1.0])
    _assert_values(a.grad, [20.0, 20.0])
    _assert_values(b.grad, [30.0, 30.0])


# ----- retain_grad -----
def test_a_retained_gradient_of_a_non_leaf_accumulates_like_a_leafs() -> None:
    x = leaf(1.0, -1.0, 2.0)
    h = x * 2 - 1                                  # [1, -3, 3]
    loss = (h * h * h).sum()                       # d/dh = 3h^2
    h.retain_grad()
    h.retain_grad()                                # twice is the same as once
    assert h.retains_grad
    loss.backward(retain_graph=True)
    _assert_values(h.grad, [3.0, 27.0, 27.0])
    loss.backward()
    _assert_values(h.grad, [6.0, 54.0, 54.0])
    _assert_values(x.grad, [12.0, 108.0, 108.0])


def test_retain_grad_on_a_leaf_changes_nothing() -> None:
    x = leaf(0.5, -3.0)
    x.retain_grad()
    x.retain_grad()
    (x * x).sum().backward()
    _assert_values(x.grad, [1.0, -6.0])


def test_a_retained_gradient_includes_the_tensors_hooks_in_registration_order() -> None:
    a = leaf(2.0)
    b = a * 1
    b.register_hook(lambda g: g * 3)
    b.retain_grad()
    b.register_hook(lambda g: g + 1)               # after retain_grad, still seen by it
    (b * 5).sum().backward()
    _assert_values(b.grad, [16.0])                 # 5 * 3 + 1; the other order gives 18
    _assert_values(a.grad, [16.0])

    c = leaf(2.0) * 1
    c.retain_grad()
    c.register_hook(lambda g: g * 3)
    (c * 5).sum().backward()
    _assert_values(c.grad, [15.0])


@pytest.mark.parametrize("changes", [1, 2])
def test_a_retained_gradient_after_an_in_place_change_is_for_the_new_value(
        changes: int) -> None:
    a = leaf(3.0)
    t = a * 1
    t.retain_grad()
    t.mul_(4)
    if changes == 2:
        t.add_(1)
    (t * 2).sum().backward()
    _assert_values(t.grad, [2.0])
    _assert_values(a.grad, [8.0])


def test_a_retained_gradient_after_in_place_changes_through_a_view_is_for_the_new_value(
        ) -> None:
    source = leaf(1.0, 2.0)
    x = source * 1
    x.retain_grad()
    head = x[:1]
    head *= 3                                      # x = [3, 2]
    x *= 2                                         # x = [6, 4]
    (x * x).sum().backward()
    _assert_values(x.grad, [12.0, 8.0])            # 2x at x's final value
    _assert_values(source.grad, [72.0, 16.0])        # loss = 36 l0^2 + 4 l1^2


def test_adding_a_differentiable_tensor_into_a_view_of_a_plain_one_records_it() -> None:
    base = pargrad.tensor(np.zeros(4))
    grid = base.reshape(2, 2)
    w = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    grid.add_(w)
    assert grid.requires_grad
    np.testing.assert_array_equal(base.data, [1.0, 2.0, 3.0, 4.0])
    (grid * grid).sum().backward()
    _assert_values(w.grad, [[2.0, 4.0], [6.0, 8.0]])


def test_retained_gradients_of_a_functions_outputs_after_one_is_changed_in_place() -> None:
    b = leaf(1.0, -2.0)
    doubled, tripled = Spread.apply(b)
    doubled.retain_grad()
    tripled.retain_grad()
    doubled.mul_(4)
    loss = (doubled + tripled * 5).sum()
    loss.backward(retain_graph=True)
    _assert_values(doubled.grad, [1.0, 1.0])
    _assert_values(tripled.grad, [5.0, 5.0])
    _assert_values(b.grad, [23.0, 23.0])           # 4 * 2 + 5 * 3
    by_grad = pargrad.grad(loss, (doubled, tripled))
    _assert_values(by_grad[0], doubled.grad.data)
    _assert_values(by_grad[1], tripled.grad.data)


def test_retained_gradients_of_two_views_after_one_is_changed_in_place() -> None:
    source = leaf(2.0, 5.0)
    base = source * 1
    changed, other = base[:], base[:]
    changed.retain_grad()
    other.retain_grad()
    changed.mul_(3)                                # other sees it too: both are 3 * source
    np.testing.assert_array_equal(other.data, [6.0, 15.0])
    (changed * 2 + other * 7).sum().backward()
    _assert_values(changed.grad, [2.0, 2.0])
    _assert_values(other.grad, [7.0, 7.0])
    _assert_values(source.grad, [27.0, 27.0])


# ----- hooks and in-place changes -----
def test_a_hook_stays_with_the_version_it_was_registered_on() -> None:
    a = leaf(1.5)
    t = a * 1
    log: Log = []
    t.register_hook(_scaling(log, "before", 2.0))
    t.mul_(3)
    t.register_hook(_scaling(log, "after", 5.0))
    (t * 7).sum().backward()
    assert _tags(log) == ["after", "before"]
    _assert_values(log[0][1], [7.0])
    _assert_values(log[1][1], [105.0])             # 7 * 5, then through mul_(3)
    _assert_values(a.grad, [210.0])


def test_a_hook_on_an_old_version_sees_every_later_in_place_change() -> None:
    a = leaf(1.5)
    t = a * 1
    log: Log = []
    t.register_hook(_scaling(log, "before", 2.0))
    t.mul_(3)
    t.mul_(2)
    (t * 7).sum().backward()
    assert _tags(log) == ["before"]
    _assert_values(log[0][1], [42.0])
    _assert_values(a.grad, [84.0])


def test_hooks_on_a_functions_outputs_across_an_in_place_change_of_one() -> None:
    b = leaf(1.0, 2.0)
    doubled, tripled = Spread.apply(b)
    log: Log = []
    handles = [doubled.register_hook(_recorder(log, "doubled, before")),
               tripled.register_hook(_recorder(log, "tripled"))]
    doubled.mul_(4)
    handles.append(doubled.register_hook(_recorder(log, "doubled, after")))
    (doubled + tripled * 5).sum().backward()
    assert Counter(_tags(log)) == Counter(["doubled, before", "tripled", "doubled, after"])
    seen = {entry[0]: entry[1] for entry in log}
    _assert_values(seen["doubled, after"], [1.0, 1.0])
    _assert_values(seen["doubled, before"], [4.0, 4.0])
    _assert_values(seen["tripled"], [5.0, 5.0])
    _assert_values(b.grad, [23.0, 23.0])
    for handle in handles:
        handle.remove()


def test_hooks_on_views_registered_before_their_base_changed_do_not_fire() -> None:
    source = leaf(2.0)
    base = source * 1
    changed, other = base[:], base[:]
    stale: Log = []
    changed.register_hook(_recorder(stale, "changed"))
    other.register_hook(_recorder(stale, "other"))
    changed.mul_(3)
    fresh: Log = []
    other.register_hook(_recorder(fresh, "other"))
    (changed * 2 + other * 7).sum().backward()
    assert stale == []
    assert _tags(fresh) == ["other"]
    _assert_values(fresh[0][1], [7.0])
    _assert_values(source.grad, [27.0])


# ----- post-accumulate-grad hooks -----
def test_post_accumulate_grad_hooks_are_refused_on_non_leaves() -> None:
    h = leaf(1.0) * 2
    with pytest.raises(RuntimeError, match=NOT_ON_A_NON_LEAF):
        h.register_post_accumulate_grad_hook(lambda t: None)


def test_post_accumulate_grad_hooks_run_in_order_and_may_update_the_leaf() -> None:
    w = leaf(1.0, 2.0, 4.0)
    order: list[str] = []

    def step(t: Tensor) -> None:
        order.append("step")
        _assert_values(t.grad, [2.0, 4.0, 8.0])    # already updated
        with pargrad.no_grad():
            t.sub_(_grad(t) * 0.25)                  # w / 2

    def rescale(t: Tensor) -> None:
        order.append("rescale")
        with pargrad.no_grad():
            t.mul_(10)

    w.register_post_accumulate_grad_hook(step)
    w.register_post_accumulate_grad_hook(rescale)
    (w * w).sum().backward()
    assert order == ["step", "rescale"]
    np.testing.assert_allclose(w.data, [5.0, 10.0, 20.0])  # the other order: 9.5 w


def test_a_post_accumulate_grad_hook_runs_for_each_leaf_that_got_a_gradient() -> None:
    p = leaf(1.0, 2.0, 3.0)
    q = leaf(-1.0, 0.5)
    stepped: list[Tensor] = []

    def sgd(t: Tensor) -> None:
        stepped.append(t)
        with pargrad.no_grad():
            t.sub_(_grad(t))

    p.register_post_accumulate_grad_hook(sgd)
    q.register_post_accumulate_grad_hook(sgd)
    (p * 3).sum().backward()
    assert stepped == [p]
    np.testing.assert_allclose(p.data, [-2.0, -1.0, 0.0])
    np.testing.assert_allclose(q.data, [-1.0, 0.5])
    (q * q).sum().backward()
    assert len(stepped) == 2 and stepped[1] is q
    np.testing.assert_allclose(q.data, [1.0, -0.5])  # q - 2q


def test_a_post_accumulate_grad_hook_returning_a_value_fails_the_backward() -> None:
    w = leaf(1.0, 2.0)
    w.register_post_accumulate_grad_hook(lambda t: t.grad)
    with pytest.raises(RuntimeError, match=MUST_RETURN_NONE):
        (w * w).sum().backward()
    assert w.grad is None                          # a failed backward leaves .grad as it was


class _Marker:
    """Something a hook's closure holds, to see when it is released."""


def test_a_post_accumulate_grad_hook_lives_as_long_as_its_leaf() -> None:
    def leaf_with_hook() -> tuple[Tensor, weakref.ref[_Marker]]:
        held = _Marker()
        w = leaf(1.0, 2.0)

        def hook(t: Tensor) -> None:
            assert held is not None

        w.register_post_accumulate_grad_hook(hook)
        (w * 2).sum().backward()
        return w, weakref.ref(held)

    w, held = leaf_with_hook()
    gc.collect()
    assert held() is not None
    del w
    gc.collect()
    assert held() is None


def test_a_leafs_hooks_fire_in_order_around_the_update_of_its_grad() -> None:
    a = leaf(2.0, -1.0)
    y = a * 4
    acc = _accumulator(y)
    log: Log = []

    def after_update(t: Tensor) -> None:
        log.append(("post-accumulate",))
        _grad(t).add_(0.25)

    def acc_posthook(grads_in: tuple[Any, ...], grads_out: tuple[Any, ...]) -> None:
        log.append(("acc post", grads_in, grads_out))
        # On a first accumulation its gradient is the new .grad itself, changes included.
        a.grad = grads_out[0] * 10

    def minus_one(grad: Tensor) -> Tensor:
        log.append(("tensor",))
        return grad - 1

    # Registered in the reverse of the order they fire in.
    acc.register_hook(acc_posthook)
    a.register_post_accumulate_grad_hook(after_update)
    acc.register_prehook(_scaling_pre(log, "acc pre", 0.5))
    a.register_hook(minus_one)
    y.sum().backward()
    assert _tags(log) == ["tensor", "acc pre", "post-accumulate", "acc post"]
    _assert_values(log[1][1], [3.0, 3.0])          # 4 - 1
    grads_in, grads_out = log[3][1:]
    assert grads_in == ()
    _assert_values(grads_out[0], [1.75, 1.75])     # 3 / 2 + 0.25
    _assert_values(a.grad, [17.5, 17.5])


# ----- the accumulator's hooks, and what grad and backward(inputs=...) run -----
def test_accumulator_hooks_see_the_gradient_after_the_leafs_tensor_hooks() -> None:
    a = leaf(1.0, 3.0)
    y = a * 5
    acc = _accumulator(y)
    log: Log = []
    acc.register_hook(_recorder(log, "post"))
    acc.register_prehook(_recorder(log, "pre"))
    a.register_hook(lambda g: g * 2)
    y.sum().backward()
    assert _tags(log) == ["pre", "post"]
    pre_grads = log[0][1]
    assert len(pre_grads) == 1
    _assert_values(pre_grads[0], [10.0, 10.0])
    post_in, post_out = log[1][1:]
    assert post_in == () and len(post_out) == 1
    _assert_values(post_out[0], [10.0, 10.0])
    _assert_values(a.grad, [10.0, 10.0])


def test_hooks_of_a_leaf_left_out_by_backward_inputs_do_not_fire() -> None:
    a = leaf(2.0)
    b = leaf(3.0)
    y = a * 1
    log: Log = []
    a.register_hook(_recorder(log, "tensor"))
    _accumulator(y).register_hook(_recorder(log, "acc post"))
    (a * b + y).sum().backward(inputs=[b])
    assert log == []
    assert a.grad is None
    _assert_values(b.grad, [2.0])


@pytest.fixture
def chain() -> Iterator[tuple[Tensor, Tensor, Tensor, Counter[str]]]:
    """``a -> b = 3a -> c = b * b`` with a counting hook of every kind on ``a`` and ``b``."""
    a = pargrad.tensor(2.0, requires_grad=True)
    b = a * 3
    c = b * b
    fired: Counter[str] = Counter()

    def count(name: str) -> Callable[..., None]:
        return lambda *args: fired.update([name])

    a.register_hook(count("a tensor"))
    b.register_hook(count("b tensor"))
    _node(b).register_prehook(count("b pre"))
    _node(b).register_hook(count("b post"))
    acc = _accumulator(b)
    acc.register_prehook(count("acc pre"))
    acc.register_hook(count("acc post"))
    yield a, b, c, fired


def test_grad_for_a_non_leaf_runs_only_that_tensors_hooks(
        chain: tuple[Tensor, Tensor, Tensor, Counter[str]]) -> None:
    _, b, c, fired = chain
    (gb,) = pargrad.grad(c, b)
    assert fired == Counter({"b tensor": 1})
    _assert_values(gb, 12.0)


def test_grad_runs_the_nodes_hooks_but_never_the_accumulators(
        chain: tuple[Tensor, Tensor, Tensor, Counter[str]]) -> None:
    a, b, c, fired = chain
    ga, gb = pargrad.grad(c, (a, b))
    assert fired == Counter({"a tensor": 1, "b tensor": 1, "b pre": 1, "b post": 1})
    _assert_values(ga, 36.0)
    _assert_values(gb, 12.0)
    assert a.grad is None


@pytest.mark.parametrize("inputs", ["all leaves", "a and non-leaf b"])
def test_backward_runs_every_hook_once(
        chain: tuple[Tensor, Tensor, Tensor, Counter[str]], inputs: str) -> None:
    a, b, c, fired = chain
    # b's node still runs when b is an input: a's gradient needs it.
    c.backward(inputs=None if inputs == "all leaves" else (a, b))
    assert fired == Counter({"a tensor": 1, "b tensor": 1, "b pre": 1, "b post": 1,
                             "acc pre": 1, "acc post": 1})
    _assert_values(a.grad, 36.0)
    if inputs != "all leaves":
        _assert_values(b.grad, 12.0)


# ----- order along a chain -----
def _chain_with_ordered_hooks() -> tuple[Tensor, Tensor, Log]:
    """``b = 2a`` (scalar ``a = 1``) with tensor hooks (x3) and pre-hooks (x2) on both
    nodes, registered out of the order they fire in."""
    a = pargrad.tensor(1.0, requires_grad=True)
    b = a * 2
    log: Log = []
    _node(b).register_prehook(_scaling_pre(log, "b pre", 2.0))
    b.register_hook(_scaling(log, "b tensor", 3.0))
    _node(b).register_prehook(_scaling_pre(log, "b pre", 2.0))
    acc = _accumulator(b)
    a.register_hook(_scaling(log, "a tensor", 3.0))
    acc.register_prehook(_scaling_pre(log, "acc pre", 2.0))
    a.register_hook(_scaling(log, "a tensor", 3.0))
    return a, b, log


def test_tensor_hooks_run_before_the_pre_hooks_of_their_node() -> None:
    a, b, log = _chain_with_ordered_hooks()
    b.sum().backward(retain_graph=True)
    assert _tags(log) == ["b tensor", "b pre", "b pre", "a tensor", "a tensor", "acc pre"]
    _assert_values(a.grad, 432.0)                  # 3 * 2 * 2, * 2 (the op), * 3 * 3 * 2
    del log[:]
    (ga,) = pargrad.grad(b.sum(), a)
    assert _tags(log) == ["b tensor", "b pre", "b pre", "a tensor", "a tensor"]
    _assert_values(ga, 216.0)


@pytest.mark.differs("backward(inputs=[t]) with a non-leaf t keeps t's gradient without "
                     "running t's own grad_fn, so that node's pre-hooks do not fire")
def test_backward_into_a_non_leaf_input_does_not_run_its_node() -> None:
    a, b, log = _chain_with_ordered_hooks()
    b.sum().backward(inputs=(b,), retain_graph=True)
    assert _tags(log) == ["b tensor"]
    _assert_values(b.grad, 3.0)                    # the tensor hook still applies
    assert a.grad is None
    # Through b to the leaf, the node runs and the whole order holds.
    del log[:]
    b.sum().backward(inputs=(a,))
    assert _tags(log) == ["b tensor", "b pre", "b pre", "a tensor", "a tensor", "acc pre"]
    _assert_values(a.grad, 432.0)
    _assert_values(b.grad, 3.0)                    # b not an input this time: unchanged


# ----- an output that got no gradient -----
def _two_from_function(x: Tensor) -> tuple[Tensor, Tensor]:
    doubled, tripled = Spread.apply(x)
    return doubled, tripled


def _two_from_split(x: Tensor) -> tuple[Tensor, Tensor]:
    first, second = pargrad.split(x, 2)
    return first, second


@pytest.mark.parametrize("make", [_two_from_function, _two_from_split], ids=["function", "split"])
def test_hook_on_an_output_that_got_no_gradient_is_called_with_none(
        make: Callable[[Tensor], tuple[Tensor, Tensor]]) -> None:
    x = leaf(1.0, 2.0, 3.0, 4.0)
    unused, used = make(x)
    log: Log = []
    unused.register_hook(_recorder(log, "unused"))
    used.register_hook(_recorder(log, "used"))
    unused.retain_grad()
    (used * 2).sum().backward()
    assert sorted(_tags(log)) == ["unused", "used"]
    seen = {entry[0]: entry[1] for entry in log}
    assert seen["unused"] is None
    _assert_values(seen["used"], np.full(used.shape, 2.0))
    assert unused.grad is None


# ----- hooks that run a backward -----
def test_a_leafs_hook_may_remove_itself_and_run_a_backward_of_its_own() -> None:
    p = leaf(1.0, 2.0, 3.0)
    handle: Any = None

    def add_penalty(grad: Tensor) -> Tensor:
        handle.remove()
        p.grad = grad                              # the hooked gradient is added to this
        with pargrad.enable_grad():
            g = grad.detach().requires_grad_()
            (g * g).sum().backward()
        return grad + g.grad                       # 3 * grad

    handle = p.register_hook(add_penalty)
    loss = (p * p).sum()
    loss.backward(retain_graph=True)
    _assert_values(p.grad, [8.0, 16.0, 24.0])      # 2p set in the hook, + 6p
    loss.backward()                                # the hook is gone
    _assert_values(p.grad, [10.0, 20.0, 30.0])


def test_a_non_leafs_hook_may_remove_itself_and_run_a_backward_of_its_own() -> None:
    p = leaf(1.0, -2.0)
    squared = p * p
    handle: Any = None

    def bump(grad: Tensor) -> Tensor:
        handle.remove()
        with pargrad.enable_grad():
            g = grad.detach().requires_grad_()
            (g * 4 + 1).sum().backward()
        return grad + g.grad                       # 1 + 4

    handle = squared.register_hook(bump)
    squared.sum().backward()
    _assert_values(p.grad, [10.0, -20.0])          # 5 * 2p


# ----- multi-grad hooks -----
def test_multi_grad_hook_in_all_mode_fires_once_per_backward_with_every_gradient() -> None:
    t1, t2, t3, t4 = leaf(9.0, 9.0), leaf(1.0, 2.0), leaf(3.0, -1.0), leaf(7.0, 7.0)
    calls: list[tuple[Any, ...]] = []
    handle = pargrad.register_multi_grad_hook((t1, t2, t3, t4),
                                              lambda grads: calls.append(tuple(grads)))
    loss = (t2 * t3).sum()
    loss.backward(inputs=(t2, t3), retain_graph=True)
    assert len(calls) == 1
    g1, g2, g3, g4 = calls[0]
    assert g1 is None and g4 is None
    _assert_values(g2, [3.0, -1.0])
    _assert_values(g3, [1.0, 2.0])
    (t1 * t3).sum().backward(retain_graph=True)
    assert len(calls) == 2
    assert [g is not None for g in calls[1]] == [True, False, True, False]
    handle.remove()
    loss.backward()
    assert len(calls) == 2


def test_multi_grad_hook_in_any_mode_fires_once_per_backward() -> None:
    t1, t2, t3, t4 = leaf(9.0, 9.0), leaf(1.0, 2.0), leaf(3.0, -1.0), leaf(7.0, 7.0)
    calls: list[Tensor] = []
    pargrad.register_multi_grad_hook((t1, t2, t3, t4), calls.append, mode="any")
    loss = (t2 * t3).sum()
    loss.backward(inputs=(t2, t3), retain_graph=True)
    assert len(calls) == 1
    # Whichever of the two gradients was ready first.
    assert any(np.array_equal(calls[0].data, v) for v in ([3.0, -1.0], [1.0, 2.0]))
    loss.backward()
    assert len(calls) == 2


# ----- properties on random graphs -----
def _every_value(recipe: GraphRecipe) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The recipe on fresh leaves: (leaves, every step's output, the roots)."""
    leaves = [pargrad.tensor(a, requires_grad=r)
              for a, r in zip(recipe.leaves, recipe.requires_grad)]
    n = len(leaves)
    everything = replace(recipe, roots=tuple(range(n + len(recipe.steps))))
    values = everything.build(leaves)
    return leaves, values[n:], [values[r] for r in recipe.roots]


def _grads_of(leaves: list[Tensor]) -> list[np.ndarray | None]:
    return [None if t.grad is None else t.grad.data.copy() for t in leaves]


@given(recipe=graph_recipes(max_steps=8), data=st.data())
def test_a_hook_scaling_an_intermediate_scales_exactly_what_flows_through_it(
        recipe: GraphRecipe, data: st.DataObject) -> None:
    leaves, steps, roots = _every_value(recipe)
    # Any tensor that can have a hook: a step's output, or a leaf.
    hooked = data.draw(st.sampled_from([t for t in (*leaves, *steps) if t.requires_grad]),
                       label="hooked")
    grad_leaves = [t for t in leaves if t.requires_grad]
    # Without the hook: the leaves' gradients, and the part of them that flows through
    # `hooked` (its gradient pulled back to the leaves).
    (g_hooked,) = pargrad.grad(roots, hooked, recipe.root_grads, retain_graph=True,
                               allow_unused=True)
    through = ([None] * len(grad_leaves) if g_hooked is None else
               pargrad.grad(hooked, grad_leaves, g_hooked, retain_graph=True,
                            allow_unused=True))
    pargrad.backward(roots, recipe.root_grads, retain_graph=True)
    plain = _grads_of(grad_leaves)
    for t in grad_leaves:
        t.grad = None

    calls: list[Tensor] = []

    def double(grad: Tensor) -> Tensor:
        calls.append(grad)
        return grad * 2

    hooked.register_hook(double)
    hooked.retain_grad()
    pargrad.backward(roots, recipe.root_grads)
    if g_hooked is None:                           # not on any path to a root
        assert calls == []
        assert hooked.grad is None
    else:
        assert len(calls) == 1
        np.testing.assert_allclose(calls[0].data, g_hooked.data, rtol=1e-12)
        np.testing.assert_allclose(_grad(hooked).data, 2 * g_hooked.data, rtol=1e-12)
    for got, before, extra in zip(_grads_of(grad_leaves), plain, through):
        if before is None:
            assert got is None
            continue
        assert got is not None
        expected = before if extra is None else before + extra.data
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


@given(recipe=graph_recipes(max_steps=8))
def test_tensor_hooks_fire_once_exactly_where_a_gradient_is_computed(
        recipe: GraphRecipe) -> None:
    leaves, steps, roots = _every_value(recipe)
    watched = [t for t in (*leaves, *steps) if t.requires_grad]
    expected = pargrad.grad(roots, watched, recipe.root_grads, retain_graph=True,
                            allow_unused=True)
    seen: list[list[Tensor]] = [[] for _ in watched]
    for t, calls in zip(watched, seen):
        t.register_hook(calls.append)
    pargrad.backward(roots, recipe.root_grads)
    for calls, want in zip(seen, expected):
        if want is None:
            assert calls == []
        else:
            assert len(calls) == 1
            np.testing.assert_allclose(calls[0].data, want.data, rtol=1e-12)
