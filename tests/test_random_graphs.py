"""The reference engine on random graphs, checked against finite differences.

The recipes come from ``strategies.graph_recipes``: fan-out, fan-in, diamonds, a custom
Function with two outputs (sometimes one unused), split nodes whose other outputs are
unused, leaves that need no grad, broadcasting, shared leaves and several roots.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

import pargrad
from pargrad.graph import AccumulateGrad, reachable
from tests.strategies import GraphRecipe, graph_recipes

# The engine fixture is stateless between examples, so sharing it is safe.
shared_fixture = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def ordered(engine: pargrad.Engine) -> bool:
    """Whether ``engine`` promises the canonical summation order on every graph."""
    return isinstance(engine, pargrad.SequentialEngine) or getattr(engine, "deterministic", False)


def run(recipe: GraphRecipe, engine: pargrad.Engine, repeats: int = 1) -> list[pargrad.Tensor]:
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    grads = [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)]
    for k in range(repeats):
        pargrad.backward(roots, grads, retain_graph=k < repeats - 1, engine=engine)
    return leaves


def numerical_gradient(recipe: GraphRecipe, k: int, eps: float = 1e-6) -> np.ndarray:
    arrays = [a.astype(np.float64) for a in recipe.leaves]
    grad = np.zeros(arrays[k].shape)
    for index in np.ndindex(arrays[k].shape):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[k][index] += eps
        minus[k][index] -= eps
        grad[index] = (recipe.loss(plus) - recipe.loss(minus)) / (2 * eps)
    return grad


@shared_fixture
@given(recipe=graph_recipes())
def test_matches_finite_differences(recipe: GraphRecipe, engine: pargrad.Engine) -> None:
    leaves = run(recipe, engine)
    for k, (leaf, flag) in enumerate(zip(leaves, recipe.requires_grad)):
        if not flag:
            assert leaf.grad is None
            continue
        expected = numerical_gradient(recipe, k)
        got = np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.data
        assert got.shape == leaf.shape and got.dtype == leaf.dtype
        scale = max(1.0, float(np.max(np.abs(expected), initial=0)))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * scale)


@shared_fixture
@given(recipe=graph_recipes())
def test_nodes_run_once_each_in_reverse_creation_order(
        recipe: GraphRecipe, in_order_engine: pargrad.Engine) -> None:
    # The reference runs the newest ready node first (a heap, and a chain's next node
    # straight when it is the newest): over a whole graph, strictly descending numbers.
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    ran: list[int] = []
    nodes = reachable([r.grad_fn for r in roots if r.grad_fn is not None])
    for node in nodes:
        if not isinstance(node, AccumulateGrad):
            node.register_prehook(lambda grads, nr=node.sequence_nr: ran.append(nr))
    grads = [g.astype(r.dtype) for g, r in zip(recipe.root_grads, roots)]
    pargrad.backward(roots, grads, engine=in_order_engine)
    assert ran == sorted(ran, reverse=True) and len(set(ran)) == len(ran)
    assert len(ran) == sum(not isinstance(node, AccumulateGrad) for node in nodes)


@shared_fixture
@given(recipe=graph_recipes(dtypes=(np.float64, np.float32)))
def test_repeated_backward_accumulates(recipe: GraphRecipe, engine: pargrad.Engine) -> None:
    once = run(recipe, engine)
    thrice = run(recipe, engine, repeats=3)
    for a, b in zip(once, thrice):
        if a.grad is None:
            assert b.grad is None
        else:
            assert b.grad.dtype == a.dtype
            expected = (a.grad.data + a.grad.data) + a.grad.data
            if ordered(engine):
                np.testing.assert_array_equal(b.grad.data, expected)
            else:  # arrival order may differ from call to call
                rtol = 1e-5 if a.dtype == np.float32 else 1e-12
                np.testing.assert_allclose(b.grad.data, expected, rtol=rtol, atol=rtol)
