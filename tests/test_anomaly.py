"""Anomaly mode: NaN/Inf checks in backward, forward stacks on errors, per-thread mode."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from tests.helpers import Boom, sleeping_function


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", ()))


def nan_graph() -> tuple[Tensor, Tensor]:
    """x and a loss whose backward makes SqrtBackward return nan (0 / 0) at x[0]."""
    x = pargrad.tensor([0.0, 1.0, 4.0], requires_grad=True)
    loss = (x.sqrt() * np.array([0.0, 1.0, 1.0])).sum()  # forward: sqrt of x
    return x, loss


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_names_the_node_and_shows_the_forward_line(engine: pargrad.Engine) -> None:
    with pargrad.detect_anomaly():
        x, loss = nan_graph()
        with pytest.raises(pargrad.BackwardError) as info:
            loss.backward()
    error = info.value
    assert error.node_name == "SqrtBackward"
    assert "returned nan or inf values in its gradient for input 0 (nan at index (0,))" in str(
        error)
    text = notes(error)
    assert "Traceback of the forward call that created SqrtBackward, the node that failed" in text
    assert "loss = (x.sqrt() * np.array([0.0, 1.0, 1.0])).sum()  # forward: sqrt of x" in text
    # pargrad's own frames are trimmed: the last frame is the line that called the op.
    assert error.forward_trace[-1].name == "nan_graph"
    assert x.grad is None  # all or nothing: a failed backward changes no .grad


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_inf_is_found_too(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.0, 2.0], requires_grad=True)
    with pargrad.detect_anomaly():
        y = pargrad.log(x).sum()
        with pytest.raises(pargrad.BackwardError, match=r"LogBackward: .*\(inf at index \(0,\)\)"):
            y.backward()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_without_anomaly_mode_or_check_nan_nan_passes_through(engine: pargrad.Engine) -> None:
    x, loss = nan_graph()
    loss.backward(retain_graph=True)
    assert np.isnan(x.grad.data[0])
    x.grad = None
    with pargrad.detect_anomaly(check_nan=False):
        assert pargrad.is_anomaly_enabled()
        assert not pargrad.is_anomaly_check_nan_enabled()
        loss.backward()
    assert np.isnan(x.grad.data[0])


def test_other_errors_carry_the_forward_stack(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    with pargrad.detect_anomaly():
        y = Boom.apply(x * 3)  # the failing forward call
        with pytest.raises(pargrad.BackwardError, match="BoomBackward: ValueError: boom"
                           ) as info:
            y.sum().backward()
    assert isinstance(info.value.__cause__, ValueError)
    assert "y = Boom.apply(x * 3)  # the failing forward call" in notes(info.value)


def test_no_notes_outside_anomaly_mode(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = Boom.apply(x)
    assert y.grad_fn is not None and y.grad_fn._forward_trace is None
    with pytest.raises(pargrad.BackwardError) as info:
        y.sum().backward()
    assert notes(info.value) == ""
    assert not hasattr(info.value, "forward_trace")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_backward_callers_mode_decides_the_checks(engine: pargrad.Engine) -> None:
    x, loss = nan_graph()  # recorded outside anomaly mode: no stacks
    with pargrad.detect_anomaly(), pytest.raises(pargrad.BackwardError) as info:
        loss.backward(retain_graph=True)
    assert "SqrtBackward was created outside anomaly mode" in notes(info.value)
    with pargrad.detect_anomaly():  # recorded under anomaly mode, run outside it
        x, loss = nan_graph()
    loss.backward()
    assert np.isnan(x.grad.data[0])


def test_nodes_recorded_by_a_backward_under_anomaly_mode_keep_their_stack(
        engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.5, 1.0, 2.0], requires_grad=True)
    with pargrad.detect_anomaly():
        (x.sin() * x).sum().backward(create_graph=True)
    node = x.grad.grad_fn
    assert node is not None and node._forward_trace is not None
    # The last frame of the recorded stack is this test's backward call, wherever it ran.
    assert node._forward_trace[-1].name == (
        "test_nodes_recorded_by_a_backward_under_anomaly_mode_keep_their_stack")


Slow = sleeping_function(0.05)  # keeps the caller busy


class MakesNan(pargrad.Function):
    """Identity whose backward returns nan and says which thread ran it."""

    threads: ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> np.ndarray:
        MakesNan.threads.append(threading.current_thread().name)
        return np.full(g.shape, np.nan)


def test_workers_check_under_the_callers_mode() -> None:
    # The caller keeps the newest expensive node (Slow) and hands MakesNan to a worker:
    # the worker must check under the caller's anomaly mode.
    with pargrad.ThreadedEngine(workers=4, handoff_threshold=2) as engine:
        for _ in range(5):
            MakesNan.threads = []
            x = pargrad.tensor([1.0, 2.0], requires_grad=True)
            y = (MakesNan.apply(x) + Slow.apply(x)).sum()
            with pargrad.detect_anomaly(), pytest.raises(
                    pargrad.BackwardError, match="MakesNanBackward: returned nan"):
                y.backward(engine=engine)
            if MakesNan.threads[0].startswith("pargrad-"):
                break
        assert MakesNan.threads[0].startswith("pargrad-cpu-")
        y = (MakesNan.apply(x) + Slow.apply(x)).sum()
        y.backward(engine=engine)  # the same workers, outside anomaly mode: no check
        assert np.isnan(x.grad.data).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_mode_is_per_thread_while_backward_calls_run_at_once(engine: pargrad.Engine) -> None:
    barrier = threading.Barrier(2)
    results: dict[str, list[str]] = {"on": [], "off": []}

    def run(name: str) -> None:
        for _ in range(10):
            barrier.wait()
            with pargrad.set_detect_anomaly(name == "on"):
                x, loss = nan_graph()
                try:
                    loss.backward(engine=engine)  # threads do not share use_engine blocks
                    results[name].append("nan" if np.isnan(x.grad.data[0]) else "finite")
                except pargrad.BackwardError as exc:
                    trace = getattr(exc, "forward_trace", None)
                    results[name].append("error" if trace is not None else "error-no-trace")

    threads = [threading.Thread(target=run, args=(name,)) for name in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"on": ["error"] * 10, "off": ["nan"] * 10}


def test_switches_nest_restore_and_decorate() -> None:
    assert not pargrad.is_anomaly_enabled()
    with pargrad.detect_anomaly():
        assert pargrad.is_anomaly_enabled() and pargrad.is_anomaly_check_nan_enabled()
        with pargrad.set_detect_anomaly(False):
            assert not pargrad.is_anomaly_enabled()
        assert pargrad.is_anomaly_enabled()
    assert not pargrad.is_anomaly_enabled()

    @pargrad.detect_anomaly(check_nan=False)
    def inside() -> tuple[bool, bool]:
        return pargrad.is_anomaly_enabled(), pargrad.is_anomaly_check_nan_enabled()

    assert inside() == (True, False)
    assert not pargrad.is_anomaly_enabled()
    pargrad.set_detect_anomaly(True)  # a plain call switches it on ...
    try:
        assert pargrad.is_anomaly_enabled()
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(pargrad.is_anomaly_enabled()))
        other.start()
        other.join()
        assert seen == [False]  # ... in this thread only
    finally:
        pargrad.set_detect_anomaly(False)
    assert not pargrad.is_anomaly_enabled()


def test_set_detect_anomaly_decorates() -> None:
    @pargrad.set_detect_anomaly(True, check_nan=False)
    def on() -> tuple[bool, bool]:
        return pargrad.is_anomaly_enabled(), pargrad.is_anomaly_check_nan_enabled()

    @pargrad.set_detect_anomaly(False)
    def off() -> bool:
        return pargrad.is_anomaly_enabled()

    assert not pargrad.is_anomaly_enabled()  # decorating changed nothing
    assert on() == (True, False) and on() == (True, False)  # each call sets it anew
    assert not pargrad.is_anomaly_enabled()  # and restores it
    with pargrad.detect_anomaly():
        assert off() is False
        assert pargrad.is_anomaly_enabled() and pargrad.is_anomaly_check_nan_enabled()
        assert on() == (True, False)
        assert pargrad.is_anomaly_check_nan_enabled()  # the caller's check_nan is back
    assert not pargrad.is_anomaly_enabled()


def test_anomaly_switches_restore_after_errors_and_nest_in_any_order() -> None:
    @pargrad.set_detect_anomaly(True)
    def fails() -> None:
        assert pargrad.is_anomaly_enabled()
        raise KeyError("inside")

    with pytest.raises(KeyError):
        fails()
    assert not pargrad.is_anomaly_enabled()
    with pytest.raises(KeyError), pargrad.detect_anomaly(check_nan=False):
        raise KeyError("inside")
    assert pargrad.anomaly.current_mode() == (False, True)

    outer = pargrad.detect_anomaly(check_nan=False)
    seen: list[tuple[bool, bool]] = []
    with outer:
        seen.append(pargrad.anomaly.current_mode())
        with pargrad.set_detect_anomaly(False):
            seen.append(pargrad.anomaly.current_mode())
            with outer:  # one instance entered again, inside itself
                seen.append(pargrad.anomaly.current_mode())
                with pargrad.detect_anomaly():
                    seen.append(pargrad.anomaly.current_mode())
                seen.append(pargrad.anomaly.current_mode())
            seen.append(pargrad.anomaly.current_mode())
        seen.append(pargrad.anomaly.current_mode())
    seen.append(pargrad.anomaly.current_mode())
    assert seen == [(True, False), (False, True), (True, False), (True, True), (True, False),
                    (False, True), (True, False), (False, True)]


def test_detect_anomaly_on_a_generator_applies_to_its_steps() -> None:
    @pargrad.detect_anomaly(check_nan=False)
    def steps() -> Any:
        for _ in range(3):
            yield pargrad.anomaly.current_mode()

    seen = []
    for mode in steps():
        seen.append((mode, pargrad.anomaly.current_mode()))  # the loop keeps its own mode
    assert seen == [((True, False), (False, True))] * 3


def test_one_detect_anomaly_instance_shared_by_threads() -> None:
    shared = pargrad.detect_anomaly(check_nan=False)
    barrier = threading.Barrier(4)
    results: list[tuple[bool, bool]] = []

    def worker() -> None:
        with shared:
            barrier.wait(10)
            results.append(pargrad.anomaly.current_mode())
        results.append(pargrad.anomaly.current_mode())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [(False, True)] * 4 + [(True, False)] * 4
