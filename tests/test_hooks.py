"""Hooks: tensor hooks, retain_grad, node pre-hooks and hooks, post-accumulate-grad
hooks; their order, their threads, their errors. Every test runs on every engine."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pargrad
from tests.helpers import Boom


def test_a_tensor_hook_can_replace_a_leaf_gradient(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    seen: list[list[float]] = []

    def hook(g: pargrad.Tensor) -> pargrad.Tensor:
        seen.append(g.data.tolist())
        return g * 10

    handle = x.register_hook(hook)
    (x * x).sum().backward()
    assert seen == [[2.0, 4.0]] and x.grad.data.tolist() == [20.0, 40.0]
    handle.remove()
    handle.remove()  # idempotent
    x.grad = None
    (x * x).sum().backward()
    assert x.grad.data.tolist() == [2.0, 4.0] and len(seen) == 1


def test_a_hook_on_a_leaf_registered_after_its_graph_was_built(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * 3).sum()  # the accumulator exists already
    x.register_hook(lambda g: g + 1)
    loss.backward()
    assert x.grad.data.tolist() == [4.0, 4.0]


def test_a_non_leaf_hook_changes_what_flows_on(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * 2
    h.register_hook(lambda g: g * 0.5)
    h.register_hook(lambda g: g + 1)  # hooks run in registration order
    (h * h).sum().backward()
    # dloss/dh = 2h = [4, 8] -> 0.5 * that + 1 = [3, 5] -> times dh/dx = 2
    assert x.grad.data.tolist() == [6.0, 10.0]


def test_retain_grad_keeps_a_non_leaf_gradient(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * 3
    assert not h.retains_grad
    h.retain_grad()
    x.retain_grad()  # a no-op on a leaf
    assert h.retains_grad
    h.register_hook(lambda g: g * 2)  # retain_grad sees the gradient after the hooks
    loss = (h * h).sum()
    loss.backward(retain_graph=True)
    np.testing.assert_allclose(h.grad.data, 2 * 2 * h.data)
    loss.backward()
    np.testing.assert_allclose(h.grad.data, 2 * 2 * 2 * h.data)  # accumulates
    np.testing.assert_allclose(x.grad.data, 2 * 2 * 2 * h.data * 3)


def test_grad_does_not_fill_retained_gradients(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * 3
    h.retain_grad()
    (g,) = pargrad.grad((h * h).sum(), [x])
    assert h.grad is None and x.grad is None
    np.testing.assert_allclose(g.data, 18 * x.data)


def test_the_order_of_one_nodes_hooks(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = pargrad.sin(x)
    y = h * 2
    order: list[str] = []
    node = y.grad_fn
    y.register_hook(lambda g: order.append("tensor") or None)
    node.register_prehook(lambda grads: order.append("pre") or None)
    node.register_hook(lambda grads_in, grads_out: order.append("post") or None)
    h.register_hook(lambda g: order.append("next node's tensor hook") or None)
    y.sum().backward()
    assert order == ["tensor", "pre", "post", "next node's tensor hook"]


def test_node_hooks_see_and_replace_gradients(engine: pargrad.Engine) -> None:
    a = pargrad.tensor([1.0, 2.0], requires_grad=True)
    b = pargrad.tensor([3.0, 4.0], requires_grad=True)
    y = a * b
    node = y.grad_fn
    seen: dict[str, Any] = {}

    def pre(grads: tuple[pargrad.Tensor, ...]) -> tuple[pargrad.Tensor, ...]:
        seen["pre"] = [g.data.tolist() for g in grads]
        return (grads[0] * 2,)

    def post(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        seen["post"] = ([g.data.tolist() for g in grad_inputs],
                        [g.data.tolist() for g in grad_outputs])
        return (None, grad_inputs[1] + 100)  # None keeps that gradient

    pre_handle = node.register_prehook(pre)
    with node.register_hook(post):
        y.backward(np.array([1.0, 1.0]), retain_graph=True)
    assert seen["pre"] == [[1.0, 1.0]]
    assert seen["post"] == ([[6.0, 8.0], [2.0, 4.0]], [[2.0, 2.0]])
    assert a.grad.data.tolist() == [6.0, 8.0] and b.grad.data.tolist() == [102.0, 104.0]
    pre_handle.remove()
    a.grad = b.grad = None
    y.backward(np.array([1.0, 1.0]))  # both removed (the post hook by the with block)
    assert a.grad.data.tolist() == [3.0, 4.0] and b.grad.data.tolist() == [1.0, 2.0]


def test_hook_errors_name_the_node_and_change_no_grad(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x.grad = pargrad.tensor([5.0, 5.0])
    h = pargrad.exp(x)

    def bad(g: pargrad.Tensor) -> None:
        raise KeyError("nope")

    handle = h.register_hook(bad)
    with pytest.raises(pargrad.BackwardError, match=r"ExpBackward: tensor hook .*bad raised "
                                                     r"KeyError") as info:
        h.sum().backward(retain_graph=True)
    assert isinstance(info.value.__cause__, KeyError)
    handle.remove()
    h.register_hook(lambda g: pargrad.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(pargrad.BackwardError, match=r"hook returned a gradient of shape \(3,\)"):
        h.sum().backward(retain_graph=True)
    h.grad_fn.register_prehook(lambda grads: grads[0])
    with pytest.raises(pargrad.BackwardError):
        h.sum().backward()
    assert x.grad.data.tolist() == [5.0, 5.0]


def test_registering_on_tensors_that_need_no_grad_is_an_error() -> None:
    t = pargrad.tensor([1.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        t.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="does not require grad"):
        t.retain_grad()
    x = pargrad.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="only be registered on leaf"):
        (x * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(TypeError, match="callable"):
        x.register_hook(3)  # type: ignore[arg-type]


def test_post_accumulate_grad_hooks_see_the_final_grad(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    b = pargrad.tensor([0.5], requires_grad=True)
    seen: list[tuple[str, list[float]]] = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(("w", t.grad.data.tolist())))
    b.register_post_accumulate_grad_hook(lambda t: seen.append(("b", t.grad.data.tolist())))
    loss = (w * w).sum() + (w * b).sum() + b.sum()
    loss.backward(retain_graph=True)
    assert sorted(seen) == [("b", [4.0]), ("w", [2.5, 4.5])]
    loss.backward()
    assert sorted(seen)[1:3] == [("b", [8.0]), ("w", [2.5, 4.5])]
    assert len(seen) == 4


def test_optimizer_in_backward(engine: pargrad.Engine) -> None:
    """A post-accumulate-grad hook may step its parameter in place and reset .grad."""
    rng = np.random.default_rng(1)
    x = pargrad.tensor(rng.normal(size=(16, 4)))
    w1 = pargrad.tensor(rng.normal(size=(4, 4)), requires_grad=True)
    w2 = pargrad.tensor(rng.normal(size=(4, 4)), requires_grad=True)
    copies = [pargrad.tensor(w1.data.copy(), requires_grad=True),
              pargrad.tensor(w2.data.copy(), requires_grad=True)]

    def sgd(p: pargrad.Tensor) -> None:
        with pargrad.no_grad():
            p -= 0.1 * p.grad
        p.grad = None

    for p in (w1, w2):
        p.register_post_accumulate_grad_hook(sgd)

    def loss(a: pargrad.Tensor, b: pargrad.Tensor) -> pargrad.Tensor:
        return (pargrad.tanh(x @ a) @ b).sum()

    for _ in range(3):
        loss(w1, w2).backward()
        loss(*copies).backward(engine=pargrad.SequentialEngine())
        for p in copies:
            sgd(p)
        assert w1.grad is None
    np.testing.assert_allclose(w1.data, copies[0].data, rtol=1e-12)
    np.testing.assert_allclose(w2.data, copies[1].data, rtol=1e-12)


def test_a_failed_backward_restores_early_commits(engine: pargrad.Engine) -> None:
    early = pargrad.tensor([1.0], requires_grad=True)
    late = pargrad.tensor([2.0], requires_grad=True)
    late.grad = pargrad.tensor([9.0])
    fired: list[float] = []
    early.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.item()))
    # early's accumulator is the newest node, so even the reference finishes it first.
    loss = Boom.apply(late * 2).sum() + (early * 3).sum()
    with pytest.raises(pargrad.BackwardError, match="BoomBackward: ValueError: boom"):
        loss.backward()
    assert fired == [3.0]
    assert early.grad is None and late.grad.data.tolist() == [9.0]

    def bad(t: pargrad.Tensor) -> None:
        raise RuntimeError("hook failed")

    late.register_post_accumulate_grad_hook(bad)
    with pytest.raises(pargrad.BackwardError, match=r"AccumulateGrad: post-accumulate-grad "
                                                     r"hook .*hook failed"):
        ((late * 2).sum() + (early * 3).sum()).backward()
    assert early.grad is None and late.grad.data.tolist() == [9.0]


def test_hooks_under_create_graph_get_differentiable_tensors(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * x
    handle = h.register_hook(lambda g: g * h)  # depends on x: the hook is differentiated too
    (g,) = pargrad.grad(h.sum(), [x], create_graph=True)
    np.testing.assert_allclose(g.data, 2 * x.data ** 3)  # (1 * h) * 2x
    (gg,) = pargrad.grad(g.sum(), [x], retain_graph=True)
    # The hook fires again in this backward, which passes through h's node: the gradient
    # 2x that reaches h becomes 2x * h, so d/dx sum(2 x h) = 2h + (2x * h) * 2x.
    np.testing.assert_allclose(gg.data, 2 * x.data ** 2 + 4 * x.data ** 4)
    handle.remove()
    (gg,) = pargrad.grad(g.sum(), [x])
    np.testing.assert_allclose(gg.data, 6 * x.data ** 2)


def test_which_threads_run_hooks(engine: pargrad.Engine) -> None:
    rng = np.random.default_rng(2)
    leaves = [pargrad.tensor(rng.normal(size=(32, 32)), requires_grad=True) for _ in range(4)]
    names: list[str] = []
    lock = threading.Lock()

    def record(g: Any) -> None:
        with lock:
            names.append(threading.current_thread().name)

    branches = []
    for leaf in leaves:
        h = pargrad.tanh(leaf @ leaf)
        h.register_hook(record)
        leaf.register_post_accumulate_grad_hook(record)
        branches.append(h.sum())
    pargrad.backward(branches)
    assert len(names) == 8
    caller = threading.current_thread().name
    assert all(n == caller or n.startswith("pargrad-cpu-") for n in names)
    if isinstance(engine, pargrad.SequentialEngine):
        assert set(names) == {caller}


def test_hooks_from_many_threads_at_once(engine: pargrad.Engine) -> None:
    shared = pargrad.tensor(np.ones(16), requires_grad=True)
    calls: list[float] = []
    lock = threading.Lock()

    def count(g: pargrad.Tensor) -> None:
        with lock:
            calls.append(float(g.data.sum()))

    shared.register_hook(count)
    errors: list[BaseException] = []

    def step(k: int) -> None:
        try:
            for _ in range(10):
                local = pargrad.tensor(np.full(16, float(k)), requires_grad=True)
                h = (shared * local)
                h.register_hook(lambda g: g * 2)
                pargrad.grad(h.sum(), [shared, local], engine=engine)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=step, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(calls) == sorted(2.0 * 16 * k for k in range(6) for _ in range(10))
