"""Grad mode: ``no_grad``, ``enable_grad``, ``set_grad_enabled`` and ``is_grad_enabled``,
as context managers, as decorators (on plain functions, recursive ones and generators),
inside custom Functions, and per thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad import Tensor
from tests.parity.support import leaf
from tests.strategies import GraphRecipe, graph_recipes

NOTHING_TO_DIFFERENTIATE = "does not require grad and has no grad_fn"
WAIT_S = 10.0


def _assert_detached(t: Tensor) -> None:
    """``t`` carries no history: it neither requires grad nor can start a backward."""
    assert not t.requires_grad
    assert t.grad_fn is None
    with pytest.raises(RuntimeError, match=NOTHING_TO_DIFFERENTIATE):
        t.sum().backward()


# ----- no_grad as a block -----
def test_no_grad_block_computes_values_but_records_no_history() -> None:
    x = leaf(1.0, -2.0)
    with pargrad.no_grad():
        assert pargrad.is_grad_enabled() is False
        y = x * x + 3.0
    assert pargrad.is_grad_enabled() is True
    np.testing.assert_array_equal(y.data, [4.0, 7.0])
    _assert_detached(y)
    with pytest.raises(RuntimeError, match=NOTHING_TO_DIFFERENTIATE):
        y.backward(np.ones(2))


@given(recipe=graph_recipes(max_steps=6))
def test_no_grad_changes_what_is_recorded_never_the_values(recipe: GraphRecipe) -> None:
    def leaves() -> list[Tensor]:
        return [pargrad.tensor(a, requires_grad=r)
                for a, r in zip(recipe.leaves, recipe.requires_grad)]

    recorded = recipe.build(leaves())
    with pargrad.no_grad():
        unrecorded = recipe.build(leaves())
    for r, with_graph, without in zip(recipe.roots, recorded, unrecorded):
        assert with_graph.requires_grad  # the recipe's roots all depend on a grad leaf
        # a root may be a leaf itself: no_grad leaves a leaf's own flag alone
        assert without.requires_grad is (r < len(recipe.leaves))
        assert without.grad_fn is None
        np.testing.assert_array_equal(without.data, with_graph.data)


# ----- decorators on plain functions -----
def _halve_and_shift(t: Tensor) -> Tensor:
    return t * 0.5 - 1.0


@pytest.mark.parametrize("decorate", [
    pytest.param(lambda f: pargrad.no_grad()(f), id="called-instance"),
    pytest.param(lambda f: pargrad.no_grad(f), id="bare"),
])
def test_no_grad_decorates_with_or_without_parentheses(
        decorate: Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]) -> None:
    wrapped = decorate(_halve_and_shift)
    assert wrapped.__name__ == "_halve_and_shift"
    y = wrapped(leaf(4.0, 2.0))
    np.testing.assert_array_equal(y.data, [1.0, 0.0])
    _assert_detached(y)
    assert pargrad.is_grad_enabled()  # the caller's mode, back after the call


def test_no_grad_decorated_call_inside_no_grad_block_keeps_grad_off() -> None:
    seen = []

    @pargrad.no_grad
    def probe() -> None:
        seen.append(pargrad.is_grad_enabled())

    with pargrad.no_grad():
        probe()
        # the decorator restores what it found, which was "off", not a blanket "on"
        assert not pargrad.is_grad_enabled()
    assert seen == [False]
    assert pargrad.is_grad_enabled()


def test_bare_enable_grad_decorator_records_inside_no_grad() -> None:
    @pargrad.enable_grad
    def cube(t: Tensor) -> Tensor:
        return t ** 3

    x = leaf(1.0, 2.0, -1.0)
    with pargrad.no_grad():
        z = cube(x)
        assert not pargrad.is_grad_enabled()
    assert z.requires_grad
    z.sum().backward()
    np.testing.assert_allclose(x.grad.data, [3.0, 12.0, 3.0])  # 3 x**2


def test_set_grad_enabled_decorator_turns_recording_off_only_inside_the_call() -> None:
    inside = []

    @pargrad.set_grad_enabled(False)
    def sine(t: Tensor) -> Tensor:
        inside.append(pargrad.is_grad_enabled())
        return t.sin()

    assert pargrad.is_grad_enabled()  # decorating left the mode alone
    y = sine(leaf(0.0))
    assert pargrad.is_grad_enabled()
    assert inside == [False]
    np.testing.assert_array_equal(y.data, [0.0])
    _assert_detached(y)


@pytest.mark.parametrize("flag", [False, True])
def test_set_grad_enabled_switches_when_made_and_decorating_undoes_that(flag: bool) -> None:
    def square(t: Tensor) -> Tensor:
        return t * t

    with pargrad.set_grad_enabled(not flag):
        switch = pargrad.set_grad_enabled(flag)
        assert pargrad.is_grad_enabled() is flag  # a plain call acts at once
        wrapped = switch(square)
        assert pargrad.is_grad_enabled() is not flag  # as a decorator: as if never called
        y = wrapped(leaf(3.0))
        assert pargrad.is_grad_enabled() is not flag
    np.testing.assert_array_equal(y.data, [9.0])
    assert y.requires_grad is flag


# ----- set_grad_enabled as a block and as a call -----
@pytest.mark.parametrize("flag", [True, False])
def test_set_grad_enabled_block_chooses_whether_ops_record(flag: bool) -> None:
    x = leaf(2.0)
    with pargrad.no_grad(), pargrad.set_grad_enabled(flag):
        assert pargrad.is_grad_enabled() is flag
        y = x * x
    assert y.requires_grad is flag
    assert (y.grad_fn is not None) is flag


def test_plain_set_grad_enabled_call_acts_inside_an_enclosing_block() -> None:
    x = leaf(2.0)
    with pargrad.set_grad_enabled(False):
        before = x * x
        pargrad.set_grad_enabled(True)
        after = x * x
    assert not before.requires_grad
    assert after.requires_grad
    after.backward(np.ones(1))
    np.testing.assert_array_equal(x.grad.data, [4.0])
    assert pargrad.is_grad_enabled()


# ----- nesting -----
@pytest.mark.parametrize("outer", [True, False])
def test_alternating_decorated_recursion_sees_each_levels_mode(outer: bool) -> None:
    log: list[tuple[str, int, bool]] = []

    @pargrad.enable_grad()
    def on(depth: int) -> None:
        log.append(("enter", depth, pargrad.is_grad_enabled()))
        if depth:
            off(depth - 1)
            log.append(("back", depth, pargrad.is_grad_enabled()))

    @pargrad.no_grad()
    def off(depth: int) -> None:
        log.append(("enter", depth, pargrad.is_grad_enabled()))
        if depth:
            on(depth - 1)
            log.append(("back", depth, pargrad.is_grad_enabled()))

    with pargrad.set_grad_enabled(outer):
        on(9)
        assert pargrad.is_grad_enabled() is outer
    # level d is "on" when 9 - d is even: the mode alternates all the way down and back
    expected_enter = [("enter", d, (9 - d) % 2 == 0) for d in range(9, -1, -1)]
    expected_back = [("back", d, (9 - d) % 2 == 0) for d in range(1, 10)]
    assert log == expected_enter + expected_back


@pytest.mark.parametrize("outer", [True, False])
def test_alternating_blocks_by_recursion_restore_each_level(outer: bool) -> None:
    modes: list[bool] = []

    def descend(depth: int, enable: bool) -> None:
        block = pargrad.enable_grad() if enable else pargrad.no_grad()
        with block:
            modes.append(pargrad.is_grad_enabled())
            if depth:
                descend(depth - 1, not enable)
                modes.append(pargrad.is_grad_enabled())

    with pargrad.set_grad_enabled(outer):
        descend(8, enable=False)
        assert pargrad.is_grad_enabled() is outer
    down = [d % 2 == 1 for d in range(9)]  # off, on, off, ... from the top
    assert modes == down + down[:-1][::-1]


SWITCHES: dict[str, Callable[[], Any]] = {
    "no_grad": pargrad.no_grad,
    "enable_grad": pargrad.enable_grad,
    "set_grad_enabled(True)": lambda: pargrad.set_grad_enabled(True),
    "set_grad_enabled(False)": lambda: pargrad.set_grad_enabled(False),
}
_EFFECT = {"no_grad": False, "enable_grad": True,
           "set_grad_enabled(True)": True, "set_grad_enabled(False)": False}

nestings = st.recursive(
    st.just([]),
    lambda inner: st.lists(st.tuples(st.sampled_from(list(SWITCHES)), inner), max_size=3),
    max_leaves=12,
)


@given(start=st.booleans(), tree=nestings)
def test_any_nesting_of_blocks_restores_every_level(start: bool, tree: list[Any]) -> None:
    def run(blocks: list[Any], expected: bool) -> None:
        for name, children in blocks:
            with SWITCHES[name]():
                assert pargrad.is_grad_enabled() is _EFFECT[name]
                run(children, _EFFECT[name])
            assert pargrad.is_grad_enabled() is expected

    with pargrad.set_grad_enabled(start):
        run(tree, start)
    assert pargrad.is_grad_enabled()


# ----- generators and coroutines -----
GENERATOR_CASES = [
    pytest.param(pargrad.no_grad(), True, id="no_grad-under-enable_grad"),
    pytest.param(pargrad.enable_grad(), False, id="enable_grad-under-no_grad"),
]


@pytest.mark.parametrize(("decorator", "caller_mode"), GENERATOR_CASES)
def test_decorated_generator_steps_run_in_its_mode_and_the_loop_in_the_callers(
        decorator: Any, caller_mode: bool) -> None:
    body: list[bool] = []

    @decorator
    def squares(n: int) -> Generator[int, None, None]:
        for i in range(n):
            body.append(pargrad.is_grad_enabled())
            yield i * i
        body.append(pargrad.is_grad_enabled())

    loop: list[bool] = []
    with pargrad.set_grad_enabled(caller_mode):
        got = []
        for value in squares(4):
            loop.append(pargrad.is_grad_enabled())
            got.append(value)
    assert got == [0, 1, 4, 9]
    assert body == [not caller_mode] * 5
    assert loop == [caller_mode] * 4


@pytest.mark.parametrize(("decorator", "caller_mode"), GENERATOR_CASES)
def test_values_sent_to_a_decorated_coroutine_arrive_in_its_mode(
        decorator: Any, caller_mode: bool) -> None:
    body: list[bool] = []

    @decorator
    def running_total() -> Generator[int, int, str]:
        total = 0
        body.append(pargrad.is_grad_enabled())
        while total < 10:
            sent = yield total
            body.append(pargrad.is_grad_enabled())
            total += sent
        return f"done at {total}"

    with pargrad.set_grad_enabled(caller_mode):
        coroutine = running_total()
        totals = [next(coroutine)]
        with pytest.raises(StopIteration) as stop:
            for step in (3, 4, 5):
                assert pargrad.is_grad_enabled() is caller_mode
                totals.append(coroutine.send(step))
                assert pargrad.is_grad_enabled() is caller_mode
        assert pargrad.is_grad_enabled() is caller_mode
    assert totals == [0, 3, 7]
    assert stop.value.value == "done at 12"  # the 5 sent last arrived
    assert body == [not caller_mode] * 4


class _Retry(Exception):
    pass


class _GiveUp(Exception):
    pass


@pytest.mark.parametrize(("decorator", "caller_mode"), GENERATOR_CASES)
def test_exception_thrown_into_decorated_generator_is_handled_in_its_mode(
        decorator: Any, caller_mode: bool) -> None:
    handled: list[bool] = []

    @decorator
    def attempts() -> Generator[str, None, None]:
        for n in range(3):
            try:
                yield f"attempt {n}"
            except _Retry:
                handled.append(pargrad.is_grad_enabled())
                yield f"retrying after {n}"

    with pargrad.set_grad_enabled(caller_mode):
        gen = attempts()
        assert next(gen) == "attempt 0"
        assert gen.throw(_Retry()) == "retrying after 0"
        assert next(gen) == "attempt 1"
        assert gen.throw(_Retry()) == "retrying after 1"
        assert pargrad.is_grad_enabled() is caller_mode
        assert list(gen) == ["attempt 2"]  # it carried on to its normal end
    assert handled == [not caller_mode] * 2


@pytest.mark.parametrize(("decorator", "caller_mode"), GENERATOR_CASES)
def test_exception_a_decorated_generator_raises_from_a_throw_reaches_the_caller(
        decorator: Any, caller_mode: bool) -> None:
    handled: list[bool] = []

    @decorator
    def fragile() -> Generator[int, None, None]:
        try:
            yield 1
        except _Retry:
            handled.append(pargrad.is_grad_enabled())
            raise _GiveUp("no more retries") from None

    with pargrad.set_grad_enabled(caller_mode):
        gen = fragile()
        assert next(gen) == 1
        with pytest.raises(_GiveUp, match="no more retries"):
            gen.throw(_Retry())
        assert pargrad.is_grad_enabled() is caller_mode
    assert handled == [not caller_mode]


@pytest.mark.parametrize(("decorator", "caller_mode"), GENERATOR_CASES)
def test_closing_a_decorated_generator_runs_its_cleanup_in_its_mode(
        decorator: Any, caller_mode: bool) -> None:
    cleanup: list[tuple[int, bool]] = []

    @decorator
    def counter() -> Generator[int, None, None]:
        n = 0
        try:
            while True:
                yield n
                n += 1
        except GeneratorExit:
            cleanup.append((n, pargrad.is_grad_enabled()))
            raise

    with pargrad.set_grad_enabled(caller_mode):
        gen = counter()
        assert [next(gen) for _ in range(3)] == [0, 1, 2]
        gen.close()
        assert pargrad.is_grad_enabled() is caller_mode
    assert cleanup == [(2, not caller_mode)]


# ----- custom Functions -----
class _Offset(pargrad.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor) -> np.ndarray:
        return t.data + 10.0

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class _Passthrough(pargrad.Function):
    """Returns its input tensor itself from forward."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


def test_custom_function_applied_under_no_grad_records_nothing() -> None:
    x = leaf(1.0, 2.0)
    with pargrad.no_grad():
        shifted = _Offset.apply(x)
        same = _Passthrough.apply(x)
    np.testing.assert_array_equal(shifted.data, [11.0, 12.0])
    _assert_detached(shifted)
    np.testing.assert_array_equal(same.data, [1.0, 2.0])
    _assert_detached(same)
    # the input is untouched: still a leaf that requires grad
    assert x.requires_grad
    assert x.grad_fn is None


class _CubeByNestedGrad(pargrad.Function):
    """x**3, whose backward gets 3 x**2 from a nested ``pargrad.grad`` on a fresh graph;
    ``log`` receives the grad mode at each stage."""

    log: ClassVar[list[tuple[str, bool]]] = []

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> np.ndarray:
        _CubeByNestedGrad.log.append(("forward", pargrad.is_grad_enabled()))
        ctx.save_for_backward(t)
        return t.data ** 3

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        log = _CubeByNestedGrad.log
        log.append(("backward entered", pargrad.is_grad_enabled()))
        (t,) = ctx.saved_tensors
        with pargrad.enable_grad():
            log.append(("enable_grad block", pargrad.is_grad_enabled()))
            fresh = pargrad.tensor(np.array(t.data), requires_grad=True)
            (result,) = pargrad.grad(fresh ** 3, fresh, grad_outputs=g)
            log.append(("after nested grad", pargrad.is_grad_enabled()))
        log.append(("block left", pargrad.is_grad_enabled()))
        return result


@pytest.mark.parametrize("create_graph", [False, True])
def test_function_backward_can_enable_grad_for_a_nested_grad_and_gets_its_mode_back(
        create_graph: bool) -> None:
    _CubeByNestedGrad.log = []
    x = leaf(1.0, 2.0, -1.0)
    _CubeByNestedGrad.apply(x).sum().backward(create_graph=create_graph)
    np.testing.assert_allclose(x.grad.data, [3.0, 12.0, 3.0])
    # a backward records only under create_graph, so that is the mode it starts in
    assert _CubeByNestedGrad.log == [
        ("forward", False),
        ("backward entered", create_graph),
        ("enable_grad block", True),
        ("after nested grad", True),
        ("block left", create_graph),
    ]


# ----- threads -----
def test_grad_mode_belongs_to_the_thread_that_set_it() -> None:
    x = leaf(3.0)
    main_in_no_grad, worker_in_no_grad, main_checked = (
        threading.Event(), threading.Event(), threading.Event())
    seen: dict[str, Any] = {}

    def worker() -> None:
        assert main_in_no_grad.wait(WAIT_S)
        seen["fresh thread"] = pargrad.is_grad_enabled()
        seen["records"] = (x * 2).requires_grad
        with pargrad.no_grad():
            worker_in_no_grad.set()
            seen["woken"] = main_checked.wait(WAIT_S)
            seen["still off"] = pargrad.is_grad_enabled()

    thread = threading.Thread(target=worker)
    thread.start()
    with pargrad.no_grad():
        main_in_no_grad.set()
        assert worker_in_no_grad.wait(WAIT_S)
    # the worker is inside its own no_grad block now; this thread is not
    assert pargrad.is_grad_enabled()
    assert (x * 2).requires_grad
    main_checked.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert seen == {"fresh thread": True, "records": True, "woken": True, "still off": False}
