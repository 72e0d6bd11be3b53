"""Reliability at the API boundary (issue #18): futures without races, argument checks,
dtype safety, and the atomic commit of ``.grad`` under KeyboardInterrupt. (Interrupts in
the engine's loop: tests/test_interrupts.py; fork: tests/test_fork.py.)"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import numpy as np
import pytest

import pargrad
from pargrad import Tensor

WAIT = 30  # seconds: a generous bound on anything these tests wait for


def leaf(value: Any) -> Tensor:
    return pargrad.tensor(value, requires_grad=True)


class Fails(pargrad.Function):
    """Identity whose backward raises at once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise ValueError("boom")


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


# ----- futures: cancel() returns False only on a resolved future -----

def test_cancel_after_a_node_failed_returns_false_only_once_resolved() -> None:
    """A node's error is recorded while another node of the backward still runs: the
    backward has failed but is not over. cancel() must not report False (not
    cancelled) while the future is still pending."""
    Block.started.clear()
    Block.release.clear()
    p, q = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    with pargrad.ThreadedEngine(workers=2, handoff_threshold=1) as engine:
        future = pargrad.backward_async(
            Fails.apply(p).sum() + Block.apply(q).sum(), engine=engine)
        task = cast(Any, future._work).task
        assert Block.started.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while task.error is None:  # the other worker ran Fails
            assert time.monotonic() < deadline
            time.sleep(0.001)
        threading.Timer(0.2, Block.release.set).start()
        try:
            cancelled = future.cancel()
            assert not cancelled
            assert future.done(), "cancel() returned False on a pending future"
            assert isinstance(future.exception(), pargrad.BackwardError)
        finally:
            Block.release.set()
    assert p.grad is None and q.grad is None


def test_cancel_racing_a_failure_under_tiny_switch_interval() -> None:
    """The race of the issue (16 of 600 trials with switchinterval 1e-6): cancel() while
    a node fails. Whatever cancel() answers, the future is done when it returns."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with pargrad.ThreadedEngine(workers=2, handoff_threshold=1) as engine:
            for _ in range(100):
                p = leaf([1.0, 2.0])
                future = pargrad.backward_async((Fails.apply(p) * p).sum(), engine=engine)
                cancelled = future.cancel()
                assert future.done() and future.cancelled() == cancelled
                assert p.grad is None
    finally:
        sys.setswitchinterval(previous)


# ----- argument validation at the API boundary -----

def test_engine_must_be_an_engine() -> None:
    x = leaf([1.0])
    with pytest.raises(TypeError, match="engine="):
        (x * x).sum().backward(engine=cast(Any, "threaded"))
    with pytest.raises(TypeError, match="engine="):
        pargrad.grad((x * x).sum(), [x], engine=cast(Any, "sequential"))
    with pytest.raises(TypeError, match="engine="):
        pargrad.backward_async((x * x).sum(), engine=cast(Any, object()))
    assert x.grad is None


@pytest.mark.parametrize("bad", ["many", 0, -3, 2.5, True, None])
def test_handoff_threshold_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="handoff_threshold"):
        pargrad.ThreadedEngine(handoff_threshold=bad)


@pytest.mark.parametrize("name", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("bad", ["no", "yes", 1, 0.0, [True]])
def test_graph_flags_must_be_bools(name: str, bad: Any) -> None:
    x = leaf([1.0, 2.0])
    with pytest.raises(TypeError, match=name):
        pargrad.backward((x * x).sum(), **{name: bad})
    with pytest.raises(TypeError, match=name):
        pargrad.grad((x * x).sum(), [x], **{name: bad})
    with pytest.raises(TypeError, match=name):
        (x * x).sum().backward(**{name: bad})
    assert x.grad is None


def test_graph_flags_accept_bools_numpy_bools_and_none() -> None:
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    pargrad.backward(y, retain_graph=np.True_, create_graph=None)
    pargrad.backward(y, retain_graph=None, create_graph=False)
    np.testing.assert_array_equal(x.grad.data, [4.0, 8.0])
