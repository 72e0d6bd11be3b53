"""Ports of PyTorch's TestAutograd: in-place operations, version counters, views."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

import pargrad
from tests.peer_torch._helpers import assert_equal, ones, rand, randn, value, zeros


def test_inplace() -> None:
    x = ones(5, 5, requires_grad=True)
    y = pargrad.tensor(np.ones((5, 5)) * 4, requires_grad=True)
    z = x * y
    q = z + y
    w = z * y
    z.add_(2)
    # Add doesn't need its inputs to do backward, so it shouldn't raise
    q.backward(np.ones((5, 5)), retain_graph=True)
    # Mul saves both inputs in forward, so it should raise
    with pytest.raises(RuntimeError):
        w.backward(np.ones((5, 5)))
    z = x * y
    q = z * y
    r = z + y
    w = z.add_(y)
    w.backward(np.ones((5, 5)), retain_graph=True)
    r.backward(np.ones((5, 5)), retain_graph=True)
    with pytest.raises(RuntimeError):
        q.backward(np.ones((5, 5)))
    with pargrad.no_grad():
        x.grad.zero_()
    m = x / 2
    z = m + y / 8
    q = z * y
    r = z + y
    prev_version = z._version
    w = z.exp_()
    assert z._version != prev_version
    r.backward(np.ones((5, 5)), retain_graph=True)
    assert_equal(x.grad, np.ones((5, 5)) / 2)
    w.backward(np.ones((5, 5)), retain_graph=True)
    assert_equal(x.grad, np.full((5, 5), (1 + math.e) / 2))
    with pytest.raises(RuntimeError):
        q.backward(np.ones((5, 5)))
    leaf = ones(5, 5, requires_grad=True)
    x = leaf.copy()
    x.add_(10)
    assert_equal(x, np.ones((5, 5)) * 11)
    y = x + 2
    y.backward(np.ones((5, 5)))
    assert_equal(leaf.grad, np.ones((5, 5)))
    z = x * y
    x.add_(2)
    with pytest.raises(RuntimeError):
        z.backward(np.ones((5, 5)))


def _test_setitem(size: tuple[int, ...], index: object) -> None:
    x = pargrad.tensor(np.ones(size), requires_grad=True)
    y = x + 2
    y_version = y._version
    y[index] = 2
    assert y._version != y_version
    y.backward(np.ones(size))
    expected_grad = np.ones(size)
    expected_grad[index] = 0
    assert_equal(x.grad, expected_grad)


def _test_setitem_tensor(size: tuple[int, ...], index: object) -> None:
    x = pargrad.tensor(np.ones(size), requires_grad=True)
    y = x + 2
    y_version = y._version
    v = pargrad.tensor(np.full(np.shape(value(x)[index]), 7.0), requires_grad=True)
    y[index] = v
    assert y._version != y_version
    y.backward(np.ones(size))
    expected_grad_input = np.ones(size)
    expected_grad_input[index] = 0
    assert_equal(x.grad, expected_grad_input)
    assert_equal(v.grad, np.ones_like(value(v)))
    # case when x broadcasts to as y[1]
    x = randn(4, requires_grad=True)
    y = zeros(2, 3, 4)
    y[1] = x
    y.backward(value(randn(2, 3, 4)))
    assert x.shape == x.grad.shape


def test_setitem() -> None:
    _test_setitem((5, 5), 1)
    _test_setitem((5,), 1)
    _test_setitem((1,), 0)
    _test_setitem((10,), ([0, 4, 2]))
    _test_setitem((5, 5), ([0, 4], [2, 2]))
    _test_setitem((5, 5, 5), (slice(None), slice(None), [1, 3]))
    _test_setitem((5, 5, 5), (slice(None), [1, 3], slice(None)))
    _test_setitem((5, 5, 5), ([1, 3], slice(None), slice(None)))
    _test_setitem((5, 5, 5), (slice(None), [2, 4], [1, 3]))
    _test_setitem((5, 5, 5), ([1, 3], [2, 4], slice(None)))
    _test_setitem_tensor((5, 5), 3)
    _test_setitem_tensor((5, 5), ([0, 1], [1, 0]))
    _test_setitem_tensor((5,), 3)
    _test_setitem_tensor((5,), np.array([3]).sum())
    _test_setitem_tensor((5,), [[0, 1, 2, 3]])
    _test_setitem_tensor((5, 5, 5), (slice(None), slice(None), [1, 3]))
    _test_setitem_tensor((5, 5, 5), (slice(None), [1, 3], slice(None)))
    _test_setitem_tensor((5, 5, 5), ([1, 3], slice(None), slice(None)))
    _test_setitem_tensor((5, 5, 5), (slice(None), [2, 4], [1, 3]))
    _test_setitem_tensor((5, 5, 5), ([1, 3], [2, 4], slice(None)))
    _test_setitem_tensor((5, 5, 5), (np.array([1, 3]), [2, 4], slice(None)))


def test_setitem_mask() -> None:
    mask = np.random.default_rng(3).random((5, 5)) > 0.5
    _test_setitem((5, 5), mask)
    _test_setitem((5,), mask[0])
    _test_setitem((1,), mask[0, 0:1])
    _test_setitem_tensor((5, 5), mask)
    _test_setitem_tensor((5,), mask[0])


def test_index_backward_does_not_save_tensor() -> None:
    a = pargrad.tensor([1.0, 0, 0])
    b = zeros(3, requires_grad=True)
    tensor = b + 0
    tensor[value(a != 0)] = tensor[value(a != 0)]
    tensor.backward(np.zeros(3))


def test_leaf_assignment() -> None:
    x = randn(5, 5)
    y = randn(5, requires_grad=True)
    z = randn(5, requires_grad=True)
    x[0] = y
    x[1] = 2 * z
    assert x.requires_grad
    assert x.grad_fn is not None
    x.sum().backward()
    assert_equal(y.grad, np.ones(5))
    assert_equal(z.grad, np.ones(5) * 2)


def test_no_grad_assignment() -> None:
    x = randn(5, 5, requires_grad=True)
    y = randn(5)
    with pargrad.no_grad():
        x[0] = y
    assert x.requires_grad
    assert x.grad_fn is None


def test_no_grad_modifies_version() -> None:
    x = randn(5, requires_grad=True)
    y = randn(5, requires_grad=True)
    z = (x * y).sum()
    with pargrad.no_grad():
        x *= 2
    with pytest.raises(RuntimeError, match="changed by an in-place operation"):
        z.backward()


def test_requires_grad_inplace() -> None:
    a = randn(5, 5)
    b = randn(5, 5, requires_grad=True)
    a += b
    assert a.requires_grad
    a = randn(5, 5) + 0
    b = randn(5, 5, requires_grad=True)
    a += b
    assert a.requires_grad


def test_no_requires_grad_inplace() -> None:
    a = randn(2, 3)
    a.add_(5)
    a.requires_grad = True
    a.sum().backward()
    assert_equal(a.grad, np.ones((2, 3)))
    a = randn(2, 3)
    b = a[:]
    b.add_(5)
    a.requires_grad = True
    a.sum().backward()
    assert_equal(a.grad, np.ones((2, 3)))
    a = randn(2, 3)
    b = a[:]
    a.requires_grad = True
    with pytest.raises(RuntimeError):
        a.add_(5)
    with pytest.raises(RuntimeError):
        b.add_(5)


def test_version_counter() -> None:
    x = randn(1, 2)
    x_saved_version = x._version
    x.add_(1).add_(1)
    assert x._version > x_saved_version
    xz = x[:]
    assert x._version == xz._version
    xz.add_(1)
    assert x._version == xz._version
    xz.add_(1)
    assert x._version == xz._version


def test_inplace_on_view_leaf_errors() -> None:
    x = zeros(1, requires_grad=True)
    y = x.reshape(x.shape)
    with pytest.raises(RuntimeError, match="a view of a leaf tensor that requires grad"):
        y.add_(1)


def test_inplace_on_view_weak_grad_fn() -> None:
    a = pargrad.tensor(np.arange(10.0), requires_grad=True)
    b = a[0:2].copy().reshape(-1)
    b.relu_()
    c = b.copy()
    del b
    gc.collect()
    s = c.sum()
    s.backward()
    assert_equal(s, 1.0)
    a = rand(10, requires_grad=True)[0:10]
    with pytest.raises(RuntimeError):
        a.relu_()


def test_no_unnecessary_save() -> None:
    mu = ones(1, requires_grad=True)
    x = pargrad.tensor(np.empty(1))
    loss = 0
    for i in range(3):
        x.detach_()
        x[...] = mu + i  # x.copy_(mu + i)
        ft = pargrad.tensor([float(i)])
        multiplied = x * ft
        s = multiplied.sum()
        loss += s
    loss.backward()
