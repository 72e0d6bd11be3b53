"""ThreadedEngine(memory_budget=bytes): the gradients handed to other threads at once stay
within the budget, also when a thread waiting in result(timeout) hands back what it kept;
0 hands nothing off and peaks as the reference does; the gradients are the reference's
whatever the budget."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad.engine.graph_task import GraphTask

N = 4096  # elements per branch array: 32 KiB of float64


def wide(width: int = 6, depth: int = 3, seed: int = 0) -> tuple[list[Any], Any]:
    rng = np.random.default_rng(seed)
    leaves = [pargrad.tensor(rng.standard_normal(N), requires_grad=True) for _ in range(width)]
    parts = []
    for leaf in leaves:
        h = leaf
        for _ in range(depth):
            h = pargrad.tanh(h) * 1.1
        parts.append(h)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return leaves, (total * total).sum()


def grads(engine: pargrad.Engine) -> list[np.ndarray]:
    leaves, loss = wide()
    loss.backward(engine=engine)
    return [leaf.grad.data for leaf in leaves]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [0, N * 8, 3 * N * 8, None])
def test_gradients_are_the_references_whatever_the_budget(budget: int | None) -> None:
    want = grads(pargrad.SequentialEngine())
    for deterministic in (False, True):
        with pargrad.ThreadedEngine(workers=2, handoff_threshold=0, memory_budget=budget,
                                    deterministic=deterministic) as engine:
            got = grads(engine)
        for w, g in zip(want, got):
            if deterministic:
                np.testing.assert_array_equal(g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-12)


@pytest.mark.timeout(120)
def test_a_budget_of_zero_hands_nothing_off() -> None:
    with pargrad.ThreadedEngine(workers=2, handoff_threshold=0, memory_budget=0) as engine:
        grads(engine)
        assert engine.statistics().handed_off == 0
    with pargrad.ThreadedEngine(workers=2, handoff_threshold=0) as engine:
        for _ in range(5):
            grads(engine)
        assert engine.statistics().handed_off > 0  # the graph does hand off without it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [N * 8, 2 * N * 8 + 1])
def test_handed_off_gradients_stay_within_the_budget(
        budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    most = [0]
    admitted = [0]
    admit = GraphTask.admit

    def watched(self: GraphTask, nbytes: int) -> bool:
        ok = admit(self, nbytes)
        with self._lock:
            most[0] = max(most[0], self._handed)
        admitted[0] += ok
        return ok

    monkeypatch.setattr(GraphTask, "admit", watched)
    with pargrad.ThreadedEngine(workers=2, handoff_threshold=0, memory_budget=budget) as engine:
        for _ in range(5):
            grads(engine)
    assert 0 < most[0] <= budget
    assert admitted[0] > 0


def peak(engine: pargrad.Engine) -> int:
    _leaves, loss = wide(width=8, depth=4)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        loss.backward(engine=engine)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(120)
def test_a_budget_of_zero_peaks_as_the_reference() -> None:
    reference = peak(pargrad.SequentialEngine())
    with pargrad.ThreadedEngine(workers=2, handoff_threshold=0, memory_budget=0) as engine:
        budgeted = peak(engine)
    assert budgeted <= 1.05 * reference


def test_the_budget_is_checked() -> None:
    with pytest.raises(ValueError, match="memory_budget must be an integer >= 0"):
        pargrad.ThreadedEngine(memory_budget=-1)
    with pytest.raises(ValueError, match="memory_budget"):
        pargrad.ThreadedEngine(memory_budget=1.5)  # type: ignore[arg-type]


def test_a_budget_of_zero_admits_not_even_an_empty_hand_off() -> None:
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    y = (x * 2).sum()
    engine = pargrad.ThreadedEngine(workers=1, memory_budget=0)
    task = GraphTask(pargrad.BackwardRequest([y._edge()], [np.float64(1.0)]),
                     deterministic=False, depth=0, memory_budget=0, engine=engine,
                     on_done=lambda task: None)
    assert not task.admit(0)
    budgeted = GraphTask(pargrad.BackwardRequest([y._edge()], [np.float64(1.0)]),
                         deterministic=False, depth=0, memory_budget=8, engine=engine,
                         on_done=lambda task: None)
    assert budgeted.admit(8) and not budgeted.admit(1)
    budgeted.release(8)
    assert budgeted.admit(1)
    engine.shutdown()


# ----- result(timeout): what a waiter kept goes back within the budget -----

WAIT = 30  # seconds: a generous bound on anything these tests wait for


class Hold(pargrad.Function):
    """Identity whose backward counts itself in ``started`` and waits for ``release``:
    keeps a worker busy."""

    lock = threading.Lock()
    started = 0
    release = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> pargrad.Tensor:
        with Hold.lock:
            Hold.started += 1
        assert Hold.release.wait(WAIT), "the test never released the node"
        return g


class Spread(pargrad.Function):
    """``a + b + c``, whose backward lets ``seconds`` pass (the deadline of the thread
    running it passes) and then makes the three branches ready at once."""

    seconds = 0.0
    ran_on = ""

    @staticmethod
    def forward(ctx: Any, a: pargrad.Tensor, b: pargrad.Tensor, c: pargrad.Tensor) -> np.ndarray:
        return a.data + b.data + c.data

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[Any, ...]:
        Spread.ran_on = threading.current_thread().name
        time.sleep(Spread.seconds)
        return g * 1.0, g * 1.0, g * 1.0


class Meet(pargrad.Function):
    """Identity whose backward records how many branches run at once (``most``): each
    waits, up to ``patience`` s, for three to be running, so that branches able to run
    at once are seen to."""

    lock = threading.Lock()
    running = 0
    most = 0
    patience = 1.0
    all_in = threading.Condition(lock)

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> pargrad.Tensor:
        with Meet.all_in:
            Meet.running += 1
            Meet.most = max(Meet.most, Meet.running)
            Meet.all_in.notify_all()
            Meet.all_in.wait_for(lambda: Meet.running >= 3, Meet.patience)
            Meet.patience = 0.0 if Meet.running < 3 else Meet.patience  # waited once: enough
            Meet.running -= 1
        return g


def branches_at_once_after_a_timeout(budget: int | None) -> int:
    """How many of three ready branches run at once when the thread that made them
    ready was waiting in ``result(timeout)`` and its deadline passed right then: it
    kept what it could not hand off within ``budget`` and hands it back."""
    Hold.started, Meet.running, Meet.most, Meet.patience = 0, 0, 0, 1.0
    Hold.release.clear()
    with pargrad.ThreadedEngine(workers=3, handoff_threshold=0,
                                memory_budget=budget) as engine:
        held = [pargrad.tensor(np.ones(1), requires_grad=True) for _ in range(3)]
        # One backward each (the roots of one would go to one worker together).
        blocked = [pargrad.backward_async(Hold.apply(h).sum(), engine=engine) for h in held]
        deadline = time.monotonic() + WAIT
        while Hold.started < 3:  # every worker is stuck
            assert time.monotonic() < deadline, "the workers never took the held nodes"
            time.sleep(0.001)
        xs = [pargrad.tensor(np.ones(N), requires_grad=True) for _ in range(3)]
        timeout = 0.5
        Spread.seconds = 2 * timeout  # the deadline has passed once it returns
        loss = Spread.apply(*[Meet.apply(x) for x in xs]).sum()
        other = pargrad.backward_async(loss, engine=engine)
        with pytest.raises(concurrent.futures.TimeoutError):
            blocked[0].result(timeout=timeout)  # helps: takes other's root, runs Spread
        assert Spread.ran_on == threading.current_thread().name
        assert Meet.most == 0 and not other.done()  # the branches went back on the queue
        Hold.release.set()  # three idle workers take what is on the queue
        assert other.result(timeout=WAIT) is None
        assert all(b.result(timeout=WAIT) is None for b in blocked)
    for x in xs:
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.data, 1.0)
    return Meet.most


@pytest.mark.timeout(120)
def test_a_result_timeout_hands_back_what_it_kept_within_the_budget() -> None:
    # One branch's gradient fits the budget: one branch is handed off, the thread that
    # made them ready keeps the other two, and at its deadline hands them on together,
    # to one thread, which runs them one after the other (as the waiter would have).
    assert branches_at_once_after_a_timeout(N * 8) == 2
    # Without a budget all three are handed off, and run at once (the test sees it).
    assert branches_at_once_after_a_timeout(None) == 3


# ----- execute_async: the roots go to one thread within a budget -----

def roots_at_once_async(budget: int | None) -> int:
    """How many of three roots' branches run at once in an asynchronous backward (no
    calling thread runs it: workers take the roots)."""
    Meet.running, Meet.most, Meet.patience = 0, 0, 1.0
    with pargrad.ThreadedEngine(workers=3, handoff_threshold=0,
                                memory_budget=budget) as engine:
        xs = [pargrad.tensor(np.ones(N), requires_grad=True) for _ in range(3)]
        future = pargrad.backward_async([Meet.apply(x).sum() for x in xs], engine=engine)
        assert future.result(timeout=WAIT) is None
    for x in xs:
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.data, 1.0)
    return Meet.most


@pytest.mark.timeout(120)
def test_an_async_backward_hands_its_roots_on_within_the_budget() -> None:
    assert roots_at_once_async(0) == 1  # one thread runs it all, as the reference
    assert roots_at_once_async(N * 8) <= 2  # at most one branch admitted beside it
    assert roots_at_once_async(None) == 3  # without a budget each root has a worker
