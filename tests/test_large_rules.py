"""The one-buffer form of the rules (pargrad/ops/large.py) and their fused kernels
(pargrad/ops/fused.py, where numba is installed) against their operator form.

Each rule runs on the same arrays twice: with ``OUT_MIN`` at 0 (every call takes the
one-buffer form, or the fused kernel under ``kernels=fused``) and above the arrays' size
(the operator form); the gradients must be
the same bits once cast to the input's dtype (as ``Node.apply`` casts them), in float64
and float32, also where the incoming gradient is a read-only
broadcast (as ``sum``'s rule returns it), which the rules must never write into.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pargrad
from pargrad.ops import elementwise as e
from pargrad.ops import fused, large, nn, reductions

SHAPE = (40, 50)
# The fused kernels that sum rows in their own order: close to the numpy form, not equal.
NOT_BITWISE_FUSED = {"softmax", "log_softmax"}


@pytest.fixture(params=["numpy", "fused"])
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """The rules' large form: numpy's out= steps, or the fused kernels (needs numba)."""
    if request.param == "fused" and not fused.available():
        pytest.skip("numba is not installed (pip install 'pargrad[fast]')")
    previous = fused.set_enabled(request.param == "fused")
    yield request.param
    fused.set_enabled(previous)


def _cases() -> dict[str, tuple[Any, int, Callable[[np.random.Generator], tuple[Any, ...]],
                                dict[str, Any]]]:
    """name -> (op, argument, its arguments from a generator, params)."""
    def one(rng: np.random.Generator) -> tuple[Any, ...]:
        return (rng.uniform(-3, 3, SHAPE),)

    def positive(rng: np.random.Generator) -> tuple[Any, ...]:
        return (rng.uniform(0.1, 3, SHAPE),)

    def two(rng: np.random.Generator) -> tuple[Any, ...]:
        return rng.uniform(-3, 3, SHAPE), rng.uniform(0.5, 3, SHAPE)

    def with_zeros(rng: np.random.Generator) -> tuple[Any, ...]:
        x = rng.uniform(-3, 3, SHAPE)
        x[::3] = 0.0
        return (x,)

    def ties(rng: np.random.Generator) -> tuple[Any, ...]:
        return (rng.integers(0, 3, SHAPE).astype(float),)

    axis = {"axis": 1}
    rows = {"axis": (1,), "keepdims": False}
    return {
        "divide/y": (e.divide, 1, two, {}),
        "sqrt": (e.sqrt, 0, positive, {}),
        "square": (e.square, 0, one, {}),
        "log1p": (e.log1p, 0, positive, {}),
        "expm1": (e.expm1, 0, one, {}),
        "abs": (e.abs, 0, with_zeros, {}),
        "relu": (e.relu, 0, with_zeros, {}),
        "sin": (e.sin, 0, one, {}),
        "cos": (e.cos, 0, one, {}),
        "tanh": (e.tanh, 0, one, {}),
        "sigmoid": (e.sigmoid, 0, one, {}),
        "softplus": (e.softplus, 0, one, {}),
        "softmax": (nn._softmax_op, 0, one, axis),
        "log_softmax": (nn._log_softmax_op, 0, one, axis),
        "logsumexp": (reductions._logsumexp_op, 0, one, rows),
        "logsumexp/all": (reductions._logsumexp_op, 0, one, {"axis": None, "keepdims": True}),
        "max": (reductions._max, 0, ties, rows),
        "min": (reductions._min, 0, ties, {"axis": (0,), "keepdims": True}),
        "cumsum": (reductions._cumsum, 0, one, {"axis": 1}),
    }


CASES = _cases()


def _rule_both_ways(name: str, dtype: Any, broadcast_g: bool,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    op, argnum, make, params = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    args = tuple(a.astype(dtype) for a in make(rng))
    ans = np.asarray(op.forward(*args, **params))
    if broadcast_g:
        g = np.broadcast_to(dtype(0.75), ans.shape)
    else:
        g = rng.standard_normal(ans.shape).astype(dtype)
        g.flags.writeable = False  # a rule writing into it raises
    results = []
    for out_min in (0, 10**9):
        monkeypatch.setattr(large, "OUT_MIN", out_min)
        result = np.asarray(op.rules[argnum](g, ans, *args, **params))
        results.append(result.astype(dtype, copy=False))  # as Node.apply casts it
    return results[0], results[1], g


@pytest.mark.parametrize("broadcast_g", [False, True], ids=["g", "broadcast-g"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_large_form_gives_the_operator_forms_bits(
        name: str, dtype: Any, broadcast_g: bool, kernels: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    large_form, operators, g = _rule_both_ways(name, dtype, broadcast_g, monkeypatch)
    assert large_form.shape == operators.shape
    assert large_form.dtype == operators.dtype
    if kernels == "fused" and name in NOT_BITWISE_FUSED and dtype == np.float64:
        np.testing.assert_allclose(large_form, operators, rtol=1e-12, atol=1e-15)
        assert large_form.tobytes() != operators.tobytes() or broadcast_g  # the kernel ran
    else:
        assert large_form.tobytes() == operators.tobytes()
    assert not np.shares_memory(large_form, g)


@pytest.mark.skipif(not fused.available(), reason="numba is not installed")
@pytest.mark.parametrize("name", ["tanh_backward", "sigmoid_backward", "relu_backward"])
def test_fused_elementwise_kernel_runs_on_a_slice(name: str) -> None:
    """The lead's chunks call a kernel on slices: writing half and half gives the whole."""
    previous = fused.set_enabled(True)
    try:
        run = fused.kernel(name)
    finally:
        fused.set_enabled(previous)
    assert run is not None
    rng = np.random.default_rng(7)
    g, other = rng.standard_normal(1000), rng.uniform(-1, 1, 1000)
    whole, halves = np.empty(1000), np.empty(1000)
    run(whole, g, other)
    run(halves[:500], g[:500], other[:500])
    run(halves[500:], g[500:], other[500:])
    assert whole.tobytes() == halves.tobytes()
    expected = {"tanh_backward": g * (1 - other * other),
                "sigmoid_backward": g * (other * (1 - other)),
                "relu_backward": g * (other > 0)}[name]
    assert whole.tobytes() == expected.tobytes()


def test_a_numba_that_fails_to_import_turns_the_kernels_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, Any]:
        raise ImportError("numba needs an older numpy")

    monkeypatch.setattr(fused, "_available", True)
    monkeypatch.setattr(fused, "_enabled", True)
    monkeypatch.setattr(fused, "_kernels", {})
    monkeypatch.setattr(fused, "_compile", broken)
    g = np.full(large.OUT_MIN, 0.5)
    ans = np.linspace(-0.9, 0.9, large.OUT_MIN)
    with pytest.warns(RuntimeWarning, match="fused kernels are off: numba failed"):
        result = e.tanh.rules[0](g, ans, ans)
    assert result.tobytes() == (g * (1 - ans * ans)).tobytes()
    assert not fused.enabled() and not fused.available()
    assert fused.kernel("tanh_backward") is None


def test_switch_without_numba_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_available", False)
    monkeypatch.setattr(fused, "_enabled", False)
    with pytest.raises(ImportError, match="numba"):
        fused.set_enabled(True)
    assert not fused.enabled()
    assert fused.kernel("tanh_backward") is None


def test_plain_means_no_tensor_among_the_arrays() -> None:
    big = np.zeros(large.OUT_MIN)
    assert large.plain(big, big)
    assert not large.plain(big, pargrad.tensor(big))
    assert not large.plain(pargrad.tensor(big))


def test_arrays_below_out_min_take_the_operator_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Just below OUT_MIN no out= step runs (the out= forms would raise here)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a one-buffer step ran on a small array")

    monkeypatch.setattr(fused, "_enabled", False)
    x = np.linspace(-2, 2, large.OUT_MIN - 1)
    g, ans = np.ones_like(x), np.tanh(x)
    monkeypatch.setattr(large, "plain", refuse)
    np.testing.assert_array_equal(e.tanh.rules[0](g, ans, x), 1 - ans * ans)


@pytest.mark.timeout(120)
def test_engines_agree_bitwise_with_the_same_kernel_set(
        canonical_engine: pargrad.Engine, kernels: str) -> None:
    """Deterministic mode's contract with either kernel set: the reference's bits."""
    rng = np.random.default_rng(11)
    x = pargrad.tensor(rng.standard_normal((64, 600)), requires_grad=True)

    def grads(engine: pargrad.Engine) -> bytes:
        x.grad = None
        h = pargrad.tanh(x) * 1.5 + pargrad.sigmoid(x) + pargrad.relu(x)
        loss = pargrad.sum(pargrad.log_softmax(h, axis=1) * pargrad.softmax(x, axis=1))
        pargrad.backward([loss], engine=engine)
        assert x.grad is not None
        return x.grad.numpy().tobytes()

    assert grads(canonical_engine) == grads(pargrad.SequentialEngine())


def test_retained_graph_gives_a_fresh_gradient_each_backward() -> None:
    """A second backward of a retained graph must not write into the first's result."""
    x = pargrad.tensor(np.linspace(-2, 2, 4 * large.OUT_MIN), requires_grad=True)
    y = pargrad.tanh(pargrad.sigmoid(x))
    seed = pargrad.tensor(np.full(x.shape, 0.5))
    first = pargrad.grad([y], [x], [seed], retain_graph=True)[0].numpy().copy()
    again = pargrad.grad([y], [x], [seed], retain_graph=True)[0]
    held = pargrad.grad([y], [x], [seed * 2], retain_graph=True)[0]
    np.testing.assert_array_equal(again.numpy(), first)
    np.testing.assert_array_equal(held.numpy(), 2 * first)
    assert not np.shares_memory(again.numpy(), held.numpy())
    np.testing.assert_array_equal(seed.numpy(), 0.5)  # the caller's grad_output untouched


def test_large_form_matches_finite_differences_through_create_graph() -> None:
    """With create_graph the rules get Tensors and take the operator form: second
    derivatives of a large input are right (tanh'' = -2 tanh (1 - tanh^2))."""
    x = pargrad.tensor(np.linspace(-2, 2, 2 * large.OUT_MIN), requires_grad=True)
    (dx,) = pargrad.grad([pargrad.sum(pargrad.tanh(x))], [x], create_graph=True)
    (ddx,) = pargrad.grad([pargrad.sum(dx)], [x])
    t = np.tanh(x.numpy())
    np.testing.assert_allclose(dx.numpy(), 1 - t * t, rtol=1e-12)
    np.testing.assert_allclose(ddx.numpy(), -2 * t * (1 - t * t), rtol=1e-12, atol=1e-15)


# ----- a broadcast gradient of one value (a sum's), folded as a scalar -----
# The rules that fold it (tanh's, sigmoid's and relu's fused kernels' scalar twins, the
# numpy forms' multiplication by a broadcast 1, multiply's rule keeping a broadcast of one
# value times a scalar, sum's and mean's direct broadcast) must give the bits of the same
# rule on the gradient written out in full, and of the operator form.
_FOLDING = {"tanh": (e.tanh, 0), "sigmoid": (e.sigmoid, 0), "relu": (e.relu, 0)}
_SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 5e-324]


def _kernel_sets() -> list[bool]:
    return [False, True] if fused.available() else [False]


def _with_kernels(on: bool, run: Callable[[], Any]) -> Any:
    previous = fused.set_enabled(on)
    try:
        return run()
    finally:
        fused.set_enabled(previous)


def _layouts(value: Any, shape: tuple[int, ...], dtype: Any) -> dict[str, np.ndarray]:
    """The same gradient (every element ``value``) as the rules may receive it."""
    full = np.full(shape, value, dtype)
    read_only = full.copy()
    read_only.flags.writeable = False
    strided = np.full((*shape[:-1], 2 * shape[-1]), value, dtype)[..., ::2]
    row = np.broadcast_to(np.full(shape[-1:], value, dtype), shape)  # strides (0, ..., s)
    return {"broadcast": np.broadcast_to(dtype(value), shape), "contiguous": full,
            "read-only": read_only, "strided": strided, "row-broadcast": row}


_sizes = st.sampled_from([large.OUT_MIN - 1, large.OUT_MIN, large.OUT_MIN + 1, 100])


@st.composite
def _folding_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Any, float, int]:
    size = draw(_sizes)
    shape = draw(st.sampled_from([(size,), (2, (size + 1) // 2), (size, 1)]))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    value = draw(st.sampled_from([1.0, 0.75, -2.5, 0.0, -0.0, np.nan, np.inf, 1e-300]))
    return shape, dtype, value, draw(st.integers(0, 2**32 - 1))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0
@settings(max_examples=30)
@given(case=_folding_cases(), name=st.sampled_from(sorted(_FOLDING)))
def test_a_folded_broadcast_gives_the_bits_of_the_full_gradient(
        case: tuple[tuple[int, ...], Any, float, int], name: str) -> None:
    shape, dtype, value, seed = case
    op, argnum = _FOLDING[name]
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, shape).astype(dtype)
    x.reshape(-1)[rng.integers(0, x.size, len(_SPECIAL))] = _SPECIAL  # NaNs, zeros, inf
    x.flags.writeable = False
    ans = np.asarray(op.forward(x))
    ans.flags.writeable = False
    expected = np.asarray(op.rules[argnum](*(np.full(shape, value, dtype), ans, x)))
    operators = {"tanh": lambda g: g * (1 - ans * ans),
                 "sigmoid": lambda g: g * (ans * (1 - ans)),
                 "relu": lambda g: g * (x > 0)}[name](np.full(shape, value, dtype))
    assert expected.tobytes() == operators.astype(expected.dtype).tobytes()
    for on in _kernel_sets():
        for layout, g in _layouts(value, shape, dtype).items():
            result = np.asarray(_with_kernels(on, lambda g=g: op.rules[argnum](g, ans, x)))
            assert result.shape == shape, (layout, on)
            assert result.astype(dtype, copy=False).tobytes() == \
                expected.astype(dtype, copy=False).tobytes(), (layout, on)
            assert not np.shares_memory(result, g) or result is g is None, (layout, on)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0
@settings(max_examples=30)
@given(case=_folding_cases(),
       scalar=st.sampled_from([1.5, 2, -0.0, np.float32(0.5), np.float64(3.0), "0-d"]),
       argnum=st.sampled_from([0, 1]))
def test_multiply_keeps_a_broadcast_times_a_scalar_a_broadcast(
        case: tuple[tuple[int, ...], Any, float, int], scalar: Any, argnum: int) -> None:
    shape, dtype, value, _ = case
    other = np.array(-1.25) if isinstance(scalar, str) else scalar
    array = np.zeros(shape, dtype)  # the operand whose gradient is not asked
    args = (array, other) if argnum == 0 else (other, array)
    for layout, g in _layouts(value, shape, dtype).items():
        result = np.asarray(e.multiply.rules[argnum](g, None, *args))
        expected = np.full(shape, value, dtype) * other
        assert result.dtype == expected.dtype and result.shape == shape, layout
        assert result.tobytes() == expected.tobytes(), layout
        if layout == "broadcast" and g.size >= large.OUT_MIN:
            assert not any(result.strides) and not result.flags.writeable  # no pass
        assert not np.shares_memory(result, g) or not result.flags.writeable, layout


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0
@settings(max_examples=30)
@given(shape=st.sampled_from([(), (0,), (3, 0), (large.OUT_MIN + 1,), (4, 5, 6)]),
       dtype=st.sampled_from([np.float64, np.float32, np.complex128]),
       value=st.sampled_from([1.0, -0.0, 0.3, np.nan]),
       keepdims=st.booleans(), full=st.booleans())
def test_sum_and_mean_rules_give_broadcast_to_s_bits(
        shape: tuple[int, ...], dtype: Any, value: float, keepdims: bool, full: bool) -> None:
    axis = None if full or not shape else (len(shape) - 1,)
    reduced = np.asarray(np.sum(np.zeros(shape, dtype), axis=axis, keepdims=keepdims))
    g = np.full(reduced.shape, value, dtype)
    x = np.zeros(shape, dtype)
    unreduced = g if axis is None or keepdims else np.expand_dims(g, axis)
    count = x.size if axis is None else shape[axis[0]]
    for op, expected in ((reductions._sum, np.broadcast_to(unreduced, shape)),
                         (reductions._mean, np.broadcast_to(unreduced, shape) / (count or 1))):
        result = op.rules[0](g, None, x, axis=axis, keepdims=keepdims)
        assert result.shape == shape and result.dtype == expected.dtype, op.name
        assert np.ascontiguousarray(result).tobytes() == \
            np.ascontiguousarray(expected).tobytes(), op.name
        assert not result.flags.writeable, op.name  # never an array to write into
    g.fill(7)  # sum's view shares g's memory, as broadcast_to's did
    assert np.all(reductions._sum.rules[0](g, None, x, axis=axis, keepdims=keepdims) == 7)


def test_uniform_finds_only_broadcasts_of_one_value() -> None:
    assert large.uniform(np.broadcast_to(np.float32(2), (3, 4))) == np.float32(2)
    assert large.uniform(np.array(5.0)) == 5.0
    assert large.uniform(np.broadcast_to(np.arange(4.0), (3, 4))) is None
    assert large.uniform(np.ones(3)) is None
    assert large.uniform(np.ones((3, 1))[:, :0]) is None  # empty
    assert large.uniform(np.ones(1)) is None  # a stride of 8: not a broadcast


@settings(max_examples=10)
@given(size=_sizes, dtype=st.sampled_from([np.float64, np.float32]))
def test_create_graph_takes_the_operator_form_with_the_same_bits(size: int, dtype: Any) -> None:
    """With create_graph the rules get Tensors (no folding, no out=): the same first
    gradient, and a second derivative that is right."""
    x0 = np.linspace(-2, 2, size).astype(dtype)
    results = []
    for create_graph in (False, True):
        x = pargrad.tensor(x0, requires_grad=True)
        loss = pargrad.sum(pargrad.tanh(x * 1.5)) + pargrad.mean(pargrad.sigmoid(x))
        (dx,) = pargrad.grad([loss], [x], create_graph=create_graph)
        results.append(dx.numpy().tobytes())
        if create_graph:
            (ddx,) = pargrad.grad([pargrad.sum(dx)], [x])
            t, s = np.tanh(1.5 * x0.astype(float)), 1 / (1 + np.exp(-x0.astype(float)))
            expected = -2 * 1.5**2 * t * (1 - t * t) + s * (1 - s) * (1 - 2 * s) / size
            np.testing.assert_allclose(ddx.numpy(), expected,
                                       rtol=1e-5 if dtype == np.float32 else 1e-10,
                                       atol=1e-6 if dtype == np.float32 else 1e-14)
    assert results[0] == results[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [large.OUT_MIN - 1, large.OUT_MIN + 1])
def test_fan_in_of_broadcasts_agrees_bitwise_on_every_engine(
        canonical_engine: pargrad.Engine, kernels: str, size: int) -> None:
    """fan-in's shape (one leaf, consumers sum(f(x * c))): each canonical engine gives
    the reference's bits with either kernel set, around the folding's threshold."""
    x = pargrad.tensor(np.linspace(-2, 2, size), requires_grad=True)

    def grads(engine: pargrad.Engine) -> bytes:
        x.grad = None
        parts = [pargrad.sum(pargrad.tanh(x * c)) + pargrad.mean(pargrad.sigmoid(x * c))
                 + pargrad.sum(pargrad.relu(x - c)) for c in (0.5, 1.0, 1.5, -2.0)]
        loss = parts[0] + parts[1] + parts[2] + parts[3]
        pargrad.backward([loss], engine=engine)
        assert x.grad is not None
        return x.grad.numpy().tobytes()

    reference = grads(pargrad.SequentialEngine())
    assert grads(canonical_engine) == reference
    expected = sum((c * (1 - np.tanh(c * x.numpy()) ** 2)
                    + c * (s := 1 / (1 + np.exp(-c * x.numpy()))) * (1 - s) / size
                    + (x.numpy() > c)) for c in (0.5, 1.0, 1.5, -2.0))
    np.testing.assert_allclose(np.frombuffer(reference), expected, rtol=1e-12)
