"""ThreadedEngine against the reference on random graphs, and its behaviour under stress.

Deterministic mode must be bitwise equal to ``SequentialEngine``; the default mode sums
in arrival order and must agree to rounding. ``handoff_threshold=1`` hands every node
that is not the newest ready one to the ReadyQueue, so these small graphs really spread
over the workers instead of staying on the calling thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pargrad
from tests.strategies import GraphRecipe, graph_recipes

# Engines are costly to start, so the property tests share them across examples.
SHARED: dict[tuple[Any, ...], pargrad.ThreadedEngine] = {}


def threaded(workers: Any = 2, deterministic: bool = False,
             handoff_threshold: int = 1) -> pargrad.ThreadedEngine:
    key = (str(workers), deterministic, handoff_threshold)
    if key not in SHARED:
        SHARED[key] = pargrad.ThreadedEngine(workers, deterministic=deterministic,
                                             handoff_threshold=handoff_threshold)
    return SHARED[key]


@pytest.fixture(scope="module", autouse=True)
def _shutdown_shared() -> Iterator[None]:
    yield
    for engine in SHARED.values():
        engine.shutdown()
    SHARED.clear()


def grads_of(recipe: GraphRecipe, engine: pargrad.Engine, devices: Any = None,
             repeats: int = 1) -> list[np.ndarray | None]:
    """Build the recipe on fresh leaves, run ``repeats`` backward calls, return the .grads."""
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves, devices)
    grads = [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)]
    for k in range(repeats):
        pargrad.backward(roots, grads, retain_graph=k < repeats - 1, engine=engine)
    return [None if leaf.grad is None else leaf.grad.data for leaf in leaves]


def assert_bitwise(got: list[np.ndarray | None], want: list[np.ndarray | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g is not None and g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes(), (g, w)  # bit for bit, -0.0 and NaN included


def assert_close(got: list[np.ndarray | None], want: list[np.ndarray | None]) -> None:
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g is not None and g.dtype == w.dtype
            rtol = 1e-5 if w.dtype == np.float32 else 1e-12
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(1.0, np.abs(w).max(
                initial=0)))


@st.composite
def placed_recipes(draw: st.DrawFn) -> tuple[GraphRecipe, list[str] | None]:
    """A random graph and, half the time, a logical device for each of its steps."""
    recipe = draw(graph_recipes(dtypes=(np.float64, np.float32)))
    if not draw(st.booleans()):
        return recipe, None
    names = st.sampled_from(["cpu", "cpu:1", "cpu:2"])
    return recipe, draw(st.lists(names, min_size=len(recipe.steps),
                                 max_size=len(recipe.steps)))


# ----- equal to the reference -----

@pytest.mark.parametrize("workers", [1, 2, 8])
@given(case=placed_recipes())
def test_deterministic_mode_is_bitwise_the_reference(
        workers: int, case: tuple[GraphRecipe, list[str] | None]) -> None:
    recipe, devices = case
    want = grads_of(recipe, pargrad.SequentialEngine(), devices)
    got = grads_of(recipe, threaded(workers, deterministic=True), devices)
    assert_bitwise(got, want)


@pytest.mark.parametrize("workers", [1, 2, 8])
@given(case=placed_recipes())
def test_default_mode_matches_the_reference(
        workers: int, case: tuple[GraphRecipe, list[str] | None]) -> None:
    recipe, devices = case
    want = grads_of(recipe, pargrad.SequentialEngine(), devices)
    assert_close(grads_of(recipe, threaded(workers), devices), want)


@given(case=placed_recipes(), repeats=st.integers(2, 4))
def test_repeated_calls_accumulate_bitwise(
        case: tuple[GraphRecipe, list[str] | None], repeats: int) -> None:
    recipe, devices = case
    want = grads_of(recipe, pargrad.SequentialEngine(), devices, repeats)
    got = grads_of(recipe, threaded({"cpu": 2, "cpu:1": 1}, deterministic=True), devices,
                   repeats)
    assert_bitwise(got, want)


@settings(max_examples=10)
@given(recipe=graph_recipes(), workers=st.sampled_from([1, 2, 8]))
def test_create_graph_on_workers_matches_the_reference(recipe: GraphRecipe,
                                                        workers: int) -> None:
    # The backward records a graph on whichever worker runs each node: grad mode must
    # follow the graph task onto the workers. Differentiate the gradients again.
    def second(engine: pargrad.Engine) -> list[np.ndarray | None]:
        leaves = [pargrad.tensor(a, requires_grad=flag)
                  for a, flag in zip(recipe.leaves, recipe.requires_grad)]
        roots = recipe.build(leaves)
        grads = [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)]
        pargrad.backward(roots, grads, create_graph=True, engine=engine)
        firsts = [leaf.grad for leaf in leaves if leaf.grad is not None]
        for leaf in leaves:
            leaf.grad = None
        differentiable = [g for g in firsts if g.requires_grad]
        if differentiable:
            total = pargrad.stack([(g * g).sum() for g in differentiable]).sum()
            total.backward(engine=engine)
        return [None if leaf.grad is None else leaf.grad.data for leaf in leaves]

    assert_bitwise(second(threaded(workers, deterministic=True)),
                   second(pargrad.SequentialEngine()))


class Delayed(pargrad.Function):
    """x * c whose backward waits ``delay`` seconds first, so that branches finish (and
    record their part of the backward graph) in the reverse of the reference's order."""

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, c: float, delay: float) -> np.ndarray:
        ctx.save_for_backward(x)
        ctx.c, ctx.delay = c, delay
        return x.data * c

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None, None]:
        time.sleep(ctx.delay)
        (x,) = ctx.saved_tensors
        return g * x * ctx.c, None, None


@pytest.mark.parametrize("seed", range(3))
def test_deterministic_double_backward_is_bitwise(seed: int) -> None:
    # The graph a backward records must be the reference's too, or a second backward
    # through it sums in an order that depends on which thread ran first.
    rng = np.random.default_rng(seed)
    cs = rng.standard_normal(4) * 10.0 ** rng.integers(-8, 8, 4)
    x0, w = rng.standard_normal(5), rng.standard_normal(5)

    def run(engine: pargrad.Engine) -> tuple[np.ndarray, np.ndarray]:
        x = pargrad.tensor(x0, requires_grad=True)
        loss = Delayed.apply(x, cs[0], 0.0).sum()
        for c, delay in zip(cs[1:], (0.01, 0.02, 0.03)):
            loss = loss + Delayed.apply(x, c, delay).sum()
        loss.backward(create_graph=True, engine=engine)
        first = x.grad
        x.grad = None
        (first * pargrad.tensor(w)).sum().backward(engine=engine)
        return first.data, x.grad.data

    want = run(pargrad.SequentialEngine())
    got = run(threaded(3, deterministic=True, handoff_threshold=0))
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


# ----- many callers, slow nodes, failures -----

def run_in_threads(target: Any, count: int) -> None:
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            target()
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_many_callers_at_once(deterministic: bool) -> None:
    engine = threaded(3, deterministic=deterministic)
    shared = pargrad.tensor(np.linspace(-1, 1, 50), requires_grad=True)
    trunk = pargrad.tanh(shared) * 2.0  # a subgraph every caller goes through
    calls = 20

    def work() -> None:
        own = pargrad.tensor(np.linspace(0, 1, 50), requires_grad=True)
        for _ in range(calls):
            loss = (trunk * pargrad.sin(own)).sum() + (own * own).sum()
            loss.backward(engine=engine, retain_graph=True)
        np.testing.assert_allclose(
            own.grad.data, calls * (trunk.data * np.cos(own.data) + 2 * own.data))

    run_in_threads(work, 8)
    expected = 8 * calls * 2 * (1 - np.tanh(shared.data) ** 2) * np.sin(np.linspace(0, 1, 50))
    np.testing.assert_allclose(shared.grad.data, expected, rtol=1e-12)


class Sleep(pargrad.Function):
    """Identity whose backward sleeps, and records when it ran."""

    log: list[tuple[str, float]] = []  # noqa: RUF012 -- appended to from several threads

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, tag: str, seconds: float) -> np.ndarray:
        ctx.tag, ctx.seconds = tag, seconds
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None, None]:
        time.sleep(ctx.seconds)
        Sleep.log.append((ctx.tag, time.monotonic()))
        return g, None, None


def test_a_slow_branch_does_not_hold_up_the_others() -> None:
    engine = threaded(2)
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    Sleep.log = []
    slow = Sleep.apply(x * 1.0, "slow", 0.5)
    fast = [Sleep.apply(x * 2.0, f"fast{i}", 0.0) for i in range(6)]
    pargrad.stack([b.sum() for b in [*fast, slow]]).sum().backward(engine=engine)
    np.testing.assert_array_equal(x.grad.data, np.full(3, 13.0))
    finished = dict(Sleep.log)
    assert len(finished) == 7
    # The slow node was handed to one thread; every fast one finished while it slept.
    assert all(finished[f"fast{i}"] < finished["slow"] for i in range(6))


class Boom(pargrad.Function):
    """Identity whose backward raises if its tag is in ``fail``."""

    fail: frozenset[int] = frozenset()

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, tag: int) -> np.ndarray:
        ctx.tag = tag
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None]:
        if ctx.tag in Boom.fail:
            raise ZeroDivisionError(f"boom {ctx.tag}")
        return g, None


@settings(max_examples=15)
@given(fail=st.sets(st.integers(0, 19), min_size=1, max_size=4),
       workers=st.sampled_from([1, 2, 8]), deterministic=st.booleans())
def test_errors_in_random_nodes(fail: set[int], workers: int, deterministic: bool) -> None:
    engine = threaded(workers, deterministic=deterministic)
    x = pargrad.tensor(np.arange(4.0), requires_grad=True)
    x.grad = pargrad.tensor(np.full(4, 7.0))
    # Five chains of four Boom nodes each, joined at the end.
    chains = []
    for c in range(5):
        y = x * float(c + 1)
        for k in range(4):
            y = Boom.apply(pargrad.tanh(y), 4 * c + k)
        chains.append(y.sum())
    loss = pargrad.stack(chains).sum()
    Boom.fail = frozenset(fail)
    try:
        with pytest.raises(pargrad.BackwardError, match=r"BoomBackward: ZeroDivisionError: "
                                                        r"boom \d+.*PARGRAD_ENGINE=sequential"
                           ) as info:
            loss.backward(engine=engine, retain_graph=True)
    finally:
        Boom.fail = frozenset()
    assert int(str(info.value).split("boom ")[1].split(";")[0]) in fail
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.__cause__.__traceback__ is not None  # the worker's traceback is kept
    np.testing.assert_array_equal(x.grad.data, np.full(4, 7.0))  # no .grad changed
    x.grad = None
    loss.backward(engine=engine)  # the engine serves the next call
    assert x.grad is not None and np.all(np.isfinite(x.grad.data))


def test_workers_survive_errors() -> None:
    engine = pargrad.ThreadedEngine(workers=2, handoff_threshold=1)
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    for _ in range(3):
        Boom.fail = frozenset({0})
        try:
            with pytest.raises(pargrad.BackwardError):
                pargrad.stack([Boom.apply(x * 2.0, 0).sum(), (x * 3).sum()]).sum().backward(
                    engine=engine)
        finally:
            Boom.fail = frozenset()
    threads = engine.threads()
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    (x * 2).sum().backward(engine=engine)
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])
    engine.shutdown()
    assert not any(t.is_alive() for t in threads)


# ----- reentrant backward -----

class Nested(pargrad.Function):
    """Identity whose backward runs a whole backward of its own, ``depth`` levels deep."""

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, depth: int) -> np.ndarray:
        ctx.depth = depth
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None]:
        if ctx.depth > 0:
            inner = pargrad.tensor(np.ones(2), requires_grad=True)
            with pargrad.enable_grad():  # a backward runs with grad mode off
                Nested.apply(inner * 2.0, ctx.depth - 1).sum().backward()
            Nested.seen.append(inner.grad.data.copy())
        return g, None

    seen: list[np.ndarray] = []  # noqa: RUF012


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 4])
def test_reentrant_backward_100_deep(workers: int) -> None:
    engine = threaded(workers)
    Nested.seen = []
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    with pargrad.use_engine(engine):  # the inner calls use the engine running them anyway
        Nested.apply(x * 3.0, 100).sum().backward()
    np.testing.assert_array_equal(x.grad.data, [3.0, 3.0])
    assert len(Nested.seen) == 100
    assert all(np.array_equal(s, [2.0, 2.0]) for s in Nested.seen)


def test_reentrant_backward_from_many_branches_at_once() -> None:
    # Every worker is inside a node that waits for an inner backward: none may block.
    engine = threaded(2)
    Nested.seen = []
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    branches = [Nested.apply(x * float(k), 3).sum() for k in range(1, 9)]
    pargrad.stack(branches).sum().backward(engine=engine)
    np.testing.assert_array_equal(x.grad.data, np.full(2, 36.0))
    assert len(Nested.seen) == 8 * 3


# ----- interrupts -----

@pytest.mark.timeout(60)
@pytest.mark.sigint
def test_keyboard_interrupt_stops_the_backward() -> None:
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    engine = pargrad.ThreadedEngine(workers=2, handoff_threshold=1)
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    x.grad = pargrad.tensor([5.0, 5.0])
    Sleep.log = []
    # 40 chained sleeps of 0.05 s: two seconds if nothing stops it.
    y: pargrad.Tensor = x * 1.0
    for k in range(40):
        y = Sleep.apply(y, f"s{k}", 0.05)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            y.sum().backward(engine=engine)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 1.5  # promptly, not after the whole chain
    np.testing.assert_array_equal(x.grad.data, [5.0, 5.0])
    time.sleep(0.2)  # let a node still sleeping on a worker finish
    ran = len(Sleep.log)
    time.sleep(0.3)
    assert len(Sleep.log) == ran < 40  # the rest of the task was skipped
    z = x * 4.0
    z.sum().backward(engine=engine)  # the engine is still usable
    np.testing.assert_array_equal(x.grad.data, [9.0, 9.0])
    engine.shutdown()


# ----- big graphs -----

@pytest.mark.timeout(300)
@pytest.mark.parametrize("deterministic", [False, True])
def test_100k_node_graphs_free_themselves(deterministic: bool) -> None:
    import gc
    import weakref

    engine = threaded(2, deterministic=deterministic, handoff_threshold=1 << 15)
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    probes = []
    for _ in range(2):  # repeated calls: nothing kept from one to the next
        y = x
        for _ in range(100_000):  # a chain
            y = y * 1.0
        wide = pargrad.stack([x * 1.0 for _ in range(100_000)]).sum()  # 100k branches
        probes += [weakref.ref(y.grad_fn), weakref.ref(wide.grad_fn)]
        pargrad.backward([y.sum(), wide], engine=engine)
        del y, wide
    np.testing.assert_array_equal(x.grad.data, np.full(3, 2 * 100_001.0))
    gc.collect()
    assert all(p() is None for p in probes)
