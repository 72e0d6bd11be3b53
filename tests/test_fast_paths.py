"""The hot path's lean paths against the general paths they shortcut: same graphs, same
gradients (bitwise), same errors. Not their speed: benchmarks measure that.

The lean paths: ``Op.__call__`` (one pass over the operands, the node built inline)
against ``Op.outputs``; ``OpNode.apply`` (rules called directly, results checked by a
shape/dtype comparison) against ``Node.apply``; ``ThreadedEngine`` running a backward
with nothing to hand off inline on the calling thread against the same engine running it
as a GraphTask (``handoff_threshold=1``). Each test runs a graph both ways.
"""

from __future__ import annotations

import gc
import importlib
import pkgutil
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import pargrad
import pargrad.ops
from pargrad.function import FunctionNode
from pargrad.graph import Node
from pargrad.ops.core import Op, OpNode, defop
from pargrad.versions import VersionCounter
from tests.strategies import GraphRecipe, graph_recipes

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def every_op() -> list[Op]:
    ops: dict[int, Op] = {}
    for info in pkgutil.iter_modules(pargrad.ops.__path__):
        module = importlib.import_module(f"pargrad.ops.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Op):
                ops[id(value)] = value
    return list(ops.values())


@pytest.fixture
def general(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Call ``general.on()`` to send every op and node down the general paths (until the
    test ends); ``general.off()`` restores the lean ones."""
    class Switch:
        def on(self) -> None:
            for op in every_op():
                monkeypatch.setattr(op, "lean", False)
            monkeypatch.setattr(OpNode, "apply", Node.apply)
            monkeypatch.setattr(FunctionNode, "apply", Node.apply)

        def off(self) -> None:
            monkeypatch.undo()

    switch = Switch()
    yield switch
    monkeypatch.undo()


def leaf_grads(recipe: GraphRecipe, engine: pargrad.Engine) -> list[np.ndarray | None]:
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    grads = [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)]
    pargrad.backward(roots, grads, engine=engine)
    return [None if t.grad is None else t.grad.data for t in leaves]


def assert_same(a: list[np.ndarray | None], b: list[np.ndarray | None]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)


@fixture_ok
@given(recipe=graph_recipes(dtypes=(np.float64, np.float32)))
def test_lean_forward_and_node_paths_give_the_general_paths_gradients(
        recipe: GraphRecipe, general: Any) -> None:
    engine = pargrad.SequentialEngine()
    lean = leaf_grads(recipe, engine)
    general.on()
    try:
        slow = leaf_grads(recipe, engine)
    finally:
        general.off()
    assert_same(lean, slow)


SHARED: dict[str, pargrad.ThreadedEngine] = {}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, pargrad.ThreadedEngine]]:
    made = {
        "inline": pargrad.ThreadedEngine(workers=2, deterministic=True),
        "graph-task": pargrad.ThreadedEngine(workers=2, deterministic=True,
                                             handoff_threshold=1),
    }
    yield made
    for engine in made.values():
        engine.shutdown()


@fixture_ok
@given(recipe=graph_recipes(dtypes=(np.float64, np.float32)))
def test_inline_backward_gives_the_graph_task_gradients_bitwise(
        recipe: GraphRecipe, engines: dict[str, pargrad.ThreadedEngine]) -> None:
    inline = leaf_grads(recipe, engines["inline"])
    handed = leaf_grads(recipe, engines["graph-task"])
    reference = leaf_grads(recipe, pargrad.SequentialEngine())
    assert_same(inline, reference)
    assert_same(handed, reference)


def test_small_graphs_run_inline_and_large_ones_do_not() -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        small = pargrad.tensor(np.ones(4), requires_grad=True)
        (small * 2).sum().backward(engine=engine)
        assert engine.threads() == []  # inline: no worker was needed
        assert engine.statistics().nodes == 2
        big = pargrad.tensor(np.ones(engine.handoff_threshold), requires_grad=True)
        (big * 2).sum().backward(engine=engine)
        assert engine.threads()  # a GraphTask: its device's workers started
        np.testing.assert_array_equal(big.grad.data, np.full(big.shape, 2.0))


# ----- errors: the same on every path -----

def _bad_shape_rule(g: Any, ans: Any, x: Any) -> Any:
    return np.ones((7,))


def _raising_rule(g: Any, ans: Any, x: Any) -> Any:
    raise ZeroDivisionError("boom in a rule")


# Forwards that are not ufuncs: an op made from a ufunc would serve that ufunc on Tensors
# (np.negative(t)) for the rest of the session.
bad_shape = defop("bad_shape", lambda x: -x, _bad_shape_rule)
raising = defop("raising", lambda x: -x, _raising_rule)


def error_of(build: Any, engine: pargrad.Engine) -> tuple[type, str, Any]:
    x = pargrad.tensor(np.arange(3.0), requires_grad=True)
    loss = build(x)
    with pytest.raises(Exception) as info:
        loss.backward(engine=engine)
    assert x.grad is None  # a failed backward changes no .grad
    return type(info.value), str(info.value), type(info.value.__cause__)


def _saved_changed(x: pargrad.Tensor) -> pargrad.Tensor:
    y = x * 1.0
    z = y * y
    with pargrad.no_grad():
        y.add_(1.0)
    return z.sum()


def _output_changed(x: pargrad.Tensor) -> pargrad.Tensor:
    y = pargrad.tanh(x * 1.0)
    loss = y.sum()
    with pargrad.no_grad():
        y.mul_(2.0)
    return loss


def _output_changed_through(how: str) -> Any:
    """tanh's output changed in place through another tensor of its memory (made after
    the node), or after another node saved it."""
    def build(x: pargrad.Tensor) -> pargrad.Tensor:
        y = pargrad.tanh(x * 1.0)
        loss = y.sum()
        if how == "saved first":  # another node saves y (and makes the counter)
            y * x
        with pargrad.no_grad():
            if how == "detach":
                y.detach().add_(1.0)
            elif how == "view":
                y[:1].add_(1.0)
            elif how == "detach_":
                y.detach_().add_(1.0)
            else:
                y.add_(1.0)
        return loss
    return build


class _Faulty(pargrad.Function):
    """A custom Function whose backward does what ``how`` (a class attribute) says."""

    how = "raises"

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x.data * 2.0

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        if _Faulty.how == "raises":
            raise ValueError("this backward fails")
        if _Faulty.how == "wrong shape":
            return np.ones(7)
        if _Faulty.how == "too many":
            return g * 2.0, g
        return "not a gradient"


def _function_fails(how: str) -> Any:
    def build(x: pargrad.Tensor) -> pargrad.Tensor:
        _Faulty.how = how
        return pargrad.tanh(_Faulty.apply(x * 1.0)).sum()
    return build


BUILDS = {
    **{f"Function's backward: {how}": _function_fails(how)
       for how in ("raises", "wrong shape", "too many", "not a gradient")},
    "wrong shape": lambda x: bad_shape(x).sum(),
    "rule raises": lambda x: raising(x).sum(),
    "saved argument changed": _saved_changed,
    "saved output changed": _output_changed,
    **{f"saved output changed ({how})": _output_changed_through(how)
       for how in ("detach", "view", "detach_", "saved first")},
}


@pytest.mark.parametrize("case", list(BUILDS))
@pytest.mark.parametrize("engine_name", ["sequential", "inline", "graph-task"])
def test_errors_are_the_same_on_lean_and_general_paths(
        case: str, engine_name: str, general: Any,
        engines: dict[str, pargrad.ThreadedEngine]) -> None:
    engine = (pargrad.SequentialEngine() if engine_name == "sequential"
              else engines[engine_name])
    lean = error_of(BUILDS[case], engine)
    general.on()
    slow = error_of(BUILDS[case], engine)
    assert lean == slow
    assert lean[0] is pargrad.BackwardError
    if case.startswith("saved output changed"):
        assert lean[1].startswith("TanhBackward: one of the tensors saved"), lean[1]


ruleless = defop("ruleless", lambda x: -x)
ruleless2 = defop("ruleless2", lambda x, y: x * y)


@pytest.mark.parametrize("call", [lambda x: ruleless(x), lambda x: ruleless2(x, 2.0),
                                  lambda x: ruleless2(x, x)],
                         ids=["one Tensor", "Tensor and scalar", "two Tensors"])
def test_an_argument_without_a_rule_fails_in_the_forward_on_every_path(
        call: Any, general: Any) -> None:
    x = pargrad.tensor(np.arange(3.0), requires_grad=True)
    with pytest.raises(TypeError) as lean:
        call(x)
    general.on()
    with pytest.raises(TypeError) as slow:
        call(x)
    assert str(lean.value) == str(slow.value)
    assert str(lean.value).startswith("ruleless")
    assert "no gradient rule for argument 0" in str(lean.value)


# A node keeps the values its rules read and nothing else: x * 2 needs 2, not x's array
# (which would otherwise live until the backward, for every link of a chain).
KEEPS = {
    "Tensor times a scalar": (lambda h, c: h * 2.0, 2.0),
    "Tensor times a constant Tensor": (lambda h, c: h * c, None),
    "Tensor times a constant array": (lambda h, c: pargrad.multiply(h, c.data), None),
}


@pytest.mark.parametrize("case", list(KEEPS))
@pytest.mark.parametrize("path", ["lean", "general"])
def test_a_node_keeps_no_array_its_rules_do_not_read(case: str, path: str,
                                                     general: Any) -> None:
    if path == "general":
        general.on()
    build, factor = KEEPS[case]
    x = pargrad.tensor(np.linspace(-1.0, 1.0, 5), requires_grad=True)
    c = pargrad.tensor(np.full(5, 2.0))
    h = x + 1.0  # a non-leaf whose array only h (and what keeps it) holds
    gone = weakref.ref(h.data)
    y = build(h, c)
    del h
    gc.collect()
    assert gone() is None
    assert y.grad_fn is not None
    saved = y.grad_fn.saved_arrays
    assert saved is not None and saved[0] is None
    if factor is not None:
        assert saved[1] == factor
    pargrad.sum(y).backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.data, np.full(5, 2.0))


@pytest.mark.parametrize("path", ["lean", "general"])
def test_a_saved_output_gets_its_version_counter_only_when_changed(path: str,
                                                                   general: Any) -> None:
    if path == "general":
        general.on()

    def counters() -> int:
        return sum(type(o) is VersionCounter for o in gc.get_objects())

    x = pargrad.tensor(np.linspace(-1.0, 1.0, 5), requires_grad=True)
    before = counters()
    y = x
    for _ in range(4):
        y = pargrad.tanh(y)  # each node saves its output
    assert counters() == before
    node = y.grad_fn
    assert node is not None and node.output_counter is None
    with pargrad.no_grad():
        y.add_(1.0)  # the first change makes it, shared by the tensor and its node
    assert node.output_counter is y._counter and y._version == 1
    with pytest.raises(pargrad.BackwardError, match=r"TanhBackward: .*output 0"):
        pargrad.sum(y).backward()


@pytest.mark.parametrize("step", ["tanh", "times a scalar"])
@pytest.mark.parametrize("path", ["lean", "general"])
def test_a_recorded_op_leaves_two_objects_for_the_collector(step: str, path: str,
                                                            general: Any) -> None:
    """A node and the tuple of its next nodes: a chain of small ops is mostly such
    objects, and every object the collector tracks is one it walks, again and again.
    (A node that saves a Tensor also keeps it, for create_graph, and a record of its
    version: three more.)"""
    if path == "general":
        general.on()
    steps = {"tanh": pargrad.tanh, "times a scalar": lambda y: y * 1.0001}
    x = pargrad.tensor(np.linspace(-1.0, 1.0, 5), requires_grad=True)
    y = steps[step](x)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(100):
        y = steps[step](y)
    gc.collect()  # (which stops tracking tuples of untracked objects: ints, None, floats)
    assert len(gc.get_objects()) - before <= 2 * 100
    assert y.grad_fn is not None and y.grad_fn.next_functions[0][0] is not None
    pargrad.sum(y).backward()
    assert x.grad is not None
