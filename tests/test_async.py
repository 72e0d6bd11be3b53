"""Asynchronous backward: backward_async / grad_async futures, their values and errors,
cancellation, per-leaf hooks before completion, helping waiters, many futures at once,
asyncio. Tests that need a backward still in flight run on the threaded engines only
(SequentialEngine returns a future that is done); nodes that block on Events make them
deterministic."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from tests.conftest import ENGINES
from tests.helpers import Boom, blocking_function, release_once_cancelled

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


Block = blocking_function(WAIT)


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
    with pytest.raises(RuntimeError, match="pass grad_tensors="):
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
    called = threading.Event()  # waiters are woken before the callbacks run
    future = pargrad.backward_async(mlp_loss(x, w1, w2))
    future.add_done_callback(lambda f: (events.append(("done", None)), called.set()))
    future.result(timeout=WAIT)
    assert called.wait(WAIT)
    assert sorted(name for name, _ in events[:2]) == ["w1", "w2"]
    assert [name for name, _ in events[2:]] == ["done"]
    seen = dict(events[:2])
    np.testing.assert_array_equal(seen["w1"], w1.grad.data)
    np.testing.assert_array_equal(seen["w2"], w2.grad.data)


def test_done_callbacks_may_use_the_same_graph(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    loss = (x * x).sum()
    again: list[Any] = []
    called = threading.Event()
    future = pargrad.backward_async(loss, retain_graph=True)
    future.add_done_callback(
        lambda f: (again.append(pargrad.grad(loss, [x])[0]), called.set()))
    future.result(timeout=WAIT)
    assert called.wait(WAIT)  # the callbacks run after result() may return
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
    # Count and x's multiply run only after Block. Early's branch is newer, so a thread
    # that keeps both branches (no hand-off) finishes it before Block; with hand-offs,
    # another thread may not have started it by the cancel.
    loss = Block.apply(Count.apply(x) * 3).sum() + (early * 2).sum()
    future = pargrad.backward_async(loss, engine=threaded)
    assert block.started.wait(WAIT)
    release_once_cancelled(future, block)
    assert future.cancel()  # returns once the blocked node has finished
    assert future.cancelled() and future.done() and not future.running()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert concurrent.futures.wait([future], timeout=WAIT).done == {future}
    assert Count.runs == 0  # not started: skipped
    np.testing.assert_array_equal(x.grad.data, [7.0, 7.0])
    # Its hook ran (or, handed off, was skipped); its commit is undone.
    assert early.grad is None
    assert fired == [2.0] if threaded.handoff_threshold > 2 else fired in ([], [2.0])
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
        outer = pargrad.backward_async(Waits.apply(x).sum(), engine=engine)
        # Not result(): this thread must not help, so the worker alone runs both.
        assert concurrent.futures.wait([outer], timeout=WAIT).done == {outer}
        assert outer.exception() is None
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


# ----- review of issue 6: each test failed before its fix -----

@pytest.mark.timeout(3 * WAIT)
@pytest.mark.parametrize("where", ["node", "done-callback"])
def test_cancel_helps_when_it_holds_the_only_worker(where: str, block: type[Block]) -> None:
    # The one worker cancels backward A from a node (or done-callback) of backward B
    # while A's root waits on the queue: cancel() must take it off and skip it itself.
    with pargrad.ThreadedEngine(workers=1) as engine:
        x = leaf([1.0, 2.0])
        loss_a = (x * x).sum()  # older: B (newer) is taken from the queue first
        target: list[pargrad.BackwardFuture[None]] = []
        answers: list[bool] = []
        answered = threading.Event()

        def cancel_a(*_: Any) -> None:
            answers.append(target[0].cancel())
            answered.set()

        class CancelsA(pargrad.Function):
            @staticmethod
            def forward(ctx: Any, t: Tensor) -> np.ndarray:
                return t.data.copy()

            @staticmethod
            def backward(ctx: Any, g: Tensor) -> Tensor:
                cancel_a()
                return g

        y = leaf([3.0])
        loss_b = CancelsA.apply(y).sum() if where == "node" else (y * 2).sum()
        held = pargrad.backward_async(block.apply(leaf([1.0])).sum(), engine=engine)
        assert block.started.wait(WAIT)  # the worker is busy: A and B queue up
        a = pargrad.backward_async(loss_a, engine=engine)
        target.append(a)
        b = pargrad.backward_async(loss_b, engine=engine)
        if where == "done-callback":
            b.add_done_callback(cancel_a)
        block.release.set()
        try:
            assert answered.wait(WAIT), "cancel() never returned"  # nobody else helps
            assert answers == [True] and a.cancelled() and x.grad is None
            assert concurrent.futures.wait([b, held], timeout=WAIT).not_done == set()
        finally:  # a cancel() that does not help is unblocked by this thread's help
            with contextlib.suppress(concurrent.futures.CancelledError):
                a.exception(timeout=WAIT)


def test_a_hook_of_a_root_leaf_fails_the_future_and_restores_grad(
        engine: pargrad.Engine) -> None:
    # The leaves are roots: their early commits and hooks run inside backward_async.
    a, b = leaf([1.0, 2.0]), leaf([5.0])
    a.grad = pargrad.tensor([7.0, 7.0])
    a.register_post_accumulate_grad_hook(lambda t: None)

    def bad(t: Tensor) -> None:
        raise ValueError("hook of b")

    b.register_post_accumulate_grad_hook(bad)
    future = pargrad.backward_async([a, b], [np.ones(2), np.ones(1)])
    error = future.exception(timeout=WAIT)
    assert isinstance(error, pargrad.BackwardError) and "hook of b" in str(error)
    np.testing.assert_array_equal(a.grad.data, [7.0, 7.0])
    assert b.grad is None
    if isinstance(engine, pargrad.ThreadedEngine):
        assert engine.statistics().errors >= 1  # counted as a failed backward


@pytest.mark.timeout(3 * WAIT)
def test_a_callback_raising_systemexit_keeps_the_worker(
        block: type[Block], monkeypatch: pytest.MonkeyPatch) -> None:
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    with pargrad.ThreadedEngine(workers=1) as engine:
        x = leaf([1.0])
        future = pargrad.backward_async(Block.apply(x).sum(), engine=engine)
        assert block.started.wait(WAIT)  # the callbacks below run on the worker

        def exits(f: Any) -> None:
            raise SystemExit("from a callback")

        later = threading.Event()
        future.add_done_callback(exits)
        future.add_done_callback(lambda f: later.set())
        block.release.set()
        assert later.wait(WAIT)  # the callbacks after it still ran
        again = pargrad.backward_async((x * 2).sum(), engine=engine)
        assert concurrent.futures.wait([again], timeout=WAIT).done == {again}  # no help
        assert [type(e) for e in reported] == [SystemExit]
        assert all(t.is_alive() for t in engine.threads())


def test_shutdown_returns_after_the_future_resolved(block: type[Block]) -> None:
    # Deterministic create_graph: the task has a thread of its own (pargrad-cpu-async).
    engine = pargrad.ThreadedEngine(workers=1, deterministic=True)
    order: list[str] = []
    task_done = engine._pool.task_done

    def counted() -> None:
        order.append("task done")
        task_done()

    engine._pool.task_done = counted  # type: ignore[method-assign]
    x = leaf([1.0, 2.0])
    future = pargrad.backward_async(Block.apply(x).sum(), create_graph=True, engine=engine)
    future.add_done_callback(lambda f: order.append("callback"))
    assert block.started.wait(WAIT)
    block.release.set()
    engine.shutdown(wait=True)
    assert future.done() and order == ["callback", "task done"]
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])
    assert engine._pool._helpers and not any(t.is_alive() for t in engine._pool._helpers)


@pytest.mark.timeout(3 * WAIT)
def test_shutdown_waiting_from_a_done_callback_raises(block: type[Block]) -> None:
    engine = pargrad.ThreadedEngine(workers=1)
    errors: list[BaseException] = []
    called = threading.Event()

    def shut(f: Any) -> None:
        try:
            engine.shutdown(wait=True)
        except RuntimeError as exc:
            errors.append(exc)
        engine.shutdown(wait=False)  # allowed: it does not wait
        called.set()

    future = pargrad.backward_async(Block.apply(leaf([1.0])).sum(), engine=engine)
    assert block.started.wait(WAIT)  # the callback runs on the worker
    future.add_done_callback(shut)
    block.release.set()
    assert called.wait(WAIT)
    assert len(errors) == 1 and "done-callback" in str(errors[0])
    engine.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        pargrad.backward_async((leaf([1.0]) * 2).sum(), engine=engine)


@pytest.mark.timeout(3 * WAIT)
def test_async_waits_nested_in_nodes_hand_off_past_the_depth_limit() -> None:
    from pargrad.engine.threaded import MAX_REENTRANT_DEPTH

    levels = 5 * MAX_REENTRANT_DEPTH  # deeper than one thread's stack allows

    with pargrad.ThreadedEngine(workers=1) as engine:
        class Nest(pargrad.Function):
            @staticmethod
            def forward(ctx: Any, t: Tensor, n: int) -> np.ndarray:
                ctx.n = n
                return t.data * 2.0

            @staticmethod
            def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
                if ctx.n > 0:
                    z = leaf([1.0])
                    with pargrad.enable_grad():
                        out = Nest.apply(z, ctx.n - 1).sum()
                    (inner,) = pargrad.grad_async(out, [z], engine=engine).result(timeout=WAIT)
                    assert inner.data.tolist() == [2.0]
                return g * 2.0, None

        x = leaf([1.0])
        (got,) = pargrad.grad_async(Nest.apply(x, levels).sum(), [x],
                                    engine=engine).result(timeout=WAIT)
        assert got.data.tolist() == [2.0]


@pytest.mark.timeout(3 * WAIT)
def test_a_cancelled_futures_callback_may_wait_for_it(threaded: pargrad.ThreadedEngine,
                                                      block: type[Block]) -> None:
    future = pargrad.backward_async(Block.apply(leaf([1.0])).sum(), engine=threaded)
    assert block.started.wait(WAIT)
    seen: list[int] = []
    called = threading.Event()

    def waits(f: Any) -> None:
        seen.append(len(concurrent.futures.wait([f], timeout=WAIT).done))
        called.set()

    future.add_done_callback(waits)
    release_once_cancelled(future, block)
    assert future.cancel()
    assert called.wait(2 * WAIT) and seen == [1]


class Slow(pargrad.Function):
    """Identity whose backward lets ``seconds`` pass: the clock is what is tested."""

    seconds = 0.0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        time.sleep(Slow.seconds)
        return g


def test_result_timeout_returns_after_at_most_one_node(block: type[Block]) -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        blocked = pargrad.backward_async(Block.apply(leaf([1.0])).sum(), engine=engine)
        assert block.started.wait(WAIT)  # the one worker is stuck
        Count.runs = 0
        y = leaf([1.0])
        h = y
        for _ in range(20):
            h = Count.apply(h)
        timeout = 0.01
        Slow.seconds = 5 * timeout  # the deadline has passed once it returns
        other = pargrad.backward_async(Slow.apply(h).sum(), engine=engine)  # 23 nodes
        with pytest.raises(concurrent.futures.TimeoutError):
            blocked.result(timeout=timeout)  # helps: takes other's root, runs Slow
        assert Count.runs == 0 and not other.done()  # the rest went back on the queue
        block.release.set()
        assert other.result(timeout=WAIT) is None and blocked.result(timeout=WAIT) is None
        assert Count.runs == 20 and y.grad.data.tolist() == [1.0]


# ----- minor cases -----

def test_cancel_racing_a_failure_reports_one_outcome() -> None:
    rng = random.Random(0)

    class Fails(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> np.ndarray:
            return t.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            for _ in range(rng.randrange(3000)):
                pass
            raise ValueError("boom")

    for engine in (pargrad.ThreadedEngine(workers=1),
                   pargrad.ThreadedEngine(workers=4, handoff_threshold=2)):
        with engine:
            for _ in range(50):
                ps = [leaf(np.ones(4) * k) for k in range(4)]
                ps[0].register_post_accumulate_grad_hook(lambda t: None)
                ps[0].grad = pargrad.tensor(np.full(4, 5.0))
                loss = sum(((p * p).sum() for p in ps[1:]), (ps[0] * 3).sum())
                future = pargrad.backward_async(loss + Fails.apply(ps[1]).sum(),
                                                engine=engine)
                for _ in range(rng.randrange(3000)):
                    pass
                cancelled = future.cancel()
                assert future.done() and future.cancelled() == cancelled
                if not cancelled:
                    assert isinstance(future.exception(), pargrad.BackwardError)
                np.testing.assert_array_equal(ps[0].grad.data, np.full(4, 5.0))
                assert all(p.grad is None for p in ps[1:])


def test_a_thread_blocked_in_result_sees_the_cancel(threaded: pargrad.ThreadedEngine,
                                                    block: type[Block]) -> None:
    future = pargrad.backward_async(Block.apply(leaf([1.0])).sum(), engine=threaded)
    assert block.started.wait(WAIT)
    got: list[BaseException] = []

    def wait_for_it() -> None:
        try:
            future.result(timeout=WAIT)
        except BaseException as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    release_once_cancelled(future, block)
    assert future.cancel()
    waiter.join(WAIT)
    assert not waiter.is_alive()
    assert len(got) == 1 and isinstance(got[0], concurrent.futures.CancelledError)


def test_a_graph_on_another_device_finishes_with_nobody_waiting() -> None:
    with pargrad.ThreadedEngine(workers={"cpu": 1, "cpu:1": 1}) as engine:
        x = pargrad.tensor([1.0, 2.0], requires_grad=True, device="cpu:1")
        future = pargrad.backward_async((x * x).sum(), engine=engine)
        assert concurrent.futures.wait([future], timeout=WAIT).done == {future}
        np.testing.assert_array_equal(x.grad.data, [2.0, 4.0])


def test_done_callbacks_run_outside_the_backwards_modes(threaded: pargrad.ThreadedEngine,
                                                       block: type[Block]) -> None:
    seen: list[Any] = []
    called = threading.Event()
    with pargrad.detect_anomaly():
        future = pargrad.backward_async(Block.apply(leaf([1.0])).sum(), engine=threaded)
    assert block.started.wait(WAIT)  # the callback runs on an engine thread
    future.add_done_callback(lambda f: (seen.append((
        pargrad.is_grad_enabled(), pargrad.is_anomaly_enabled(),
        pargrad.current_engine() is threaded)), called.set()))
    block.release.set()
    assert called.wait(WAIT)
    assert seen == [(True, False, False)]


class _NoWork:
    """A future's work that is over at once (the future is resolved by hand)."""

    def cancel(self) -> bool:
        return True

    def inside(self) -> bool:
        return False

    def wait(self, timeout: float | None) -> None:
        pass


def _resolve_while_threads_add_callbacks(outcome: str) -> None:
    future: pargrad.BackwardFuture[int] = pargrad.BackwardFuture(_NoWork())
    lock = threading.Lock()
    calls: list[tuple[int, bool]] = []
    start = threading.Barrier(5)

    def add(k: int) -> None:
        start.wait(WAIT)
        for j in range(50):
            def callback(f: Any, key: int = 100 * k + j) -> None:
                with lock:
                    calls.append((key, f.done()))
            future.add_done_callback(callback)

    threads = [threading.Thread(target=add, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    start.wait(WAIT)
    if outcome == "result":
        future.set_result(7)
    elif outcome == "error":
        future.set_exception(ValueError("failed"))
    else:
        future._set_cancelled()
        future._set_cancelled()  # a second call changes nothing
    for t in threads:
        t.join(WAIT)
    assert sorted(calls) == sorted((100 * k + j, True) for k in range(4) for j in range(50))
    on_this_thread: list[str] = []
    future.add_done_callback(lambda f: on_this_thread.append(threading.current_thread().name))
    assert on_this_thread == [threading.current_thread().name]
    assert future.cancelled() == (outcome == "cancelled")
    assert concurrent.futures.wait([future], timeout=WAIT).done == {future}


@pytest.mark.parametrize("outcome", ["result", "error", "cancelled"])
def test_callbacks_added_while_the_future_resolves_run_once_each(outcome: str) -> None:
    """Threads add done-callbacks while another resolves the future: every callback runs
    exactly once, after the future is done (before or after it resolved), and a
    callback added afterwards runs at once on the thread that adds it."""
    for _ in range(20):
        _resolve_while_threads_add_callbacks(outcome)
