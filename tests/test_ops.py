"""Every op's gradient against finite differences, over hypothesis-generated shapes.

Each case checks float64 gradients with ``gradcheck`` and then, for float32 inputs, that
the gradient keeps float32 and agrees with the float64 one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pargrad
from tests.strategies import broadcast_pair, distinct, nonempty_shapes, shapes, values


def check(fn: Callable[..., Any], *arrays: np.ndarray, rtol: float = 1e-3,
          atol: float = 1e-5, eps: float = 1e-6) -> None:
    """gradcheck ``fn`` in float64, then compare a float32 run's gradients with float64."""
    inputs64 = [pargrad.tensor(a, dtype=np.float64, requires_grad=True) for a in arrays]
    assert pargrad.gradcheck(fn, inputs64, eps=eps, rtol=rtol, atol=atol)

    grads = {}
    for dtype in (np.float64, np.float32):
        ts = [pargrad.tensor(a, dtype=dtype, requires_grad=True) for a in arrays]
        out = fn(*ts)
        rng = np.random.default_rng(0)
        cotangent = rng.standard_normal(out.shape).astype(out.dtype)
        out.backward(cotangent)
        for t in ts:
            if t.grad is not None:
                assert t.grad.dtype == dtype
                assert t.grad.shape == t.shape
        grads[dtype] = [None if t.grad is None else t.grad.data for t in ts]
    for g64, g32 in zip(grads[np.float64], grads[np.float32]):
        assert (g64 is None) == (g32 is None)
        if g64 is not None:
            scale = max(1.0, float(np.max(np.abs(g64), initial=0)))
            np.testing.assert_allclose(g32, g64, rtol=2e-3, atol=2e-3 * scale)


# ----- elementwise, one argument -----
UNARY = {
    "negative": (lambda x: -x, {}),
    "exp": (pargrad.exp, {}),
    "log": (pargrad.log, {"low": 0.2, "high": 3.0}),
    "sqrt": (pargrad.sqrt, {"low": 0.2, "high": 3.0}),
    "abs": (pargrad.abs, {"away_from": 0.0}),
    "tanh": (pargrad.tanh, {}),
    "sigmoid": (pargrad.sigmoid, {"low": -6.0, "high": 6.0}),
    "relu": (pargrad.relu, {"away_from": 0.0}),
    "sin": (pargrad.sin, {}),
    "cos": (pargrad.cos, {}),
    "square": (lambda x: x ** 2, {}),
    "cube_root_like": (lambda x: x ** 0.5, {"low": 0.2, "high": 3.0}),
    "reciprocal": (lambda x: 1 / x, {"away_from": 0.0, "margin": 0.3}),
    "rpow": (lambda x: 2 ** x, {}),
    "scalar_mix": (lambda x: 1 - 3 * x / 2 + 0.5, {}),
    "square_op": (pargrad.square, {}),
    "log1p": (pargrad.log1p, {"low": -0.7, "high": 3.0}),
    "expm1": (pargrad.expm1, {}),
    "softplus": (pargrad.softplus, {}),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=shapes, data=st.data())
def test_unary(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    fn, domain = UNARY[name]
    check(fn, values(data.draw, shape, **domain))


# ----- elementwise, two arguments, with broadcasting -----
BINARY = {
    "add": (lambda x, y: x + y, {}, {}),
    "subtract": (lambda x, y: x - y, {}, {}),
    "multiply": (lambda x, y: x * y, {}, {}),
    "divide": (lambda x, y: x / y, {}, {"away_from": 0.0, "margin": 0.3}),
    "power": (lambda x, y: x ** y, {"low": 0.3, "high": 2.0}, {}),
    "maximum": (pargrad.maximum, {}, {}),
    "minimum": (pargrad.minimum, {}, {}),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair(), data=st.data())
def test_binary_broadcasting(name: str, pair: tuple[Any, Any], data: st.DataObject) -> None:
    fn, dom_x, dom_y = BINARY[name]
    check(fn, values(data.draw, pair[0], **dom_x), values(data.draw, pair[1], **dom_y))


@given(pair=broadcast_pair(), data=st.data())
def test_where(pair: tuple[Any, Any], data: st.DataObject) -> None:
    x, y = values(data.draw, pair[0]), values(data.draw, pair[1])
    cond = np.broadcast_to(x, np.broadcast_shapes(x.shape, y.shape)) > 0
    check(lambda a, b: pargrad.where(cond, a, b), x, y)


@given(shape=shapes, data=st.data())
def test_clip(shape: tuple[int, ...], data: st.DataObject) -> None:
    x = values(data.draw, shape, low=-3, high=3)
    x = np.where(np.abs(np.abs(x) - 1) < 0.05, 0.0, x)  # keep off the bounds
    check(lambda t: pargrad.clip(t, -1.0, 1.0), x)
    check(lambda t: pargrad.clip(t, None, 1.0), x)
    check(lambda t, lo, hi: pargrad.clip(t, lo, hi), x, np.array(-1.0), np.array(1.0))


# ----- reductions -----
@st.composite
def axis_for(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    ndim = len(shape)
    if ndim == 0:
        return None
    return draw(st.one_of(
        st.none(),
        st.integers(-ndim, ndim - 1),
        st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim).map(tuple),
    ))


REDUCTIONS = {
    "sum": pargrad.sum, "mean": pargrad.mean, "max": pargrad.max, "min": pargrad.min,
    "logsumexp": pargrad.logsumexp, "prod": pargrad.prod,
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy warns on means of empty axes
@given(shape=shapes, keepdims=st.booleans(), data=st.data())
def test_reductions(name: str, shape: tuple[int, ...], keepdims: bool,
                    data: st.DataObject) -> None:
    axis = data.draw(axis_for(shape))
    reduced = (range(len(shape)) if axis is None
               else [a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)])
    if name in ("max", "min") and any(shape[a] == 0 for a in reduced):
        return  # numpy refuses an empty max/min; the error is tested elsewhere
    x = distinct(data.draw, shape)
    check(lambda t: REDUCTIONS[name](t, axis=axis, keepdims=keepdims), x)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@given(shape=nonempty_shapes.filter(lambda s: len(s) > 0), data=st.data())
def test_softmax(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    fn = getattr(pargrad, name)
    # Weighting the outputs makes the check sensitive to every entry of the Jacobian.
    weights = np.arange(1, np.prod(shape) + 1).reshape(shape)
    check(lambda t: fn(t, axis=axis) * weights, values(data.draw, shape, low=-4, high=4))


# ----- linear algebra -----
@st.composite
def matmul_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m, k, n = draw(st.integers(1, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 3))
    batch = draw(broadcast_pair(min_side=1).filter(lambda p: len(p[0]) + len(p[1]) <= 3))
    kind = draw(st.sampled_from(["vv", "vm", "mv", "mm", "batched"]))
    if kind == "vv":
        return (k,), (k,)
    if kind == "vm":
        return (k,), batch[1] + (k, n)
    if kind == "mv":
        return batch[0] + (m, k), (k,)
    if kind == "mm":
        return (m, k), (k, n)
    return batch[0] + (m, k), batch[1] + (k, n)


@given(pair=matmul_shapes(), data=st.data())
def test_matmul(pair: tuple[Any, Any], data: st.DataObject) -> None:
    check(lambda a, b: a @ b, values(data.draw, pair[0]), values(data.draw, pair[1]))


@given(shape=shapes, data=st.data())
def test_transpose(shape: tuple[int, ...], data: st.DataObject) -> None:
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    x = values(data.draw, shape)
    check(lambda t: pargrad.transpose(t, perm) * np.arange(t.size).reshape(
        tuple(shape[p] for p in perm)), x)
    check(lambda t: t.T, x)


# ----- shapes -----
@given(shape=shapes, data=st.data())
def test_reshape_squeeze_expand(shape: tuple[int, ...], data: st.DataObject) -> None:
    x = values(data.draw, shape)
    check(lambda t: t.reshape(-1) * np.arange(t.size), x)
    check(lambda t: pargrad.expand_dims(t, 0).squeeze(0), x)
    check(lambda t: pargrad.squeeze(t), x)


@given(pair=broadcast_pair(), data=st.data())
def test_broadcast_to(pair: tuple[Any, Any], data: st.DataObject) -> None:
    target = np.broadcast_shapes(*pair)
    weights = np.arange(int(np.prod(target))).reshape(target)
    check(lambda t: pargrad.broadcast_to(t, target) * weights, values(data.draw, pair[0]))


@given(shape=nonempty_shapes.filter(lambda s: len(s) > 0), n=st.integers(1, 3),
       data=st.data())
def test_concatenate_and_stack(shape: tuple[int, ...], n: int, data: st.DataObject) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    arrays = [values(data.draw, shape) for _ in range(n)]
    cat_weights = np.arange(np.prod(shape) * n).reshape(
        np.concatenate(arrays, axis=axis).shape)
    check(lambda *ts: pargrad.concatenate(ts, axis=axis) * cat_weights, *arrays)
    st_weights = np.arange(np.prod(shape) * n).reshape(np.stack(arrays, axis=axis).shape)
    check(lambda *ts: pargrad.stack(ts, axis=axis) * st_weights, *arrays)


@given(shape=nonempty_shapes.filter(lambda s: len(s) > 0), data=st.data())
def test_split(shape: tuple[int, ...], data: st.DataObject) -> None:
    axis = data.draw(st.integers(0, len(shape) - 1))
    cut = data.draw(st.integers(0, shape[axis]))
    x = values(data.draw, shape)

    def fn(t: pargrad.Tensor) -> pargrad.Tensor:
        first, second = pargrad.split(t, [cut], axis=axis)
        return (first * 2).sum() + (second ** 2).sum()

    check(fn, x)


@given(shape=nonempty_shapes.filter(lambda s: len(s) > 0), data=st.data())
def test_indexing(shape: tuple[int, ...], data: st.DataObject) -> None:
    x = values(data.draw, shape)
    n = shape[0]
    idx = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=6))
    start = data.draw(st.integers(0, n - 1))
    step = data.draw(st.integers(1, 2))
    mask = data.draw(hnp.arrays(bool, (n,)))
    check(lambda t: t[np.array(idx)] * np.arange(1, len(idx) + 1).reshape(
        (-1,) + (1,) * (len(shape) - 1)), x)
    check(lambda t: t[start::step] * 3, x)
    check(lambda t: t[mask] * 2, x)
    check(lambda t: t[..., None][0], x)


# ----- the remaining ops and forms -----
@given(shape=nonempty_shapes, data=st.data())
def test_copy_astype_swapaxes(shape: tuple[int, ...], data: st.DataObject) -> None:
    x = values(data.draw, shape)
    check(lambda t: pargrad.copy(t) * 2, x)
    # A float32 round trip: finite differences need a step well above float32's spacing.
    check(lambda t: t.astype(np.float32).astype(np.float64) * 2, x, eps=1e-2, rtol=1e-2)
    if len(shape) >= 2:
        a1, a2 = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(0, 1))
        weights = np.arange(np.prod(shape)).reshape(np.swapaxes(x, a1, a2).shape)
        check(lambda t: pargrad.swapaxes(t, a1, a2) * weights, x)


@given(shape=nonempty_shapes, n=st.integers(1, 3), data=st.data())
def test_concatenate_flat_and_split_sections(shape: tuple[int, ...], n: int,
                                            data: st.DataObject) -> None:
    arrays = [values(data.draw, shape) for _ in range(n)]
    check(lambda *ts: pargrad.concatenate(ts, axis=None) * np.arange(n * np.prod(shape)),
          *arrays)
    if len(shape) > 0:
        parts = data.draw(st.sampled_from([d for d in range(1, shape[0] + 1)
                                           if shape[0] % d == 0]))
        check(lambda t: pargrad.stack([p.sum() * (k + 1) for k, p in
                                       enumerate(pargrad.split(t, parts))]), arrays[0])


@given(pair=broadcast_pair(), data=st.data())
def test_clip_with_broadcast_tensor_bounds(pair: tuple[Any, Any], data: st.DataObject) -> None:
    x = values(data.draw, pair[0], low=-3, high=3)
    lo = values(data.draw, pair[1], low=-2, high=-0.5)
    hi = lo + 2.0
    target = np.broadcast_shapes(x.shape, lo.shape)
    xb = np.broadcast_to(x, target)
    lob = np.broadcast_to(lo, target)
    if np.any(np.abs(xb - lob) < 0.05) or np.any(np.abs(xb - lob - 2.0) < 0.05):
        return  # a finite difference would cross a kink
    check(lambda t, a, b: pargrad.clip(t, a, b), x, lo, hi)


@given(pair=broadcast_pair(), dtype=st.sampled_from([np.float64, np.float32]),
       data=st.data())
def test_sum_to_sums_a_broadcast_gradient_back_as_np_sum_does(
        pair: tuple[Any, Any], dtype: type, data: st.DataObject) -> None:
    """``sum_to`` on a plain array (numpy's ufunc reduce, without np.sum's wrapper) and on
    a Tensor (np.sum's dispatch) gives np.sum's bits, in the target's shape."""
    from pargrad.shapes import sum_to

    target = pair[0]
    g = values(data.draw, np.broadcast_shapes(*pair), dtype)
    lead = g.ndim - len(target)
    axes = tuple(range(lead)) + tuple(lead + i for i, side in enumerate(target)
                                      if side == 1 and g.shape[lead + i] != 1)
    expected = np.sum(g, axis=axes, keepdims=True).reshape(target) if axes else g
    for got in (sum_to(g, target), sum_to(pargrad.tensor(g), target).data):
        assert got.shape == target and got.dtype == g.dtype
        assert got.tobytes() == np.ascontiguousarray(expected).tobytes()
    if g.ndim:  # a shape that target does not broadcast to: None
        assert sum_to(g, (*g.shape[:-1], g.shape[-1] + 2)) is None
