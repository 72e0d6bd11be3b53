"""pargrad.grad and backward(inputs=...): gradients of chosen inputs, touching no .grad,
running only the nodes on a path to the inputs. Every test runs on every engine."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from tests.helpers import Boom
from tests.strategies import GraphRecipe, graph_recipes


class Count(pargrad.Function):
    """Identity that counts how often its backward runs (per name)."""

    calls: ClassVar[dict[str, int]] = {}
    lock = threading.Lock()

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, name: str) -> np.ndarray:
        ctx.name = name
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None]:
        with Count.lock:
            Count.calls[ctx.name] = Count.calls.get(ctx.name, 0) + 1
        return g, None


@pytest.fixture(autouse=True)
def _reset_counts() -> None:
    Count.calls = {}


def test_grad_returns_gradients_and_touches_no_grad(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    w = pargrad.tensor([3.0, -1.0], requires_grad=True)
    loss = (x * w).sum() + (x ** 2).sum()
    gx, gw = pargrad.grad(loss, [x, w])
    assert gx.data.tolist() == [5.0, 3.0] and gw.data.tolist() == [1.0, 2.0]
    assert x.grad is None and w.grad is None
    assert gx.grad_fn is None and not gx.requires_grad


def test_only_nodes_on_a_path_to_the_inputs_run(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = pargrad.tensor([3.0, 4.0], requires_grad=True)
    above_x = Count.apply(x * 2, "x-branch")       # on the path from the loss to x
    above_y = Count.apply(y * 3, "y-branch")       # leads only to y
    below = Count.apply(x + 1, "below-z")          # under the non-leaf input z
    z = below * 5
    loss = (above_x * 1.0).sum() + above_y.sum() + (z * z).sum()
    (gx,) = pargrad.grad(loss, [x], retain_graph=True)
    assert Count.calls == {"x-branch": 1, "below-z": 1}
    assert gx.data.tolist() == [2.0 + 2 * 25 * 2, 2.0 + 2 * 25 * 3]
    Count.calls = {}
    (gz,) = pargrad.grad(loss, [z], retain_graph=True)
    assert Count.calls == {}  # nothing below z, and neither branch, has to run
    assert gz.data.tolist() == (2 * z.data).tolist()
    Count.calls = {}
    pargrad.grad(loss, [y, z])
    assert Count.calls == {"y-branch": 1}


def test_non_leaf_inputs_and_roots_as_inputs(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, -2.0], requires_grad=True)
    h = pargrad.tanh(x)
    y = (h * h).sum()
    gh, gx, gy = pargrad.grad(y, [h, x, y])
    np.testing.assert_allclose(gh.data, 2 * np.tanh(x.data))
    np.testing.assert_allclose(gx.data, 2 * np.tanh(x.data) * (1 - np.tanh(x.data) ** 2))
    assert gy.data.tolist() == 1.0
    with pytest.warns(UserWarning, match="non-leaf"):
        assert h.grad is None


def test_the_same_input_twice_and_several_outputs(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    a, b = x * 2, x ** 3
    g1, g2 = pargrad.grad([a, b], [x, x], grad_outputs=[np.ones(2), np.array([1.0, 0.5])])
    assert g1.data.tolist() == g2.data.tolist() == [2.0 + 3.0, 2.0 + 6.0]
    assert g1.data is not g2.data


def test_unused_inputs(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    unused = pargrad.tensor([[1.0]], requires_grad=True, dtype=np.float32)
    loss = (x * x).sum()
    with pytest.raises(RuntimeError, match=r"inputs\[1\] got no gradient.*allow_unused=True"):
        pargrad.grad(loss, [x, unused], retain_graph=True)
    gx, none = pargrad.grad(loss, [x, unused], allow_unused=True, retain_graph=True)
    assert none is None and gx.data.tolist() == [2.0, 4.0]
    _, zeros = pargrad.grad(loss, [x, unused], materialize_grads=True)
    assert zeros.data.tolist() == [[0.0]] and zeros.dtype == np.float32
    with pytest.raises(ValueError, match="materialize_grads"):
        pargrad.grad(loss, [x], materialize_grads=True, allow_unused=False)


def test_bad_inputs_get_clear_errors(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * x).sum()
    with pytest.raises(RuntimeError, match=r"inputs\[0\] does not require grad"):
        pargrad.grad(loss, [pargrad.tensor([1.0])])
    with pytest.raises(TypeError, match=r"inputs\[0\] is a ndarray"):
        pargrad.grad(loss, [np.ones(2)])
    with pytest.raises(ValueError, match="inputs must not be empty"):
        pargrad.grad(loss, [])
    with pytest.raises(RuntimeError, match=r"outputs\[0\] does not require grad"):
        pargrad.grad(pargrad.tensor(1.0), [x])


def test_retain_graph_defaults_to_create_graph(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    loss = (pargrad.exp(x)).sum()
    pargrad.grad(loss, [x])
    with pytest.raises(pargrad.BackwardError, match="second time"):
        pargrad.grad(loss, [x])


def test_create_graph_gives_higher_derivatives(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.5, -1.0], requires_grad=True)
    (g,) = pargrad.grad((x ** 4).sum(), [x], create_graph=True)
    assert g.requires_grad
    (h,) = pargrad.grad(g.sum(), [x], create_graph=True)
    (t,) = pargrad.grad(h.sum(), [x])
    np.testing.assert_allclose(g.data, 4 * x.data ** 3)
    np.testing.assert_allclose(h.data, 12 * x.data ** 2)
    np.testing.assert_allclose(t.data, 24 * x.data)
    assert x.grad is None


def test_a_failing_node_raises_and_changes_nothing(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0], requires_grad=True)
    x.grad = pargrad.tensor([7.0])
    with pytest.raises(pargrad.BackwardError, match=r"BoomBackward.*boom"):
        pargrad.grad(Boom.apply(x).sum(), [x])
    with pytest.raises(pargrad.BackwardError, match="BoomBackward"):
        pargrad.backward(Boom.apply(x).sum(), inputs=[x])
    assert x.grad.data.tolist() == [7.0]


def test_backward_inputs_restricts_accumulation(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    w = pargrad.tensor([3.0, 4.0], requires_grad=True)
    h = x * w
    side = Count.apply(w * 1.0, "w-only")
    loss = (h * h).sum() + side.sum()
    loss.backward(inputs=[x, h], retain_graph=True)
    assert w.grad is None and Count.calls == {}
    np.testing.assert_allclose(x.grad.data, 2 * h.data * w.data)
    np.testing.assert_allclose(h.grad.data, 2 * h.data)  # a non-leaf input gets .grad too
    pargrad.backward(loss, inputs=x)
    np.testing.assert_allclose(x.grad.data, 4 * h.data * w.data)  # accumulates
    assert w.grad is None


def test_grad_from_many_threads_on_one_graph(engine: pargrad.Engine) -> None:
    rng = np.random.default_rng(0)
    x = pargrad.tensor(rng.normal(size=(8, 8)), requires_grad=True)
    w = pargrad.tensor(rng.normal(size=(8, 8)), requires_grad=True)
    h = pargrad.tanh(x @ w)
    loss = (h * h).sum()
    want = pargrad.grad(loss, [x, w, h], retain_graph=True, engine=pargrad.SequentialEngine())
    results: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            for _ in range(5):
                results.append(pargrad.grad(loss, [x, w, h], retain_graph=True, engine=engine))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 30
    for got in results:
        for g, e in zip(got, want):
            np.testing.assert_allclose(g.data, e.data, rtol=1e-12)
    assert x.grad is None and w.grad is None


@given(recipe=graph_recipes(), pick=st.lists(st.booleans(), min_size=4, max_size=4))
def test_grad_of_random_graphs_matches_the_reference_backward(
        recipe: GraphRecipe, pick: list[bool]) -> None:
    def leaves() -> list[pargrad.Tensor]:
        return [pargrad.tensor(a, requires_grad=r)
                for a, r in zip(recipe.leaves, recipe.requires_grad)]

    reference = leaves()
    pargrad.backward(recipe.build(reference), list(recipe.root_grads),
                     engine=pargrad.SequentialEngine())
    chosen = [i for i, r in enumerate(recipe.requires_grad) if r and pick[i]] or [0]
    for name in ("sequential", "threaded"):
        engine: pargrad.Engine = (pargrad.SequentialEngine() if name == "sequential" else
                                  pargrad.ThreadedEngine(workers=3, handoff_threshold=2))
        fresh = leaves()
        roots = recipe.build(fresh)
        got = pargrad.grad(roots, [fresh[i] for i in chosen], list(recipe.root_grads),
                           allow_unused=True, engine=engine)
        for i, g in zip(chosen, got):
            want = reference[i].grad
            if want is None:
                assert g is None
            else:
                assert g is not None
                np.testing.assert_allclose(g.data, want.data, rtol=1e-10, atol=1e-12)
        assert all(t.grad is None for t in fresh)
        if isinstance(engine, pargrad.ThreadedEngine):
            engine.shutdown()
