"""Tracing and statistics of the threaded engine: every node recorded once, on the thread
that ran it; Chrome trace export; counts that add up, also under concurrent callers."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad.engine.trace import Trace
from tests.helpers import Boom


@pytest.fixture
def engine() -> Iterator[pargrad.ThreadedEngine]:
    # Every node with more than one element is handed to the ReadyQueue.
    with pargrad.ThreadedEngine(workers=2, trace=True, handoff_threshold=2) as made:
        yield made


def branches(width: int = 4) -> tuple[pargrad.Tensor, pargrad.Tensor]:
    """A leaf and a loss of ``width`` branches (4 nodes each) summed: 4 * width + width
    nodes, ``width - 1`` of them adds."""
    x = pargrad.tensor(np.linspace(-1, 1, 8), requires_grad=True)
    parts = [pargrad.tanh(pargrad.sin(x) * (k + 1.0)).sum() for k in range(width)]
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return x, loss


def test_every_node_is_recorded_once(engine: pargrad.ThreadedEngine) -> None:
    x, loss = branches()
    loss.backward(engine=engine)
    assert engine.trace is not None
    events = engine.trace.events()
    assert len(events) == 4 * 4 + 3
    assert len({e.sequence_nr for e in events}) == len(events)
    assert {e.node for e in events} == {"SinBackward", "MultiplyBackward", "TanhBackward",
                                        "SumBackward", "AddBackward"}
    assert all(e.start <= e.end for e in events)
    assert [e.start for e in events] == sorted(e.start for e in events)
    assert {e.device for e in events} == {"cpu"}
    assert len({e.task for e in events}) == 1
    assert any(e.handed_off for e in events)
    assert {e.thread for e in events if e.handed_off} <= {"pargrad-cpu-0", "pargrad-cpu-1",
                                                         threading.current_thread().name}
    # Gradients are those of the reference.
    want = (np.cos(x.data) * sum((k + 1) * (1 - np.tanh(np.sin(x.data) * (k + 1)) ** 2)
                                 for k in range(4)))
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.data, want, rtol=1e-12)


def test_a_node_is_run_by_the_thread_its_event_names(engine: pargrad.ThreadedEngine) -> None:
    seen: dict[float, str] = {}

    class Where(pargrad.Function):
        @staticmethod
        def forward(ctx: pargrad.FunctionCtx, a: pargrad.Tensor) -> np.ndarray:
            ctx.tag = float(a.data[0])
            return a.data * 2

        @staticmethod
        def backward(ctx: pargrad.FunctionCtx, g: np.ndarray) -> np.ndarray:
            seen[ctx.tag] = threading.current_thread().name
            return g * 2

    x = pargrad.tensor(np.ones(4), requires_grad=True)
    parts = [Where.apply(x + float(k)).sum() for k in range(6)]
    pargrad.backward(parts, engine=engine)
    assert engine.trace is not None
    ran = [e.thread for e in engine.trace.events() if e.node == "WhereBackward"]
    assert sorted(ran) == sorted(seen.values())


def test_chrome_trace(engine: pargrad.ThreadedEngine, tmp_path: Path) -> None:
    _, loss = branches()
    loss.backward(engine=engine)
    assert engine.trace is not None
    path = tmp_path / "trace.json"
    engine.trace.save_chrome_trace(path)
    data = json.loads(path.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert len(slices) == 19
    assert min(e["ts"] for e in slices) == 0
    assert all(e["dur"] >= 0 and e["cat"] in ("inline", "handed off") for e in slices)
    assert {e["tid"] for e in slices} == set(names)
    assert set(names.values()) == {e.thread for e in engine.trace.events()}
    engine.trace.clear()
    assert engine.trace.events() == []


def test_profile_records_every_engine_while_open() -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        assert engine.trace is None
        _, loss = branches(2)
        with pargrad.profile() as outer:
            with pargrad.profile() as inner:
                loss.backward(engine=engine, retain_graph=True)
            loss.backward(engine=engine)
        _, after = branches(2)
        after.backward(engine=engine)
    assert len(inner.events()) == 9
    assert len(outer.events()) == 18
    assert len({e.task for e in outer.events()}) == 2


def test_untraced_engine_records_nothing() -> None:
    with pargrad.ThreadedEngine(workers=1) as engine:
        _, loss = branches()
        loss.backward(engine=engine)
        assert engine.trace is None
        assert engine.statistics().nodes == 19


def test_an_inline_backward_counts_the_nodes_it_ran_even_when_one_fails() -> None:
    # Nothing to hand off: the calling thread runs each backward inline. The failing
    # node counts as run (it was called), as do the nodes before it, and a backward
    # nested in a node counts its own nodes once.
    class Nested(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, a: np.ndarray) -> np.ndarray:
            return a * 1.0

        @staticmethod
        def backward(ctx: Any, g: np.ndarray) -> np.ndarray:
            y = pargrad.tensor(np.ones(2), requires_grad=True)
            with pargrad.enable_grad():
                (y * 3).sum().backward(engine=engine)  # Sum, Mul
            return g

    with pargrad.ThreadedEngine(workers=1) as engine:
        x = pargrad.tensor(np.ones(3), requires_grad=True)
        with pytest.raises(pargrad.BackwardError):
            (Boom.apply(x * 2) * 3).sum().backward(engine=engine)  # Sum, Mul, Boom
        assert engine.statistics().nodes == 3 and engine.statistics().handed_off == 0
        Nested.apply(x).sum().backward(engine=engine)  # Sum, Nested (+ 2 nested)
        stats = engine.statistics()
        assert stats.nodes == 3 + 4 and stats.inline == stats.nodes
        assert stats.graph_tasks_completed == 3 and stats.errors == 1


def test_statistics_add_up(engine: pargrad.ThreadedEngine) -> None:
    for _ in range(3):
        _, loss = branches()
        loss.backward(engine=engine)
    stats = engine.statistics()
    assert stats.nodes == 3 * 19
    assert stats.inline + stats.handed_off == stats.nodes
    assert stats.handed_off > 0
    assert set(stats.nodes_per_thread) <= {"pargrad-cpu-0", "pargrad-cpu-1",
                                           threading.current_thread().name}
    assert stats.graph_tasks_completed == 3 and stats.errors == 0
    assert stats.queue_waits >= 1  # the workers waited for the first work at least
    assert engine.trace is not None
    events = engine.trace.events()
    assert sum(e.handed_off for e in events) == stats.handed_off
    with pytest.raises(AttributeError):
        stats.errors = 1  # type: ignore[misc]


def test_statistics_count_errors(engine: pargrad.ThreadedEngine) -> None:
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(pargrad.BackwardError):
        Boom.apply(x).sum().backward(engine=engine)
    (x * 2).sum().backward(engine=engine)
    stats = engine.statistics()
    assert stats.graph_tasks_completed == 2 and stats.errors == 1


def test_counts_are_exact_with_concurrent_callers(engine: pargrad.ThreadedEngine) -> None:
    calls, threads = 10, 4
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(calls):
                _, loss = branches()
                loss.backward(engine=engine)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=caller, name=f"caller-{i}") for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert not errors
    stats = engine.statistics()
    assert stats.nodes == calls * threads * 19
    assert stats.graph_tasks_completed == calls * threads
    assert engine.trace is not None
    events = engine.trace.events()
    assert len(events) == stats.nodes
    assert len({e.task for e in events}) == calls * threads
    per_thread: dict[str, int] = {}
    for e in events:
        per_thread[e.thread] = per_thread.get(e.thread, 0) + 1
    assert per_thread == dict(stats.nodes_per_thread)


def test_trace_is_empty_until_used() -> None:
    trace = Trace()
    assert trace.events() == []
    assert trace.chrome_trace()["traceEvents"] == []
