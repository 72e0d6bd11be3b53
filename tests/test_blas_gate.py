"""The BLAS gate: the threaded engine runs no more BLAS nodes at once than the cores allow,
and gets the reference's gradients doing so."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import pargrad
from pargrad.devices import available_cores
from pargrad.engine import blas


def test_matmul_nodes_say_they_call_blas() -> None:
    a = pargrad.tensor(np.ones((2, 2)), requires_grad=True)
    assert (a @ a).grad_fn.calls_blas
    assert not (a * a).grad_fn.calls_blas
    assert not pargrad.tanh(a).grad_fn.calls_blas


def test_gate_size_is_cores_over_blas_threads() -> None:
    threads = max(blas.thread_counts(), default=1)
    assert blas.gate_size() == max(1, available_cores() // threads)
    with threadpool_limits(limits=1, user_api="blas"):
        assert blas.gate_size() == available_cores()


@pytest.fixture
def most_in_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The most BLAS nodes that were inside the gate at once (wrapping the real gate)."""
    lock = threading.Lock()
    inside, most = [0], [0]
    enter, leave = blas.enter_gate, blas.leave_gate

    def counting_enter() -> None:
        enter()
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])

    def counting_leave() -> None:
        with lock:
            inside[0] -= 1
        leave()

    monkeypatch.setattr(blas, "enter_gate", counting_enter)
    monkeypatch.setattr(blas, "leave_gate", counting_leave)
    yield most


def wide_matmul_grads(engine: pargrad.Engine, width: int = 8) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = pargrad.tensor(rng.standard_normal((256, 256)), requires_grad=True)
    loss = None
    for _ in range(width):
        h = x
        for _ in range(3):
            h = pargrad.tanh(h @ pargrad.tensor(rng.standard_normal((256, 256)) / 10,
                                                requires_grad=True))
        loss = h.sum() if loss is None else loss + h.sum()
    assert loss is not None
    loss.backward(engine=engine)
    assert x.grad is not None
    return x.grad.data


@pytest.mark.parametrize("blas_threads", [None, 1], ids=["default-blas", "blas-1"])
def test_no_more_blas_nodes_at_once_than_the_gate_allows(
        most_in_gate: list[int], blas_threads: int | None) -> None:
    want = wide_matmul_grads(pargrad.SequentialEngine())
    with threadpool_limits(limits=blas_threads, user_api="blas"):
        size = blas.gate_size()
        with pargrad.ThreadedEngine(workers=4, handoff_threshold=1) as engine:
            for _ in range(5):
                got = wide_matmul_grads(engine)
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
            handed = engine.statistics().handed_off
    if size > 1:
        assert handed > 0  # the branches really ran on several threads
        assert 1 <= most_in_gate[0] <= size
    else:  # BLAS on every core and BLAS work dominating: the caller runs it all inline
        assert handed == 0
        assert most_in_gate[0] <= size


def test_blas_dominated_backward_stays_on_the_caller_while_blas_uses_every_core() -> None:
    want = wide_matmul_grads(pargrad.SequentialEngine())
    with (threadpool_limits(limits=available_cores(), user_api="blas"),
          pargrad.ThreadedEngine(workers=2, handoff_threshold=1) as engine):
        np.testing.assert_array_equal(wide_matmul_grads(engine), want)  # bitwise
        assert engine.threads() == [] and engine.statistics().handed_off == 0
    if available_cores() > 1:
        with (threadpool_limits(limits=1, user_api="blas"),
              pargrad.ThreadedEngine(workers=2, handoff_threshold=1) as engine):
            wide_matmul_grads(engine)
            assert engine.statistics().handed_off > 0


def test_a_waiter_takes_its_turn() -> None:
    size = blas.gate_size()
    for _ in range(size):
        blas.enter_gate()
    entered = threading.Event()

    def waiter() -> None:
        blas.enter_gate()
        entered.set()
        blas.leave_gate()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not entered.wait(0.2)  # the gate is full
    blas.leave_gate()
    assert entered.wait(10)
    thread.join()
    for _ in range(size - 1):
        blas.leave_gate()
