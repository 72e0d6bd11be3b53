"""checkpoint: gradients equal to the plain graph's on every engine, nesting, several
inputs and outputs, create_graph, errors, concurrent backward calls, and the memory saved."""

from __future__ import annotations

import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pargrad
from pargrad import Tensor, checkpoint, memory
from tests.conftest import CANONICAL

RNG = np.random.default_rng(3)


def layer(h: Tensor, w: Tensor, scale: float = 1.0) -> Tensor:
    return (h @ w).tanh() * scale


def grads_of(loss: Tensor, *leaves: Tensor) -> list[np.ndarray | None]:
    for t in leaves:
        t.grad = None
    loss.backward()
    return [None if t.grad is None else t.grad.data for t in leaves]


def assert_same(got: list[Any], expected: list[Any], bitwise: bool) -> None:
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if g is not None:
            if bitwise:
                np.testing.assert_array_equal(g, e)
            else:
                np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)


def leaves() -> tuple[Tensor, Tensor, Tensor]:
    x = pargrad.tensor(RNG.standard_normal((3, 4)), requires_grad=True)
    w = pargrad.tensor(RNG.standard_normal((4, 4)) / 2, requires_grad=True)
    v = pargrad.tensor(RNG.standard_normal((4, 4)) / 2, requires_grad=True)
    return x, w, v


def test_forward_keeps_only_the_inputs_and_backward_recomputes(engine: pargrad.Engine) -> None:
    x, w, _ = leaves()
    calls = []

    def fn(h: Tensor, w: Tensor) -> Tensor:
        calls.append(pargrad.is_grad_enabled())
        return layer(layer(h, w), w)

    y = checkpoint(fn, x, w)
    node = y.grad_fn
    assert node is not None and node.name() == "CheckpointBackward"
    # The node's edges go straight to the inputs: the graph fn recorded was dropped.
    assert [type(n).__name__ for n, _ in node.next_functions] == [
        "NoneType", "AccumulateGrad", "AccumulateGrad"]
    assert calls == [True]  # run once, recording, to find what fn differentiates through
    got = grads_of(y.sum(), x, w)
    assert calls == [True, True]  # recomputed once more, in backward
    assert_same(got, grads_of(fn(x, w).sum(), x, w), bitwise=False)
    with pargrad.no_grad():  # nothing to record: fn runs once, as itself
        out = checkpoint(fn, x, w)
    assert calls[3:] == [False] and out.grad_fn is None


def test_several_inputs_outputs_and_plain_arguments(engine: pargrad.Engine) -> None:
    x, w, v = leaves()
    k = pargrad.tensor(RNG.standard_normal(4))  # a Tensor that requires no grad

    def fn(h: Tensor, w: Tensor, scale: float, k: Tensor, v: Tensor,
           flag: bool) -> tuple[Tensor, ...]:
        a = layer(h, w, scale) + k
        return (a @ v if flag else a, (a * h).sum(axis=1), (h > 0).astype(np.int64))

    plain = fn(x, w, 0.5, k, v, True)
    out = checkpoint(fn, x, w, 0.5, k, v, True)
    assert len(out) == 3 and out[2].dtype == np.int64 and not out[2].requires_grad
    for a, b in zip(out, plain):
        np.testing.assert_array_equal(a.data, b.data)
    loss = lambda o: (o[0] ** 2).sum() + o[1].sum()
    assert_same(grads_of(loss(out), x, w, v, k), grads_of(loss(plain), x, w, v, k),
                bitwise=False)
    assert k.grad is None
    # Outputs that get no gradient (the second) arrive as zeros.
    first_only = checkpoint(fn, x, w, 0.5, k, v, True)[0].sum()
    assert_same(grads_of(first_only, x, w, v), grads_of(fn(x, w, 0.5, k, v, True)[0].sum(),
                                                        x, w, v), bitwise=False)


def test_nested_checkpoints(engine: pargrad.Engine) -> None:
    x, w, v = leaves()

    def inner(h: Tensor, w: Tensor) -> Tensor:
        return checkpoint(layer, checkpoint(layer, h, w, 2.0), w, 0.5)

    def outer(h: Tensor, w: Tensor, v: Tensor) -> Tensor:
        return checkpoint(inner, layer(checkpoint(inner, h, w), v), w)

    plain = layer(layer(layer(layer(layer(x, w, 2.0), w, 0.5), v), w, 2.0), w, 0.5)
    y = checkpoint(outer, x, w, v)
    np.testing.assert_array_equal(y.data, plain.data)
    # w is used in four layers: each checkpoint sums its part of w's gradient first, so
    # the sum is associated differently from the plain graph's (equal to rounding).
    assert_same(grads_of(y.sum(), x, w, v), grads_of(plain.sum(), x, w, v), bitwise=False)


def test_create_graph_differentiates_through_the_recomputation(engine: pargrad.Engine) -> None:
    x = pargrad.tensor(RNG.standard_normal((2, 3)), requires_grad=True)
    w = pargrad.tensor(RNG.standard_normal((3, 3)) / 2, requires_grad=True)

    def fn(h: Tensor, w: Tensor) -> Tensor:
        return checkpoint(layer, layer(h, w), w, 0.5)  # nested too

    assert pargrad.gradgradcheck(lambda h, w: checkpoint(fn, h, w), [x, w])
    # Third order: the gradient of a gradient is itself a checkpoint.
    t = pargrad.tensor([0.3, -0.7], requires_grad=True)
    checkpoint(lambda a: (a ** 4).sum(), t).backward(create_graph=True)
    d1, t.grad = t.grad, None
    assert d1.grad_fn is not None  # .grad is a recorded copy of the checkpoint's output
    assert d1.grad_fn.next_functions[0][0].name() == "CheckpointBackward"
    d1.sum().backward(create_graph=True)
    d2, t.grad = t.grad, None
    d2.sum().backward()
    np.testing.assert_allclose(t.grad.data, 24 * t.data, rtol=1e-12)


ACTIVATIONS = {"tanh": Tensor.tanh, "sin": Tensor.sin, "square": lambda t: t * t}


@st.composite
def closed_over_stacks(draw: st.DrawFn) -> tuple[list[np.ndarray], list[str], list[bool],
                                                 np.ndarray, int]:
    """Random layers: weights, activations, which weights each checkpointed segment gets
    as arguments (the others it closes over), an input, and the segment length."""
    depth = draw(st.integers(1, 4))
    widths = draw(st.lists(st.integers(1, 4), min_size=depth + 1, max_size=depth + 1))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal((widths[i], widths[i + 1])) / 2 for i in range(depth)]
    acts = draw(st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=depth,
                         max_size=depth))
    passed = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
    x = rng.standard_normal((draw(st.integers(1, 3)), widths[0]))
    return weights, acts, passed, x, draw(st.integers(1, depth))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # engines are reusable
@given(closed_over_stacks())
def test_weights_reached_by_closure_get_the_plain_graphs_gradient(
        engine: pargrad.Engine, stack: tuple[list[np.ndarray], list[str], list[bool],
                                             np.ndarray, int]) -> None:
    arrays, acts, passed, x_array, segment = stack
    weights = [pargrad.tensor(a, requires_grad=True) for a in arrays]
    x = pargrad.tensor(x_array, requires_grad=True)

    def apply_layers(h: Tensor, first: int, given: dict[int, Tensor]) -> Tensor:
        for i in range(first, min(first + segment, len(weights))):
            h = ACTIVATIONS[acts[i]](h @ given.get(i, weights[i]))
        return h

    expected = grads_of(_plain(x, weights, acts).sum(), x, *weights)
    h = x
    for first in range(0, len(weights), segment):
        mine = [i for i in range(first, min(first + segment, len(weights))) if passed[i]]

        def block(h: Tensor, *ws: Tensor, first: int = first, mine: list[int] = mine
                  ) -> Tensor:
            return apply_layers(h, first, dict(zip(mine, ws)))

        h = checkpoint(block, h, *[weights[i] for i in mine])
    assert_same(grads_of(h.sum(), x, *weights), expected, bitwise=False)


def _plain(x: Tensor, weights: list[Tensor], acts: list[str]) -> Tensor:
    for w, act in zip(weights, acts):
        x = ACTIVATIONS[act](x @ w)
    return x


def test_a_tensor_computed_before_fn_gets_its_gradient_through_its_history(
        engine: pargrad.Engine) -> None:
    w = pargrad.tensor([[1.0, -2.0], [0.5, 3.0]], requires_grad=True)
    x = pargrad.tensor([[2.0, 1.0]], requires_grad=True)
    scaled = w * 3  # a non-leaf fn closes over: its gradient must go on to w
    y = checkpoint(lambda h: (h @ scaled).sum(), x)
    assert [n.name() for n, _ in y.grad_fn.next_functions[1:]] == [
        "AccumulateGrad", "MultiplyBackward"]
    y.backward(retain_graph=True)  # (scaled's node is used again below)
    # d/dx sum(x @ 3w) = 3 * row sums of w; d/dw = 3 * x^T broadcast over columns.
    np.testing.assert_array_equal(x.grad.data, [[-3.0, 10.5]])
    np.testing.assert_array_equal(w.grad.data, [[6.0, 6.0], [3.0, 3.0]])
    out = checkpoint(lambda h: scaled, x)  # fn returns the outside tensor itself
    out.sum().backward()
    np.testing.assert_array_equal(w.grad.data, [[9.0, 9.0], [6.0, 6.0]])


def test_closed_over_leaves_in_nested_checkpoints_and_second_order(
        engine: pargrad.Engine) -> None:
    w = pargrad.tensor([0.7, -1.2, 0.4], requires_grad=True)
    x = pargrad.tensor([0.3, 0.9, -0.5], requires_grad=True)

    def inner(h: Tensor) -> Tensor:
        return (h * w).sin()

    def outer(h: Tensor) -> Tensor:
        return checkpoint(inner, checkpoint(inner, h)) * w

    expected = grads_of((inner(inner(x)) * w).sum(), x, w)
    assert_same(grads_of(checkpoint(outer, x).sum(), x, w), expected, bitwise=False)
    # Second order through a closure: d/dw of (d/dx sum(sin(x*w)*w)) . 1.
    (gx,) = pargrad.grad(checkpoint(lambda h: (h * w).sin() * w, x).sum(), x,
                         create_graph=True)
    (gw,) = pargrad.grad(gx.sum(), w)
    u = x.data * w.data
    expected_gw = 2 * w.data * np.cos(u) - w.data ** 2 * x.data * np.sin(u)
    np.testing.assert_allclose(gw.data, expected_gw, rtol=1e-12)


def test_a_closed_over_leaf_changed_in_place_before_backward_is_refused(
        engine: pargrad.Engine) -> None:
    x, w, _ = leaves()
    y = checkpoint(lambda h: layer(h, w), x)
    with pargrad.no_grad():
        w *= 0.5  # an optimizer step before the backward: recomputing would be wrong
    with pytest.raises(pargrad.BackwardError, match=r"CheckpointBackward: one of the tensors "
                       r"saved for its backward was changed by an in-place operation: saved "
                       r"tensor 1 \(shape \(4, 4\)"):
        y.sum().backward()
    assert x.grad is None and w.grad is None


def test_fn_that_reaches_another_tensor_in_backward_is_refused(engine: pargrad.Engine) -> None:
    x, w, v = leaves()
    use = [w]
    y = checkpoint(lambda h: layer(h, use[0]), x)
    use[0] = v  # not deterministic: backward's graph reaches a tensor forward's did not
    with pytest.raises(pargrad.BackwardError, match=r"CheckpointBackward: RuntimeError: "
                       r"checkpoint: recomputed in backward, fn reached a tensor that "
                       r"requires grad which it did not reach in forward \(a leaf of "
                       r"shape \(4, 4\)\)"):
        y.sum().backward()
    h = x * 2
    y = checkpoint(lambda a: a + h, x)
    h.mul_(1.5)  # h now has another history than the one forward saw
    with pytest.raises(pargrad.BackwardError, match=r"did not reach in forward \(output 0 "
                                                    r"of MultiplyBackward"):
        y.sum().backward()
    assert x.grad is None and w.grad is None and v.grad is None


def test_bad_outputs_and_a_second_backward(engine: pargrad.Engine) -> None:
    x, w, _ = leaves()
    with pytest.raises(TypeError, match="checkpoint: fn must return a Tensor or a tuple of "
                                        "Tensors, got a float"):
        checkpoint(lambda h: 1.0, x)
    y = checkpoint(layer, x, w).sum()
    y.backward()
    with pytest.raises(pargrad.BackwardError, match="retain_graph=True"):
        y.backward()
    y = checkpoint(layer, x, w).sum()
    x.grad = w.grad = None
    y.backward(retain_graph=True)
    first = [x.grad.data.copy(), w.grad.data.copy()]  # .grad accumulates in place
    y.backward()  # retained: a second backward recomputes again
    assert_same([x.grad.data, w.grad.data], [2 * g for g in first], bitwise=False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_anomaly_mode_names_the_failing_node_and_the_checkpoint(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.0, 1.0], requires_grad=True)
    with pargrad.detect_anomaly():
        y = checkpoint(lambda t: (t.sqrt() * 0).sum(), x)  # the checkpoint call
        with pytest.raises(pargrad.BackwardError, match="SqrtBackward: returned nan") as info:
            y.backward()
    notes = info.value.__notes__
    assert "created SqrtBackward, the node that failed" in notes[0]
    assert "(t.sqrt() * 0).sum()" in notes[0]  # recorded by the recomputation
    assert "created CheckpointBackward, whose backward called the one that failed" in notes[1]
    assert "the checkpoint call" in notes[1]


def test_backward_from_several_threads_at_once(engine: pargrad.Engine) -> None:
    x, w, v = leaves()

    def model(h: Tensor) -> Tensor:
        h = checkpoint(lambda a, b: checkpoint(layer, layer(a, b), b), h, w)
        return checkpoint(layer, h, v).sum()

    expected = grads_of(layer(layer(layer(x, w), w), v).sum(), x, w, v)
    w.grad = v.grad = None
    barrier = threading.Barrier(4)
    results: list[Any] = []

    def run() -> None:
        inputs = [pargrad.tensor(x.data, requires_grad=True) for _ in range(3)]
        barrier.wait()
        for t in inputs:
            model(t).backward(engine=engine)  # threads do not share use_engine blocks
            results.append(t.grad.data)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12
    for g in results:
        np.testing.assert_allclose(g, expected[0], rtol=1e-12)
    # w and v are shared by all twelve backward calls: no contribution is lost.
    np.testing.assert_allclose(w.grad.data, 12 * expected[1], rtol=1e-12)
    np.testing.assert_allclose(v.grad.data, 12 * expected[2], rtol=1e-12)


def mlp_peak(weights: list[Tensor], x: np.ndarray, segment: int | None) -> tuple[int, list[Any]]:
    """Peak traced memory of forward plus backward through tanh layers, checkpointing
    every ``segment`` layers (None: the plain graph)."""

    def run(h: Tensor, *ws: Tensor) -> Tensor:
        for w in ws:
            h = layer(h, w)
        return h

    for w in weights:
        w.grad = None
    memory.empty_cache()  # blocks kept from before would be reused untraced
    tracemalloc.start()
    try:
        h = pargrad.tensor(x)
        if segment is None:
            h = run(h, *weights)
        else:
            for s in range(0, len(weights), segment):
                h = checkpoint(run, h, *weights[s:s + segment])
        h.sum().backward()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, [w.grad.data for w in weights]


def test_deep_mlp_peak_memory(engine: pargrad.Engine, request: pytest.FixtureRequest) -> None:
    # 16 layers of 512 x 32 activations (128 KiB each): the plain graph keeps three per
    # layer until backward reaches it; checkpointing every 4 layers keeps 4 segment inputs
    # and one segment's intermediates at a time.
    width = 32
    weights = [pargrad.tensor(RNG.standard_normal((width, width)) / np.sqrt(width),
                              requires_grad=True) for _ in range(16)]
    x = RNG.standard_normal((512, width))
    plain_peak, plain = mlp_peak(weights, x, None)
    checkpointed_peak, checkpointed = mlp_peak(weights, x, 4)
    assert checkpointed_peak < 0.6 * plain_peak, (checkpointed_peak, plain_peak)
    bitwise = request.node.callspec.params["engine"] in CANONICAL
    assert_same(checkpointed, plain, bitwise)
