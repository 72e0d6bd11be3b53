"""Hooks as a ``torch.autograd`` user relies on them: tensor hooks, node pre- and
post-hooks, ``retain_grad``, post-accumulate-grad hooks, a leaf's ``AccumulateGrad`` hooks
and multi-grad hooks, and how they meet in-place changes, ``inputs=`` and
``pargrad.grad``. Every test runs on every engine (conftest). Hooks may run on engine
threads, so what they see is written down under a lock (``Trail``)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import operator
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pargrad
from pargrad import Tensor
from tests.parity.support import close, grad_of, leaf
from tests.strategies import GraphRecipe, graph_recipes

# The autouse engine fixture holds no state between examples, so hypothesis may share it.
engine_shared = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----- what the hooks saw -----


class Trail:
    """What hooks saw, in the order they ran. Hooks may run on engine threads: every
    entry is added under ``_lock``, which guards ``_entries``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[str, Any]] = []

    def add(self, name: str, value: Any = None) -> None:
        """Note that ``name`` ran, with a copy of what it saw: a Tensor's array, or a
        tuple of them (the gradients a hook gets share the engine's arrays)."""
        value = tuple(map(_copied, value)) if isinstance(value, tuple) else _copied(value)
        with self._lock:
            self._entries.append((name, value))

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self._entries]

    def seen(self, name: str) -> list[Any]:
        """What ``name`` saw, call by call."""
        with self._lock:
            return [value for n, value in self._entries if n == name]

    def noting(self, name: str, result: Any = None) -> Callable[[Any], Any]:
        """A tensor hook (or pre-hook) that notes its argument and returns ``result``."""
        def hook(grad: Any) -> Any:
            self.add(name, grad)
            return result
        return hook

    def watch(self, name: str, t: Tensor) -> None:
        """A tensor hook on ``t`` noting ``name``."""
        t.register_hook(self.noting(name))

    def watch_node(self, name: str, node: pargrad.Node) -> None:
        """A pre-hook noting ``name.pre`` and a post-hook noting ``name.post`` on ``node``."""
        node.register_prehook(lambda grads: self.add(f"{name}.pre"))
        node.register_hook(lambda grads_in, grads_out: self.add(f"{name}.post"))


def _copied(value: Any) -> Any:
    return value.data.copy() if isinstance(value, Tensor) else value


def const(*numbers: float) -> Tensor:
    """A float64 tensor that needs no gradient."""
    return pargrad.tensor(np.array(numbers, dtype=np.float64))


def accumulator_of(t: Tensor) -> pargrad.Node:
    """The AccumulateGrad node of leaf ``t`` (through a node applied to it)."""
    node = pargrad.negative(t).grad_fn
    assert node is not None
    return node.next_functions[0][0]


# ----- the nodes under test: a built-in op and a custom Function -----


class DampedRamp(pargrad.Function):
    """x * exp(-x), whose slope is (1 - x) exp(-x)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        ctx.save_for_backward(x)
        return x.data * np.exp(-x.data)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        return g * (1.0 - x) * pargrad.exp(-x)


@dataclasses.dataclass(frozen=True)
class Unary:
    """A one-input, one-output node maker and its derivative on arrays."""

    apply: Callable[[Tensor], Tensor]
    slope: Callable[[np.ndarray], np.ndarray]


UNARIES = {
    "built-in-sin": Unary(pargrad.sin, np.cos),
    "custom-function": Unary(DampedRamp.apply, lambda a: (1.0 - a) * np.exp(-a)),
}


@pytest.fixture(params=list(UNARIES))
def unary(request: pytest.FixtureRequest) -> Unary:
    """Node-hook tests run on a built-in op's node and on a custom Function's node."""
    return UNARIES[request.param]


class SinCos(pargrad.Function):
    """Two outputs, (sin x, cos x), not sharing the input's memory."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        ctx.save_for_backward(x)
        return np.sin(x.data), np.cos(x.data)

    @staticmethod
    def backward(ctx: Any, g_sin: Any, g_cos: Any) -> Any:
        (x,) = ctx.saved_tensors
        return g_sin * pargrad.cos(x) - g_cos * pargrad.sin(x)


# ----- tensor hooks -----


def test_tensor_hooks_on_a_leaf_and_a_non_leaf_receive_their_gradient_as_a_tensor() -> None:
    x = leaf(0.0, 1.0)
    h = pargrad.exp(x)
    trail = Trail()
    h.register_hook(lambda g: trail.add("h", (isinstance(g, Tensor), g.data.copy())))
    x.register_hook(lambda g: trail.add("x", (isinstance(g, Tensor), g.data.copy())))
    (h * const(2.0, -3.0)).sum().backward()
    ((h_is_tensor, h_grad),) = trail.seen("h")
    ((x_is_tensor, x_grad),) = trail.seen("x")
    assert h_is_tensor and x_is_tensor
    close(h_grad, [2.0, -3.0])
    close(x_grad, [2.0, -3.0 * np.e])


def test_a_non_leaf_hook_fires_once_per_backward_that_goes_through_it() -> None:
    x = leaf(1.0, 2.0)
    h = pargrad.sin(x)
    trail = Trail()
    trail.watch("h", h)
    through = (h * 4.0).sum()
    for _ in range(3):
        through.backward(retain_graph=True)
    (x * x).sum().backward()              # does not go through h
    assert trail.names() == ["h"] * 3
    for seen in trail.seen("h"):
        close(seen, [4.0, 4.0])


def test_every_hook_of_a_tensor_fires_and_a_late_one_joins_from_the_next_pass() -> None:
    x = leaf(-1.0, 0.5)
    h = x @ pargrad.tensor(np.array([[2.0, 0.0], [1.0, 3.0]]))
    trail = Trail()
    trail.watch("first", h)
    trail.watch("second", h)
    loss = h.sum()
    loss.backward(retain_graph=True)
    assert Counter(trail.names()) == {"first": 1, "second": 1}
    trail.watch("late", h)
    loss.backward()
    assert Counter(trail.names()) == {"first": 2, "second": 2, "late": 1}
    close(trail.seen("late")[0], [1.0, 1.0])
    close(x.grad, [4.0, 8.0])             # two passes of M's row sums


def test_removing_one_hook_leaves_the_tensors_other_hooks_firing() -> None:
    x = leaf(3.0)
    h = x * x
    trail = Trail()
    gone = h.register_hook(trail.noting("gone", None))
    kept = h.register_hook(trail.noting("kept", None))
    loss = (h * 2.0).sum()
    loss.backward(retain_graph=True)
    gone.remove()
    loss.backward()
    assert trail.names() == ["gone", "kept", "kept"]
    kept.remove()


def matmul_then_sine(hook: Callable[[Any], Any]) -> tuple[Tensor, Tensor]:
    """a (1x2) @ b (2x1) = [[11]], hooked, then sin(.) + 2 sum(a): returns a, b after backward."""
    a = pargrad.tensor(np.array([[1.0, 2.0]]), requires_grad=True)
    b = pargrad.tensor(np.array([[3.0], [4.0]]), requires_grad=True)
    h = a @ b
    h.register_hook(hook)
    (pargrad.sin(h).sum() + (a * 2.0).sum()).backward()
    return a, b


def test_a_hook_that_returns_a_tensor_replaces_exactly_the_gradient_through_its_tensor() -> None:
    a, b = matmul_then_sine(lambda g: pargrad.tensor(np.array([[5.0]])))
    close(a.grad, [[5.0 * 3.0 + 2.0, 5.0 * 4.0 + 2.0]])   # the direct 2 is untouched
    close(b.grad, [[5.0], [10.0]])


def test_a_hook_that_returns_none_leaves_the_gradient_as_it_was() -> None:
    trail = Trail()
    a, b = matmul_then_sine(trail.noting("h", None))
    close(trail.seen("h")[0], [[np.cos(11.0)]])
    close(a.grad, [[np.cos(11.0) * 3.0 + 2.0, np.cos(11.0) * 4.0 + 2.0]])
    close(b.grad, [[np.cos(11.0)], [2.0 * np.cos(11.0)]])


def test_hooks_on_a_non_leaf_and_on_the_leaf_below_it_both_shape_the_leaf_grad() -> None:
    x = leaf(1.0, -2.0)
    h = x * 3.0
    h.register_hook(lambda g: g * 2.0)
    trail = Trail()
    x.register_hook(lambda g: (trail.add("x", g), g + 10.0)[1])
    h.sum().backward()
    close(trail.seen("x")[0], [6.0, 6.0])  # the doubled gradient, through * 3
    close(x.grad, [16.0, 16.0])


def test_a_leaf_grad_zeroed_in_place_under_no_grad_restarts_from_zero() -> None:
    x = leaf(2.0, -1.0)
    loss = (x * x * x).sum()                # 3 x**2 = [12, 3]
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    close(x.grad, [24.0, 6.0])
    with pargrad.no_grad():
        x.grad.zero_()
    close(x.grad, [0.0, 0.0])
    loss.backward()
    close(x.grad, [12.0, 3.0])


class Tripler:
    """A hook that is an object: it has ``__call__`` but no ``__name__``."""

    def __call__(self, grad: Tensor) -> Tensor:
        return grad * 3.0


def test_any_callable_can_be_a_hook_and_its_result_is_the_gradient() -> None:
    x = leaf(0.3, 1.1)
    h = pargrad.sin(x)
    tripler = Tripler()
    halver = functools.partial(operator.mul, 0.5)
    assert not hasattr(tripler, "__name__") and not hasattr(halver, "__name__")
    h.register_hook(tripler)
    x.register_hook(halver)
    (h * 2.0).sum().backward()
    close(x.grad, 0.5 * 6.0 * np.cos([0.3, 1.1]))


class ScaledAndSine(pargrad.Function):
    """(x * k, sin x), with k not differentiated: backward returns None for it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: Tensor) -> tuple[np.ndarray, np.ndarray]:
        ctx.save_for_backward(x, k)
        return x.data * k.data, np.sin(x.data)

    @staticmethod
    def backward(ctx: Any, g_scaled: Any, g_sine: Any) -> Any:
        x, k = ctx.saved_tensors
        return g_scaled * k + g_sine * pargrad.cos(x), None


def test_each_used_output_of_a_several_output_function_gets_a_real_gradient() -> None:
    x, k = leaf(0.5, 2.0), const(4.0, -1.0)
    scaled, sine = ScaledAndSine.apply(x, k)
    trail = Trail()
    trail.watch("scaled", scaled)
    trail.watch("sine", sine)
    ((scaled * 2.0).sum() - sine.sum()).backward()
    assert sorted(trail.names()) == ["scaled", "sine"]
    close(trail.seen("scaled")[0], [2.0, 2.0])
    close(trail.seen("sine")[0], [-1.0, -1.0])
    close(x.grad, np.array([8.0, -2.0]) - np.cos([0.5, 2.0]))
    assert k.grad is None


class Probe(pargrad.Function):
    """a + b * c, noting ``ctx.needs_input_grad`` in forward and in backward."""

    trail: Trail

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, c: Tensor) -> np.ndarray:
        Probe.trail.add("forward", ctx.needs_input_grad)
        ctx.save_for_backward(b, c)
        return a.data + b.data * c.data

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        Probe.trail.add("backward", ctx.needs_input_grad)
        b, c = ctx.saved_tensors
        return g, (g * c if ctx.needs_input_grad[1] else None), g * b


def test_needs_input_grad_is_true_exactly_for_inputs_that_require_grad() -> None:
    Probe.trail = Trail()
    a, b, w = leaf(1.0, 2.0), const(3.0, -2.0), leaf(0.0, 1.0)
    c = pargrad.exp(w)                      # a non-leaf that requires grad
    Probe.apply(a, b, c).sum().backward()
    assert Probe.trail.seen("forward") == [(True, False, True)]
    assert Probe.trail.seen("backward") == [(True, False, True)]
    close(a.grad, [1.0, 1.0])
    close(w.grad, np.array([3.0, -2.0]) * np.exp([0.0, 1.0]))


class Passthrough(pargrad.Function):
    """Returns its input itself."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g


def test_a_function_returning_its_input_gives_the_output_hooks_of_its_own() -> None:
    x = leaf(1.0, -2.0)
    y = Passthrough.apply(x)
    assert y is not x
    trail = Trail()
    trail.watch("y", y)
    trail.watch("x", x)
    ((y * 3.0).sum() + (x * 5.0).sum()).backward()
    close(trail.seen("y")[0], [3.0, 3.0])   # only the uses of the output
    close(trail.seen("x")[0], [8.0, 8.0])
    close(x.grad, [8.0, 8.0])


QUARTER_STEPS = np.array([0.2, 0.4, 0.6, 0.8])


def sincos_pair(x: Tensor) -> tuple[Tensor, Tensor]:
    return SinCos.apply(x)


def split_pair(x: Tensor) -> tuple[Tensor, Tensor]:
    first, second = pargrad.split(x, 2)
    return first, second


@pytest.mark.parametrize(("pair", "x_grad"), [
    pytest.param(sincos_pair, 2.0 * np.cos(QUARTER_STEPS), id="custom-function"),
    pytest.param(split_pair, [2.0, 2.0, 0.0, 0.0], id="split"),
])
def test_an_output_that_got_no_gradient_has_its_hooks_called_with_none(
        pair: Callable[[Tensor], tuple[Tensor, Tensor]], x_grad: Any) -> None:
    x = leaf(*QUARTER_STEPS)
    used, idle = pair(x)
    assert used.grad_fn is idle.grad_fn     # one node, two outputs
    idle.retain_grad()
    trail = Trail()
    trail.watch("idle", idle)
    (used * 2.0).sum().backward()
    assert trail.names() == ["idle"] and trail.seen("idle") == [None]
    assert idle.grad is None
    close(x.grad, x_grad)


# ----- node pre-hooks and post-hooks -----

C = np.array([2.0, -0.5])                   # the gradient reaching the node under test
X = np.array([0.25, -1.5])                  # where it is evaluated


def unary_graph(unary: Unary) -> tuple[Tensor, Tensor, pargrad.Node]:
    """x, the root sum(f(x) * C), and f's node."""
    x = leaf(*X)
    out = unary.apply(x)
    assert out.grad_fn is not None
    return x, (out * pargrad.tensor(C)).sum(), out.grad_fn


def test_all_pre_hooks_of_a_node_run_before_any_of_its_post_hooks(unary: Unary) -> None:
    x, root, node = unary_graph(unary)
    trail = Trail()
    node.register_hook(lambda grads_in, grads_out: trail.add("post-1"))
    node.register_prehook(lambda grads: trail.add("pre-1"))
    node.register_hook(lambda grads_in, grads_out: trail.add("post-2"))
    node.register_prehook(lambda grads: trail.add("pre-2"))
    root.backward()
    assert trail.names() == ["pre-1", "pre-2", "post-1", "post-2"]
    close(x.grad, C * unary.slope(X))


def test_pre_hooks_chain_each_seeing_what_the_previous_one_returned(unary: Unary) -> None:
    x, root, node = unary_graph(unary)
    trail = Trail()

    def doubling(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        trail.add("doubling", grads)
        return (grads[0] * 2.0,)

    def same(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        trail.add("same", grads)
        return grads

    def plus_one(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        trail.add("plus-one", grads)
        return (grads[0] + 1.0,)

    node.register_prehook(doubling)
    node.register_prehook(lambda grads: trail.add("silent", grads))
    node.register_prehook(same)
    node.register_prehook(plus_one)
    root.backward()
    assert trail.names() == ["doubling", "silent", "same", "plus-one"]
    for name, expected in [("doubling", C), ("silent", 2 * C), ("same", 2 * C),
                           ("plus-one", 2 * C)]:
        (grads,) = trail.seen(name)
        assert isinstance(grads, tuple) and len(grads) == 1
        close(grads[0], expected)
    close(x.grad, (2 * C + 1.0) * unary.slope(X))


def test_a_post_hook_sees_the_pre_hooked_gradients_and_what_backward_made_of_them(
        unary: Unary) -> None:
    x, root, node = unary_graph(unary)
    trail = Trail()
    node.register_prehook(lambda grads: (grads[0] * 3.0,))
    node.register_hook(lambda grads_in, grads_out: trail.add(
        "post", (grads_in[0].data.copy(), grads_out[0].data.copy())))
    root.backward()
    ((grad_in, grad_out),) = trail.seen("post")
    close(grad_out, 3.0 * C)
    close(grad_in, 3.0 * C * unary.slope(X))
    close(x.grad, grad_in)


def test_a_post_hook_registered_twice_runs_twice_and_may_return_its_grad_inputs(
        unary: Unary) -> None:
    x, root, node = unary_graph(unary)
    trail = Trail()

    def echo(grads_in: tuple[Any, ...], grads_out: tuple[Any, ...]) -> tuple[Any, ...]:
        trail.add("echo")
        return grads_in

    node.register_hook(echo)
    node.register_hook(echo)
    root.backward()
    assert trail.names() == ["echo", "echo"]
    close(x.grad, C * unary.slope(X))


def test_a_pre_hook_returning_none_changes_no_leaf_gradient(unary: Unary) -> None:
    x, root, node = unary_graph(unary)
    trail = Trail()
    node.register_prehook(trail.noting("pre", None))
    root.backward()
    assert trail.names() == ["pre"]
    close(x.grad, C * unary.slope(X))


class SineWithCount(pargrad.Function):
    """(2 x, the number 7, sin x): the middle output is not a tensor."""

    trail: Trail

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Any, ...]:
        ctx.save_for_backward(x)
        return 2.0 * x.data, 7, np.sin(x.data)

    @staticmethod
    def backward(ctx: Any, g_double: Any, g_count: Any, g_sine: Any) -> Any:
        SineWithCount.trail.add("count-grad", g_count)
        (x,) = ctx.saved_tensors
        return g_double * 2.0 + g_sine * pargrad.cos(x)


def test_a_several_output_function_pre_hook_gets_none_for_a_non_tensor_output() -> None:
    SineWithCount.trail = trail = Trail()
    x = leaf(0.5, 1.0)
    double, count, sine = SineWithCount.apply(x)
    assert count == 7 and double.grad_fn is sine.grad_fn

    def reshape_grads(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        trail.add("pre", tuple(None if g is None else g.data.copy() for g in grads))
        return (grads[0] * 10.0, None, -grads[2])

    double.grad_fn.register_prehook(reshape_grads)
    root = (double * 3.0).sum() + (sine * -2.0).sum()
    root.backward(retain_graph=True)
    root.backward()
    assert trail.names().count("pre") == 2
    for seen in trail.seen("pre"):
        assert len(seen) == 3 and seen[1] is None
        close(seen[0], [3.0, 3.0])
        close(seen[2], [-2.0, -2.0])
    assert trail.seen("count-grad") == [None, None]
    close(x.grad, 2 * (60.0 + 2.0 * np.cos([0.5, 1.0])))


def test_a_removed_pre_hook_is_silent_while_the_same_function_under_another_handle_runs_once(
        unary: Unary) -> None:
    _, root, node = unary_graph(unary)
    trail = Trail()
    hook = trail.noting("pre", None)
    first = node.register_prehook(hook)
    node.register_prehook(hook)
    first.remove()
    root.backward()
    assert trail.names() == ["pre"]


def register_by_kind(kind: str, x: Tensor, h: Tensor, hook: Callable[[], None]) -> Any:
    """Register a hook of ``kind`` (on leaf ``x`` or non-leaf ``h``) that calls ``hook()``."""
    node = h.grad_fn
    assert node is not None
    if kind == "tensor":
        return h.register_hook(lambda g: hook())
    if kind == "pre":
        return node.register_prehook(lambda grads: hook())
    if kind == "post":
        return node.register_hook(lambda grads_in, grads_out: hook())
    if kind == "post-accumulate":
        return x.register_post_accumulate_grad_hook(lambda t: hook())
    return pargrad.register_multi_grad_hook([x, h], lambda grads: hook())


@pytest.mark.parametrize("kind", ["tensor", "pre", "post", "post-accumulate", "multi-grad"])
def test_removing_a_handle_twice_is_harmless(kind: str, unary: Unary) -> None:
    x = leaf(*X)
    h = unary.apply(x)
    trail = Trail()
    removed = register_by_kind(kind, x, h, lambda: trail.add("removed"))
    register_by_kind(kind, x, h, lambda: trail.add("kept"))
    removed.remove()
    removed.remove()
    (h * 2.0).sum().backward()
    assert trail.names() == ["kept"]
    close(x.grad, 2.0 * unary.slope(X))


def test_a_pre_hook_removed_by_an_earlier_one_mid_backward_still_runs_in_that_pass_only(
        unary: Unary) -> None:
    _, root, node = unary_graph(unary)
    trail = Trail()
    handles: list[Any] = []

    def remover(grads: tuple[Any, ...]) -> None:
        trail.add("remover")
        handles[0].remove()

    node.register_prehook(remover)
    handles.append(node.register_prehook(trail.noting("victim", None)))
    root.backward(retain_graph=True)
    assert trail.names() == ["remover", "victim"]
    root.backward()
    assert trail.names() == ["remover", "victim", "remover"]


# ----- retain_grad -----


def test_retain_grad_fills_a_non_leaf_grad() -> None:
    x = leaf(0.1, 0.7)
    h = pargrad.sin(x)
    h.retain_grad()
    assert h.retains_grad
    (h * const(-1.0, 4.0)).sum().backward()
    close(h.grad, [-1.0, 4.0])


def test_retain_grad_called_twice_keeps_one_gradient() -> None:
    x = leaf(0.1, 0.7)
    h = pargrad.exp(x)
    h.retain_grad()
    h.retain_grad()
    (h * const(3.0, 5.0)).sum().backward()
    close(h.grad, [3.0, 5.0])


def test_a_retained_grad_accumulates_over_backward_passes() -> None:
    x = leaf(2.0, 3.0)
    h = x @ pargrad.tensor(np.array([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]]))
    h.retain_grad()
    (h * const(1.0, 2.0, 3.0)).sum().backward(retain_graph=True)
    (h[1:] * 10.0).sum().backward()
    close(h.grad, [1.0, 12.0, 13.0])


def test_retain_grad_on_a_leaf_changes_nothing() -> None:
    x = leaf(1.5, -0.5)
    x.retain_grad()
    x.retain_grad()
    (pargrad.exp(x) * 2.0).sum().backward()
    close(x.grad, 2.0 * np.exp([1.5, -0.5]))


@pytest.mark.parametrize("also_add", [False, True], ids=["one-change", "two-changes"])
def test_a_retained_grad_is_taken_at_the_latest_version_after_in_place_ops(
        also_add: bool) -> None:
    x, y = leaf(1.0, 2.0), leaf(0.5, 0.5)
    h = x * 2.0
    h.retain_grad()
    h.mul_(-2.0)
    if also_add:
        h.add_(y)
    (h * const(3.0, 7.0)).sum().backward()
    close(h.grad, [3.0, 7.0])               # not the old version's -2 * that
    close(x.grad, [-12.0, -28.0])
    if also_add:
        close(y.grad, [3.0, 7.0])


def test_a_retained_grad_follows_an_in_place_change_through_a_view_then_on_the_tensor() -> None:
    x = leaf(1.0, 2.0, 3.0)
    h = x * 1.0
    h.retain_grad()
    h[1:].mul_(5.0)
    h.mul_(2.0)
    c = np.array([1.0, -1.0, 0.5])
    (h * pargrad.tensor(c)).sum().backward()
    close(h.grad, c)
    close(x.grad, c * 2.0 * np.array([1.0, 5.0, 5.0]))


def test_adding_a_grad_tensor_into_a_view_of_a_plain_tensor_is_recorded() -> None:
    w = leaf(0.0, 1.0, -1.0)
    plain = pargrad.tensor(np.ones((2, 3)))
    assert not plain.requires_grad
    plain[1].add_(pargrad.exp(w))
    assert plain.requires_grad and plain.grad_fn is not None
    close(plain, [[1.0, 1.0, 1.0], 1.0 + np.exp([0.0, 1.0, -1.0])])
    weights = np.array([[9.0, 9.0, 9.0], [2.0, -3.0, 4.0]])
    (plain * pargrad.tensor(weights)).sum().backward()
    close(w.grad, weights[1] * np.exp([0.0, 1.0, -1.0]))


def test_retained_grads_of_function_outputs_match_pargrad_grad_after_an_in_place_change() -> None:
    x = leaf(0.3, 1.2)
    s, c = SinCos.apply(x)
    s.retain_grad()
    c.retain_grad()
    s.mul_(3.0)
    root = (s * c).sum() + pargrad.exp(c).sum()
    root.backward(retain_graph=True)
    retained = [grad_of(s).copy(), grad_of(c).copy()]
    expected = pargrad.grad(root, [s, c])
    close(retained[0], expected[0])
    close(retained[1], expected[1])
    close(retained[0], np.cos([0.3, 1.2]))                        # d/ds of s * c
    close(retained[1], 3.0 * np.sin([0.3, 1.2]) + np.exp(np.cos([0.3, 1.2])))


def test_two_views_with_retained_grads_each_get_the_gradient_of_their_current_value() -> None:
    x = pargrad.tensor(np.array([[0.5, 1.0], [1.5, 2.0]]), requires_grad=True)
    base = x * 1.0
    top, bottom = base[0], base[1]
    top.retain_grad()
    bottom.retain_grad()
    bottom.mul_(2.0)
    c_top, c_bottom = np.array([1.0, -2.0]), np.array([0.5, 3.0])
    ((top * pargrad.tensor(c_top)).sum()
     + (pargrad.exp(bottom) * pargrad.tensor(c_bottom)).sum()).backward()
    close(top.grad, c_top)
    close(bottom.grad, c_bottom * np.exp([3.0, 4.0]))
    close(x.grad, [c_top, 2.0 * c_bottom * np.exp([3.0, 4.0])])


def test_a_retained_grad_shows_every_hook_in_registration_order() -> None:
    x = leaf(0.0, 0.5)
    h = pargrad.exp(x)
    h.register_hook(lambda g: g * 2.0)
    h.retain_grad()
    h.register_hook(lambda g: g + 1.0)      # after retain_grad, still counted
    (h * const(3.0, -1.0)).sum().backward()
    close(h.grad, [7.0, -1.0])              # (c * 2) + 1, not (c + 1) * 2
    close(x.grad, np.array([7.0, -1.0]) * np.exp([0.0, 0.5]))


# ----- hooks and in-place changes -----


def test_hooks_before_and_after_an_in_place_op_see_the_old_and_new_versions() -> None:
    x = leaf(1.0, -1.0)
    h = x * 2.0
    trail = Trail()
    h.register_hook(lambda g: (trail.add("old", g), g + 1.0)[1])
    h.mul_(3.0)
    h.register_hook(lambda g: (trail.add("new", g), g * 10.0)[1])
    c = np.array([1.0, 2.0])
    root = (h * pargrad.tensor(c)).sum()
    root.backward(retain_graph=True)
    assert trail.names() == ["new", "old"]
    close(trail.seen("new")[0], c)
    close(trail.seen("old")[0], 30.0 * c)   # through the new hook and the * 3
    close(x.grad, 2.0 * (30.0 * c + 1.0))
    root.backward()
    assert trail.names() == ["new", "old"] * 2


def test_a_hook_on_an_old_version_sees_the_gradient_through_every_later_in_place_op() -> None:
    x = leaf(0.2, 0.4)
    h = pargrad.sin(x)
    trail = Trail()
    trail.watch("oldest", h)
    h.mul_(-1.5)
    h.exp_()
    h.add_(4.0)
    c = np.array([2.0, 1.0])
    (h * pargrad.tensor(c)).sum().backward()
    expected = c * np.exp(-1.5 * np.sin([0.2, 0.4])) * -1.5
    assert trail.names() == ["oldest"]
    close(trail.seen("oldest")[0], expected)
    close(x.grad, expected * np.cos([0.2, 0.4]))


def test_hooks_on_function_outputs_follow_an_in_place_change_of_one_output() -> None:
    x = leaf(0.6, -0.3)
    s, c = SinCos.apply(x)
    trail = Trail()
    handles = [s.register_hook(trail.noting("s-before")), c.register_hook(trail.noting("c"))]
    s.mul_(4.0)
    handles.append(s.register_hook(trail.noting("s-after")))
    root = (s * const(1.0, 2.0)).sum() + (c * const(-3.0, 0.5)).sum()
    root.backward(retain_graph=True)
    assert Counter(trail.names()) == {"s-before": 1, "c": 1, "s-after": 1}
    close(trail.seen("s-after")[0], [1.0, 2.0])
    close(trail.seen("s-before")[0], [4.0, 8.0])
    close(trail.seen("c")[0], [-3.0, 0.5])
    for handle in handles:
        handle.remove()
    root.backward()
    assert len(trail.names()) == 3
    once = np.array([4.0, 8.0]) * np.cos([0.6, -0.3]) - np.array([-3.0, 0.5]) * np.sin([0.6, -0.3])
    close(x.grad, 2.0 * once)


def test_view_hooks_from_before_an_in_place_change_go_quiet_and_a_new_one_fires() -> None:
    x = pargrad.tensor(np.array([[1.0, 2.0], [3.0, 4.0]]), requires_grad=True)
    base = x * 1.0
    top, bottom = base[0], base[1]
    trail = Trail()
    trail.watch("top-before", top)
    trail.watch("bottom-before", bottom)
    bottom.mul_(2.0)
    trail.watch("top-after", top)
    ((top * const(5.0, 6.0)).sum() + (bottom * const(-1.0, 1.0)).sum()).backward()
    assert trail.names() == ["top-after"]
    close(trail.seen("top-after")[0], [5.0, 6.0])
    close(x.grad, [[5.0, 6.0], [-2.0, 2.0]])


# ----- post-accumulate-grad hooks -----


def test_a_post_accumulate_grad_hook_is_refused_on_a_non_leaf() -> None:
    h = pargrad.sin(leaf(1.0))
    with pytest.raises(RuntimeError, match="post-accumulate-grad hooks can only be registered "
                                           "on leaf"):
        h.register_post_accumulate_grad_hook(lambda t: None)


def test_post_accumulate_grad_hooks_run_in_order_and_may_change_the_leaf() -> None:
    x = leaf(1.0, 2.0)
    trail = Trail()

    def amplify(t: Tensor) -> None:
        trail.add("amplify", (t is x, grad_of(t).copy()))
        with pargrad.no_grad():
            t.grad.mul_(10.0)

    def step(t: Tensor) -> None:
        trail.add("step", (t is x, grad_of(t).copy()))
        with pargrad.no_grad():
            t.sub_(t.grad * 0.01)

    x.register_post_accumulate_grad_hook(amplify)
    x.register_post_accumulate_grad_hook(step)
    (x * x).sum().backward()              # 2 x = [2, 4]
    assert trail.names() == ["amplify", "step"]
    (same_1, seen_1), (same_2, seen_2) = trail.seen("amplify") + trail.seen("step")
    assert same_1 and same_2
    close(seen_1, [2.0, 4.0])
    close(seen_2, [20.0, 40.0])
    close(x.grad, [20.0, 40.0])
    close(x, [0.8, 1.6])


def test_one_post_accumulate_grad_hook_on_several_leaves_runs_for_each_leaf_reached() -> None:
    a, b, c = leaf(1.0), leaf(2.0), leaf(3.0)
    names = {id(a): "a", id(b): "b", id(c): "c"}
    trail = Trail()
    hook = lambda t: trail.add(names[id(t)])
    for t in (a, b, c):
        t.register_post_accumulate_grad_hook(hook)
    (pargrad.sin(a) * b).sum().backward()
    assert sorted(trail.names()) == ["a", "b"]
    (c * c + a).sum().backward()
    assert sorted(trail.names()) == ["a", "a", "b", "c"]


def test_a_post_accumulate_grad_hook_that_returns_a_value_fails_the_backward() -> None:
    x = leaf(1.0)
    x.register_post_accumulate_grad_hook(lambda t: t.grad)
    with pytest.raises(RuntimeError, match="hooks should return None"):
        (x * 2.0).sum().backward()


class Keepsake:
    """Something a hook's closure holds, to watch with a weak reference."""


def test_a_post_accumulate_grad_hook_lives_exactly_as_long_as_its_tensor() -> None:
    x = leaf(1.0, 2.0)
    keepsake = Keepsake()
    trail = Trail()
    x.register_post_accumulate_grad_hook(
        lambda t, held=keepsake: trail.add("hook", type(held).__name__))
    alive = weakref.ref(keepsake)
    del keepsake
    gc.collect()
    assert alive() is not None
    (x * 3.0).sum().backward()
    assert trail.names() == ["hook"]
    gc.collect()
    assert alive() is not None
    del x
    deadline = time.monotonic() + 5.0      # engine threads may let go a moment later
    while alive() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert alive() is None


def test_at_a_leaf_tensor_hooks_then_accumulator_pre_hooks_then_grad_then_post_hooks() -> None:
    x = leaf(0.5, 1.5)
    acc = accumulator_of(x)
    trail = Trail()
    # Registered in the reverse of the order they run in.
    acc.register_hook(lambda grads_in, grads_out: trail.add("acc-post", x.grad is None))
    x.register_post_accumulate_grad_hook(lambda t: trail.add("post-accumulate", x.grad is None))
    acc.register_prehook(lambda grads: trail.add("acc-pre", x.grad is None))
    x.register_hook(lambda g: trail.add("tensor", x.grad is None))
    pargrad.sin(x).sum().backward()
    assert trail.names() == ["tensor", "acc-pre", "post-accumulate", "acc-post"]
    assert [trail.seen(n)[0] for n in trail.names()] == [True, True, False, False]


def test_a_leafs_accumulator_is_the_first_next_function_of_a_node_on_it() -> None:
    x = leaf(2.0)
    y = pargrad.exp(x)
    acc = y.grad_fn.next_functions[0][0]
    assert acc.name() == "AccumulateGrad"
    trail = Trail()
    acc.register_prehook(trail.noting("acc"))
    y.backward()
    ((grad,),) = trail.seen("acc")
    close(grad, [np.exp(2.0)])


def test_a_first_accumulation_hands_the_accumulator_post_hook_the_grad_tensor_itself() -> None:
    x = leaf(1.0, -1.0)
    acc = accumulator_of(x)
    trail = Trail()

    def quadruple(t: Tensor) -> None:
        with pargrad.no_grad():
            t.grad.mul_(4.0)

    x.register_post_accumulate_grad_hook(quadruple)
    acc.register_hook(lambda grads_in, grads_out: trail.add("post", grads_out[0]))
    acc.register_hook(lambda grads_in, grads_out: trail.add("same", grads_out[0] is x.grad))
    assert x.grad is None
    (x * const(1.0, 2.0)).sum().backward()
    assert trail.seen("same") == [True]
    close(trail.seen("post")[0], [4.0, 8.0])
    close(x.grad, [4.0, 8.0])


# ----- AccumulateGrad hooks, and which hooks run under inputs= / pargrad.grad -----


def test_an_accumulator_pre_hook_gets_a_one_tuple_after_the_leaf_tensor_hooks() -> None:
    x = leaf(2.0, 3.0)
    acc = accumulator_of(x)
    trail = Trail()
    acc.register_prehook(lambda grads: trail.add("pre", grads))
    x.register_hook(lambda g: g * 3.0)
    (x * x).sum().backward()
    (grads,) = trail.seen("pre")
    assert isinstance(grads, tuple) and len(grads) == 1
    close(grads[0], [12.0, 18.0])


def test_an_accumulator_post_hook_gets_no_grad_inputs_and_the_hooked_gradient() -> None:
    x = leaf(2.0, 3.0)
    acc = accumulator_of(x)
    trail = Trail()
    acc.register_hook(lambda grads_in, grads_out: trail.add(
        "post", (len(grads_in), grads_out[0].data.copy())))
    x.register_hook(lambda g: g - 1.0)
    pargrad.sin(x).sum().backward()
    ((count, grad),) = trail.seen("post")
    assert count == 0
    close(grad, np.cos([2.0, 3.0]) - 1.0)


def refuse(*args: Any) -> None:
    raise AssertionError("this hook should not run")


def test_backward_inputs_leaving_out_a_leaf_runs_none_of_its_hooks() -> None:
    a, b = leaf(1.0, 2.0), leaf(-1.0, 4.0)
    b.register_hook(refuse)
    acc = accumulator_of(b)
    acc.register_prehook(refuse)
    acc.register_hook(refuse)
    (pargrad.exp(a) * b).sum().backward(inputs=[a])
    close(a.grad, np.array([-1.0, 4.0]) * np.exp([1.0, 2.0]))
    assert b.grad is None


def instrumented_chain() -> tuple[Tensor, Tensor, Tensor, Trail]:
    """x -> t = sin(x) -> root = sum(t * t), with a Trail on every tensor and node."""
    x = leaf(0.4, 0.9)
    t = pargrad.sin(x)
    root = (t * t).sum()
    trail = Trail()
    trail.watch("x", x)
    trail.watch("t", t)
    trail.watch("root", root)
    trail.watch_node("acc", accumulator_of(x))
    trail.watch_node("sin", t.grad_fn)
    trail.watch_node("square", root.grad_fn.next_functions[0][0])
    trail.watch_node("sum", root.grad_fn)
    return x, t, root, trail


def test_grad_for_a_non_leaf_runs_its_tensor_hooks_and_nothing_below() -> None:
    _, t, root, trail = instrumented_chain()
    (gt,) = pargrad.grad(root, [t])
    close(gt, 2.0 * np.sin([0.4, 0.9]))
    ran = set(trail.names())
    assert "t" in ran
    assert not ran & {"sin.pre", "sin.post", "x", "acc.pre", "acc.post"}


def test_grad_for_a_leaf_and_a_non_leaf_runs_their_hooks_and_no_accumulator_hooks() -> None:
    x, t, root, trail = instrumented_chain()
    gx, gt = pargrad.grad(root, [x, t])
    close(gx, 2.0 * np.sin([0.4, 0.9]) * np.cos([0.4, 0.9]))
    close(gt, 2.0 * np.sin([0.4, 0.9]))
    ran = Counter(trail.names())
    assert ran["x"] == ran["t"] == ran["sin.pre"] == ran["sin.post"] == 1
    assert ran["acc.pre"] == ran["acc.post"] == 0
    assert x.grad is None


EVERY_HOOK_ONCE = {"root": 1, "sum.pre": 1, "sum.post": 1, "square.pre": 1, "square.post": 1,
                   "t": 1, "sin.pre": 1, "sin.post": 1, "x": 1, "acc.pre": 1, "acc.post": 1}


def test_plain_backward_runs_every_hook_on_the_path_once() -> None:
    x, _, root, trail = instrumented_chain()
    root.backward()
    assert Counter(trail.names()) == EVERY_HOOK_ONCE
    close(x.grad, np.sin([0.8, 1.8]))       # 2 sin cos


def test_backward_inputs_naming_a_leaf_and_a_non_leaf_runs_the_same_hooks_as_plain_backward(
        ) -> None:
    x, t, root, trail = instrumented_chain()
    root.backward(inputs=[x, t])
    assert Counter(trail.names()) == EVERY_HOOK_ONCE
    close(x.grad, np.sin([0.8, 1.8]))
    close(t.grad, 2.0 * np.sin([0.4, 0.9]))


# ----- hook order between a tensor and its node -----


def ordered_chain() -> tuple[Tensor, Tensor, Trail]:
    """x -> t = exp(x) -> u = t @ M -> root = sum(u), each node's pre-hook registered
    before its tensor's hook."""
    x = leaf(0.0, 1.0)
    t = pargrad.exp(x)
    u = t @ pargrad.tensor(np.array([[1.0, 2.0], [3.0, 4.0]]))
    root = u.sum()
    trail = Trail()
    acc = accumulator_of(x)
    for name, tensor, node in [("u", u, u.grad_fn), ("t", t, t.grad_fn), ("x", x, acc)]:
        node.register_prehook(lambda grads, name=name: trail.add(f"{name}.pre"))
        tensor.register_hook(lambda g, name=name: trail.add(name))
    return x, root, trail


def test_tensor_hooks_precede_their_nodes_pre_hooks_all_the_way_down_to_the_accumulator(
        ) -> None:
    x, root, trail = ordered_chain()
    root.backward()
    assert trail.names() == ["u", "u.pre", "t", "t.pre", "x", "x.pre"]
    close(x.grad, np.array([3.0, 7.0]) * np.exp([0.0, 1.0]))


def test_under_grad_the_order_is_the_same_without_the_accumulator() -> None:
    x, root, trail = ordered_chain()
    (gx,) = pargrad.grad(root, [x])
    assert trail.names() == ["u", "u.pre", "t", "t.pre", "x"]
    close(gx, np.array([3.0, 7.0]) * np.exp([0.0, 1.0]))


def test_backward_inputs_a_non_leaf_keeps_its_hooked_gradient_and_leaves_the_leaves_alone(
        ) -> None:
    x = leaf(0.5, 2.5)
    t = pargrad.sin(x)
    t.register_hook(lambda g: g * 5.0)
    (t * const(1.0, -2.0)).sum().backward(inputs=[t])
    close(t.grad, [5.0, -10.0])
    assert x.grad is None


# ----- hooks that run a backward -----


def test_a_leaf_hook_may_remove_itself_set_grad_and_run_a_nested_backward() -> None:
    x = leaf(0.5, 1.0)
    trail = Trail()
    handles: list[Any] = []

    def nested(g: Tensor) -> Tensor:
        handles[0].remove()
        x.grad = const(100.0, 200.0)
        with pargrad.enable_grad():
            copy = x.detach().requires_grad_()
            pargrad.exp(copy * 2.0).sum().backward()
        trail.add("nested", copy.grad)
        return g * 2.0

    handles.append(x.register_hook(nested))
    loss = (x * const(3.0, 4.0)).sum()
    loss.backward(retain_graph=True)
    close(trail.seen("nested")[0], 2.0 * np.exp([1.0, 2.0]))
    close(x.grad, [106.0, 208.0])
    loss.backward()
    assert trail.names() == ["nested"]
    close(x.grad, [109.0, 212.0])


def test_a_non_leaf_hook_may_build_its_gradient_from_a_nested_backward() -> None:
    x = leaf(0.3, 0.8)
    h = pargrad.sin(x)
    trail = Trail()
    handles: list[Any] = []

    def nested(g: Tensor) -> Tensor:
        handles[0].remove()
        trail.add("nested")
        with pargrad.enable_grad():
            copy = h.detach().requires_grad_()
            (copy * copy * copy).sum().backward()
        return g * copy.grad                # 3 sin(x)**2 per element

    handles.append(h.register_hook(nested))
    c = np.array([2.0, -1.0])
    loss = (h * pargrad.tensor(c)).sum()
    loss.backward(retain_graph=True)
    s, cos = np.sin([0.3, 0.8]), np.cos([0.3, 0.8])
    close(x.grad, c * 3.0 * s**2 * cos)
    loss.backward()
    assert trail.names() == ["nested"]
    close(x.grad, c * 3.0 * s**2 * cos + c * cos)


# ----- multi-grad hooks -----


def three_tensors() -> tuple[Tensor, Tensor, Tensor]:
    """A leaf a, a non-leaf h = exp(w) and a leaf b."""
    return leaf(1.0, 2.0), pargrad.exp(leaf(0.0, 0.0)), leaf(-3.0)


def summary(grads: Any) -> tuple[Any, ...]:
    return tuple(None if g is None else g.data.copy() for g in grads)


def test_a_multi_grad_hook_gets_one_entry_per_tensor_with_none_for_the_missing() -> None:
    a, h, b = three_tensors()
    trail = Trail()
    pargrad.register_multi_grad_hook((h, b, a), lambda grads: trail.add("all", summary(grads)))
    ((a * 4.0).sum() + (h * const(2.0, -2.0)).sum()).backward()
    ((grad_h, grad_b, grad_a),) = trail.seen("all")
    close(grad_h, [2.0, -2.0])
    assert grad_b is None
    close(grad_a, [4.0, 4.0])


def test_a_multi_grad_hook_fires_again_in_later_passes() -> None:
    a, h, b = three_tensors()
    trail = Trail()
    pargrad.register_multi_grad_hook((h, b, a), lambda grads: trail.add("all", summary(grads)))
    (b * b).sum().backward()
    (leaf(9.0) * 2.0).sum().backward()    # reaches none of them
    (pargrad.sin(h) + b).sum().backward()
    first, second = trail.seen("all")
    assert first[0] is None and first[2] is None
    close(first[1], [-6.0])
    close(second[0], np.cos([1.0, 1.0]))
    close(second[1], [2.0])
    assert second[2] is None


def test_a_removed_multi_grad_hook_stays_silent() -> None:
    a, h, b = three_tensors()
    trail = Trail()
    handle = pargrad.register_multi_grad_hook((a, h, b), lambda grads: trail.add("all"))
    loss = (a * h).sum() + b.sum()
    loss.backward(retain_graph=True)
    handle.remove()
    loss.backward()
    assert trail.names() == ["all"]


def test_an_any_mode_multi_grad_hook_fires_once_per_pass_with_one_gradient() -> None:
    a, h, b = three_tensors()
    trail = Trail()
    pargrad.register_multi_grad_hook(
        (a, h, b), lambda grad: trail.add("any", (isinstance(grad, Tensor), grad.data.copy())),
        mode="any")
    loss = (a * 5.0).sum() + (h * 6.0).sum() + (b * 7.0).sum()
    loss.backward(retain_graph=True)
    assert trail.names() == ["any"]
    loss.backward()
    assert trail.names() == ["any", "any"]
    for is_tensor, seen in trail.seen("any"):
        assert is_tensor
        assert any(seen.shape == v.shape and np.array_equal(seen, v)
                   for v in (np.full(2, 5.0), np.full(2, 6.0), np.full(1, 7.0)))


# ----- properties over random graphs -----


def every_value(recipe: GraphRecipe) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Fresh leaves, every value of the recipe's graph (leaves, then one per step), and
    its roots."""
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    every = dataclasses.replace(recipe, roots=tuple(range(len(leaves) + len(recipe.steps))))
    values = every.build(leaves)
    return leaves, values, [values[r] for r in recipe.roots]


def reference_grads(recipe: GraphRecipe) -> list[Tensor | None]:
    """pargrad.grad of the roots (with their gradients) for every value that requires
    grad, on a graph of its own without hooks."""
    _, values, roots = every_value(recipe)
    return list(pargrad.grad(roots, [v for v in values if v.requires_grad],
                             grad_outputs=list(recipe.root_grads), allow_unused=True))


@engine_shared
@given(recipe=graph_recipes())
def test_tensor_hooks_fire_exactly_where_grad_finds_a_gradient(recipe: GraphRecipe) -> None:
    expected = reference_grads(recipe)
    _, values, roots = every_value(recipe)
    watched = [v for v in values if v.requires_grad]
    trail = Trail()
    for k, v in enumerate(watched):
        trail.watch(str(k), v)
    pargrad.backward(roots, list(recipe.root_grads))
    fired = Counter(trail.names())
    assert set(fired) == {str(k) for k, g in enumerate(expected) if g is not None}
    assert set(fired.values()) <= {1}
    for k, g in enumerate(expected):
        if g is not None:
            np.testing.assert_allclose(trail.seen(str(k))[0], g.data, rtol=1e-9, atol=1e-12)


@engine_shared
@given(recipe=graph_recipes(), data=st.data())
def test_scaling_one_tensors_gradient_scales_exactly_its_share_of_every_leaf_grad(
        recipe: GraphRecipe, data: st.DataObject) -> None:
    n_leaves = len(recipe.leaves)
    needs = [v.requires_grad for v in every_value(recipe)[1]]
    k = data.draw(st.sampled_from([i for i, need in enumerate(needs) if need]), label="k")
    scale = data.draw(st.sampled_from([-2.0, 0.0, 0.5, 3.0]), label="scale")
    with_grad = [i for i in range(n_leaves) if recipe.requires_grad[i]]

    # The parts of every leaf's gradient: all of it, and the part through value k.
    leaves, values, roots = every_value(recipe)
    grads = list(recipe.root_grads)
    total = pargrad.grad(roots, [leaves[i] for i in with_grad], grad_outputs=grads,
                         materialize_grads=True, retain_graph=True)
    (at_k,) = pargrad.grad(roots, [values[k]], grad_outputs=grads, allow_unused=True,
                           retain_graph=True)
    if at_k is None:
        through = [np.zeros_like(t.data) for t in total]
    elif k < n_leaves:
        through = [at_k.data if i == k else np.zeros_like(t.data)
                   for i, t in zip(with_grad, total)]
    else:
        through = [g.data for g in pargrad.grad(values[k], [leaves[i] for i in with_grad],
                                                grad_outputs=[at_k], materialize_grads=True)]

    leaves, values, roots = every_value(recipe)
    values[k].register_hook(lambda g: g * scale)
    values[k].retain_grad()
    pargrad.backward(roots, grads)
    for i, whole, part in zip(with_grad, total, through):
        got = leaves[i].grad.data if leaves[i].grad is not None else np.zeros_like(whole.data)
        np.testing.assert_allclose(got, whole.data + (scale - 1.0) * part,
                                   rtol=1e-9, atol=1e-12)
    if at_k is None:
        assert values[k].grad is None
    else:
        np.testing.assert_allclose(grad_of(values[k]), scale * at_k.data, rtol=1e-9, atol=1e-12)


# ----- the deliberate difference -----


@pytest.mark.differs("backward(inputs=[t]) stops at a non-leaf t: its own node, and that "
                     "node's hooks, only run in a backward that goes on below it")
def test_backward_inputs_a_non_leaf_does_not_run_its_node_or_the_nodes_hooks() -> None:
    x = leaf(0.0, 1.0)
    t = pargrad.exp(x)
    trail = Trail()
    t.grad_fn.register_prehook(lambda grads: trail.add("pre"))
    t.grad_fn.register_hook(lambda grads_in, grads_out: trail.add("post"))
    t.register_hook(lambda g: (trail.add("tensor"), g * 2.0)[1])
    root = (t * const(2.0, 3.0)).sum()
    root.backward(inputs=[t], retain_graph=True)
    assert trail.names() == ["tensor"]
    close(t.grad, [4.0, 6.0])
    assert x.grad is None

    root.backward(inputs=[x])
    assert trail.names() == ["tensor", "tensor", "pre", "post"]
    close(x.grad, np.array([4.0, 6.0]) * np.exp([0.0, 1.0]))
    close(t.grad, [4.0, 6.0])               # t was not an input this time
