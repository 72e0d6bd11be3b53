"""Asynchronous backward: backward_async / grad_async futures, their values and errors,
cancellation, per-leaf hooks before completion, helping waiters, many futures at once,
asyncio. Tests that need a backward still in flight run on the threaded engines only
(SequentialEngine returns a future that is done); nodes that block on Events make them
deterministic."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from tests.conftest import ENGINES

THREADED = [name for name in ENGINES if name.startswith("threaded")]
WAIT = 30  # seconds: a generous bound on anything these tests wait for


def leaf(value: Any) -> Tensor:
    return pargrad.tensor(value, requires_grad=True)


def mlp_loss(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return (pargrad.tanh(x @ w1) @ w2).sum()


def parameters(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    rng = np.random.default_rng(seed)
    return (pargrad.tensor(rng.normal(size=(8, 4))), leaf(rng.normal(size=(4, 5))),
            leaf(rng.normal(size=(5, 3))))


@pytest.fixture(params=THREADED)
def threaded(request: pytest.FixtureRequest) -> Iterator[pargrad.ThreadedEngine]:
    made = ENGINES[request.param]()
    assert isinstance(made, pargrad.ThreadedEngine)
    with made:
        yield made


class Block(pargrad.Function):
    """Identity whose backward says it started and then waits for ``release``."""

    started = threading.Event()
    release = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        Block.started.set()
        assert Block.release.wait(WAIT), "the test never released the node"
        return g


@pytest.fixture
def block() -> Iterator[type[Block]]:
    Block.started.clear()
    Block.release.clear()
    yield Block
    Block.release.set()  # whatever the test did, nothing stays blocked


class Count(pargrad.Function):
    """Identity that counts how often its backward ran."""

    runs = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        Count.runs += 1
        return g


class Boom(pargrad.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data * 1.0

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise ValueError("boom")


# ----- values and errors, on every engine -----

def test_backward_async_commits_what_backward_would(engine: pargrad.Engine) -> None:
    x, w1, w2 = parameters()
    mlp_loss(x, w1, w2).backward(engine=pargrad.SequentialEngine())
    want = (w1.grad.data.copy(), w2.grad.data.copy())
    w1.grad = w2.grad = None
    future = pargrad.backward_async(mlp_loss(x, w1, w2))
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=WAIT) is None
    assert future.done() and not future.running() and not future.cancelled()
    assert future.exception() is None
    np.testing.assert_allclose(w1.grad.data, want[0], rtol=1e-12)
    np.testing.assert_allclose(w2.grad.data, want[1], rtol=1e-12)


def test_grad_async_resolves_with_the_gradients(engine: pargrad.Engine) -> None:
    x, w1, w2 = parameters()
    loss = mlp_loss(x, w1, w2)
    want = pargrad.grad(loss, [w1, w2], retain_graph=True)
    got = pargrad.grad_async(loss, [w1, w2]).result(timeout=WAIT)
    assert len(got) == 2 and w1.grad is None
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.data, w.data, rtol=1e-12)


def test_bad_arguments_raise_at_once(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match="pass gradient="):
        pargrad.backward_async(x * 2)
    with pytest.raises(ValueError, match="inputs must not be empty"):
        pargrad.grad_async((x * 2).sum(), [])


def test_an_unused_input_fails_the_grad_future(engine: pargrad.Engine) -> None:
    x, unused = leaf([1.0, 2.0]), leaf([3.0])
    future = pargrad.grad_async((x * 2).sum(), [x, unused])
    with pytest.raises(RuntimeError, match=r"inputs\[1\] got no gradient"):
        future.result(timeout=WAIT)


def test_a_failed_backward_future_carries_the_node_error(engine: pargrad.Engine) -> None:
    x1, x2 = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    x1.grad = pargrad.tensor([10.0, 10.0])
    fired: list[float] = []
    x1.register_post_accumulate_grad_hook(lambda t: fired.append(float(t.grad.data[0])))
    future = pargrad.backward_async((Boom.apply(x2) + x1 * 2).sum())
    error = future.exception(timeout=WAIT)
    assert isinstance(error, pargrad.BackwardError) and error.node_name == "BoomBackward"
    assert isinstance(error.__cause__, ValueError)
    with pytest.raises(pargrad.BackwardError, match="BoomBackward: ValueError: boom"):
        future.result()
    np.testing.assert_array_equal(x1.grad.data, [10.0, 10.0])  # early commit undone
    assert x2.grad is None and len(fired) <= 1
    (x2 * 3).sum().backward()  # the engine still works
    np.testing.assert_array_equal(x2.grad.data, [3.0, 3.0])


def test_hooks_fire_once_per_leaf_with_the_final_gradient_before_the_future(
        engine: pargrad.Engine) -> None:
    x, w1, w2 = parameters()
    events: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def hook(name: str) -> Callable[[Tensor], None]:
        def record(t: Tensor) -> None:
            with lock:
                events.append((name, t.grad.data.copy()))
        return record

    w1.register_post_accumulate_grad_hook(hook("w1"))
    w2.register_post_accumulate_grad_hook(hook("w2"))
    future = pargrad.backward_async(mlp_loss(x, w1, w2))
    future.add_done_callback(lambda f: events.append(("done", None)))
    future.result(timeout=WAIT)
    assert sorted(name for name, _ in events[:2]) == ["w1", "w2"]
    assert [name for name, _ in events[2:]] == ["done"]
    seen = dict(events[:2])
    np.testing.assert_array_equal(seen["w1"], w1.grad.data)
    np.testing.assert_array_equal(seen["w2"], w2.grad.data)


def test_done_callbacks_may_use_the_same_graph(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    loss = (x * x).sum()
    again: list[Any] = []
    future = pargrad.backward_async(loss, retain_graph=True)
    future.add_done_callback(lambda f: again.append(pargrad.grad(loss, [x])[0]))
    future.result(timeout=WAIT)
    concurrent.futures.wait([future], timeout=WAIT)
    np.testing.assert_array_equal(x.grad.data, [2.0, 4.0])
    assert len(again) == 1
    np.testing.assert_array_equal(again[0].data, [2.0, 4.0])


def test_asyncio_awaits_wrapped_futures(engine: pargrad.Engine) -> None:
    xs = [leaf([float(k), 1.0]) for k in range(4)]

    async def main() -> list[Any]:
        futures = [asyncio.wrap_future(pargrad.grad_async((x * x * x).sum(), [x]))
                   for x in xs]
        return list(await asyncio.gather(*futures))

    results = asyncio.run(main())
    for x, (g,) in zip(xs, results):
        np.testing.assert_allclose(g.data, 3 * x.data ** 2)


def test_many_futures_in_flight_from_several_threads(engine: pargrad.Engine) -> None:
    shared = leaf(np.linspace(-1, 1, 6))
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            futures = []
            for i in range(6):
                scale = float(k * 10 + i)
                loss = (pargrad.sin(shared) * scale).sum()
                futures.append((scale, pargrad.grad_async(loss, [shared], engine=engine)))
            done, _ = concurrent.futures.wait([f for _, f in futures], timeout=WAIT)
            assert len(done) == len(futures)
            for scale, f in futures:
                np.testing.assert_allclose(f.result()[0].data, scale * np.cos(shared.data))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors, errors


# ----- a backward in flight: threaded engines -----

def test_the_workers_alone_finish_when_nobody_waits(threaded: pargrad.ThreadedEngine,
                                                     block: type[Block]) -> None:
    x = leaf([1.0, 2.0])
    future = pargrad.backward_async(Block.apply(x * 2).sum(), engine=threaded)
    assert block.started.wait(WAIT)  # a worker runs it while this thread goes on
    assert not future.done() and future.running()
    block.release.set()
    done, _ = concurrent.futures.wait([future], timeout=WAIT)  # no result(): no help
    assert done and x.grad is not None
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])


def test_result_helps_when_the_workers_are_busy(block: type[Block]) -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        busy = pargrad.backward_async(Block.apply(leaf([1.0]) * 1).sum(), engine=engine)
        assert block.started.wait(WAIT)  # the only worker is blocked
        x = leaf([1.0, 2.0])
        assert pargrad.grad_async((x * x).sum(), [x], engine=engine).result(
            timeout=WAIT)[0].data.tolist() == [2.0, 4.0]  # run by this thread
        with pytest.raises(concurrent.futures.TimeoutError):
            busy.result(timeout=0.05)
        block.release.set()
        busy.result(timeout=WAIT)


def test_cancel_stops_the_backward_and_changes_no_grad(threaded: pargrad.ThreadedEngine,
                                                       block: type[Block]) -> None:
    x, early = leaf([1.0, 2.0]), leaf([5.0])
    x.grad = pargrad.tensor([7.0, 7.0])
    fired: list[float] = []
    early.register_post_accumulate_grad_hook(lambda t: fired.append(float(t.grad.data[0])))
    Count.runs = 0
    # Count and x's multiply run only after Block; early's gradient is final before it.
    loss = Block.apply(Count.apply(x) * 3).sum() + (early * 2).sum()
    future = pargrad.backward_async(loss, engine=threaded)
    assert block.started.wait(WAIT)
    threading.Timer(0.1, block.release.set).start()
    assert future.cancel()  # returns once the blocked node has finished
    assert future.cancelled() and future.done() and not future.running()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert concurrent.futures.wait([future], timeout=WAIT).done == {future}
    assert Count.runs == 0  # not started: skipped
    np.testing.assert_array_equal(x.grad.data, [7.0, 7.0])
    assert early.grad is None and fired == [2.0]  # its hook ran; its commit is undone
    assert future.cancel()  # idempotent
    block.release.set()
    (x * 3).sum().backward(engine=threaded)  # the engine still works
    np.testing.assert_array_equal(x.grad.data, [10.0, 10.0])


def test_cancel_after_the_end_returns_false(threaded: pargrad.ThreadedEngine) -> None:
    x = leaf([1.0, 2.0])
    future = pargrad.backward_async((x * x).sum(), engine=threaded)
    future.result(timeout=WAIT)
    assert not future.cancel() and not future.cancelled()
    np.testing.assert_array_equal(x.grad.data, [2.0, 4.0])


def test_cancel_from_inside_the_backward(threaded: pargrad.ThreadedEngine) -> None:
    x, y = leaf([1.0, 2.0]), leaf([3.0])
    holder: list[pargrad.BackwardFuture[None]] = []
    ready = threading.Event()
    answers: list[bool] = []

    def stop(t: Tensor) -> None:
        assert ready.wait(WAIT)
        answers.append(holder[0].cancel())  # must not wait for itself

    y.register_post_accumulate_grad_hook(stop)
    Count.runs = 0
    future = pargrad.backward_async((Count.apply(x) * 2).sum() + (y * 4).sum(),
                                    engine=threaded)
    holder.append(future)
    ready.set()
    assert concurrent.futures.wait([future], timeout=WAIT).done == {future}
    assert answers == [True] and future.cancelled()
    assert x.grad is None and y.grad is None


def test_result_inside_its_own_backward_raises(threaded: pargrad.ThreadedEngine) -> None:
    x = leaf([1.0, 2.0])
    holder: list[pargrad.BackwardFuture[None]] = []
    ready = threading.Event()

    def wait_for_myself(t: Tensor) -> None:
        assert ready.wait(WAIT)
        holder[0].result()

    x.register_post_accumulate_grad_hook(wait_for_myself)
    future = pargrad.backward_async((x * x).sum(), engine=threaded)
    holder.append(future)
    ready.set()
    error = future.exception(timeout=WAIT)
    assert isinstance(error, pargrad.BackwardError)
    assert isinstance(error.__cause__, RuntimeError)
    assert "from inside a node or hook of the backward" in str(error.__cause__)
    assert x.grad is None


def test_a_node_may_wait_for_another_backward(block: type[Block]) -> None:
    # The one worker runs a node that waits for another backward: it helps run it.
    with pargrad.ThreadedEngine(workers=1, handoff_threshold=2) as engine:
        inner_x = leaf([1.0, 2.0])
        inner_loss = (inner_x * inner_x).sum()  # a node runs with grad mode off
        inner: list[Any] = []

        class Waits(pargrad.Function):
            @staticmethod
            def forward(ctx: Any, x: Tensor) -> np.ndarray:
                return x.data.copy()

            @staticmethod
            def backward(ctx: Any, g: Tensor) -> Tensor:
                future = pargrad.grad_async(inner_loss, [inner_x], engine=engine)
                inner.append(future.result(timeout=WAIT)[0])
                return g

        x = leaf([1.0])
        pargrad.backward_async(Waits.apply(x).sum(), engine=engine).result(timeout=WAIT)
        np.testing.assert_array_equal(inner[0].data, [2.0, 4.0])
        np.testing.assert_array_equal(x.grad.data, [1.0])


def test_deterministic_create_graph_runs_on_one_thread() -> None:
    with pargrad.ThreadedEngine(workers=2, deterministic=True) as engine:
        x = leaf([1.0, 2.0])
        (g,) = pargrad.grad_async((x ** 3).sum(), [x], create_graph=True,
                                  engine=engine).result(timeout=WAIT)
        (gg,) = pargrad.grad(g.sum(), [x], engine=pargrad.SequentialEngine())
        np.testing.assert_array_equal(gg.data, 6 * x.data)


def test_the_trace_shows_when_each_leaf_was_ready() -> None:
    with pargrad.ThreadedEngine(workers=2, trace=True, handoff_threshold=2) as engine:
        x, w1, w2 = parameters()
        pargrad.backward_async(mlp_loss(x, w1, w2), engine=engine).result(timeout=WAIT)
        assert engine.trace is not None
        ready = engine.trace.leaves_ready()
        assert sorted(r.shape for r in ready) == [(4, 5), (5, 3)]
        events = engine.trace.events()
        assert all(r.time >= events[0].start for r in ready)
        assert {r.thread for r in ready} <= {e.thread for e in events}
        chrome = engine.trace.chrome_trace()["traceEvents"]
        assert len([e for e in chrome if e["name"] == "ready" and e["ph"] == "i"]) == 2


def test_the_guide_runs() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "async.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 2
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, "docs/async.md", "exec"), namespace)
    np.testing.assert_array_equal(namespace["x"].grad.data, [2.0, 4.0, 6.0])
