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


def test_threads_saving_one_output_at_once_share_its_counter(engine: pargrad.Engine) -> None:
    """The version counter of a saved output is made by the first thread that asks
    (``counter_of``): every thread saving it gets that one, and the node that made the
    output sees a later in-place change through it."""
    x = pargrad.tensor(np.linspace(-1.0, 1.0, 4), requires_grad=True)
    for _ in range(20):
        y = pargrad.tanh(x)  # TanhBackward saves y, with no counter made yet
        w = pargrad.tensor(np.full(4, 2.0), requires_grad=True)
        products: list[pargrad.Tensor] = []
        start = threading.Barrier(8)

        def record(y: pargrad.Tensor = y, w: pargrad.Tensor = w,
                   products: list[pargrad.Tensor] = products,
                   start: threading.Barrier = start) -> None:
            start.wait()
            products.append(y * w)  # saves y: asks for y's counter

        run_threads(record)
        counters = {id(r.counter) for p in products for r in p.grad_fn.saved_versions
                    if r.where == 0}
        node = y.grad_fn
        assert counters == {id(y._counter)} == {id(node.output_counter)}
        with pargrad.no_grad():
            y.add_(1.0)
        loss = pargrad.sum(products[0])
        try:
            loss.backward()
        except pargrad.BackwardError as exc:
            assert exc.node_name == "MultiplyBackward"  # the first to read y's values
        else:
            raise AssertionError("the in-place change of a saved output went unseen")
        assert x.grad is None and w.grad is None


def test_threads_switching_modes_each_see_and_record_their_own() -> None:
    """Grad and anomaly mode are per thread, and the hot paths skip the thread-local
    while no thread has grad mode off or anomaly mode on (``grad_mode.off``,
    ``anomaly.on``): with threads switching both at once, each thread's ops still
    record (or not), and keep a forward stack (or not), by its own mode alone."""
    from pargrad import anomaly, grad_mode

    off, on = grad_mode.off, anomaly.on
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for i in range(300):
            assert pargrad.is_grad_enabled() and not pargrad.is_anomaly_enabled()
            assert (x * 2.0).grad_fn is not None
            if i % 2:
                with pargrad.no_grad():
                    assert not pargrad.is_grad_enabled()
                    assert (x * 2.0).grad_fn is None and pargrad.tanh(x).grad_fn is None
            else:
                with pargrad.detect_anomaly():
                    assert pargrad.is_anomaly_enabled()
                    assert (x * 2.0).grad_fn._forward_trace is not None
                node = pargrad.tanh(x).grad_fn
                assert node is not None and node._forward_trace is None

    run_threads(work)
    assert (grad_mode.off, anomaly.on) == (off, on)  # each thread took back its count
