"""Grad mode: context managers, decorators, and thread-locality."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pargrad


def test_no_grad_records_nothing() -> None:
    x = pargrad.tensor([1.0], requires_grad=True)
    with pargrad.no_grad():
        assert not pargrad.is_grad_enabled()
        y = x * 2
        with pargrad.enable_grad():
            z = x * 2
    assert pargrad.is_grad_enabled()
    assert y.grad_fn is None and not y.requires_grad
    assert z.grad_fn is not None


def test_decorators() -> None:
    @pargrad.no_grad()
    def off() -> bool:
        return pargrad.is_grad_enabled()

    @pargrad.set_grad_enabled(False)
    def also_off() -> bool:
        return pargrad.is_grad_enabled()

    assert pargrad.is_grad_enabled()  # decorating changed nothing
    assert off() is False and also_off() is False
    assert pargrad.is_grad_enabled()


def test_set_grad_enabled_as_call_and_context() -> None:
    pargrad.set_grad_enabled(False)
    try:
        assert not pargrad.is_grad_enabled()
    finally:
        pargrad.set_grad_enabled(True)
    with pargrad.set_grad_enabled(False):
        assert not pargrad.is_grad_enabled()
    assert pargrad.is_grad_enabled()


def test_mode_is_restored_after_an_exception() -> None:
    try:
        with pargrad.no_grad():
            raise KeyError
    except KeyError:
        pass
    assert pargrad.is_grad_enabled()


def test_grad_mode_is_thread_local() -> None:
    inside = threading.Event()
    release = threading.Event()
    seen: list[bool] = []

    def worker() -> None:
        with pargrad.no_grad():
            inside.set()
            release.wait(10)
            seen.append(pargrad.is_grad_enabled())

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    # Another thread is inside no_grad; this thread still records.
    x = pargrad.tensor(1.0, requires_grad=True)
    assert pargrad.is_grad_enabled() and (x * 2).grad_fn is not None
    release.set()
    t.join(10)
    assert seen == [False]

    results: list[bool] = []
    with pargrad.no_grad():
        t = threading.Thread(target=lambda: results.append(pargrad.is_grad_enabled()))
        t.start()
        t.join(10)
    assert results == [True]  # a new thread starts with grad mode on


def test_one_instance_shared_by_threads() -> None:
    shared = pargrad.no_grad()
    barrier = threading.Barrier(4)
    results: list[bool] = []

    def worker() -> None:
        with shared:
            barrier.wait(10)
            results.append(pargrad.is_grad_enabled())
        results.append(pargrad.is_grad_enabled())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False] * 4 + [True] * 4


def test_every_switch_and_backward_gives_back_its_count(engine: pargrad.Engine) -> None:
    # grad_mode.off counts the threads with grad mode off, and anomaly.on those with
    # anomaly mode on; every way in and out of a mode, on any thread an engine uses,
    # must leave them as it found them (a leak would only slow ops, but never silently).
    from pargrad import anomaly, grad_mode

    def counts() -> tuple[int, int]:
        return grad_mode.off, anomaly.on

    before = counts()
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    with pargrad.no_grad():
        assert grad_mode.off == before[0] + 1
        with pargrad.no_grad(), pargrad.enable_grad():
            pass
    pargrad.set_grad_enabled(False)
    pargrad.set_grad_enabled(False)  # no change: counted once
    assert grad_mode.off == before[0] + 1
    pargrad.set_grad_enabled(True)

    @pargrad.no_grad()
    def steps() -> Iterator[bool]:
        yield pargrad.is_grad_enabled()
        yield pargrad.is_grad_enabled()

    assert list(steps()) == [False, False]
    with pargrad.detect_anomaly():
        y = (x * x).sum()
        y.backward(create_graph=True)  # recording the backward's graph, under anomaly
    assert x.grad is not None
    x.grad.sum().backward()
    with pargrad.set_detect_anomaly(True), pargrad.no_grad():
        try:
            with pargrad.enable_grad():
                raise KeyError
        except KeyError:
            pass
    # A worker thread gives its count back as it leaves the task, which may be just
    # after the caller's backward returned.
    deadline = time.monotonic() + 10
    while counts() != before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert counts() == before


class Nest(pargrad.Function):
    """x * 2, whose backward runs a backward of the same kind ``n`` levels deeper."""

    @staticmethod
    def forward(ctx: Any, t: pargrad.Tensor, n: int) -> Any:
        ctx.n = n
        return t.data * 2.0

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None]:
        if ctx.n > 0:
            z = pargrad.tensor([1.0], requires_grad=True)
            with pargrad.enable_grad():
                out = Nest.apply(z, ctx.n - 1).sum()
            (inner,) = pargrad.grad(out, [z])
            assert inner.data.tolist() == [2.0]
        return g * 2.0, None


def test_backward_calls_nested_past_one_stack_give_back_their_counts(
        engine: pargrad.Engine) -> None:
    # Nested deeper than MAX_REENTRANT_DEPTH, a backward continues on a fresh thread,
    # which takes the caller's anomaly mode: it gives its count back as it ends.
    from pargrad import anomaly, grad_mode
    from pargrad.engine.sequential import MAX_REENTRANT_DEPTH

    before = grad_mode.off, anomaly.on
    x = pargrad.tensor([1.0], requires_grad=True)
    with pargrad.detect_anomaly():
        (got,) = pargrad.grad(Nest.apply(x, MAX_REENTRANT_DEPTH + 8).sum(), [x])
    assert got.data.tolist() == [2.0]
    deadline = time.monotonic() + 10
    while (grad_mode.off, anomaly.on) != before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (grad_mode.off, anomaly.on) == before
