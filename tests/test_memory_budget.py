"""ThreadedEngine(memory_budget=bytes): the gradients handed to other threads at once stay
within the budget; 0 hands nothing off and peaks as the reference does; the gradients are
the reference's whatever the budget."""

from __future__ import annotations

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
