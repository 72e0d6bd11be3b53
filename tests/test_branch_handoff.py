"""The branch hand-off (``ThreadedEngine(handoff_branch=...)``): where a node makes several
small nodes ready, one that leads to a long enough branch of its own goes to another
thread. A free-threaded Python uses it by default; these tests ask for it explicitly, so
they run it on every interpreter."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pargrad
from pargrad.engine.loop import has_branches, leads_to
from pargrad.engine.threaded import DEFAULT_HANDOFF_BRANCH
from pargrad.graph import counting
from tests.strategies import GraphRecipe, graph_recipes

pytestmark = pytest.mark.timeout(120)


def branches(widths: list[int], size: int = 5,
             seed: int = 0) -> tuple[pargrad.Tensor, list[pargrad.Tensor]]:
    """A loss summing ``len(widths)`` independent branches, branch ``k`` a chain of
    ``widths[k]`` small ops (sin, then times a constant, alternately) on a leaf of its
    own; returns the loss and the leaves."""
    rng = np.random.default_rng(seed)
    leaves = [pargrad.tensor(rng.uniform(-1, 1, size), requires_grad=True) for _ in widths]
    parts = []
    for k, (leaf, ops) in enumerate(zip(leaves, widths)):
        h = leaf
        for i in range(ops):
            h = pargrad.sin(h) if i % 2 == 0 else h * (1.0 + 0.01 * k)
        parts.append(h.sum())
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss, leaves


def reference_grads(widths: list[int]) -> list[np.ndarray]:
    loss, leaves = branches(widths)
    loss.backward(engine=pargrad.SequentialEngine())
    return [leaf.grad.numpy() for leaf in leaves]  # type: ignore[union-attr]


def test_the_default_follows_the_interpreter() -> None:
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    with pargrad.ThreadedEngine(workers=1) as engine:
        assert engine.handoff_branch is None
        assert engine.branch_now() == (0 if gil else DEFAULT_HANDOFF_BRANCH)
    with pargrad.ThreadedEngine(workers=1, handoff_branch=7) as engine:
        assert engine.branch_now() == 7
    with pargrad.ThreadedEngine(workers=1, handoff_branch=0) as engine:
        assert engine.branch_now() == 0
    with pytest.raises(ValueError, match="handoff_branch"):
        pargrad.ThreadedEngine(workers=1, handoff_branch=-1)


def test_long_branches_go_to_other_threads_and_sum_as_the_reference() -> None:
    widths = [40, 40, 40, 40]
    want = reference_grads(widths)
    with pargrad.ThreadedEngine(workers=2, handoff_branch=8) as engine:
        for _ in range(5):
            loss, leaves = branches(widths)
            loss.backward(engine=engine)
            for leaf, w in zip(leaves, want):
                np.testing.assert_allclose(leaf.grad.numpy(), w, rtol=1e-12)  # type: ignore[union-attr]
        stats = engine.statistics()
        # Three of the four branches are handed off at their forks (the newest node made
        # ready, the next add, stays), in every call.
        assert stats.handed_off == 5 * 3
        assert stats.nodes == 5 * (4 * 41 + 3)


def test_without_it_small_nodes_stay_on_the_calling_thread() -> None:
    with pargrad.ThreadedEngine(workers=2, handoff_branch=0) as engine:
        loss, _ = branches([40, 40, 40, 40])
        loss.backward(engine=engine)
        assert engine.statistics().handed_off == 0
        assert set(engine.statistics().nodes_per_thread) == {"MainThread"}


def test_short_branches_and_chains_stay_on_the_calling_thread() -> None:
    with pargrad.ThreadedEngine(workers=2, handoff_branch=50) as engine:
        for widths in ([40, 40, 40, 40], [400], [1, 1, 1, 1, 1, 1, 200]):
            loss, leaves = branches(widths)
            loss.backward(engine=engine)
            for leaf, w in zip(leaves, reference_grads(widths)):
                np.testing.assert_allclose(leaf.grad.numpy(), w, rtol=1e-12)  # type: ignore[union-attr]
        assert engine.statistics().handed_off == 0


def counted(loss: pargrad.Tensor) -> tuple[dict, set]:
    assert loss.grad_fn is not None
    roots = {loss.grad_fn}
    return counting(roots, None)[0].counts, roots


def test_has_branches_needs_two_long_branches_at_one_fork() -> None:
    assert has_branches(*counted(branches([20, 20])[0]), 10)
    assert has_branches(*counted(branches([3, 20, 20])[0]), 10)  # the fork is deeper in
    assert not has_branches(*counted(branches([20, 3])[0]), 10)  # one long, one short
    assert not has_branches(*counted(branches([100])[0]), 10)  # a chain
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    h = x
    for _ in range(30):
        h = pargrad.sin(h)
    # Two uses of one value: a diamond joins again, so neither side is its own branch.
    assert not has_branches(*counted((h * h + pargrad.cos(h)).sum()), 10)


def test_leads_to_counts_only_what_is_reached_through_the_node_alone() -> None:
    x = pargrad.tensor(np.ones(2), requires_grad=True)
    shared = pargrad.sin(x)
    a, b = pargrad.cos(shared), pargrad.exp(shared)
    loss = (a + b).sum()
    counts, roots = counted(loss)
    single = {node for node, owed in counts.items() if owed == [1] and node not in roots}
    sinks = {x.grad_fn} if x.grad_fn is not None else set()
    assert a.grad_fn is not None and shared.grad_fn is not None
    # a's branch is a's node alone: ``shared`` is reached from b too.
    assert leads_to(a.grad_fn, 1, single, sinks)
    assert not leads_to(a.grad_fn, 2, single, sinks)


@settings(max_examples=40, deadline=None)
@given(recipe=graph_recipes(), branch=st.integers(1, 4))
def test_deterministic_mode_with_branch_hand_off_is_the_reference_bit_for_bit(
        recipe: GraphRecipe, branch: int) -> None:
    def grads(engine: pargrad.Engine) -> list[np.ndarray | None]:
        leaves = [pargrad.tensor(a, requires_grad=flag)
                  for a, flag in zip(recipe.leaves, recipe.requires_grad)]
        roots = recipe.build(leaves)
        pargrad.backward(roots, [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)],
                         engine=engine)
        return [None if leaf.grad is None else leaf.grad.numpy() for leaf in leaves]

    want = grads(pargrad.SequentialEngine())
    with pargrad.ThreadedEngine(workers=2, deterministic=True, handoff_branch=branch) as engine:
        got = grads(engine)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == w.dtype and np.array_equal(g, w, equal_nan=True)  # type: ignore[union-attr]
