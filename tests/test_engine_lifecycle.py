"""The threaded engine's workers: lazy start, names, shutdown, the default engine."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest

import pargrad
from tests.helpers import run_python


def backward_once(engine: pargrad.Engine) -> pargrad.Tensor:
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    (x * 3).sum().backward(engine=engine)
    return x


def test_workers_start_lazily_named_and_daemon() -> None:
    engine = pargrad.ThreadedEngine(workers=3)
    assert engine.threads() == []
    np.testing.assert_array_equal(backward_once(engine).grad.data, [3.0, 3.0])
    assert engine.threads() == []  # nothing worth handing off: run on the caller alone
    big = pargrad.tensor(np.ones(engine.handoff_threshold), requires_grad=True)
    (big * 3).sum().backward(engine=engine)
    np.testing.assert_array_equal(big.grad.data, np.full(big.shape, 3.0))
    threads = engine.threads()
    assert [t.name for t in threads] == ["pargrad-cpu-0", "pargrad-cpu-1", "pargrad-cpu-2"]
    assert all(t.daemon and t.is_alive() for t in threads)
    backward_once(engine)
    assert engine.threads() == threads  # persistent: no new threads per call
    engine.shutdown()
    assert not any(t.is_alive() for t in threads)
    engine.shutdown()  # idempotent


def test_context_manager_and_use_after_shutdown() -> None:
    with pargrad.ThreadedEngine(workers=2) as engine:
        backward_once(engine)
        threads = engine.threads()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="shut down"):
        backward_once(engine)


def test_shutdown_waits_for_backward_calls_in_flight() -> None:
    engine = pargrad.ThreadedEngine(workers=2)
    started = threading.Event()
    release = threading.Event()

    class Gate(pargrad.Function):
        @staticmethod
        def forward(ctx: object, x: pargrad.Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: object, g: pargrad.Tensor) -> pargrad.Tensor:
            started.set()
            release.wait(10)
            return g

    x = pargrad.tensor(np.ones(2), requires_grad=True)
    caller = threading.Thread(target=lambda: Gate.apply(x).sum().backward(engine=engine))
    caller.start()
    assert started.wait(10)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # waiting for the backward in flight
    release.set()
    caller.join(10)
    stopper.join(10)
    assert not stopper.is_alive() and not caller.is_alive()
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])


def test_shutdown_from_inside_a_backward_is_refused() -> None:
    engine = pargrad.ThreadedEngine(workers=1)
    seen: list[BaseException] = []

    class Stop(pargrad.Function):
        @staticmethod
        def forward(ctx: object, x: pargrad.Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: object, g: pargrad.Tensor) -> pargrad.Tensor:
            try:
                engine.shutdown()
            except RuntimeError as exc:
                seen.append(exc)
            return g

    x = pargrad.tensor(np.ones(2), requires_grad=True)
    Stop.apply(x).sum().backward(engine=engine)
    assert len(seen) == 1 and "inside a backward" in str(seen[0])
    engine.shutdown()


def test_an_engine_nobody_holds_stops_its_workers() -> None:
    engine = pargrad.ThreadedEngine(workers=2)
    backward_once(engine)
    threads = engine.threads()
    probe = weakref.ref(engine)
    del engine
    gc.collect()
    assert probe() is None
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_bad_worker_counts() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            pargrad.ThreadedEngine(workers=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"workers\['cpu:1'\]"):
        pargrad.ThreadedEngine(workers={"cpu:1": 0})
    with pytest.raises(ValueError, match="unknown device type"):
        pargrad.ThreadedEngine(workers={"gpu": 1})


def test_default_worker_count_fits_the_machine() -> None:
    engine = pargrad.ThreadedEngine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert engine.workers() == max(1, (cores or 1) - 1)
    assert "ThreadedEngine(workers=" in repr(engine)


def test_default_engine_and_the_environment_variable() -> None:
    assert isinstance(pargrad.get_default_engine(), (pargrad.ThreadedEngine,
                                                     pargrad.SequentialEngine))
    code = "import pargrad; print(type(pargrad.get_default_engine()).__name__)"
    assert run_python(code, PARGRAD_ENGINE="").stdout.strip() == "ThreadedEngine"
    assert run_python(code, PARGRAD_ENGINE="threaded").stdout.strip() == "ThreadedEngine"
    assert run_python(code, PARGRAD_ENGINE="Sequential").stdout.strip() == "SequentialEngine"
    bad = run_python(code, PARGRAD_ENGINE="gpu")
    assert bad.returncode != 0 and "PARGRAD_ENGINE='gpu' is not an engine" in bad.stderr


def test_workers_never_keep_the_interpreter_alive() -> None:
    # A pool with idle workers, and one with a backward still running on a worker when
    # the main thread ends: the interpreter exits either way.
    code = """
import threading, time, numpy as np, pargrad
engine = pargrad.ThreadedEngine(workers=2)
x = pargrad.tensor(np.ones(2), requires_grad=True)
(x * 2).sum().backward(engine=engine)
class Slow(pargrad.Function):
    @staticmethod
    def forward(ctx, x):
        return x.data.copy()
    @staticmethod
    def backward(ctx, g):
        time.sleep(30)
        return g
threading.Thread(target=lambda: Slow.apply(x).sum().backward(engine=engine),
                 daemon=True).start()
time.sleep(0.2)
print("exiting")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "exiting"


def test_limit_blas_holds_during_the_backward_and_is_restored() -> None:
    from pargrad.engine import blas

    before = blas.thread_counts()
    if not before:
        pytest.skip("threadpoolctl finds no BLAS library in this process")
    seen: list[list[int]] = []

    class Probe(pargrad.Function):
        @staticmethod
        def forward(ctx: object, x: pargrad.Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: object, g: pargrad.Tensor) -> pargrad.Tensor:
            seen.append(blas.thread_counts())
            return g

    x = pargrad.tensor(np.ones(2), requires_grad=True)
    with pargrad.ThreadedEngine(workers=1, limit_blas=True) as engine:
        Probe.apply(x).sum().backward(engine=engine)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    wanted = max(1, (cores or 1) // 2)
    assert seen == [[min(wanted, b) for b in before]]
    assert blas.thread_counts() == before
    with pargrad.ThreadedEngine(workers=1) as engine:  # off by default: BLAS left alone
        Probe.apply(x).sum().backward(engine=engine)
    assert seen[-1] == before


@pytest.mark.timeout(30)
def test_an_empty_backward_returns(engine: pargrad.Engine) -> None:
    pargrad.backward([], engine=engine)  # nothing to do, on every engine


class Slow(pargrad.Function):
    """Identity whose backward waits for ``gate`` (if set) and may run a nested backward."""

    gate: threading.Event | None = None
    entered = threading.Event()  # set when a backward reaches the gate
    nested = False

    @staticmethod
    def forward(ctx: object, x: pargrad.Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: object, g: pargrad.Tensor) -> pargrad.Tensor:
        if Slow.gate is not None:
            Slow.entered.set()
            Slow.gate.wait(10)
        if Slow.nested:
            inner = pargrad.tensor(np.ones(2), requires_grad=True)
            with pargrad.enable_grad():
                (inner * 2).sum().backward()
        return g


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [False, True])
def test_shutdown_lets_backward_calls_in_flight_finish(wait: bool) -> None:
    engine = pargrad.ThreadedEngine(workers=1, handoff_threshold=1)
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    Slow.gate, Slow.nested = threading.Event(), True
    try:
        loss = pargrad.stack([Slow.apply(x * 2.0).sum(), Slow.apply(x * 3.0).sum()]).sum()
        caller = threading.Thread(target=lambda: loss.backward(engine=engine))
        Slow.entered.clear()
        caller.start()
        assert Slow.entered.wait(10)  # the backward is in flight before shutdown starts
        stopper = threading.Thread(target=engine.shutdown, args=(wait,))
        stopper.start()
        stopper.join(0.3)
        assert stopper.is_alive() == wait  # shutdown(wait=True) waits for the call
        with pytest.raises(RuntimeError, match="shut down"):
            backward_once(engine)  # new calls are refused at once
        Slow.gate.set()  # the nodes in flight run their nested backward calls
        caller.join(10)
        stopper.join(10)
    finally:
        Slow.gate, Slow.nested = None, False
    assert not caller.is_alive() and not stopper.is_alive()
    np.testing.assert_array_equal(x.grad.data, [5.0, 5.0])  # nothing lost
    for t in engine.threads():
        t.join(10)
    assert not any(t.is_alive() for t in engine.threads())
