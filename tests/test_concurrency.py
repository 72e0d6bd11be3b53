"""Several threads using pargrad at once: independent graphs and one shared leaf."""

from __future__ import annotations

import sys
import threading

import numpy as np

import pargrad


def run_threads(target, count: int = 8) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            target()
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(count)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that races show up
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_backward_from_many_threads_into_one_leaf(engine: pargrad.Engine) -> None:
    w = pargrad.tensor(np.ones(4), requires_grad=True)
    calls = 50

    def work() -> None:
        for _ in range(calls):
            (w * 2.0).sum().backward(engine=engine)

    run_threads(work)
    np.testing.assert_array_equal(w.grad.data, np.full(4, 8 * calls * 2.0))


def test_independent_graphs_in_threads(engine: pargrad.Engine) -> None:
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    lock = threading.Lock()

    def work() -> None:
        ident = threading.get_ident()
        x = pargrad.tensor(np.arange(3.0) + ident % 7, requires_grad=True)
        for _ in range(20):
            x.grad = None
            (pargrad.tanh(x) * x).sum().backward(engine=engine)
        with lock:
            results[ident] = (x.data, x.grad.data)

    run_threads(work)
    for data, grad in results.values():
        np.testing.assert_allclose(grad, np.tanh(data) + data * (1 - np.tanh(data) ** 2))
