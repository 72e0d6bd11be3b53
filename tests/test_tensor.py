"""Tensor: construction, attributes, operators with scalars and arrays, numpy interop."""

from __future__ import annotations

import numpy as np
import pytest

import pargrad
from pargrad import Tensor


def test_construction_and_attributes() -> None:
    data = np.arange(6.0).reshape(2, 3)
    t = pargrad.tensor(data, requires_grad=True)
    assert isinstance(t, Tensor) and t.is_leaf and t.grad_fn is None and t.grad is None
    assert (t.shape, t.ndim, t.dtype, t.size) == ((2, 3), 2, np.float64, 6)
    data[0, 0] = 99.0  # the tensor copied the user's array
    assert t.data[0, 0] == 0.0
    assert t.numpy() is t.data
    assert pargrad.tensor(1.0).dtype == np.float64  # Python floats are float64, as in numpy
    assert pargrad.tensor([1, 2]).dtype == np.int64
    assert pargrad.tensor([1, 2], dtype=np.float32).dtype == np.float32
    assert pargrad.Tensor([1.0]).requires_grad is False


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_dtypes_may_require_grad(dtype: type) -> None:
    x = pargrad.tensor([1.0, 2.0], dtype=dtype, requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.dtype == dtype
    np.testing.assert_array_equal(x.grad.data, np.array([2.0, 4.0], dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, bool])
def test_integer_tensors_cannot_require_grad(dtype: type) -> None:
    with pytest.raises(TypeError, match=r"only floating-point tensors.*dtype"):
        pargrad.tensor([1, 0], dtype=dtype, requires_grad=True)
    with pytest.raises(TypeError, match="only floating-point"):
        pargrad.tensor([1, 0], dtype=dtype).requires_grad_()


def test_non_leaf_properties() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    assert y.requires_grad and not y.is_leaf
    assert y.grad_fn.name() == "MultiplyBackward"
    assert y.grad_fn.next_functions[0][0] is x._grad_accumulator()
    assert y.grad_fn.next_functions[1] == (None, 0)
    assert isinstance(y.grad_fn, pargrad.Node)
    with pytest.raises(RuntimeError, match="leaf"):
        y.requires_grad_(False)


def test_sequence_numbers_increase() -> None:
    x = pargrad.tensor(1.0, requires_grad=True)
    a = x * 2
    b = a + 1
    assert b.grad_fn.sequence_nr > a.grad_fn.sequence_nr


def test_detach_and_item() -> None:
    x = pargrad.tensor([3.0], requires_grad=True)
    d = (x * 2).detach()
    assert d.is_leaf and not d.requires_grad and d.item() == 6.0
    assert float(pargrad.tensor(2.5)) == 2.5 and int(pargrad.tensor(3)) == 3


def test_repr() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    assert repr(x) == "tensor([1., 2.], dtype=float64, requires_grad=True)"
    assert repr(x * 2) == "tensor([2., 4.], dtype=float64, grad_fn=<MultiplyBackward>)"
    assert repr(pargrad.tensor([1, 2], dtype=np.int32)) == "tensor([1, 2], dtype=int32)"


@pytest.mark.parametrize(
    ("expression", "value", "grad"),
    [
        (lambda x: 2 * x, 6.0, 2.0),
        (lambda x: x * 2, 6.0, 2.0),
        (lambda x: 1 - x, -2.0, -1.0),
        (lambda x: x - 1, 2.0, 1.0),
        (lambda x: 1 + x, 4.0, 1.0),
        (lambda x: x / 3, 1.0, 1 / 3),
        (lambda x: 6 / x, 2.0, -6 / 9),
        (lambda x: x ** 2, 9.0, 6.0),
        (lambda x: 2 ** x, 8.0, 8 * np.log(2)),
        (lambda x: -x, -3.0, -1.0),
        (lambda x: +x, 3.0, 1.0),
        (lambda x: abs(-x), 3.0, 1.0),
        (lambda x: np.float64(2.0) * x, 6.0, 2.0),
        (lambda x: np.array(2.0) * x, 6.0, 2.0),
        (lambda x: x * np.array(2.0), 6.0, 2.0),
        (lambda x: np.array(1.0) - x, -2.0, -1.0),
    ],
)
def test_operators_mix_with_scalars_and_arrays(expression, value, grad) -> None:  # type: ignore[no-untyped-def]
    x = pargrad.tensor(3.0, requires_grad=True)
    y = expression(x)
    assert isinstance(y, Tensor)
    assert y.item() == pytest.approx(value)
    y.backward()
    assert x.grad.item() == pytest.approx(grad)


def test_matmul_operator_with_arrays_on_either_side() -> None:
    a = np.arange(6.0).reshape(2, 3)
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    y = a @ x
    assert isinstance(y, Tensor)
    np.testing.assert_array_equal(y.data, a @ np.ones(3))
    (y.sum() + (x @ a.T).sum()).backward()
    np.testing.assert_array_equal(x.grad.data, 2 * a.sum(axis=0))


def test_float32_model_stays_float32() -> None:
    w = pargrad.tensor(np.ones((3, 2)), dtype=np.float32, requires_grad=True)
    x = np.ones((4, 3), np.float32)
    y = (x @ w * 2.0 + 1).tanh().sum()
    assert y.dtype == np.float32
    y.backward()
    assert w.grad.dtype == np.float32


def test_comparisons_give_constant_tensors() -> None:
    x = pargrad.tensor([1.0, -1.0], requires_grad=True)
    for result in (x > 0, x >= 0, x < 0, x <= 0, x == 1.0, x != 1.0, (x > 0) & (x < 2), ~(x > 0)):
        assert isinstance(result, Tensor) and result.dtype == bool
        assert not result.requires_grad
    np.testing.assert_array_equal((x > 0).data, [True, False])


def test_numpy_functions_dispatch_to_ops() -> None:
    x = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = np.sum(np.exp(x) * np.sin(x), axis=0, keepdims=True)
    assert isinstance(y, Tensor) and y.shape == (1, 2)
    y.sum().backward()
    expected = np.exp(x.data) * (np.sin(x.data) + np.cos(x.data))
    np.testing.assert_allclose(x.grad.data, expected)
    assert isinstance(np.concatenate([x, x]), Tensor)
    assert isinstance(np.transpose(x), Tensor)
    assert np.asarray(x) is x.data


def test_unsupported_numpy_calls_fail_clearly() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(TypeError, match=r"do not support numpy\.arctan2"):
        np.arctan2(x, x)
    with pytest.raises(TypeError, match=r"do not support numpy\.diff"):
        np.diff(x)


def test_methods_match_functions() -> None:
    x = pargrad.tensor(np.arange(1.0, 7.0).reshape(2, 3))
    pairs = [
        (x.sum(axis=1), np.sum(x.data, axis=1)),
        (x.mean(axis=0, keepdims=True), np.mean(x.data, axis=0, keepdims=True)),
        (x.max(), np.max(x.data)),
        (x.min(axis=1), np.min(x.data, axis=1)),
        (x.reshape(3, 2), x.data.reshape(3, 2)),
        (x.reshape((6,)), x.data.reshape(6)),
        (x.T, x.data.T),
        (x.transpose(1, 0), x.data.T),
        (x.transpose((1, 0)), x.data.T),
        (x.expand_dims(0), x.data[None]),
        (x.expand_dims(0).squeeze(0), x.data),
        (x.broadcast_to((4, 2, 3)), np.broadcast_to(x.data, (4, 2, 3))),
        (x.clip(2, 5), np.clip(x.data, 2, 5)),
        (x.log(), np.log(x.data)),
        (x.sqrt(), np.sqrt(x.data)),
        (x.exp(), np.exp(x.data)),
        (x.abs(), np.abs(x.data)),
        (x.tanh(), np.tanh(x.data)),
        (x.sin(), np.sin(x.data)),
        (x.cos(), np.cos(x.data)),
        (x.relu(), x.data),
        (x.sigmoid(), 1 / (1 + np.exp(-x.data))),
        (x.astype(np.float32), x.data.astype(np.float32)),
        (x.logsumexp(axis=1), np.log(np.exp(x.data).sum(axis=1))),
        (x.softmax(), np.exp(x.data) / np.exp(x.data).sum(axis=-1, keepdims=True)),
        (x.log_softmax(axis=0), x.data - np.log(np.exp(x.data).sum(axis=0))),
        (x.matmul(x.T), x.data @ x.data.T),
    ]
    for got, want in pairs:
        np.testing.assert_allclose(got.data, want, rtol=1e-12)
        assert got.dtype == np.asarray(want).dtype
    assert [p.shape for p in x.split(3, axis=1)] == [(2, 1)] * 3
    assert [row.shape for row in x] == [(3,), (3,)] and len(x) == 2


def test_grad_setter_checks() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x.grad = pargrad.tensor([1.0, 1.0])
    with pytest.raises(TypeError, match="Tensor or None"):
        x.grad = np.ones(2)  # type: ignore[assignment]
    with pytest.raises(ValueError, match="shape"):
        x.grad = pargrad.tensor([1.0])
    x.grad = None
    assert x.grad is None


def test_stable_sigmoid_and_softmax() -> None:
    x = pargrad.tensor([-1000.0, 0.0, 1000.0], requires_grad=True)
    np.testing.assert_allclose(pargrad.sigmoid(x).data, [0.0, 0.5, 1.0])
    s = pargrad.softmax(x)
    assert np.all(np.isfinite(s.data)) and s.data[2] == 1.0
    ls = pargrad.log_softmax(x)
    np.testing.assert_allclose(ls.data, [-2000.0, -1000.0, 0.0])
    assert pargrad.logsumexp(x).item() == 1000.0
    (pargrad.sigmoid(x).sum() + ls[2]).backward()
    assert np.all(np.isfinite(x.grad.data))


def test_max_ties_share_the_gradient() -> None:
    x = pargrad.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_allclose(x.grad.data, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    y = pargrad.tensor([1.0, 2.0], requires_grad=True)
    z = pargrad.tensor([1.0, 1.0], requires_grad=True)
    pargrad.maximum(y, z).sum().backward()
    np.testing.assert_array_equal(y.grad.data, [0.5, 1.0])
    np.testing.assert_array_equal(z.grad.data, [0.5, 0.0])


def test_repeated_indices_accumulate() -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x[[0, 0, 2, 0]].sum().backward()
    np.testing.assert_array_equal(x.grad.data, [3.0, 0.0, 1.0])
    m = pargrad.tensor(np.zeros((3, 2)), requires_grad=True)
    m[np.array([1, 1]), np.array([0, 0])].sum().backward()
    np.testing.assert_array_equal(m.grad.data, [[0, 0], [2, 0], [0, 0]])


def test_power_special_cases() -> None:
    x = pargrad.tensor([0.0, 2.0], requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad.data, [0.0, 0.0])
    base = pargrad.tensor([0.0, 2.0], requires_grad=True)
    exponent = pargrad.tensor([2.0, 3.0], requires_grad=True)
    (base ** exponent).sum().backward()
    np.testing.assert_allclose(base.grad.data, [0.0, 12.0])
    np.testing.assert_allclose(exponent.grad.data, [0.0, 8 * np.log(2)])


def test_clip_with_crossed_bounds_sends_the_gradient_to_a_max() -> None:
    # numpy returns a_max everywhere when a_min > a_max.
    x = pargrad.tensor([0.0, 1.5, 3.0], requires_grad=True)
    lo = pargrad.tensor(2.0, requires_grad=True)
    hi = pargrad.tensor(1.0, requires_grad=True)
    out = pargrad.clip(x, lo, hi)
    np.testing.assert_array_equal(out.data, [1.0, 1.0, 1.0])
    out.sum().backward()
    assert (lo.grad.item(), hi.grad.item()) == (0.0, 3.0)
    np.testing.assert_array_equal(x.grad.data, [0.0, 0.0, 0.0])


def test_axes_and_shapes_accept_numpy_integers() -> None:
    x = pargrad.tensor(np.ones((2, 1, 3)), requires_grad=True)
    assert x.squeeze(np.int64(1)).shape == (2, 3)
    assert x.expand_dims(np.int32(0)).shape == (1, 2, 1, 3)
    assert x.reshape(np.int64(6)).shape == (6,)
    assert x.broadcast_to((np.int64(4), 2, 1, 3)).shape == (4, 2, 1, 3)
    assert pargrad.concatenate([x, x], axis=None).shape == (12,)
    with pytest.raises(ValueError, match="swapaxes: axis 3 is out of bounds"):
        pargrad.swapaxes(x, 0, 3)


def test_bitwise_operators_follow_numpy() -> None:
    a = pargrad.tensor([6, 3])
    np.testing.assert_array_equal((a & 5).data, [4, 1])
    np.testing.assert_array_equal((a | 1).data, [7, 3])
    np.testing.assert_array_equal((~a).data, [-7, -4])


def test_grad_setter_checks_dtype() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(TypeError, match="dtype float32"):
        x.grad = pargrad.tensor([1.0, 1.0], dtype=np.float32)


def test_requires_grad_attribute_is_checked() -> None:
    t = pargrad.tensor([1, 2])
    with pytest.raises(TypeError, match="only floating-point"):
        t.requires_grad = True
    x = pargrad.tensor([1.0], requires_grad=True)
    y = x * 2
    with pytest.raises(RuntimeError, match="leaf"):
        y.requires_grad = False
    y.requires_grad = True  # no change: allowed
    x.requires_grad = False
    assert not x.requires_grad and not (x * 2).requires_grad


def test_replacing_data_after_the_forward_keeps_the_gradient() -> None:
    w = pargrad.tensor([2.0], requires_grad=True)
    x = pargrad.tensor([3.0], requires_grad=True)
    loss = (w * x).sum()
    with pargrad.no_grad():
        w.data = w.data - 1.0
    loss.backward()
    assert x.grad.item() == 2.0  # the value w had in the forward pass
    loss2 = (w * x).sum()
    with pargrad.no_grad():
        w.data = w.data * 10
    with pytest.raises(pargrad.BackwardError,
                       match=r"MultiplyBackward: RuntimeError: argument 0 .*new \.data"):
        loss2.backward(create_graph=True)


def test_a_leaf_whose_data_changes_shape_records_its_new_shape() -> None:
    # A leaf's shape and dtype are read from its array at each op (a non-leaf's come
    # from its node's record), on the one-tensor path and the general one.
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (pargrad.tanh(w) * w).sum().backward()
    assert w.grad.shape == (2,)
    w.grad = None
    with pargrad.no_grad():
        w.data = np.ones((2, 3), np.float32)
    y = pargrad.tanh(w) * 2.0
    assert y.grad_fn.next_nodes[0]._input_meta[0] == ((2, 3), np.dtype(np.float32))
    (y * w).sum().backward()
    assert w.grad.shape == (2, 3) and w.grad.dtype == np.float32
    np.testing.assert_allclose(w.grad.data, 2 * np.tanh(1.0) + 2 * (1 - np.tanh(1.0) ** 2),
                               rtol=1e-6)


def test_in_place_operators() -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (w * w).sum().backward()
    loss = (w * 3.0).sum()
    before = w
    with pargrad.no_grad():
        w -= 0.5 * w.grad  # the optimizer idiom updates the parameter itself
        w *= 2
    assert w is before and w.requires_grad and w.is_leaf
    np.testing.assert_array_equal(w.data, [0.0, 0.0])
    loss.backward()  # w * 3.0 reads only 3.0 for w's gradient: w's change is harmless
    np.testing.assert_array_equal(w.grad.data, [2.0 + 3.0, 4.0 + 3.0])
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        w += 1
    h = w * 1.0
    h_before = h
    h += 1  # a non-leaf changes in place and takes the add's node as its history
    assert h is h_before and h.grad_fn.name() == "AddBackward" and h._version == 1
    c = pargrad.tensor([1, 2])
    c += 1
    np.testing.assert_array_equal(c.data, [2, 3])
    with pytest.raises(TypeError, match="int64 tensor in place"):
        c /= 2
    with pytest.raises(ValueError, match=r"shape \(2,\) in place"):
        c += np.ones((3, 2), dtype=int)
    p = pargrad.tensor([2.0, 3.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        p **= 2
    m = pargrad.tensor(np.eye(2), requires_grad=True)
    same = m
    with pargrad.no_grad():
        p **= 2
        m @= np.array([[0.0, 1.0], [1.0, 0.0]])
    assert m is same and p.is_leaf
    np.testing.assert_array_equal(p.data, [4.0, 9.0])
    np.testing.assert_array_equal(m.data, [[0.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="without a copy"):
        p.__array__(np.float32, copy=False)


def test_index_edge_cases() -> None:
    v = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert v[np.array(True)].shape == (1, 3) and v[np.array(False)].shape == (0, 3)
    assert v[[]].shape == (0,)
    (v[np.array(True)].sum() + v[[]].sum()).backward()
    np.testing.assert_array_equal(v.grad.data, [1.0, 1.0, 1.0])


def test_shape_argument_errors() -> None:
    x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"transpose: axis 5 is out of bounds"):
        x.transpose(0, 5)
    with pytest.raises(ValueError, match=r"split: indices .* must not decrease"):
        pargrad.split(x, [2, 1], axis=1)
    with pytest.raises(ValueError, match=r"split: indices \(-1, 1\) must not decrease"):
        pargrad.split(x, [-1, 1], axis=1)  # -1 is index 2 here: the pieces would overlap
    parts = pargrad.split(x, [1, -1], axis=1)  # numpy's reading: [1, 2]
    assert [p.shape for p in parts] == [(2, 1), (2, 1), (2, 1)]
    assert [p.shape for p in pargrad.split(x, [-9, 9], axis=1)] == [(2, 0), (2, 3), (2, 0)]
    with pytest.raises(TypeError, match="list of Tensors"):
        pargrad.add(x, [x[0], x[1]])
    with pytest.raises(TypeError, match=r"numpy\.sum on pargrad Tensors takes only sum\(x"):
        np.sum(x, dtype=np.float32)


def test_graphs_without_saved_values_can_run_backward_again() -> None:
    x = pargrad.tensor(np.arange(4.0), requires_grad=True)
    a, b = pargrad.split(x + 1, 2)
    a.sum().backward()
    b.sum().backward()  # as in PyTorch: nothing saved, nothing freed
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0, 1.0, 1.0])
    node = (x.reshape(2, 2).T.sum(axis=0) - x[:2]).grad_fn
    assert node.name() == "SubtractBackward"


def test_where_condition_gets_no_gradient() -> None:
    c = pargrad.tensor([1.0, 0.0], requires_grad=True)  # a float condition: truthiness
    a = pargrad.tensor([1.0, 2.0], requires_grad=True)
    pargrad.where(c, a, 5.0).sum().backward()
    assert c.grad is None
    np.testing.assert_array_equal(a.grad.data, [1.0, 0.0])


def test_an_op_without_a_rule_fails_in_the_forward() -> None:
    # Not np.add itself: defop would make this op serve np.add on Tensors, for every
    # later test of the session.
    half = pargrad.ops.defop("half_add", lambda x, y: np.add(x, y), lambda g, ans, x, y: g)
    x = pargrad.tensor(1.0, requires_grad=True)
    assert half(x, 2.0).item() == 3.0
    with pytest.raises(TypeError, match="half_add: no gradient rule for argument 1"):
        half(2.0, x)


def test_more_operand_forms() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = x + [10.0, 20.0]  # noqa: RUF005 - a Tensor plus a list of numbers
    z = [1.0, 2.0] @ x
    w = x[pargrad.tensor([1, 1])]
    assert bool(np.greater(x, 1.5)[1]) and not np.greater(x, 1.5).requires_grad
    (y.sum() + z + w.sum()).backward()
    np.testing.assert_array_equal(x.grad.data, [2.0, 5.0])
    assert np.asarray(x, dtype=np.float32).dtype == np.float32
    with pytest.raises(TypeError, match=r"add: .*operands: array of shape \(2,\).*'abc'"):
        x + "abc"


def test_more_argument_errors() -> None:
    x = pargrad.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"transpose: repeated axis in \(0, 0\)"):
        x.transpose(0, 0)
    with pytest.raises(ValueError, match="not a permutation of 2 axes"):
        x.transpose((1,))
    with pytest.raises(TypeError, match=r"sum: axis must be an integer, got 1\.5"):
        x.sum(axis=1.5)
    with pytest.raises(TypeError, match="swapaxes: axis must be an integer"):
        x.swapaxes(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concatenate: need at least one tensor"):
        pargrad.concatenate([])
    with pytest.raises(ValueError, match="stack: need at least one tensor"):
        pargrad.stack([])
    with pytest.raises(TypeError, match="concatenate: axis must be an integer"):
        pargrad.concatenate([x, x], axis=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stack: axis 4 is out of bounds"):
        pargrad.stack([x, x], axis=4)
    with pytest.raises(ValueError, match="softmax: axis 2 is out of bounds"):
        pargrad.softmax(x, axis=2)
    with pytest.raises(ValueError, match=r"sum: repeated axis"):
        x.sum(axis=(0, -2))
    with pytest.raises(ValueError, match="clip: one of a_min and a_max"):
        x.clip()


def test_pickle_and_deepcopy_make_new_leaves() -> None:
    import copy
    import pickle

    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (w * w).sum().backward()  # w now has a grad and an accumulator
    for clone in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w)):
        assert clone is not w and clone.is_leaf and clone.requires_grad
        np.testing.assert_array_equal(clone.data, w.data)
        np.testing.assert_array_equal(clone.grad.data, w.grad.data)
        assert not np.shares_memory(clone.data, w.data)
        (clone * 3).sum().backward()
        np.testing.assert_array_equal(clone.grad.data, [5.0, 7.0])
    np.testing.assert_array_equal(w.grad.data, [2.0, 4.0])
    with pytest.raises(TypeError, match="non-leaf"):
        pickle.dumps(w * 2)
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (x ** 3).sum().backward(create_graph=True)  # x.grad now belongs to a graph
    clone = pickle.loads(pickle.dumps(x))
    assert clone.grad.is_leaf
    np.testing.assert_array_equal(clone.grad.data, [3.0, 12.0])
