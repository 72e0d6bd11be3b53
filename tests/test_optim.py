"""pargrad.optim: each optimizer against values worked by hand and against a plain numpy
reference of each algorithm as PyTorch implements it (written here, out of place, one
step at a time); parameter groups, options and their errors; the state dict (a resumed
run continues bit for bit); updates during backward (bit for bit ``backward(); step();
zero_grad()`` on every engine; a failed, cancelled or overlapped backward changes
nothing); PyTorch as an optional cross-check; the training benchmark, run tiny."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad.optim import SGD, Adam, AdamW, Optimizer, RMSprop
from tests.helpers import blocking_function, release_once_cancelled

ROOT = Path(__file__).resolve().parent.parent
WAIT = 30  # seconds: a generous bound on anything these tests wait for


def leaf(values: Any) -> pargrad.Tensor:
    return pargrad.tensor(values, requires_grad=True)


def steps_with(opt: Optimizer, params: list[pargrad.Tensor],
               grads: list[list[np.ndarray]]) -> None:
    """One ``step`` per entry of ``grads`` (a gradient per parameter, set as ``.grad``)."""
    for step in grads:
        for p, g in zip(params, step):
            p.grad = pargrad.tensor(g)
        opt.step()


# ----- values worked by hand -----

def test_sgd_by_hand() -> None:
    w = leaf([1.0, -2.0])
    opt = SGD([w], lr=0.1)
    (w * w).sum().backward()                     # g = 2 w = [2, -4]
    opt.step()
    np.testing.assert_allclose(w.data, [0.8, -1.6], rtol=1e-15)
    assert opt.state[w] == {}                    # no momentum: nothing kept

    w = leaf([1.0, -2.0])
    opt = SGD([w], lr=0.1, momentum=0.5, dampening=0.5)
    steps_with(opt, [w], [[np.array([2.0, -4.0])], [np.array([1.0, 1.0])]])
    # b1 = g1 = [2, -4]; b2 = 0.5 b1 + 0.5 g2 = [1.5, -1.5]
    np.testing.assert_allclose(opt.state[w]["momentum_buffer"], [1.5, -1.5], rtol=1e-15)
    np.testing.assert_allclose(w.data, [1.0 - 0.2 - 0.15, -2.0 + 0.4 + 0.15], rtol=1e-15)

    w = leaf([1.0])
    opt = SGD([w], lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.5)
    steps_with(opt, [w], [[np.array([1.0])]])
    # g = 1 + 0.5 * 1 = 1.5; b = 1.5; nesterov: g + 0.5 b = 2.25
    np.testing.assert_allclose(w.data, [1.0 - 0.225], rtol=1e-15)

    w = leaf([1.0])
    opt = SGD([w], lr=0.1, weight_decay=0.5, maximize=True)
    steps_with(opt, [w], [[np.array([2.0])]])
    # g = -2 + 0.5 * 1 = -1.5: θ = 1 + 0.15
    np.testing.assert_allclose(w.data, [1.15], rtol=1e-15)


def test_adam_and_adamw_by_hand() -> None:
    # A constant gradient c: m_t = (1 - β1^t) c and v_t = (1 - β2^t) c², so m̂ = c and
    # v̂ = c², and every step moves θ by lr c / (|c| + eps).
    c = np.array([2.0, -0.5, 1e-3])
    w = leaf(np.zeros(3))
    opt = Adam([w], lr=0.01, eps=1e-3)
    steps_with(opt, [w], [[c]] * 3)
    np.testing.assert_allclose(w.data, -3 * 0.01 * c / (np.abs(c) + 1e-3), rtol=1e-12)
    assert opt.state[w]["step"] == 3
    np.testing.assert_allclose(opt.state[w]["exp_avg"], (1 - 0.9 ** 3) * c, rtol=1e-13)
    np.testing.assert_allclose(opt.state[w]["exp_avg_sq"], (1 - 0.999 ** 3) * c * c,
                               rtol=1e-13)

    # amsgrad keeps the largest v: after a big gradient then a small one, v_max is the
    # first step's v (0.01 * 100 = 1), not the second's (0.99 * 1 + 0.01 * 0.01).
    w = leaf([0.0])
    opt = Adam([w], lr=0.1, betas=(0.5, 0.99), eps=0.0, amsgrad=True)
    steps_with(opt, [w], [[np.array([10.0])], [np.array([0.1])]])
    v_max = opt.state[w]["max_exp_avg_sq"]
    np.testing.assert_allclose(v_max, [1.0], rtol=1e-14)
    m2 = 0.5 * 5.0 + 0.5 * 0.1
    step2 = 0.1 * (m2 / 0.75) / np.sqrt(1.0 / (1 - 0.99 ** 2))
    np.testing.assert_allclose(w.data, [-0.1 - step2], rtol=1e-13)

    # AdamW: θ shrinks by lr λ θ first, then Adam's step on the plain gradient.
    w = leaf([4.0])
    opt = AdamW([w], lr=0.1, weight_decay=0.5, eps=0.0)
    steps_with(opt, [w], [[np.array([3.0])], [np.array([3.0])]])
    expected = 4.0
    for _ in range(2):
        expected = expected - 0.1 * 0.5 * expected - 0.1
    np.testing.assert_allclose(w.data, [expected], rtol=1e-14)
    # Adam's L2 decay instead goes into the gradient, hence into the moments.
    w = leaf([4.0])
    opt = Adam([w], lr=0.1, weight_decay=0.5, eps=0.0)
    steps_with(opt, [w], [[np.array([3.0])]])
    np.testing.assert_allclose(opt.state[w]["exp_avg"], [0.1 * (3.0 + 2.0)], rtol=1e-14)


def test_rmsprop_by_hand() -> None:
    g = np.array([4.0])
    w = leaf([1.0])
    opt = RMSprop([w], lr=0.01, alpha=0.75, eps=0.0)
    steps_with(opt, [w], [[g], [g]])
    # v1 = 0.25 * 16 = 4 (θ - 0.01 * 4 / 2); v2 = 0.75 * 4 + 4 = 7
    np.testing.assert_allclose(w.data, [1.0 - 0.02 - 0.04 / np.sqrt(7.0)], rtol=1e-14)
    assert opt.state[w]["step"] == 2

    w = leaf([1.0])
    opt = RMSprop([w], lr=0.01, alpha=0.75, eps=0.0, centered=True, momentum=0.5)
    steps_with(opt, [w], [[g], [g]])
    # centered: a1 = 1, ṽ1 = 4 - 1 = 3; a2 = 0.75 + 1 = 1.75, ṽ2 = 7 - 1.75² = 3.9375
    b1 = 4 / np.sqrt(3.0)
    b2 = 0.5 * b1 + 4 / np.sqrt(3.9375)
    np.testing.assert_allclose(w.data, [1.0 - 0.01 * b1 - 0.01 * b2], rtol=1e-14)
    np.testing.assert_allclose(opt.state[w]["grad_avg"], [1.75], rtol=1e-15)


# ----- a plain numpy reference of each documented algorithm -----

def reference_sgd(theta: np.ndarray, grads: list[np.ndarray], o: dict[str, Any]) -> np.ndarray:
    b = None
    for g in grads:
        g = -g if o["maximize"] else g
        if o["weight_decay"]:
            g = g + o["weight_decay"] * theta
        if o["momentum"]:
            b = g if b is None else o["momentum"] * b + (1 - o["dampening"]) * g
            g = g + o["momentum"] * b if o["nesterov"] else b
        theta = theta - o["lr"] * g
    return theta


def reference_adam(theta: np.ndarray, grads: list[np.ndarray], o: dict[str, Any],
                   decoupled: bool = False) -> np.ndarray:
    b1, b2 = o["betas"]
    m = v = v_max = np.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        g = -g if o["maximize"] else g
        if decoupled:
            theta = theta - o["lr"] * o["weight_decay"] * theta
        elif o["weight_decay"]:
            g = g + o["weight_decay"] * theta
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat = m / (1 - b1 ** t)
        if o["amsgrad"]:
            v_max = np.maximum(v_max, v)
            v_hat = v_max / (1 - b2 ** t)
        else:
            v_hat = v / (1 - b2 ** t)
        theta = theta - o["lr"] * m_hat / (np.sqrt(v_hat) + o["eps"])
    return theta


def reference_rmsprop(theta: np.ndarray, grads: list[np.ndarray],
                      o: dict[str, Any]) -> np.ndarray:
    v = a = b = np.zeros_like(theta)
    for g in grads:
        g = -g if o["maximize"] else g
        if o["weight_decay"]:
            g = g + o["weight_decay"] * theta
        v = o["alpha"] * v + (1 - o["alpha"]) * g ** 2
        v_tilde = v
        if o["centered"]:
            a = o["alpha"] * a + (1 - o["alpha"]) * g
            v_tilde = v - a ** 2
        if o["momentum"] > 0:
            b = o["momentum"] * b + g / (np.sqrt(v_tilde) + o["eps"])
            theta = theta - o["lr"] * b
        else:
            theta = theta - o["lr"] * g / (np.sqrt(v_tilde) + o["eps"])
    return theta


def rate() -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 1e-3, 0.05, 0.3])


def factor() -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 0.1, 0.5, 0.9])


@st.composite
def sgd_options(draw: st.DrawFn) -> dict[str, Any]:
    momentum = draw(factor())
    nesterov = momentum > 0 and draw(st.booleans())
    return {"lr": draw(rate()), "momentum": momentum,
            "dampening": 0.0 if nesterov else draw(factor()),
            "weight_decay": draw(factor()), "nesterov": nesterov, "maximize": draw(st.booleans())}


@st.composite
def adam_options(draw: st.DrawFn) -> dict[str, Any]:
    return {"lr": draw(rate()), "betas": (draw(factor()), draw(st.sampled_from([0.0, 0.9, 0.999]))),
            "eps": draw(st.sampled_from([1e-8, 1e-3])), "weight_decay": draw(factor()),
            "amsgrad": draw(st.booleans()), "maximize": draw(st.booleans())}


@st.composite
def rmsprop_options(draw: st.DrawFn) -> dict[str, Any]:
    return {"lr": draw(rate()), "alpha": draw(st.sampled_from([0.5, 0.9, 0.99])),
            "eps": draw(st.sampled_from([1e-8, 1e-3])), "weight_decay": draw(factor()),
            "momentum": draw(factor()), "centered": draw(st.booleans()),
            "maximize": draw(st.booleans())}


# (the optimizer, a strategy for its options, its reference)
ALGORITHMS: dict[str, tuple[type[Optimizer], Any, Callable[..., np.ndarray]]] = {
    "SGD": (SGD, sgd_options(), reference_sgd),
    "Adam": (Adam, adam_options(), reference_adam),
    "AdamW": (AdamW, adam_options(), lambda t, g, o: reference_adam(t, g, o, decoupled=True)),
    "RMSprop": (RMSprop, rmsprop_options(), reference_rmsprop),
}

shapes = st.lists(st.integers(1, 4), max_size=3).map(tuple)


@pytest.mark.parametrize("name", list(ALGORITHMS))
@given(data=st.data())
def test_each_optimizer_follows_the_documented_algorithm(name: str, data: st.DataObject) -> None:
    cls, options, reference = ALGORITHMS[name]
    groups = data.draw(st.lists(st.tuples(st.lists(shapes, min_size=1, max_size=3), options),
                                min_size=1, max_size=3), label="groups")
    dtype = data.draw(st.sampled_from([np.float64, np.float32]), label="dtype")
    steps = data.draw(st.integers(1, 4), label="steps")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    start = [[rng.normal(size=s).astype(dtype) for s in group_shapes] for group_shapes, _ in groups]
    params = [[leaf(a.copy()) for a in arrays] for arrays in start]
    flat = [p for group in params for p in group]
    grads = [[rng.normal(size=p.shape).astype(dtype) for p in flat] for _ in range(steps)]
    opt = cls([{"params": ps, **o} for ps, (_, o) in zip(params, groups)], lr=0.01)
    steps_with(opt, flat, grads)
    i = 0
    for arrays, (_, o) in zip(start, groups):
        for theta in arrays:
            expected = reference(theta, [step[i] for step in grads], o)
            assert flat[i].dtype == dtype
            tolerance = 1e-12 if dtype == np.float64 else 2e-5
            np.testing.assert_allclose(flat[i].data, expected, rtol=tolerance,
                                       atol=tolerance * (1 + np.abs(theta).max(initial=0)))
            i += 1


def test_step_skips_parameters_without_a_gradient_and_bumps_versions() -> None:
    a, b = leaf([1.0]), leaf([2.0])
    opt = Adam([a, b], lr=0.1)
    (a * 3).sum().backward()
    version = a._version
    opt.step()
    assert b.data.tolist() == [2.0] and opt.state[b] == {}
    assert a._version == version + 1 and opt.state[a]["step"] == 1


def test_step_updates_in_place() -> None:
    array = np.array([1.0, 2.0])
    w = pargrad.from_numpy(array)
    w.requires_grad_()
    view = w[:1]
    opt = SGD([w], lr=0.5)
    (w * w).sum().backward()
    opt.step()
    assert array.tolist() == [0.0, 0.0] and view.data.tolist() == [0.0]


def test_zero_grad_and_closure() -> None:
    w = leaf([3.0])
    opt = SGD([w], lr=0.25)
    (w * w).sum().backward()
    grad = w.grad
    opt.zero_grad(set_to_none=False)
    assert w.grad is grad and grad.data.tolist() == [0.0]
    opt.zero_grad()
    assert w.grad is None
    (w * w).sum().backward(create_graph=True)
    grad = w.grad
    assert grad.grad_fn is not None and grad.requires_grad
    opt.zero_grad(set_to_none=False)  # the same Tensor, cut off from its graph, zeroed
    assert w.grad is grad and grad.grad_fn is None and not grad.requires_grad
    assert grad.data.tolist() == [0.0]
    opt.zero_grad()

    calls = []

    def closure() -> pargrad.Tensor:
        calls.append(pargrad.is_grad_enabled())
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    with pargrad.no_grad():  # the closure still records its graph
        loss = opt.step(closure)
    assert calls == [True] and loss.item() == 9.0 and w.item() == 1.5
    assert opt.step() is None


# ----- groups and options -----

def test_parameter_groups_fill_defaults_and_keep_their_own_options() -> None:
    a, b, c = leaf([1.0]), leaf([1.0]), leaf([1.0])
    opt = RMSprop([{"params": [a]}, {"params": b, "lr": 0.5, "centered": True}], momentum=0.1)
    assert [g["params"] for g in opt.param_groups] == [[a], [b]]
    first, second = opt.param_groups
    assert first == {"params": [a], "lr": 0.01, "alpha": 0.99, "eps": 1e-8,
                     "weight_decay": 0.0, "momentum": 0.1, "centered": False,
                     "maximize": False}
    assert second["lr"] == 0.5 and second["centered"] and second["momentum"] == 0.1
    opt.add_param_group({"params": (p for p in [c]), "alpha": 0.5})
    assert opt.param_groups[2]["alpha"] == 0.5 and opt.param_groups[2]["params"] == [c]
    assert set(opt.state) == {a, b, c}
    for p in (a, b, c):
        p.grad = pargrad.tensor([1.0])
    opt.step()
    assert "grad_avg" in opt.state[b] and "grad_avg" not in opt.state[a]
    assert "momentum_buffer" in opt.state[c]
    assert "group 1: 1 parameters, lr=0.5" in repr(opt)


@pytest.mark.parametrize("make, message", [
    (lambda p: SGD([p], lr=-0.1), "SGD: lr must be a number >= 0, got -0.1"),
    (lambda p: SGD([p], lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda p: SGD([p], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     "and dampening = 0"),
    (lambda p: SGD([{"params": [p], "momentum": -1}], lr=0.1), "momentum must be"),
    (lambda p: Adam([p], betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    (lambda p: AdamW([p], eps=-1e-8), "AdamW: eps must be"),
    (lambda p: Adam([p], lr=float("nan")), "lr must be"),
    (lambda p: RMSprop([p], alpha=-0.5), "alpha must be"),
    (lambda p: SGD([p, p], lr=0.1), r"params\[1\] is listed twice"),
    (lambda p: SGD([{"params": [p]}, {"params": [p]}], lr=0.1), "in two"),
    (lambda p: SGD([p * 2], lr=0.1), r"params\[0\] is not a leaf"),
    (lambda p: SGD([], lr=0.1), "empty list"),
    (lambda p: SGD([{"lr": 0.1}], lr=0.1), "needs a 'params' entry"),
])
def test_bad_options_and_parameters_raise_value_error(make: Callable[[pargrad.Tensor], Any],
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(leaf([1.0]))


def test_bad_parameter_types_raise_type_error() -> None:
    p = leaf([1.0])
    with pytest.raises(TypeError, match="got one Tensor; put it in a list"):
        SGD(p, lr=0.1)
    with pytest.raises(TypeError, match=r"params\[1\] is a ndarray, not a Tensor"):
        SGD([p, np.ones(1)], lr=0.1)
    with pytest.raises(TypeError, match="not a set"):
        SGD([{"params": {p}}], lr=0.1)
    opt = SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="listed twice"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


# ----- the state dict -----

@pytest.mark.parametrize("name", list(ALGORITHMS))
@given(data=st.data())
def test_a_run_resumed_from_a_state_dict_continues_bit_for_bit(name: str,
                                                               data: st.DataObject) -> None:
    cls, options, _ = ALGORITHMS[name]
    shape_list = data.draw(st.lists(shapes, min_size=1, max_size=3), label="shapes")
    o = data.draw(options, label="options")
    before, after = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    params = [leaf(rng.normal(size=s)) for s in shape_list]
    grads = [[rng.normal(size=s) for s in shape_list] for _ in range(before + after)]
    opt = cls([{"params": params[:1], **o}, {"params": params[1:]}], lr=0.02)
    steps_with(opt, params, grads[:before])
    saved = pickle.loads(pickle.dumps(opt.state_dict()))
    kept = copy.deepcopy(saved)
    values = [p.data.copy() for p in params]
    steps_with(opt, params, grads[before:])
    assert_same_state(opt.state_dict(), opt.state_dict())
    assert_same_state(kept, saved)  # later steps did not reach into the saved copy

    resumed = [leaf(v) for v in values]
    other = cls([{"params": resumed[:1]}, {"params": resumed[1:]}], lr=0.5)
    other.load_state_dict(saved)
    assert other.param_groups[1]["lr"] == 0.02
    steps_with(other, resumed, grads[before:])
    for p, q in zip(params, resumed):
        assert np.array_equal(p.data, q.data)
    assert_same_state(opt.state_dict(), other.state_dict())


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two state dicts hold the same bits."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for number, entry in a["state"].items():
        assert entry.keys() == b["state"][number].keys()
        for key, value in entry.items():
            assert np.array_equal(value, b["state"][number][key]), (number, key)


def test_state_dict_layout_and_load_errors() -> None:
    a, b = leaf([1.0, 2.0]), leaf(3.0)
    opt = Adam([{"params": [a]}, {"params": [b], "lr": 0.5}], amsgrad=True)
    a.grad = pargrad.tensor([1.0, 1.0])
    opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"] == [
        {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
         "amsgrad": True, "maximize": False, "params": [0]},
        {"lr": 0.5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
         "amsgrad": True, "maximize": False, "params": [1]}]
    assert list(saved["state"]) == [0]
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert type(saved["state"][0]["step"]) is int

    single = Adam([leaf([1.0, 2.0]), leaf(3.0)])
    with pytest.raises(ValueError, match="has 2 parameter groups, this optimizer 1"):
        single.load_state_dict(saved)
    wrong = Adam([{"params": [leaf([1.0, 2.0, 3.0])]}, {"params": [leaf(3.0)]}])
    with pytest.raises(ValueError, match=r"has shape \(2,\), but its parameter has shape"):
        wrong.load_state_dict(saved)
    assert all(entry == {} for entry in wrong.state.values())  # unchanged
    bad = copy.deepcopy(saved)
    bad["param_groups"][1]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be"):
        opt.load_state_dict(bad)
    assert opt.param_groups[1]["lr"] == 0.5

    as_float32 = Adam([{"params": [leaf(np.zeros(2, np.float32))]},
                       {"params": [leaf(np.float32(0))]}])
    as_float32.load_state_dict(saved)
    state = next(iter(as_float32.state.values()))
    assert state["exp_avg"].dtype == np.float32 and state["step"] == 1


# ----- updates during backward -----

def make_model(seed: int, dtype: Any = np.float64) -> list[pargrad.Tensor]:
    """Weights of a small two-branch network (see ``loss_of``)."""
    rng = np.random.default_rng(seed)
    shapes_ = [(6, 8), (8,), (8, 3), (8, 3), (3,)]
    return [leaf((rng.normal(size=s) * 0.5).astype(dtype)) for s in shapes_]


def loss_of(params: list[pargrad.Tensor], x: np.ndarray) -> pargrad.Tensor:
    """Every tensor here, the hidden layer and the shared scale included, gets at most
    two gradient contributions, and adding two numbers does not depend on their order:
    every engine then computes the same bits, in any order of nodes."""
    w1, b1, wa, wb, scale = params
    h = pargrad.tanh(pargrad.tensor(x) @ w1 + b1)
    ya = (h @ wa) * scale
    yb = (h @ wb) * scale
    return (ya * ya).mean() + yb.tanh().sum()


def batches(seed: int, count: int, dtype: Any = np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(5, 6)).astype(dtype) for _ in range(count)]


OPTIMIZERS: dict[str, Callable[[list[pargrad.Tensor]], Optimizer]] = {
    "SGD": lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda ps: Adam([{"params": ps[:2], "lr": 0.05}, {"params": ps[2:]}],
                            amsgrad=True, weight_decay=0.1),
    "AdamW": lambda ps: AdamW(ps, lr=0.01),
    "RMSprop": lambda ps: RMSprop(ps, centered=True, momentum=0.5, maximize=True),
}


def assert_same_run(plain: tuple[list[pargrad.Tensor], Optimizer],
                    stepped: tuple[list[pargrad.Tensor], Optimizer]) -> None:
    """The same parameters and state, bit for bit."""
    for p, q in zip(plain[0], stepped[0]):
        assert p.dtype == q.dtype and np.array_equal(p.data, q.data)
    assert_same_state(plain[1].state_dict(), stepped[1].state_dict())


def train_plain(make: Callable[[list[pargrad.Tensor]], Optimizer], xs: list[np.ndarray],
                dtype: Any = np.float64) -> tuple[list[pargrad.Tensor], Optimizer]:
    params = make_model(0, dtype)
    opt = make(params)
    for x in xs:
        loss_of(params, x).backward()
        opt.step()
        opt.zero_grad()
    return params, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_in_backward_is_bit_for_bit_backward_step_zero_grad(
        engine: pargrad.Engine, name: str) -> None:
    make = OPTIMIZERS[name]
    xs = batches(1, 4)
    plain = train_plain(make, xs)
    params = make_model(0)
    opt = make(params)
    with opt.step_in_backward():
        for x in xs:
            loss_of(params, x).backward()
            assert all(p.grad is None for p in params)
    assert_same_run(plain, (params, opt))
    assert all(opt.state[p] for p in params)


@pytest.fixture(params=["default", "handoff-1"])
def threaded_engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """The threaded engine as users get it, and one that hands every node off."""
    engine = (pargrad.ThreadedEngine() if request.param == "default"
              else pargrad.ThreadedEngine(handoff_threshold=1))
    with pargrad.use_engine(engine):
        yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_in_backward_on_the_threaded_engines_as_configured(
        threaded_engine: pargrad.Engine, name: str) -> None:
    xs = batches(2, 3, np.float32)
    plain = train_plain(OPTIMIZERS[name], xs, np.float32)
    params = make_model(0, np.float32)
    opt = OPTIMIZERS[name](params)
    with opt.step_in_backward():
        for x in xs:
            loss_of(params, x).backward()
    assert_same_run(plain, (params, opt))


def wide_loss(params: list[pargrad.Tensor], x: np.ndarray) -> pargrad.Tensor:
    """Independent branches, one weight each: their updates may all run at once. The
    ops are elementwise: a threaded engine keeps a graph dominated by matmuls on the
    calling thread (BLAS uses the cores already), and hands these off."""
    branches = [pargrad.tanh(pargrad.tensor(x) * w).sum() for w in params]
    return sum(branches[1:], start=branches[0])


def train_wide_under_a_tiny_switch_interval(
        backward: Callable[[pargrad.Tensor], None] = pargrad.Tensor.backward) -> set[str]:
    """Adam on eight independent branches, plain and with updates during backward (run
    by ``backward(loss)``) on the current engine, under a switch interval of 1 us; the
    two runs must agree. Returns the names of the threads that ran an update during
    backward."""
    rng = np.random.default_rng(3)
    start = [rng.normal(size=(16, 16)) for _ in range(8)]
    xs = [rng.normal(size=(16, 16)) for _ in range(3)]
    a = [leaf(s.copy()) for s in start]
    b = [leaf(s.copy()) for s in start]
    plain, stepped = Adam(a, lr=0.1), Adam(b, lr=0.1)
    threads: set[str] = set()
    lock = threading.Lock()
    update = stepped._update

    def spy(*args: Any) -> None:
        with lock:
            threads.add(threading.current_thread().name)
        update(*args)

    stepped._update = spy  # type: ignore[method-assign]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for x in xs:
            wide_loss(a, x).backward()
            plain.step()
            plain.zero_grad()
        with stepped.step_in_backward():
            for x in xs:
                backward(wide_loss(b, x))
    finally:
        sys.setswitchinterval(interval)
    assert_same_run((a, plain), (b, stepped))
    return threads


def test_many_updates_at_once_under_a_tiny_switch_interval(engine: pargrad.Engine) -> None:
    threads = train_wide_under_a_tiny_switch_interval()
    caller = threading.current_thread().name
    assert all(n == caller or n.startswith("pargrad-cpu-") for n in threads)
    if isinstance(engine, pargrad.SequentialEngine):
        assert threads == {caller}


def test_updates_of_handed_off_nodes_run_on_engine_workers() -> None:
    def on_the_workers(loss: pargrad.Tensor) -> None:
        # concurrent.futures.wait does not help run the backward (result() would): the
        # calling thread runs none of its nodes, so the updates run on the workers.
        future = pargrad.backward_async(loss)
        assert futures.wait([future], timeout=WAIT).done == {future}
        future.result()

    caller = threading.current_thread().name
    with pargrad.ThreadedEngine(handoff_threshold=1) as engine, pargrad.use_engine(engine):
        threads = train_wide_under_a_tiny_switch_interval(pargrad.Tensor.backward)
        assert all(n == caller or n.startswith("pargrad-cpu-") for n in threads)
        threads = train_wide_under_a_tiny_switch_interval(on_the_workers)
    assert threads and all(n.startswith("pargrad-cpu-") for n in threads), threads


def test_a_shared_parameter_is_updated_once_with_its_whole_gradient() -> None:
    w = leaf([1.0, 2.0])
    opt = SGD([w], lr=0.1)
    updates = []
    update = opt._update

    def spy(p: pargrad.Tensor, g: np.ndarray, *rest: Any) -> None:
        updates.append(g.copy())
        update(p, g, *rest)

    opt._update = spy  # type: ignore[method-assign]
    with opt.step_in_backward():
        ((w * w).sum() + (w * 3).sum() + w.sum()).backward()   # 2w + 3 + 1
    assert len(updates) == 1 and updates[0].tolist() == [6.0, 8.0]
    np.testing.assert_allclose(w.data, [0.4, 1.2], rtol=1e-15)


def test_the_handle_and_what_it_updates() -> None:
    a, b, frozen = leaf([1.0]), leaf([1.0]), pargrad.tensor([1.0])
    opt = SGD([a, frozen], lr=0.5)
    handle = opt.step_in_backward()
    with pytest.raises(RuntimeError, match="already updates during backward"):
        opt.step_in_backward()
    opt.add_param_group({"params": [b], "lr": 0.25})  # joins the updates
    (a * 2 + b * 4).sum().backward()
    assert a.data.tolist() == [0.0] and b.data.tolist() == [0.0]
    assert a.grad is None and b.grad is None and frozen.data.tolist() == [1.0]
    handle.remove()
    handle.remove()  # idempotent
    (a * 2).sum().backward()
    assert a.data.tolist() == [0.0] and a.grad.data.tolist() == [2.0]
    opt.step()  # back to plain steps
    assert a.data.tolist() == [-1.0]
    with opt.step_in_backward() as again:
        assert isinstance(again, pargrad.optim.StepInBackward)
    opt.step_in_backward().remove()


def test_two_optimizers_may_not_both_update_a_parameter_during_backward() -> None:
    a, b, c = leaf([1.0]), leaf([2.0]), leaf([3.0])
    first, second = SGD([a], lr=0.5), Adam([b, a])
    with first.step_in_backward():
        with pytest.raises(RuntimeError, match=r"do not combine: SGD\.step_in_backward\(\) "
                                               r"updates .*, and Adam\.step_in_backward"):
            second.step_in_backward()
        (a * 2 + b * 4).sum().backward()  # none of second's hooks is left (b's neither)
        assert a.data.tolist() == [0.0] and a.grad is None
        assert b.data.tolist() == [2.0] and b.grad.data.tolist() == [4.0]
        third = SGD([c], lr=0.5)
        with third.step_in_backward():
            with pytest.raises(RuntimeError, match="do not combine"):
                third.add_param_group({"params": [a]})
            assert len(third.param_groups) == 1 and a not in third.state  # unchanged
            (a * 2 + c * 4).sum().backward()
        assert a.data.tolist() == [-1.0] and c.data.tolist() == [1.0]


def test_grad_does_not_update() -> None:
    w = leaf([1.0])
    opt = SGD([w], lr=0.5)
    with opt.step_in_backward():
        (g,) = pargrad.grad((w * w).sum(), [w])
    assert w.data.tolist() == [1.0] and g.data.tolist() == [2.0]


def snapshot(params: list[pargrad.Tensor], opt: Optimizer) -> Any:
    return ([p.data.copy() for p in params], [p.grad for p in params],
            opt.state_dict())


def assert_unchanged(before: Any, params: list[pargrad.Tensor], opt: Optimizer) -> None:
    values, grads, state = before
    for p, v, g in zip(params, values, grads):
        assert np.array_equal(p.data, v)
        assert p.grad is None if g is None else np.array_equal(p.grad.data, g.data)
    assert_same_state(state, opt.state_dict())


class Updates:
    """Counts an optimizer's updates (its ``_update`` wrapped, on any thread); ``all``
    is set once ``count`` updates have run since ``expect(count)``."""

    def __init__(self, opt: Optimizer) -> None:
        self.lock = threading.Lock()
        self.ran = 0  # guarded by lock, as is expected
        self.expected = 0
        self.all = threading.Event()
        update = opt._update

        def counted(*args: Any) -> None:
            update(*args)
            with self.lock:
                self.ran += 1
                if self.ran == self.expected:
                    self.all.set()

        opt._update = counted  # type: ignore[method-assign]

    def expect(self, count: int) -> None:
        with self.lock:
            self.ran, self.expected = 0, count
            self.all.clear()


def failing_after(updated: threading.Event) -> Any:
    """A new identity ``Function`` class (``LateBoomBackward``) whose backward waits for
    ``updated`` and then raises ``ValueError("boom")``: a node that fails after the
    parameters were updated, on any engine."""

    class LateBoom(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: pargrad.Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: pargrad.Tensor) -> pargrad.Tensor:
            assert updated.wait(WAIT), "the parameters were never updated"
            raise ValueError("boom")

    return LateBoom


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_failed_backward_changes_no_parameter_and_no_state(
        engine: pargrad.Engine, name: str) -> None:
    make = OPTIMIZERS[name]
    xs = batches(4, 3)
    plain = train_plain(make, xs)
    params = make_model(0)
    opt = make(params)
    updates = Updates(opt)
    with opt.step_in_backward():
        loss_of(params, xs[0]).backward()
        before = snapshot(params, opt)

        # A node fails once every parameter was updated. (Its node is older than the
        # parameters' nodes, so the reference, and a threaded engine keeping the graph
        # on the caller, runs it after them; a worker running it waits for them.)
        updates.expect(len(params))
        bad = failing_after(updates.all).apply(leaf(np.ones(3)) * 2).sum()
        with pytest.raises(pargrad.BackwardError, match="LateBoomBackward") as info:
            (bad + loss_of(params, xs[1])).backward()
        assert repr(info.value.__cause__) == "ValueError('boom')"
        assert updates.ran == len(params)
        assert_unchanged(before, params, opt)

        # The backward fails at its very end, after every update ran: all are undone.
        versions = [p._version for p in params]

        def fail() -> None:
            raise ValueError("late failure")

        loss = loss_of(params, xs[1])
        loss.register_hook(lambda g: pargrad.queue_callback(fail))
        with pytest.raises(ValueError, match="late failure"):
            loss.backward()
        assert all(p._version >= v + 2 for p, v in zip(params, versions))  # written twice
        assert_unchanged(before, params, opt)

        for x in xs[1:]:  # and training goes on as if nothing had happened
            loss_of(params, x).backward()
    assert_same_run(plain, (params, opt))


def test_a_failed_backward_restores_a_gradient_that_was_there(engine: pargrad.Engine) -> None:
    params = make_model(0)
    opt = Adam(params, lr=0.1)
    old = pargrad.tensor(np.full(8, 0.5))
    params[1].grad = old
    before = snapshot(params, opt)

    def fail() -> None:
        raise ValueError("late failure")

    with opt.step_in_backward():
        loss = loss_of(params, batches(5, 1)[0])
        loss.register_hook(lambda g: pargrad.queue_callback(fail))
        with pytest.raises(ValueError):
            loss.backward()
    assert params[1].grad is old and old.data.tolist() == [0.5] * 8
    assert_unchanged(before, params, opt)


def test_a_failed_or_cancelled_async_backward_changes_nothing() -> None:
    # Two workers: one runs the parameters' nodes while the other is held by a node
    # that fails (or blocks) until they are all updated.
    engine = pargrad.ThreadedEngine(workers=2, handoff_threshold=1)
    block = blocking_function(WAIT)
    try:
        params = make_model(0)
        opt = SGD(params, lr=0.1, momentum=0.9)
        updates = Updates(opt)
        x = batches(6, 1)[0]
        with opt.step_in_backward():
            loss_of(params, x).backward(engine=engine)  # state to restore
            before = snapshot(params, opt)
            updates.expect(len(params))
            bad = failing_after(updates.all).apply(leaf(np.ones(3)) * 2).sum()
            future = pargrad.backward_async(bad + loss_of(params, x), engine=engine)
            assert isinstance(future.exception(timeout=WAIT), pargrad.BackwardError)
            assert updates.ran == len(params)
            assert_unchanged(before, params, opt)

            updates.expect(len(params))
            slow = block.apply(leaf(np.ones(3))).sum()
            future = pargrad.backward_async(slow + loss_of(params, x), engine=engine)
            assert block.started.wait(WAIT) and updates.all.wait(WAIT)
            release_once_cancelled(future, block)  # the backward runs until cancelled:
            assert future.cancel()                 # cancel() surely wins
            with pytest.raises(CancelledError):
                future.result(timeout=WAIT)
            assert updates.ran == len(params)
            assert_unchanged(before, params, opt)
    finally:
        block.release.set()
        engine.shutdown()


@pytest.mark.parametrize("how", ["backward", "backward_async"])
@pytest.mark.parametrize("engine_kind", ["sequential", "handoff-1"])
def test_a_failed_commit_undoes_the_updates(monkeypatch: pytest.MonkeyPatch, how: str,
                                            engine_kind: str) -> None:
    """The commit itself raises (after every node and hook ran): the updates made
    during the backward are undone, and the .grad committed early restored, whether
    the backward was called or started (its future then carries the error)."""
    engine = (pargrad.SequentialEngine() if engine_kind == "sequential"
              else pargrad.ThreadedEngine(handoff_threshold=1))
    try:
        params = make_model(0)
        make = OPTIMIZERS["Adam"]
        opt = make(params)
        updates = Updates(opt)
        xs = batches(7, 2)
        with opt.step_in_backward():
            loss_of(params, xs[0]).backward(engine=engine)  # state to restore
            old = pargrad.tensor(np.full(8, 0.5))
            params[1].grad = old
            before = snapshot(params, opt)

            def broken(self: Any, kept: Any) -> None:
                raise ValueError("commit failed")

            monkeypatch.setattr(pargrad.autograd._BackwardCall, "commit", broken)
            updates.expect(len(params))
            loss = loss_of(params, xs[1])
            if how == "backward":
                with pytest.raises(ValueError, match="commit failed"):
                    loss.backward(engine=engine)
            else:
                error = pargrad.backward_async(loss, engine=engine).exception(timeout=WAIT)
                assert repr(error) == "ValueError('commit failed')"
            assert updates.ran == len(params)  # all updated, then all undone
            assert params[1].grad is old
            assert_unchanged(before, params, opt)

            monkeypatch.undo()
            params[1].grad = None
            loss_of(params, xs[1]).backward(engine=engine)  # as if nothing had happened
        assert_same_run(train_plain(make, xs), (params, opt))
    finally:
        if isinstance(engine, pargrad.ThreadedEngine):
            engine.shutdown()


def test_a_backward_may_not_update_what_another_may_still_undo() -> None:
    """A second backward_async reaches a parameter the first updated while the first is
    still in flight (it may yet fail and restore the copy it took): the second fails
    at that parameter, changing nothing, and the first's undo restores its own copy."""
    engine = pargrad.ThreadedEngine(workers=2, handoff_threshold=1)
    block = blocking_function(WAIT)
    try:
        params = make_model(0)
        make = OPTIMIZERS["SGD"]
        opt = make(params)
        updates = Updates(opt)
        xs = batches(9, 2)

        def fail() -> None:
            raise ValueError("late failure")

        with opt.step_in_backward():
            loss_of(params, xs[0]).backward(engine=engine)
            before = snapshot(params, opt)
            updates.expect(len(params))
            first_loss = block.apply(leaf(np.ones(3))).sum() + loss_of(params, xs[1])
            first_loss.register_hook(lambda g: pargrad.queue_callback(fail))
            first = pargrad.backward_async(first_loss, engine=engine)
            assert updates.all.wait(WAIT)  # every parameter updated; the first blocked
            second = pargrad.backward_async(loss_of(params, xs[1]), engine=engine)
            error = second.exception(timeout=WAIT)
            assert isinstance(error, pargrad.BackwardError)
            assert "that another backward updated and may still undo" in str(error.__cause__)
            assert updates.ran == len(params)  # the second updated nothing
            block.release.set()
            assert repr(first.exception(timeout=WAIT)) == "ValueError('late failure')"
            assert_unchanged(before, params, opt)
            loss_of(params, xs[1]).backward(engine=engine)  # the first is over: updates
        assert_same_run(train_plain(make, xs), (params, opt))
    finally:
        block.release.set()
        engine.shutdown()


# ----- PyTorch, when it is installed -----

TORCH_CASES = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "nesterov": True, "maximize": True,
             "weight_decay": 0.1}),
    ("Adam", {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.1, "amsgrad": True}),
    ("Adam", {"lr": 0.01, "maximize": True}),
    ("AdamW", {"lr": 0.05, "amsgrad": True}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.3, "maximize": True}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.1}),
    ("RMSprop", {"lr": 0.01, "alpha": 0.9, "maximize": True}),
]


@pytest.mark.parametrize("name, options", TORCH_CASES)
def test_agrees_with_torch_optim_in_float64(name: str, options: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    start = [rng.normal(size=(4, 3)), rng.normal(size=(5,))]
    ours = [leaf(a.copy()) for a in start]
    theirs = [torch.tensor(a.copy(), requires_grad=True) for a in start]
    opt = getattr(pargrad.optim, name)(ours, **options)
    reference = getattr(torch.optim, name)(theirs, **options)
    for _ in range(6):
        for p, t in zip(ours, theirs):
            g = rng.normal(size=p.shape)
            p.grad, t.grad = pargrad.tensor(g), torch.tensor(g)
        opt.step()
        reference.step()
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)
    for p, t in zip(ours, theirs):
        for key, value in reference.state[t].items():
            np.testing.assert_allclose(np.asarray(opt.state[p][key]), value.numpy(),
                                       rtol=1e-12, atol=1e-14)


# ----- the benchmark program -----

def test_the_training_benchmark_runs_tiny() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.training", "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "SIMD" in done.stdout and "step_in_backward" in done.stdout
    assert done.stdout.count("ratio") >= 1
