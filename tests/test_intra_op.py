"""Intra-op parallelism (pargrad/parallel.py): a large elementwise call cut into chunks
that idle engine threads help with gives bitwise the unchunked result, forward and
backward, on every engine; chunks reach idle threads only; errors and interrupts of a
chunked call behave as the unchunked call's.

The thresholds are lowered (``small_chunks``) so that small arrays straddle them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pargrad
from pargrad import memory, parallel
from pargrad.engine.ready_queue import ReadyQueue
from pargrad.ops import fused, large
from pargrad.ops.core import defop

MIN, CHUNK = 48, 16

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture],
                      deadline=None, max_examples=40)


class CountedJob(parallel.Job):
    """A Job that counts the chunked calls (so a test knows the cut happened)."""

    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CountedJob.made += 1
        super().__init__(*args, **kwargs)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small thresholds: for cutting (the costly calls and, with a thread idle, the
    streaming rules), for the rules' one-buffer forms, and for the pool (so that a
    chunk's rule makes its result in its slice of the output, ``memory.into``)."""
    previous = parallel.set_thresholds(MIN, CHUNK)
    monkeypatch.setattr(parallel, "Job", CountedJob)
    monkeypatch.setattr(parallel, "STREAMING_MIN", MIN)
    monkeypatch.setattr(large, "OUT_MIN", 1)
    monkeypatch.setattr(memory, "MIN_BYTES", 8)
    try:
        yield
    finally:
        parallel.set_thresholds(*previous)


def wait_idle(engine: pargrad.ThreadedEngine, count: int = 1) -> None:
    """Until ``count`` of the engine's cpu threads wait for work (so an offer reaches
    them)."""
    queue = engine._pool.queue(pargrad.device("cpu"))
    deadline = time.monotonic() + 10
    while queue._waiting < count:
        assert time.monotonic() < deadline, "the workers never became idle"
        time.sleep(0.001)


def forward_beside_an_idle_worker(engine: pargrad.ThreadedEngine, op: Any) -> None:
    """Run ``op`` (which doubles) on 20 chunks' worth under ``engine`` once its one worker
    waits for work, and check the result."""
    engine.intra_op_helpers()  # starts the worker
    wait_idle(engine)
    x = np.arange(20 * CHUNK, dtype=np.float64)
    with pargrad.use_engine(engine):
        out = op(pargrad.tensor(x))
    np.testing.assert_array_equal(out.data, x * 2.0)


# ----- the results: bitwise the unchunked ones -----

UNARY = ["tanh", "sigmoid", "exp", "log1p", "sqrt", "square", "sin", "cos", "relu",
         "abs", "softplus", "expm1", "negative"]
BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "power"]


def chain(x: Any, y: Any, steps: list[tuple[str, int]]) -> Any:
    """A chain of elementwise ops on ``x`` (and ``y``, the same shape, or a broadcast
    row), kept in a numerically tame range."""
    h = x
    for name, k in steps:
        if name in ("log1p", "sqrt"):
            h = getattr(pargrad, name)(pargrad.abs(h) + 0.25)
        elif name in UNARY:
            h = getattr(pargrad, name)(h * 0.5 if name in ("exp", "expm1", "square") else h)
        else:
            other = y if k % 2 else 1.5
            if name == "power":
                h = pargrad.power(pargrad.abs(h) + 0.5, 1.5 if k % 3 else other * 0 + 2.0)
            elif name == "divide":
                h = pargrad.divide(h, pargrad.abs(other) + 1.0)
            else:
                h = getattr(pargrad, name)(h, other)
        h = pargrad.tanh(h)  # bounded for the next step
    return h


step = st.tuples(st.sampled_from(UNARY + BINARY), st.integers(0, 5))


def run(engine: pargrad.Engine, x0: np.ndarray, y0: np.ndarray,
        steps: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = pargrad.tensor(x0, requires_grad=True)
    y = pargrad.tensor(y0, requires_grad=True)
    with pargrad.use_engine(engine):  # the forward's chunks too
        out = chain(x, y, steps)
        loss = (out * out).sum() + y.sum()
    loss.backward(engine=engine)
    assert x.grad is not None and y.grad is not None
    return out.data, x.grad.data, y.grad.data


@pytest.mark.timeout(300)
@fixture_ok
@given(size=st.integers(1, 5 * CHUNK + 3), rows=st.integers(1, 3),
       broadcast=st.booleans(), steps=st.lists(step, min_size=1, max_size=6),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 2**16))
def test_chunked_equals_unchunked_bitwise(small_chunks: None, size: int, rows: int,
                                          broadcast: bool, steps: list[tuple[str, int]],
                                          dtype: type, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((rows, size)).astype(dtype)
    y0 = rng.standard_normal((1 if broadcast else rows, size)).astype(dtype)
    made = CountedJob.made
    reference = run(pargrad.SequentialEngine(), x0, y0, steps)
    assert CountedJob.made == made  # the reference engine cuts nothing
    for engine in ENGINES:
        got = run(engine, x0, y0, steps)
        for want, have in zip(reference, got):
            assert have.dtype == want.dtype
            if engine is ARRIVAL_ORDER:  # hands nodes off: sums y's gradients as they come
                np.testing.assert_allclose(have, want, rtol=1e-5 if dtype is np.float32
                                           else 1e-12, strict=True)
            else:
                np.testing.assert_array_equal(have, want, strict=True)
    if rows * size > max(MIN, CHUNK):  # cut by the threaded engines with intra_op on
        assert CountedJob.made > made


ARRIVAL_ORDER = pargrad.ThreadedEngine(workers=2, handoff_threshold=0)
"""The one engine that hands these small nodes to other threads and is not deterministic:
it agrees with the reference to rounding (docs/design.md §4), cut or not; every other
one runs the reference's order, so bitwise."""
ENGINES = [pargrad.ThreadedEngine(workers=1), pargrad.ThreadedEngine(workers=2),
           pargrad.ThreadedEngine(workers=2, deterministic=True),
           pargrad.ThreadedEngine(workers=2, handoff_threshold=0, deterministic=True),
           ARRIVAL_ORDER, pargrad.ThreadedEngine(workers=1, intra_op=False)]


def test_the_reference_engine_never_offers_chunks() -> None:
    assert pargrad.SequentialEngine().intra_op_helpers() is None
    assert pargrad.ThreadedEngine(intra_op=False).intra_op_helpers() is None


# ----- chunks go to idle threads, and only to them -----

def recording_op(threads: set[str], pause: float = 0.0) -> Any:
    """An elementwise op whose forward records the threads that ran its chunks."""
    def forward(x: np.ndarray) -> np.ndarray:
        threads.add(threading.current_thread().name)
        time.sleep(pause)
        return x * 2.0
    return defop("recorded", forward, lambda g, ans, x: g * 2.0, cut=("forward", 0))


@pytest.mark.timeout(60)
def test_idle_workers_help_with_chunks(small_chunks: None) -> None:
    threads: set[str] = set()
    op = recording_op(threads, pause=0.02)
    with pargrad.ThreadedEngine(workers=1) as engine:
        forward_beside_an_idle_worker(engine, op)
    assert threading.current_thread().name in threads
    assert any(name.startswith("pargrad-cpu-") for name in threads), threads


@pytest.mark.timeout(60)
def test_no_engine_threads_without_intra_op(small_chunks: None) -> None:
    threads: set[str] = set()
    op = recording_op(threads)
    for engine in (pargrad.ThreadedEngine(workers=1, intra_op=False), pargrad.SequentialEngine()):
        with pargrad.use_engine(engine):
            out = op(pargrad.tensor(np.ones(20 * CHUNK)))
        np.testing.assert_array_equal(out.data, 2.0)
    assert threads == {threading.current_thread().name}


def test_offer_reaches_only_waiting_threads() -> None:
    queue: ReadyQueue[str] = ReadyQueue()
    job = parallel.Job(lambda i: None, 4)
    assert queue.offer(job, 3) == 0  # nobody waits: nothing is queued for later
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(queue.get()))
    waiter.start()
    deadline = time.monotonic() + 10
    while queue._waiting < 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert queue.offer(job, 3) == 1  # one thread waits: one offer
    waiter.join(10)
    assert got == [job]
    queue.put("work", 0, 1)
    assert queue.offer(job, 3) == 0  # work is queued: the next get takes it, not a job
    assert queue.get() == "work"


# ----- when a call is not cut -----

@pytest.fixture
def helped() -> Iterator[None]:
    """A ThreadedEngine current (whose workers could help), whatever the default."""
    with pargrad.ThreadedEngine(workers=1) as engine, pargrad.use_engine(engine):
        yield


def test_what_is_not_cut(small_chunks: None, helped: None) -> None:
    double = lambda a, b: a * b
    big = np.ones(4 * CHUNK)
    assert parallel.elementwise(double, (big, 2.0), {}) is not None
    assert parallel.elementwise(double, (np.ones(MIN - 1), 2.0), {}) is None  # small
    assert parallel.elementwise(double, (big.reshape(4, CHUNK), np.ones(CHUNK)), {}) is None
    assert parallel.elementwise(double, (big[::2].repeat(2)[::2], 2.0), {}) is None
    assert parallel.elementwise(lambda a: a, (big,), {}) is None  # a view: no copy made
    assert parallel.elementwise(double, (2.0, 3.0), {}) is None  # no array


def test_a_chunk_error_is_raised_once_no_chunk_runs(small_chunks: None, helped: None) -> None:
    calls: list[int] = []

    def fn(a: np.ndarray) -> np.ndarray:
        calls.append(int(a[0]) // CHUNK)
        if a[0] == 2 * CHUNK:  # the third chunk, whichever thread runs it
            raise ValueError("chunk three")
        return a + 1

    with pytest.raises(ValueError, match="chunk three"):
        parallel.elementwise(fn, (np.arange(10.0 * CHUNK),), {})
    assert 2 in calls and len(calls) <= 10


def test_the_chunks_after_an_error_are_skipped() -> None:
    ran: list[int] = []

    def run(i: int) -> None:
        ran.append(i)
        if i == 2:
            raise ValueError("chunk three")

    job = parallel.Job(run, 10)
    with pytest.raises(ValueError, match="chunk three"):
        job.run_here(lambda job, count: 0, 9)  # nobody helps: the order is the holder's
    assert ran == [0, 1, 2]
    assert job.finished


@pytest.mark.timeout(60)
def test_a_failing_chunked_rule_fails_the_backward_and_names_its_node(small_chunks: None) -> None:
    def rule(g: np.ndarray, ans: np.ndarray, x: np.ndarray) -> np.ndarray:
        if g.size <= CHUNK and g[0] >= 3 * CHUNK:  # a chunk past the first ones
            raise FloatingPointError("bad chunk")
        return g * 2.0

    op = defop("fragile", lambda x: x * 2.0, rule, cut=("forward", 0))
    for engine in ENGINES[:3]:
        x = pargrad.tensor(np.zeros(8 * CHUNK), requires_grad=True)
        y = op(x)
        g = np.arange(8 * CHUNK, dtype=np.float64)
        with pytest.raises(pargrad.BackwardError, match="FragileBackward") as info:
            y.backward(g, engine=engine)
        assert isinstance(info.value.__cause__, FloatingPointError)
        assert x.grad is None


@pytest.mark.timeout(60)
def test_chunked_backward_on_a_deep_chain_keeps_the_workers_alive(small_chunks: None) -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        for _ in range(3):
            x = pargrad.tensor(np.linspace(-1, 1, 6 * CHUNK), requires_grad=True)
            h = x
            for _ in range(10):
                h = pargrad.tanh(h) * 1.1
            h.sum().backward(engine=engine)
            assert x.grad is not None
        assert all(t.is_alive() for t in engine.threads())


@pytest.mark.timeout(120)
@pytest.mark.skipif(not fused.available(), reason="numba is not installed")
@pytest.mark.parametrize("name", ["tanh_backward", "sigmoid_backward", "relu_backward"])
def test_fused_kernels_in_chunks_write_the_same_bits(
        name: str, small_chunks: None, helped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    g, other = rng.standard_normal(7 * CHUNK + 5), rng.standard_normal(7 * CHUNK + 5)
    whole = fused.elementwise(name, g, other)  # STREAMING_MIN is far above this size
    assert whole is not None
    made = CountedJob.made
    monkeypatch.setattr(fused, "STREAMING_MIN", MIN)
    cut = fused.elementwise(name, g, other)
    assert CountedJob.made == made + 1
    assert cut is not None
    np.testing.assert_array_equal(cut, whole, strict=True)


# ----- what a chunk inherits from the call, and what is never cut -----

@pytest.mark.timeout(60)
def test_helpers_run_chunks_under_the_callers_numpy_error_state(
        small_chunks: None, helped: None) -> None:
    x = np.ones(40 * CHUNK)
    x[CHUNK::CHUNK] = 0.0  # a zero in every chunk but the first: whoever runs it divides
    for _ in range(5):
        with np.errstate(divide="raise"), pytest.raises(FloatingPointError):
            pargrad.log(pargrad.tensor(x))
        with np.errstate(divide="ignore"):
            out = pargrad.log(pargrad.tensor(x))
        assert np.isneginf(out.data[CHUNK])


def test_array_subclasses_and_array_likes_are_not_cut(small_chunks: None, helped: None) -> None:
    double = lambda a, b: a * b
    big = np.ones(4 * CHUNK)
    assert parallel.elementwise(double, (np.ma.array(big), 2.0), {}) is None
    assert parallel.elementwise(double, (big, np.ma.array(big)), {}) is None
    assert parallel.elementwise(double, (big, [2.0] * big.size), {}) is None
    assert parallel.elementwise(double, (big, np.float32(2.0)), {}) is not None
    y = np.ma.array(np.full(4 * CHUNK, 2.0))
    out = pargrad.power(pargrad.tensor(np.full(4 * CHUNK, 2.0)), y)  # a chunk would fail
    np.testing.assert_array_equal(out.data, 4.0)


@pytest.mark.timeout(60)
def test_a_shut_down_engine_starts_no_threads_for_chunks(small_chunks: None) -> None:
    engine = pargrad.ThreadedEngine(workers=1)
    engine.shutdown()
    assert engine.intra_op_helpers() is None
    with pargrad.use_engine(engine):
        pargrad.exp(pargrad.tensor(np.ones(8 * CHUNK)))
    assert engine.threads() == []


def test_an_offer_nobody_took_is_dropped_once_its_call_is_over() -> None:
    queue: ReadyQueue[str] = ReadyQueue()
    done = parallel.Job(lambda i: None, 0)
    done.run_here(lambda job, count: 0, 0)
    assert done.finished
    queue._offers.append(done)  # as a waiter that found its stop set would leave it
    assert queue.offer(parallel.Job(lambda i: None, 2), 1) == 0  # nobody waits
    assert not queue._offers


# ----- what helping costs is seen: statistics and trace -----

WAIT = 30  # seconds: a generous bound on anything these tests wait for


def chunk_threads_op(threads: list[str], pause: float = 0.02,
                     first: Any = None) -> Any:
    """An elementwise op whose forward and rule (both cut) append, per call, the thread
    that made it, and pause; ``first()``, if given, runs at the end of the rule's first
    call (the holder's first chunk, before the call is offered to anyone)."""
    def forward(x: np.ndarray) -> np.ndarray:
        threads.append(threading.current_thread().name)
        time.sleep(pause)
        return x * 2.0

    def rule(g: np.ndarray, ans: np.ndarray, x: np.ndarray) -> np.ndarray:
        threads.append(threading.current_thread().name)
        time.sleep(pause)
        if first is not None and len(threads) == 1:
            first()
        return g * 2.0

    return defop("chunked", forward, rule, cut=("forward", 0))


def helped_by(threads: list[str], holder: str) -> dict[str, int]:
    """How many chunks each thread other than ``holder`` ran, by name."""
    counts: dict[str, int] = {}
    for name in threads:
        if name != holder:
            counts[name] = counts.get(name, 0) + 1
    return counts


def check_seen(engine: pargrad.ThreadedEngine, helpers: dict[str, int]) -> None:
    """The engine's statistics and trace show exactly the chunks ``helpers`` ran."""
    stats = engine.statistics()
    assert dict(stats.chunks_helped_per_thread) == helpers
    assert stats.chunks_helped == sum(helpers.values()) > 0
    assert stats.helping_seconds > 0
    assert engine.trace is not None
    spans = engine.trace.helping()
    assert sorted(s.thread for s in spans) == sorted(
        name for name, count in helpers.items() for _ in range(count))
    assert all(s.start <= s.end for s in spans)
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    slices = [e for e in engine.trace.chrome_trace()["traceEvents"]
              if e["ph"] == "X" and e["cat"] == "intra-op"]
    assert len(slices) == stats.chunks_helped and {e["name"] for e in slices} == {"help"}


@pytest.mark.timeout(60)
def test_chunks_an_idle_worker_ran_in_a_forward_are_counted_and_traced(
        small_chunks: None) -> None:
    threads: list[str] = []
    op = chunk_threads_op(threads)
    with pargrad.ThreadedEngine(workers=1, trace=True) as engine:
        forward_beside_an_idle_worker(engine, op)
        helpers = helped_by(threads, threading.current_thread().name)
        assert set(helpers) == {"pargrad-cpu-0"}  # the worker helped (and no one else)
        check_seen(engine, helpers)
        assert engine.statistics().nodes == 0  # a forward: no node ran
        engine.trace.clear()
        assert engine.trace.helping() == []


@pytest.mark.timeout(60)
def test_chunks_an_idle_worker_ran_in_a_backward_are_counted_and_traced(
        small_chunks: None) -> None:
    threads: list[str] = []
    op = chunk_threads_op(threads)
    with pargrad.ThreadedEngine(workers=1, trace=True) as engine:
        x = pargrad.tensor(np.ones(20 * CHUNK), requires_grad=True)
        with pargrad.use_engine(pargrad.SequentialEngine()):  # the forward is not cut
            y = op(x)
        assert threads == [threading.current_thread().name]
        threads.clear()
        engine.intra_op_helpers()
        wait_idle(engine)
        y.backward(np.ones(20 * CHUNK), engine=engine)
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.data, 2.0)
        helpers = helped_by(threads, threading.current_thread().name)
        assert set(helpers) == {"pargrad-cpu-0"}
        check_seen(engine, helpers)
        assert engine.statistics().nodes == 1
        nodes = engine.trace.events()
        assert [e.node for e in nodes] == ["ChunkedBackward"]
        assert all(nodes[0].start <= s.start <= s.end <= nodes[0].end
                   for s in engine.trace.helping())  # within the node they helped


@pytest.mark.timeout(60)
def test_a_thread_waiting_in_result_counts_the_chunks_it_helps_with(
        small_chunks: None) -> None:
    with pargrad.ThreadedEngine(workers=1, trace=True) as engine:
        queue = engine._pool.queue(pargrad.device("cpu"))

        def until_this_thread_waits() -> None:  # the holder is the worker
            deadline = time.monotonic() + WAIT
            while queue._waiting < 1:
                assert time.monotonic() < deadline, "result() never waited"
                time.sleep(0.001)

        threads: list[str] = []
        op = chunk_threads_op(threads, first=until_this_thread_waits)
        x = pargrad.tensor(np.ones(20 * CHUNK), requires_grad=True)
        with pargrad.use_engine(pargrad.SequentialEngine()):  # the forward is not cut
            y = op(x)
        threads.clear()
        future = pargrad.backward_async(y, np.ones(20 * CHUNK), engine=engine)
        deadline = time.monotonic() + WAIT
        while not threads:  # the worker took the root: it holds the call
            assert time.monotonic() < deadline, "the worker never ran the node"
            time.sleep(0.001)
        assert future.result(timeout=WAIT) is None  # waits, and helps: offered to it
        assert threads[0] == "pargrad-cpu-0"
        helpers = helped_by(threads, "pargrad-cpu-0")
        assert set(helpers) == {threading.current_thread().name}
        check_seen(engine, helpers)


@pytest.mark.timeout(60)
def test_nothing_is_counted_as_helped_where_nobody_helps(small_chunks: None) -> None:
    threads: list[str] = []
    op = chunk_threads_op(threads, pause=0.0)
    with pargrad.ThreadedEngine(workers=1, trace=True, intra_op=False) as engine:
        x = pargrad.tensor(np.ones(20 * CHUNK), requires_grad=True)
        with pargrad.use_engine(engine):
            y = op(x)
        y.backward(np.ones(20 * CHUNK), engine=engine)
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.data, 2.0)
        stats = engine.statistics()
        assert stats.nodes == 1
        assert stats.chunks_helped == 0 and dict(stats.chunks_helped_per_thread) == {}
        assert stats.helping_seconds == 0.0
        assert engine.trace is not None and engine.trace.helping() == []
    assert set(threads) == {threading.current_thread().name}  # nothing was cut
    with pargrad.ThreadedEngine(workers=1, trace=True) as engine:  # a call too small to cut
        engine.intra_op_helpers()
        wait_idle(engine)
        x = pargrad.tensor(np.ones(MIN - 1), requires_grad=True)
        with pargrad.use_engine(engine):
            y = op(x)
        y.backward(np.ones(MIN - 1), engine=engine)
        assert engine.statistics().chunks_helped == 0
        assert engine.trace is not None and engine.trace.helping() == []


# ----- rules that only stream memory -----
class FakeHelpers:
    """Helpers with ``idle`` threads, none of which ever takes an offer."""

    def __init__(self, idle: int) -> None:
        self._idle = idle
        self.offers = 0

    def offer(self, job: parallel.Job, count: int) -> int:
        self.offers += 1
        return 0

    def idle(self) -> int:
        return self._idle


def test_a_streaming_call_is_cut_only_while_a_thread_is_idle_and_from_its_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "STREAMING_MIN", 6 * 64)
    previous = parallel.set_thresholds(4 * 64, 64)
    try:
        x = np.linspace(-1, 1, 8 * 64)
        for idle, streaming, size, cut in [(0, True, 8, False), (1, True, 8, True),
                                           (1, True, 5, False), (0, False, 8, True)]:
            helpers = FakeHelpers(idle)
            monkeypatch.setattr(parallel, "_helpers_finder", lambda h=helpers: h)
            got = parallel.elementwise(np.tanh, (x[:size * 64],), {}, streaming=streaming)
            assert (got is not None) is cut, (idle, streaming, size)
            assert helpers.offers == int(cut)
            if got is not None:
                assert got.tobytes() == np.tanh(x[:size * 64]).tobytes()
    finally:
        parallel.set_thresholds(*previous)


def test_a_chunk_makes_its_result_in_its_slice_of_the_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that takes its result from ``memory.empty`` writes it straight into the
    call's output (no copy); any other result is copied there; both give the whole
    call's bits."""
    monkeypatch.setattr(parallel, "_helpers_finder", lambda: FakeHelpers(1))
    monkeypatch.setattr(parallel, "STREAMING_MIN", 4 * 64)
    previous = parallel.set_thresholds(4 * 64, 64)
    outputs: list[np.ndarray] = []

    def in_place(g: np.ndarray, y: np.ndarray) -> np.ndarray:
        out = memory.empty(g.shape, g.dtype)
        outputs.append(out)
        np.multiply(y, y, out=out)
        np.subtract(1.0, out, out=out)
        return np.multiply(g, out, out=out)

    def fresh(g: np.ndarray, y: np.ndarray) -> np.ndarray:
        return g * (1.0 - y * y)

    try:
        g, y = np.linspace(-1, 1, 10 * 64), np.linspace(0.5, -0.5, 10 * 64)
        whole = fresh(g, y)
        for rule in (in_place, fresh):
            outputs.clear()
            got = parallel.elementwise(rule, (g, y), {}, streaming=True)
            assert got is not None and got.tobytes() == whole.tobytes()
        got = parallel.elementwise(in_place, (g, y), {}, streaming=True)
        assert got is not None
        # Chunk 0 tells the output's dtype; every later chunk's result is its slice.
        assert all(np.shares_memory(o, got) for o in outputs[1:]) and len(outputs) == 10
        assert memory.empty((3,)).shape == (3,)  # the slice is not handed out again
    finally:
        parallel.set_thresholds(*previous)


def test_into_hands_out_its_target_once_and_only_for_its_shape_and_dtype() -> None:
    target = np.empty((4, 5))
    memory.into(target)
    try:
        assert memory.empty((4, 5), np.float32) is not target
        assert memory.empty((5, 4)) is not target
        assert memory.empty((4, 5)) is target
        assert memory.empty((4, 5)) is not target
    finally:
        memory.into(None)


def test_a_failing_chunk_leaves_no_target_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "_helpers_finder", lambda: FakeHelpers(1))
    previous = parallel.set_thresholds(4 * 64, 64)
    calls = []

    def rule(g: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("chunk 2")
        return g * 2.0

    try:
        with pytest.raises(ValueError, match="chunk 2"):
            parallel.elementwise(rule, (np.ones(8 * 64),), {})
        assert getattr(memory._local, "target", None) is None
    finally:
        parallel.set_thresholds(*previous)


def test_a_negative_idle_count_cuts_no_streaming_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "_helpers_finder", lambda: FakeHelpers(-1))
    monkeypatch.setattr(parallel, "STREAMING_MIN", 64)
    previous = parallel.set_thresholds(4 * 64, 64)
    try:
        assert parallel.elementwise(np.tanh, (np.ones(8 * 64),), {}, streaming=True) is None
    finally:
        parallel.set_thresholds(*previous)
