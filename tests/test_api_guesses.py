"""The API a torch or numpy user guesses: array creation, a seeded random module, the ops
and losses they reach for, Tensor methods, numpy functions with no gradient, torch's
keyword spellings, and a real signature and docstring on every op. Values against numpy,
gradients against finite differences (``gradcheck``)."""

from __future__ import annotations

import inspect
import pydoc
import sys
import threading

import numpy as np
import pytest

import pargrad
from pargrad.ops import functions

RNG = np.random.default_rng(3)
A = np.array([[0.3, -0.8, 1.2], [0.5, 0.9, -1.4]])
V = np.array([0.6, -1.1, 1.9])


def leaf(a: np.ndarray) -> pargrad.Tensor:
    return pargrad.tensor(a, requires_grad=True)


# ----- creation -----
@pytest.mark.parametrize("make, expected", [
    (lambda: pargrad.zeros((2, 3)), np.zeros((2, 3))),
    (lambda: pargrad.ones(4, np.float32), np.ones(4, np.float32)),
    (lambda: pargrad.full((2,), 7.5), np.full((2,), 7.5)),
    (lambda: pargrad.full(3, 1), np.full(3, 1)),
    (lambda: pargrad.arange(5), np.arange(5)),
    (lambda: pargrad.arange(1.0, 2.0, 0.25), np.arange(1.0, 2.0, 0.25)),
    (lambda: pargrad.linspace(0, 1, 5), np.linspace(0, 1, 5)),
    (lambda: pargrad.linspace(0, 1, 4, endpoint=False), np.linspace(0, 1, 4, endpoint=False)),
    (lambda: pargrad.eye(3), np.eye(3)),
    (lambda: pargrad.eye(2, 3, k=1), np.eye(2, 3, k=1)),
    (lambda: pargrad.zeros_like(pargrad.tensor(A)), np.zeros_like(A)),
    (lambda: pargrad.ones_like(A), np.ones_like(A)),
    (lambda: pargrad.full_like(pargrad.tensor([1, 2]), 9), np.array([9, 9])),
])
def test_creation_matches_numpy(make, expected: np.ndarray) -> None:
    t = make()
    assert isinstance(t, pargrad.Tensor) and t.is_leaf and not t.requires_grad
    assert t.dtype == expected.dtype
    np.testing.assert_array_equal(t.data, expected)


def test_creation_takes_requires_grad_and_device() -> None:
    w = pargrad.zeros((2, 2), requires_grad=True, device="cpu:1")
    assert w.requires_grad and str(w.device) == "cpu:1"
    assert pargrad.empty((3, 1)).shape == (3, 1)
    like = pargrad.ones_like(w)  # the device and dtype of its model, a new leaf
    assert str(like.device) == "cpu:1" and like.dtype == np.float64 and like.grad_fn is None
    assert pargrad.zeros_like(w, dtype=np.float32).dtype == np.float32
    (w * 2).sum().backward()
    np.testing.assert_array_equal(w.grad.data, np.full((2, 2), 2.0))
    with pytest.raises(TypeError, match="only floating-point tensors can require gradients"):
        pargrad.arange(3, requires_grad=True)


def test_from_numpy_shares_memory() -> None:
    a = np.zeros(3)
    t = pargrad.from_numpy(a, requires_grad=True)
    assert t.data is a and t.requires_grad
    a[1] = 5.0
    assert t.tolist() == [0.0, 5.0, 0.0]
    with pargrad.no_grad():
        t += 1.0
    assert a.tolist() == [1.0, 6.0, 1.0] and t._version == 1
    with pytest.raises(TypeError, match="from_numpy: expected a numpy array, got list"):
        pargrad.from_numpy([1.0])  # type: ignore[arg-type]


# ----- random -----
def test_seed_reproduces_and_matches_numpy() -> None:
    pargrad.random.seed(42)
    a = pargrad.random.normal(1.0, 2.0, size=(2, 3))
    b = pargrad.random.uniform(-1.0, 1.0, size=4)
    pargrad.random.seed(42)
    np.testing.assert_array_equal(pargrad.random.normal(1.0, 2.0, size=(2, 3)).data, a.data)
    np.testing.assert_array_equal(pargrad.random.uniform(-1.0, 1.0, size=4).data, b.data)
    rng = np.random.default_rng(42)
    np.testing.assert_array_equal(a.data, rng.normal(1.0, 2.0, (2, 3)))
    np.testing.assert_array_equal(b.data, rng.uniform(-1.0, 1.0, 4))


def test_generator_methods() -> None:
    g = pargrad.Generator(7)
    x = g.randn(2, 3, requires_grad=True)
    assert x.shape == (2, 3) and x.requires_grad and x.dtype == np.float64
    np.testing.assert_array_equal(x.data, np.random.default_rng(7).standard_normal((2, 3)))
    assert g.randn((4, 1)).shape == (4, 1)
    u = g.rand(1000, dtype=np.float32)
    assert u.dtype == np.float32 and u.data.min() >= 0.0 and u.data.max() < 1.0
    i = g.integers(0, 3, size=50)
    assert i.dtype == np.int64 and set(i.tolist()) <= {0, 1, 2}
    assert pargrad.randn(3).shape == (3,) and pargrad.rand(2, 2).shape == (2, 2)
    assert pargrad.random.randn().shape == ()
    # Two generators with one seed give the same stream, whoever else draws.
    h = pargrad.Generator(7)
    pargrad.random.randn(5)
    np.testing.assert_array_equal(h.randn(2, 3).data, x.data)


def test_one_generator_shared_by_threads_hands_out_every_draw_once() -> None:
    g = pargrad.Generator(0)
    drawn: list[float] = []
    lock = threading.Lock()

    def draw() -> None:
        for _ in range(200):
            value = g.uniform().item()
            with lock:
                drawn.append(value)

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = np.random.default_rng(0).uniform(size=800)
    assert sorted(drawn) == sorted(expected.tolist())


# ----- new ops: values against numpy, gradients against finite differences -----
UNARY = [
    ("square", pargrad.square, np.square, V),
    ("log1p", pargrad.log1p, np.log1p, np.array([-0.5, 0.0, 2.0, 1e-10])),
    ("expm1", pargrad.expm1, np.expm1, np.array([-2.0, 0.0, 1e-10, 1.5])),
    ("softplus", pargrad.softplus, lambda a: np.log1p(np.exp(a)), V),
]


@pytest.mark.parametrize("name, op, reference, x", UNARY, ids=[u[0] for u in UNARY])
def test_new_unary_ops(name: str, op, reference, x: np.ndarray) -> None:
    np.testing.assert_allclose(op(x).data, reference(x), rtol=1e-12)
    assert pargrad.gradcheck(op, leaf(x))
    assert getattr(np, name, None) is None or getattr(np, name)(leaf(x)).grad_fn is not None


def test_softplus_never_overflows_and_its_gradient_is_sigmoid() -> None:
    x = leaf(np.array([-1000.0, 0.0, 1000.0]))
    y = pargrad.softplus(x)
    np.testing.assert_allclose(y.data, [0.0, np.log(2.0), 1000.0])
    y.sum().backward()
    np.testing.assert_allclose(x.grad.data, [0.0, 0.5, 1.0])


def test_log1p_and_expm1_keep_small_values() -> None:
    assert pargrad.log1p(pargrad.tensor(1e-20)).item() == 1e-20
    assert pargrad.expm1(pargrad.tensor(1e-20)).item() == 1e-20


@pytest.mark.parametrize("a, b", [(V, V[::-1].copy()), (A, A.T.copy()), (A, V), (V, A.T.copy()),
                                  (np.array(2.5), A)])
def test_dot_matches_numpy(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(pargrad.dot(a, b).data, np.dot(a, b))
    np.testing.assert_allclose(np.dot(pargrad.tensor(a), b).data, np.dot(a, b))
    assert pargrad.gradcheck(pargrad.dot, [leaf(a), leaf(b)])


def test_dot_refuses_stacks() -> None:
    with pytest.raises(ValueError, match=r"dot: operands of 3 and 2 dimensions.*use matmul"):
        pargrad.dot(np.ones((2, 2, 2)), np.ones((2, 2)))


def test_outer() -> None:
    np.testing.assert_allclose(pargrad.outer(V, A).data, np.outer(V, A))
    assert pargrad.gradcheck(pargrad.outer, [leaf(V), leaf(A)])


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_cumsum(axis: int | None) -> None:
    np.testing.assert_allclose(pargrad.cumsum(A, axis=axis).data, np.cumsum(A, axis=axis))
    np.testing.assert_allclose(np.cumsum(pargrad.tensor(A), axis).data, np.cumsum(A, axis))
    assert pargrad.gradcheck(lambda t: pargrad.cumsum(t, axis=axis), leaf(A))
    assert pargrad.gradgradcheck(lambda t: pargrad.cumsum(t, axis=axis) ** 2, leaf(A))


@pytest.mark.parametrize("axis, keepdims", [(None, False), (1, False), (0, True), ((0, 1), True)])
def test_prod(axis, keepdims: bool) -> None:
    np.testing.assert_allclose(pargrad.prod(A, axis=axis, keepdims=keepdims).data,
                               np.prod(A, axis=axis, keepdims=keepdims))
    assert pargrad.gradcheck(lambda t: pargrad.prod(t, axis=axis, keepdims=keepdims), leaf(A))


def test_prod_gradient_with_zeros_is_the_product_of_the_others() -> None:
    x = leaf(np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 4.0]]))
    np.prod(x, axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad.data, [[0.0, 6.0, 0.0], [0.0, 0.0, 0.0],
                                                [8.0, 4.0, 2.0]])
    assert pargrad.gradcheck(lambda t: pargrad.prod(t, axis=1),
                             leaf(np.array([[2.0, 0.0, 3.0], [0.5, 1.5, 5.0]])))


@pytest.mark.parametrize("axis, ddof", [(None, 0), (0, 1), (1, 0), ((0, 1), 1)])
def test_var_and_std(axis, ddof: int) -> None:
    for ours, theirs in ((pargrad.var, np.var), (pargrad.std, np.std)):
        np.testing.assert_allclose(ours(A, axis=axis, ddof=ddof).data,
                                   theirs(A, axis=axis, ddof=ddof))
        np.testing.assert_allclose(theirs(pargrad.tensor(A), axis=axis, ddof=ddof).data,
                                   theirs(A, axis=axis, ddof=ddof))
        assert pargrad.gradcheck(lambda t, f=ours: f(t, axis=axis, ddof=ddof), leaf(A))
    np.testing.assert_allclose(pargrad.var(A, axis=1, keepdims=True).data,
                               np.var(A, axis=1, keepdims=True))


@pytest.mark.parametrize("axis, keepdims", [(None, False), (0, False), (1, True)])
def test_argmax_argmin_return_plain_indices(axis, keepdims: bool) -> None:
    x = leaf(A)
    for ours, theirs in ((pargrad.argmax, np.argmax), (pargrad.argmin, np.argmin)):
        for got in (ours(x, axis=axis, keepdims=keepdims),
                    theirs(x, axis=axis, keepdims=keepdims)):
            assert not isinstance(got, pargrad.Tensor)
            np.testing.assert_array_equal(got, theirs(A, axis=axis, keepdims=keepdims))
    assert x.argmax() == 2 and x.argmin(axis=1).tolist() == [1, 2]


def test_logsumexp_is_public() -> None:
    np.testing.assert_allclose(pargrad.logsumexp(A, axis=1).data,
                               np.log(np.exp(A).sum(axis=1)))


# ----- losses -----
def test_mse_loss() -> None:
    x, y = leaf(A), leaf(A[::-1].copy())
    np.testing.assert_allclose(pargrad.mse_loss(x, y).data, np.mean((A - A[::-1]) ** 2))
    np.testing.assert_allclose(pargrad.mse_loss(x, y, reduction="sum").data,
                               np.sum((A - A[::-1]) ** 2))
    assert pargrad.mse_loss(x, y, reduction="none").shape == A.shape
    assert pargrad.gradcheck(pargrad.mse_loss, [x, y])
    with pytest.raises(ValueError, match=r"mse_loss: reduction must be one of .*'avg'"):
        pargrad.mse_loss(x, y, reduction="avg")


def _log_softmax(a: np.ndarray, axis: int) -> np.ndarray:
    shifted = a - a.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def test_cross_entropy_and_nll_loss_with_class_indices() -> None:
    logits = RNG.standard_normal((5, 4))
    target = np.array([0, 3, 1, 1, 2])
    expected = -_log_softmax(logits, 1)[np.arange(5), target]
    np.testing.assert_allclose(pargrad.cross_entropy(logits, target).data, expected.mean())
    np.testing.assert_allclose(
        pargrad.cross_entropy(logits, pargrad.tensor(target), reduction="none").data, expected)
    np.testing.assert_allclose(
        pargrad.nll_loss(_log_softmax(logits, 1), target.tolist(), reduction="sum").data,
        expected.sum())
    assert pargrad.gradcheck(lambda t: pargrad.cross_entropy(t, target), leaf(logits))
    # Classes along axis 0 instead (torch's dim=1 on a (classes, samples) layout).
    np.testing.assert_allclose(pargrad.cross_entropy(logits.T, target, axis=0).data,
                               expected.mean())
    # One sample: a vector of logits and one class.
    np.testing.assert_allclose(pargrad.cross_entropy(logits[1], 3).data, expected[1])


def test_cross_entropy_with_probabilities_and_large_logits() -> None:
    logits = np.array([[1000.0, 0.0], [0.0, -1000.0]])
    probs = np.array([[0.25, 0.75], [1.0, 0.0]])
    expected = -(probs * _log_softmax(logits, 1)).sum(axis=1)
    got = pargrad.cross_entropy(leaf(logits), probs, reduction="none")
    np.testing.assert_allclose(got.data, expected)
    assert np.isfinite(got.data).all()
    assert pargrad.gradcheck(lambda t: pargrad.cross_entropy(t, probs),
                             leaf(RNG.standard_normal((2, 2))))


def test_nll_loss_refuses_bad_targets() -> None:
    log_probs = np.log(np.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"target holds classes 0\.\.3, but there are 3 classes"):
        pargrad.nll_loss(log_probs, [0, 3])
    with pytest.raises(ValueError, match=r"target has shape \(3,\).*need one class per sample"):
        pargrad.nll_loss(log_probs, [0, 1, 2])
    with pytest.raises(ValueError, match="integer class indices, got dtype float64"):
        pargrad.nll_loss(log_probs, [0.0, 1.0])
    with pytest.raises(ValueError, match=r"must have the logits' shape \(2, 3\)"):
        pargrad.cross_entropy(log_probs, np.ones((2, 2)))


def test_binary_cross_entropy_with_logits_is_stable() -> None:
    x = np.array([-1000.0, -2.0, 0.0, 0.5, 1000.0])
    t = np.array([0.0, 1.0, 1.0, 0.3, 1.0])
    sig = 1 / (1 + np.exp(-x[1:4]))
    naive = -(t[1:4] * np.log(sig) + (1 - t[1:4]) * np.log(1 - sig))
    logits = leaf(x)
    loss = pargrad.binary_cross_entropy_with_logits(logits, t, reduction="none")
    np.testing.assert_allclose(loss.data, [0.0, *naive, 0.0], atol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(logits.grad.data, [0.0, sig[0] - 1, -0.5, sig[2] - 0.3, 0.0],
                               atol=1e-12)
    assert pargrad.gradcheck(
        lambda a, b: pargrad.binary_cross_entropy_with_logits(a, b), [leaf(V), leaf(V / 3)])


# ----- Tensor methods -----
def test_tensor_methods_a_newcomer_tries() -> None:
    x = leaf(A)
    assert x.tolist() == A.tolist()
    c = x.clone()
    assert c.grad_fn is not None and not np.shares_memory(c.data, x.data)
    np.testing.assert_array_equal(x.T.data, A.T)
    stack = pargrad.tensor(RNG.standard_normal((4, 2, 3)))
    np.testing.assert_array_equal(stack.mT.data, np.swapaxes(stack.data, -1, -2))
    assert x.expand_dims(0).squeeze(0).shape == A.shape
    assert x.float().dtype == np.float32 and x.double().dtype == np.float64
    assert x.half().dtype == np.float16 and x.long().dtype == np.int64
    assert x.astype(np.float32).grad_fn is not None and x.long().grad_fn is None
    np.testing.assert_array_equal(x.square().data, A ** 2)
    np.testing.assert_array_equal(x.pow(3).data, A ** 3)
    np.testing.assert_allclose(x.var(axis=0, ddof=1).data, A.var(axis=0, ddof=1))
    np.testing.assert_allclose(x.std().data, A.std())
    np.testing.assert_allclose(x.prod(axis=1).data, A.prod(axis=1))
    np.testing.assert_allclose(x.cumsum(axis=0).data, A.cumsum(axis=0))
    np.testing.assert_allclose(pargrad.tensor(V).abs().log1p().data, np.log1p(np.abs(V)))
    np.testing.assert_allclose(x.expm1().data, np.expm1(A))
    np.testing.assert_allclose(x.softplus().data, np.log1p(np.exp(A)))
    np.testing.assert_allclose(pargrad.tensor(V).dot(V).data, V @ V)
    assert bool((x > -5).all()) and not bool((x > 5).any())
    assert x.argmax() == 2
    x.float().sum().backward()
    assert x.grad.dtype == np.float64  # the cast is differentiable back to float64
    np.testing.assert_array_equal(x.grad.data, np.ones_like(A))


# ----- numpy functions with no gradient -----
def test_numpy_functions_without_gradient_return_plain_results() -> None:
    x = leaf(np.array([3.0, np.nan, 1.0, 2.0]))
    assert np.argmax(np.array([1.0, 5.0])) == np.argmax(pargrad.tensor([1.0, 5.0]))
    assert np.argsort(leaf(V)).tolist() == [1, 0, 2]
    assert np.count_nonzero(x > 1) == 2
    np.testing.assert_array_equal(np.nonzero(leaf(V) > 0)[0], [0, 2])
    assert np.all(leaf(V) < 2) and np.any(leaf(V) < 0)
    assert np.allclose(leaf(V), V) and np.array_equal(leaf(V), V)
    assert np.shape(x) == (4,) and np.ndim(x) == 1
    for result in (np.argsort(x), np.nonzero(x)[0], np.argwhere(leaf(V) > 0)):
        assert isinstance(result, np.ndarray)
    # ufuncs with no gradient give Tensors that never require grad, as comparisons do
    for result in (np.isnan(x), np.sign(x), x > 1):
        assert isinstance(result, pargrad.Tensor) and not result.requires_grad
    assert np.isnan(x).tolist() == [False, True, False, False]


# ----- torch's keyword spellings -----
TORCH_CALLS = [
    ("sum", lambda x: x.sum(dim=0)),
    ("sum", lambda x: pargrad.sum(x, axis=0, keepdim=True)),
    ("mean", lambda x: x.mean(dim=1, keepdim=True)),
    ("max", lambda x: pargrad.max(x, dim=0)),
    ("softmax", lambda x: pargrad.softmax(x, dim=1)),
    ("log_softmax", lambda x: x.log_softmax(dim=-1)),
    ("var", lambda x: x.var(dim=0)),
    ("argmax", lambda x: x.argmax(dim=0)),
    ("cumsum", lambda x: pargrad.cumsum(x, dim=0)),
    ("concatenate", lambda x: pargrad.concatenate([x, x], dim=0)),
    ("squeeze", lambda x: x.squeeze(dim=0)),
]


@pytest.mark.parametrize("name, call", TORCH_CALLS, ids=[f"{n}-{i}" for i, (n, _) in
                                                          enumerate(TORCH_CALLS)])
def test_torch_keywords_get_numpys_names(name: str, call) -> None:
    with pytest.raises(TypeError,
                       match=rf"^{name}: pargrad uses numpy's names: axis=, keepdims= \("):
        call(leaf(A))


def test_other_bad_keywords_keep_pythons_message() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'axes'"):
        pargrad.sum(leaf(A), axes=0)


# ----- signatures and docstrings -----
def test_help_on_an_op_shows_its_signature_and_gradient() -> None:
    text = pydoc.render_doc(pargrad.tanh, renderer=pydoc.plaintext)
    assert "tanh(x)" in text and "Hyperbolic tangent" in text and "Gradient: " in text
    assert "pargrad op" not in text and "*args" not in text


@pytest.mark.parametrize("name", functions.__all__)
def test_every_op_function_has_its_signature_and_calls_the_op(name: str) -> None:
    function = getattr(pargrad, name)
    op = getattr(pargrad.ops, name)
    assert function is getattr(functions, name) and isinstance(op, pargrad.ops.Op)
    parameters = inspect.signature(function).parameters
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters.values())
    assert "Gradient: " in (function.__doc__ or "") and function.__name__ == name
    args = [np.abs(A) + 0.5, np.abs(A.T) + 0.5][:len(parameters)] if name == "matmul" \
        else [np.abs(A) + 0.5] * len(parameters)
    np.testing.assert_array_equal(function(*args).data, op(*args).data)
    assert function(*map(leaf, args)).grad_fn.name() == op(*map(leaf, args)).grad_fn.name()


def test_every_public_function_has_a_docstring_and_no_star_args() -> None:
    varargs_by_design = {"randn", "rand", "checkpoint"}  # randn(2, 3); checkpoint(fn, *args)
    for name in pargrad.__all__:
        obj = getattr(pargrad, name)
        if not inspect.isfunction(obj):
            continue
        assert obj.__doc__, name
        if name not in varargs_by_design:
            kinds = {p.kind for p in inspect.signature(obj).parameters.values()}
            assert inspect.Parameter.VAR_POSITIONAL not in kinds, name


def test_operators_call_the_ops_not_the_functions() -> None:
    # Tensor's operators stay on the op itself (no wrapper in the hot path).
    tensor_module = sys.modules["pargrad.tensor"]
    assert tensor_module._ops.multiply is pargrad.ops.multiply
    assert isinstance(pargrad.ops.multiply, pargrad.ops.Op)


def test_every_op_says_its_gradient() -> None:
    machinery = {"Op", "constant", "defop", "dispatch_function", "dispatch_ufunc", "getitem"}
    for name in set(pargrad.ops.__all__) - machinery:
        function = getattr(pargrad, name)
        assert inspect.isfunction(function), name  # help() shows its signature
        assert "gradient" in (function.__doc__ or "").lower(), name
