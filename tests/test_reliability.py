"""Reliability at the API boundary (issue #18): futures without races, argument checks,
dtype safety, and the atomic commit of ``.grad`` under KeyboardInterrupt. (Interrupts in
the engine's loop: tests/test_interrupts.py; fork: tests/test_fork.py.)"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, cast

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from tests.helpers import Boom, assert_left_as_found, blocking_function
from tests.interrupting import SigintAt, code_objects

WAIT = 30  # seconds: a generous bound on anything these tests wait for


def leaf(value: Any) -> Tensor:
    return pargrad.tensor(value, requires_grad=True)


Block = blocking_function(WAIT)


class FailsOnceBlocked(pargrad.Function):
    """Identity whose backward raises once Block's backward has started (so the error
    cannot cancel Block before it runs)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        assert Block.started.wait(WAIT), "Block never started"
        raise ValueError("boom")


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
            FailsOnceBlocked.apply(p).sum() + Block.apply(q).sum(), engine=engine)
        task = cast(Any, future._work).task
        assert Block.started.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while task.error is None:  # the other worker ran Boom
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
                future = pargrad.backward_async((Boom.apply(p) * p).sum(), engine=engine)
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


@pytest.mark.parametrize("bad", ["many", -3, 2.5, True, None])
def test_handoff_threshold_must_be_a_non_negative_int(bad: Any) -> None:
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


# ----- dtype safety: no gradient path is dropped silently -----

def test_a_complex_constant_no_longer_drops_a_gradient_path() -> None:
    """The issue's case: loss = sum(x * c) + sum(2 x) with complex c gave x.grad
    [2, 2, 2] (the first path silently lost) where the truth is [3, 3, 3]."""
    x = leaf([1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match=r"multiply: .*argument 1 \(complex128\)"):
        x * np.complex128(1 + 0j)
    with pytest.raises(TypeError, match="object"):
        x * np.array([1, 1, 1], dtype=object)
    with pytest.raises(TypeError, match="where"):
        pargrad.where(np.array([True, False, True]), x, 1j)
    with pytest.raises(TypeError, match="astype"):
        x.astype(np.complex128)
    loss = (x * np.complex128(1).real).sum() + (x * 2).sum()  # the fix the message names
    loss.backward()
    np.testing.assert_array_equal(x.grad.data, [3.0, 3.0, 3.0])


def test_mixing_outside_grad_mode_or_without_grad_is_allowed() -> None:
    x = leaf([1.0, 2.0])
    with pargrad.no_grad():
        assert (x * 1j).dtype == np.complex128
    assert (x.detach() * 1j).dtype == np.complex128
    assert (x > 1.0).dtype == np.bool_  # comparisons: constants by definition


CONSTANT_DTYPES = [np.bool_, np.int8, np.int64, np.uint16, np.float16, np.float32,
                   np.float64, np.complex64, np.complex128, np.object_, np.str_]
BINARY = {
    "add": lambda x, c: x + c,
    "radd": lambda x, c: c + x,
    "subtract": lambda x, c: x - c,
    "multiply": lambda x, c: x * c,
    "rmultiply": lambda x, c: c * x,
    "divide": lambda x, c: x / c,
    "maximum": lambda x, c: np.maximum(x, c),
    "where": lambda x, c: pargrad.where(np.array(True), x, c),
}


def _constant(dtype: Any, shape: tuple[int, ...], as_scalar: bool) -> Any:
    if dtype is np.str_:
        return np.full(shape, "1.5")
    value = np.full(shape, 1.5)
    if dtype is np.bool_:
        value = value > 0
    array = value.astype(dtype)
    return array.reshape(-1)[0] if as_scalar else array


def test_dtype_mixes_raise_or_keep_the_gradient() -> None:
    """Every binary op of a float leaf with a constant of every dtype (array or scalar):
    either it raises TypeError at the op, or the result is a float Tensor that requires
    grad and carries the gradient (checked by value for the linear ops)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300)
    @given(op=st.sampled_from(sorted(BINARY)), leaf_dtype=st.sampled_from([np.float32, np.float64]),
           const_dtype=st.sampled_from(CONSTANT_DTYPES), as_scalar=st.booleans(),
           shape=st.sampled_from([(), (3,), (2, 3)]))
    def check(op: str, leaf_dtype: Any, const_dtype: Any, as_scalar: bool,
              shape: tuple[int, ...]) -> None:
        x = pargrad.tensor(np.arange(1.0, 1.0 + np.prod(shape, dtype=int)).reshape(shape),
                           dtype=leaf_dtype, requires_grad=True)
        c = _constant(const_dtype, shape, as_scalar)
        try:
            out = BINARY[op](x, c)
        except TypeError:
            kind = np.asarray(c).dtype.kind
            assert kind in "cOSU", f"{op} refused a {np.asarray(c).dtype} constant"
            return
        assert out.requires_grad and out.dtype.kind == "f", (op, out.dtype)
        out.sum().backward()
        expected = {"add": 1.0, "radd": 1.0, "subtract": 1.0, "where": 1.0,
                    "multiply": np.asarray(c, np.float64), "rmultiply": np.asarray(c, np.float64)}
        if op in expected:
            np.testing.assert_allclose(x.grad.data, np.broadcast_to(expected[op], shape),
                                       rtol=1e-3)
        assert x.grad.dtype == leaf_dtype

    check()


# ----- the commit of .grad is atomic under KeyboardInterrupt -----

# The code objects a SIGINT is injected into, at every point where a signal can land
# (tests/interrupting.py; by name, so the test can be pointed at a rewritten commit).
COMMIT_CODE = [("pargrad.autograd", "_BackwardCall.commit"),
               ("pargrad.autograd", "_added_to_grad"),
               ("pargrad.autograd", "_adds_in_place"), ("pargrad.autograd", "_add_in_place"),
               ("pargrad.autograd", "_add_to_grad"),  # b359260's name for it
               ("pargrad.autograd", "_receivers"),
               # the call around the engine and the commit, and its one SIGINT gate
               ("pargrad.autograd", "_run"),
               ("pargrad.interrupts", "gate_installed.__enter__"),
               ("pargrad.interrupts", "gate_installed._restore"),
               ("pargrad.interrupts", "deferred_interrupts.__enter__"),
               ("pargrad.interrupts", "deferred_interrupts.__exit__")]


@pytest.mark.sigint
def test_commit_is_all_or_nothing_under_sigint_at_every_signal_point() -> None:
    import sys

    codes = code_objects(COMMIT_CODE)
    assert codes
    leaves = [leaf(np.full(3, float(i))) for i in range(6)]
    for t in leaves:
        t.grad = pargrad.tensor(np.zeros(3))
    engine = pargrad.SequentialEngine()  # the commit is the engine's caller's
    outcomes = {"all": 0, "none": 0}
    handler = signal.getsignal(signal.SIGINT)
    n = 0
    while True:
        n += 1
        before = [t.grad.data.copy() for t in leaves]  # .grad is summed into in place
        loss = sum(((t * t).sum() for t in leaves[1:]), (leaves[0] * 2).sum())
        tracer = SigintAt(codes, n)
        sys.settrace(tracer)
        interrupted = False
        try:
            pargrad.backward(loss, engine=engine)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        changed = [not np.array_equal(t.grad.data, b) for t, b in zip(leaves, before)]
        assert all(changed) or not any(changed), f"partial commit at {tracer.where}: {changed}"
        assert_left_as_found(handler, tracer.where)
        if not tracer.fired:
            break  # past the last bytecode of the commit
        assert interrupted, f"the SIGINT at {tracer.where} was lost"
        outcomes["all" if all(changed) else "none"] += 1
    assert n > 20 and outcomes["all"] and outcomes["none"], (n, outcomes)
