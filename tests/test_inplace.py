"""In-place operations and version counters (pargrad/ops/inplace.py, pargrad/versions.py):
values and gradients against the out-of-place equivalents on every engine, the errors
for changed saved tensors, leaves and views, and in-place graphs on many threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pargrad
from pargrad import Tensor

X = np.array([0.5, -1.5, 2.0, 0.25])
Y = np.array([1.5, 0.5, -2.0, 4.0])


def leaves() -> tuple[Tensor, Tensor]:
    return pargrad.tensor(X, requires_grad=True), pargrad.tensor(Y, requires_grad=True)


# name -> (in-place version, out-of-place version), both f(x, y) -> loss.
def _setitem(x: Tensor, y: Tensor) -> Tensor:
    h = x * 2.0
    h[1:3] = y[:2] * y[:2]
    return (h * h).sum()


def _setitem_reference(x: Tensor, y: Tensor) -> Tensor:
    h = x * 2.0
    h = pargrad.concatenate([h[:1], y[:2] * y[:2], h[3:]])
    return (h * h).sum()


CASES: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "add_": (lambda x, y: ((x * x).add_(y) ** 2).sum(), lambda x, y: ((x * x + y) ** 2).sum()),
    "sub_": (lambda x, y: ((x * x).sub_(y) ** 2).sum(), lambda x, y: ((x * x - y) ** 2).sum()),
    "mul_": (lambda x, y: (pargrad.exp(x * 1.0) * 1.0).mul_(y).sum(),
             lambda x, y: (pargrad.exp(x) * y).sum()),
    "div_": (lambda x, y: ((x * 1.0).div_(y) ** 2).sum(), lambda x, y: ((x / y) ** 2).sum()),
    "iadd": (lambda x, y: _iadd(x, y), lambda x, y: ((x * 3.0 + y * y) ** 2).sum()),
    "mul_self": (lambda x, y: (x * y).mul_(x * y).sum(), lambda x, y: ((x * y) ** 2).sum()),
    "fill_": (lambda x, y: (x * (x * 1.0).fill_(y[0] * 2)).sum(),
              lambda x, y: (x * (y[0] * 2)).sum()),
    "zero_": (lambda x, y: ((x * y).zero_() + x * x).sum(), lambda x, y: (x * x).sum()),
    "setitem": (_setitem, _setitem_reference),
    "setitem_mask": (lambda x, y: _masked(x, y),
                     lambda x, y: (pargrad.where(X > 0, y, x) ** 2).sum()),
    "chain": (lambda x, y: (x * 1.0).add_(y).mul_(y).sub_(x).div_(y).sum(),
              lambda x, y: (((x + y) * y - x) / y).sum()),
}


def _iadd(x: Tensor, y: Tensor) -> Tensor:
    h = x * 3.0
    h += y * y
    return (h ** 2).sum()


def _masked(x: Tensor, y: Tensor) -> Tensor:
    h = x * 1.0
    h[X > 0] = y[X > 0]
    return (h ** 2).sum()


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_place_matches_out_of_place(name: str, engine: pargrad.Engine) -> None:
    in_place, reference = CASES[name]
    x, y = leaves()
    loss = in_place(x, y)
    loss.backward()
    x2, y2 = leaves()
    expected = reference(x2, y2)
    expected.backward(engine=pargrad.SequentialEngine())
    np.testing.assert_allclose(loss.data, expected.data, rtol=1e-12)
    for got, want in ((x.grad, x2.grad), (y.grad, y2.grad)):
        if want is None:
            assert got is None or not np.any(got.data)
        else:
            np.testing.assert_allclose(got.data, want.data, rtol=1e-12, atol=1e-15)


def test_in_place_gradients_pass_gradcheck(engine: pargrad.Engine) -> None:
    for name, (in_place, _) in CASES.items():
        assert pargrad.gradcheck(in_place, [pargrad.tensor(X, requires_grad=True),
                                            pargrad.tensor(Y, requires_grad=True)]), name


def test_methods_write_into_memory_and_return_self() -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0])
    memory = x.data
    assert x.add_(1.0) is x and x.mul_(2.0) is x and x.sub_(1.0) is x and x.div_(2.0) is x
    assert x.data is memory and x._version == 4
    np.testing.assert_array_equal(x.data, [1.5, 2.5, 3.5])
    assert x.fill_(7.0) is x and x.zero_() is x
    x[1] = 5.0
    np.testing.assert_array_equal(memory, [0.0, 5.0, 0.0])
    assert x._version == 7
    x += pargrad.tensor([1.0, 1.0, 1.0])
    x -= 1
    x *= 3
    x /= 3
    x **= 2
    assert x.data is memory and x._version == 12
    np.testing.assert_array_equal(x.data, [0.0, 25.0, 0.0])


def test_views_share_the_version_counter() -> None:
    base = pargrad.tensor(np.arange(6.0).reshape(2, 3))
    views = [base.reshape(6), base[0], base[:, 1:], base.T, pargrad.squeeze(base[None]),
             pargrad.split(base, 3, axis=1)[1], base.detach()]
    for v in views:
        assert v._counter is base._counter
    copies = [base[[0, 1]], base.copy(), base * 1, base.astype(np.float32)]
    for c in copies:
        assert c._counter is not base._counter
    views[1][0] = 100.0  # through a view: the base sees it, and its version moves on
    assert base.data[0, 0] == 100.0 and base._version == 1
    base.add_(1)
    assert all(v._version == 2 for v in views) and all(c._version == 0 for c in copies)


def test_changed_saved_tensor_raises_and_changes_no_grad(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    w.grad = pargrad.tensor([10.0, 10.0])
    h = pargrad.exp(w)  # ExpBackward saves its output
    loss = (h * 2.0).sum()
    with pargrad.no_grad():
        h.add_(1)
    with pytest.raises(pargrad.BackwardError) as info:
        loss.backward()
    message = str(info.value)
    assert info.value.node_name == "ExpBackward"
    assert ("output 0 (shape (2,), dtype float64) is at version 1, but was saved at "
            "version 0") in message
    np.testing.assert_array_equal(w.grad.data, [10.0, 10.0])


def _under_no_grad(change: Callable[[], object]) -> Callable[[], object]:
    def run() -> None:
        with pargrad.no_grad():
            change()
    return run


# However a saved output's memory changes (a node makes its version counter only when
# the first change or save asks for it), the node that saved it sees the change.
CHANGES_OF_A_SAVED_OUTPUT: dict[str, Callable[[Tensor], Callable[[], object]]] = {
    "plain write": lambda h: _under_no_grad(lambda: h.add_(1)),
    "recorded": lambda h: lambda: h.add_(1),
    "recorded, reading the old value": lambda h: lambda: h.sin_(),
    "setitem": lambda h: lambda: h.__setitem__(0, 5.0),
    "through a view": lambda h: _under_no_grad(lambda: h[:1].mul_(2)),
    "through detach()": lambda h: lambda: h.detach().add_(1),
    "after detach_()": lambda h: lambda: (h.detach_(), h.add_(1)),
}


@pytest.mark.parametrize("how", list(CHANGES_OF_A_SAVED_OUTPUT))
def test_every_change_of_a_saved_output_is_seen(how: str, engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = pargrad.exp(w)  # ExpBackward saves its output
    loss = (h * 2.0).sum()  # reads 2.0, not h
    CHANGES_OF_A_SAVED_OUTPUT[how](h)()  # (reading h._version first would make its counter)
    assert h._version >= 1
    with pytest.raises(pargrad.BackwardError,
                       match=r"output 0 .* but was saved at version 0") as info:
        loss.backward()
    assert info.value.node_name == "ExpBackward"
    assert w.grad is None


def test_outputs_rebuilt_for_create_graph_share_the_saved_outputs_counter(
        engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = pargrad.exp(w)
    # The gradient of exp(h) times the rebuilt h: a product node saves that rebuilt h.
    (g,) = pargrad.grad(pargrad.exp(h).sum(), [w], create_graph=True)
    np.testing.assert_allclose(g.data, np.exp(np.exp([1.0, 2.0])) * np.exp([1.0, 2.0]))
    with pargrad.no_grad():
        h.mul_(3.0)
    with pytest.raises(pargrad.BackwardError, match=r"argument 1 .* is at version 1") as info:
        g.sum().backward()
    assert info.value.node_name == "MultiplyBackward"  # the first node reading h's values
    assert w.grad is None


def test_changed_leaf_raises_where_its_value_is_read(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x = pargrad.tensor([3.0, 4.0], requires_grad=True)
    loss = (w * x).sum()
    harmless = (w * 3.0).sum()  # w's gradient reads only 3.0
    with pargrad.no_grad():
        w -= 0.5
    harmless.backward()
    np.testing.assert_array_equal(w.grad.data, [3.0, 3.0])
    with pytest.raises(pargrad.BackwardError,
                       match=r"MultiplyBackward: .*argument 0 \(shape \(2,\), dtype float64\) "
                             r"is at version 1, but was saved at version 0"):
        loss.backward()
    assert x.grad is None


def test_refused_in_place_changes_leave_the_tensor_alone() -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    for change in (lambda: w.add_(1), lambda: w.zero_(), lambda: w.__setitem__(0, 1.0),
                   lambda: w.__imul__(2)):
        with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
            change()
    for view in (w[:1], w.reshape(2, 1), w.T[None]):
        with pytest.raises(RuntimeError, match="view of a leaf tensor that requires grad"):
            view.mul_(2)
    h = w * 1.0
    c = pargrad.tensor([1, 2])
    with pytest.raises(TypeError, match="cannot update a int64 tensor in place"):
        c.div_(2)
    with pytest.raises(ValueError, match=r"shape \(2,\) in place with a result of shape \(3, 2\)"):
        c.add_(np.ones((3, 2), dtype=int))
    with pytest.raises(ValueError, match="read-only"):
        pargrad.broadcast_to(pargrad.tensor([1.0]), (3,)).add_(1)
    with pytest.raises(IndexError, match="setitem: index 5 is out of bounds"):
        c[5] = 1
    with pytest.raises(ValueError, match="fill_: the value must be a number or a tensor with "
                                         "one element"):
        h.fill_(np.array([1.0, 2.0]))
    assert w._version == 0 and c._version == 0 and h._version == 0
    np.testing.assert_array_equal(w.data, [1.0, 2.0])
    with pargrad.no_grad():  # outside grad mode all of them are plain writes
        w.add_(1)
        w[:1].mul_(10)
        h.T.zero_()
    np.testing.assert_array_equal(w.data, [20.0, 3.0])
    assert w._version == 2 and h._version == 1


def test_setitem_into_a_constant_makes_a_non_leaf(engine: pargrad.Engine) -> None:
    v = pargrad.tensor([2.0, 3.0], requires_grad=True)
    s = pargrad.tensor(0.5, requires_grad=True)
    buf = pargrad.tensor(np.zeros((2, 3)))
    buf[:, 0] = v
    buf[1, 1:] = s * 2  # broadcast: s gets the sum
    buf[pargrad.tensor(np.array([0])), 2] = v[1]  # a Tensor index
    assert buf.requires_grad and not buf.is_leaf and buf.grad_fn.name() == "SetitemBackward"
    np.testing.assert_array_equal(buf.data, [[2.0, 0.0, 3.0], [3.0, 1.0, 1.0]])
    (buf * pargrad.tensor(np.arange(6.0).reshape(2, 3))).sum().backward()
    np.testing.assert_array_equal(v.grad.data, [0.0, 3.0 + 2.0])
    assert s.grad.item() == 2 * (4.0 + 5.0)


def test_overwritten_elements_get_no_gradient(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    h = x * 1.0
    h[1] = 0.0
    h[0] = h[2] * 2  # reads h before the write, as numpy does
    h.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [0.0, 0.0, 3.0])


def test_retain_grad_follows_the_rebased_tensor(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    h = x * 2.0
    h.retain_grad()
    seen: list[np.ndarray] = []
    h.register_hook(lambda g: seen.append(g.data.copy()))  # sees the old value's gradient
    h.mul_(3.0)
    assert h.retains_grad
    (h * h).sum().backward()
    np.testing.assert_array_equal(h.grad.data, 2 * h.data)
    np.testing.assert_array_equal(seen[0], 3 * 2 * h.data)


def test_second_derivatives_through_in_place_ops(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.5, 1.5], requires_grad=True)
    h = x * x
    h.mul_(x)  # x ** 3
    h[0] = h[0] * 2.0
    (g,) = pargrad.grad(h.sum(), x, create_graph=True)
    np.testing.assert_allclose(g.data, [2 * 3 * 0.25, 3 * 2.25])
    (gg,) = pargrad.grad(g.sum(), x)
    np.testing.assert_allclose(gg.data, [2 * 6 * 0.5, 6 * 1.5])
    assert pargrad.gradgradcheck(lambda t: (t * 1.0).mul_(t).div_(t + 3.0),
                                 [pargrad.tensor([0.3, -0.7], requires_grad=True)])


def test_changing_a_tensor_while_a_function_saved_it() -> None:
    class Twice(pargrad.Function):
        @staticmethod
        def forward(ctx: pargrad.FunctionCtx, x: Tensor) -> np.ndarray:
            ctx.save_for_backward(x)
            return x.data * 2

        @staticmethod
        def backward(ctx: pargrad.FunctionCtx, g: Tensor) -> Tensor:
            ctx.saved_tensors  # noqa: B018 - reading them runs the version check
            return g * 2

    w = pargrad.tensor([1.0], requires_grad=True)
    h = w * 1.0
    y = Twice.apply(h)
    h.add_(1)
    with pytest.raises(pargrad.BackwardError,
                       match=r"TwiceBackward: .*saved tensor 0 .* at version 1, but was saved "
                             r"at version 0"):
        y.backward()
    assert w.grad is None


def test_post_accumulate_hooks_may_step_in_place(engine: pargrad.Engine) -> None:
    """Optimizer in backward: a leaf's last reader has run when its hook fires, so the
    in-place step never trips a version check of the same backward."""
    rng = np.random.default_rng(3)
    x = pargrad.tensor(rng.normal(size=(8, 4)))
    params = [pargrad.tensor(rng.normal(size=(4, 4)), requires_grad=True) for _ in range(3)]
    memories = [p.data for p in params]

    def step(p: Tensor) -> None:
        with pargrad.no_grad():
            p.sub_(0.1 * p.grad)
        p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    for _ in range(3):
        h = x
        for p in params:
            h = pargrad.tanh(h @ p)
        h.sum().backward()
    assert all(p.data is m and p._version == 3 for p, m in zip(params, memories))


@pytest.mark.timeout(60)
def test_in_place_graphs_on_many_threads() -> None:
    """Threads build graphs with in-place ops on their own tensors and run them on one
    threaded engine; one of them changes a saved tensor and gets the error."""
    engine = pargrad.ThreadedEngine(workers=4, handoff_threshold=2)
    errors: list[BaseException] = []
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(6)

    def work(k: int) -> None:
        try:
            barrier.wait()
            for _ in range(20):
                x = pargrad.tensor(X + k, requires_grad=True)
                y = pargrad.tensor(Y, requires_grad=True)
                loss = CASES["chain"][0](x, y) + _setitem(x, y)
                if k == 5:
                    h = pargrad.tanh(x)
                    loss = loss + h.sum()
                    with pargrad.no_grad():
                        h.mul_(2)
                    with pytest.raises(pargrad.BackwardError, match="TanhBackward"):
                        loss.backward(engine=engine)
                    assert x.grad is None
                    continue
                loss.backward(engine=engine)
                results[k] = x.grad.data
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.shutdown()
    assert not errors, errors
    for k, got in results.items():
        x = pargrad.tensor(X + k, requires_grad=True)
        y = pargrad.tensor(Y, requires_grad=True)
        (CASES["chain"][1](x, y) + _setitem_reference(x, y)).backward(
            engine=pargrad.SequentialEngine())
        np.testing.assert_allclose(got, x.grad.data, rtol=1e-12)



# ----- in-place changes through views -----
W4 = np.array([2.0, 3.0, 4.0, 5.0])


def _grads(fn: Callable[[Tensor], Tensor], engine: pargrad.Engine | None = None) -> np.ndarray:
    w = pargrad.tensor(W4, requires_grad=True)
    fn(w).backward(engine=engine)
    assert w.grad is not None
    return w.grad.data


VIEW_CASES: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {
    # h[1:3] *= 2: Python changes the view h[1:3] in place, then assigns it back
    "augmented_slice": (lambda w: _aug(w), lambda w: (pargrad.concatenate(
        [w[:1], w[1:3] * 2, w[3:]]) * w).sum()),
    # a view made before its base changed is made again from the base
    "stale_view": (lambda w: _stale(w), lambda w: ((w * w)[:2] ** 2).sum()),
    # a buffer that needs no grad learns that it depends on w through its view
    "view_of_a_constant": (lambda w: _buffer(w), lambda w: (pargrad.concatenate(
        [np.zeros(1), w[1:3] * 3, np.zeros(1)]) * w).sum()),
    # and a view of it made before it did
    "stale_view_of_a_constant": (lambda w: _buffer_stale(w),
                                 lambda w: (pargrad.stack([np.float64(0.0), w[0]]) ** 2).sum()),
    # a view of a view (reshape, then a row), and a transposed view
    "view_of_a_view": (lambda w: _nested(w), lambda w: (pargrad.concatenate(
        [w[:2] * 1.0, w[2:] * w[:2]]) ** 2).sum()),
    "transposed": (lambda w: _transposed(w), lambda w: (pargrad.stack(
        [w[0], w[1] + w[0], w[2], w[3] + w[2]]) ** 2).sum()),
}


def _aug(w: Tensor) -> Tensor:
    h = w * 1.0
    h[1:3] *= 2
    return (h * w).sum()


def _stale(w: Tensor) -> Tensor:
    h = w * 1.0
    v = h[:2]
    h.mul_(w)
    return (v * v).sum()


def _buffer(w: Tensor) -> Tensor:
    buf = pargrad.tensor(np.zeros(4))
    buf[1:3].add_(w[1:3] * 3)
    if w.requires_grad:  # (gradcheck also calls it on plain tensors)
        assert buf.grad_fn.name() == "CopySlicesBackward"
    return (buf * w).sum()


def _buffer_stale(w: Tensor) -> Tensor:
    buf = pargrad.tensor(np.zeros(4))
    v = buf[:2]
    buf[1:] = w[:3]
    assert v.requires_grad == w.requires_grad  # made again from its base
    return (v * v).sum()


def _nested(w: Tensor) -> Tensor:
    h = w * 1.0
    h.reshape(2, 2)[1].mul_(w[:2])
    return (h * h).sum()


def _transposed(w: Tensor) -> Tensor:
    m = (w * 1.0).reshape(2, 2)  # rows (w0, w1), (w2, w3)
    m.T[1].add_(m.T[0])  # column 1 += column 0: (w0, w1 + w0), (w2, w3 + w2)
    return (m ** 2).sum()


@pytest.mark.parametrize("name", sorted(VIEW_CASES))
def test_in_place_through_views(name: str, engine: pargrad.Engine) -> None:
    in_place, reference = VIEW_CASES[name]
    np.testing.assert_allclose(_grads(in_place, engine), _grads(reference), rtol=1e-12)
    assert pargrad.gradcheck(in_place, [pargrad.tensor(W4, requires_grad=True)]), name


def test_view_changes_reach_the_base_and_other_views() -> None:
    w = pargrad.tensor(W4, requires_grad=True)
    h = w * 1.0
    row = h.reshape(2, 2)[0]
    before = h[1:]
    row.mul_(10.0)
    np.testing.assert_array_equal(h.data, [20.0, 30.0, 4.0, 5.0])
    assert h.grad_fn.name() == "CopySlicesBackward" and row.grad_fn.name() == "GetitemBackward"
    assert before._version == h._version == row._version == 1
    before.sum().backward()  # made again from the new h: d(30 + 4 + 5)/dw
    np.testing.assert_array_equal(w.grad.data, [0.0, 10.0, 1.0, 1.0])


def test_second_derivatives_through_a_view_change(engine: pargrad.Engine) -> None:
    def f(w: Tensor) -> Tensor:
        h = w * w
        h[1:3].mul_(w[:2])
        return h

    assert pargrad.gradgradcheck(f, [pargrad.tensor([0.3, -0.7, 1.1, 0.5], requires_grad=True)])


def test_a_tensor_index_is_kept_as_it_was() -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    idx = pargrad.tensor([0, 1])
    y = x[idx]
    h = x * 1.0
    h[idx] = pargrad.tensor([5.0, 6.0])
    idx[0] = 2  # the graph keeps the index it was made with
    (y * pargrad.tensor([10.0, 100.0])).sum().backward()
    h.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [10.0, 100.0, 1.0])


def test_setitem_value_with_leading_axes_of_length_one(engine: pargrad.Engine) -> None:
    x = pargrad.tensor(np.arange(4.0).reshape(1, 2, 2), requires_grad=True)
    s = pargrad.tensor([0.5], requires_grad=True)
    h = pargrad.tensor(np.zeros((3, 2)))
    h[0:2] = x  # numpy drops the value's leading axis of length one
    zero_d = pargrad.tensor(1.0) * 1.0
    zero_d.fill_(s)
    (h * 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad.data, np.full((1, 2, 2), 2.0))
    (zero_d * 3.0).backward()
    np.testing.assert_array_equal(s.grad.data, [3.0])


def test_dividing_then_scaling_in_place(engine: pargrad.Engine) -> None:
    """divide's rules read its arguments, not its output, so y /= ... and y *= ... after
    y = a / b are legal, as in PyTorch."""
    a = pargrad.tensor([1.0, 2.0], requires_grad=True)
    b = pargrad.tensor([4.0, 8.0], requires_grad=True)
    y = a / b
    y *= 3.0
    y.sum().backward()
    np.testing.assert_allclose(b.grad.data, -3.0 * a.data / b.data ** 2)



def test_a_view_made_under_no_grad_changed_with_grad_on(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    h = x * 2.0
    with pargrad.no_grad():
        v = h[0:2]
    assert not v.requires_grad
    v.mul_(3.0)  # recorded: the view is made again from h first
    assert h.grad_fn.name() == "CopySlicesBackward"
    h.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [6.0, 6.0, 2.0])


def test_stale_views_are_remade_for_hooks_and_retain_grad(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    h = x * 1.0
    v = h[0:3]
    h.mul_(2.0)
    v.retain_grad()  # on the remade view: it sees the gradient of v = 2x
    seen: list[np.ndarray] = []
    v.register_hook(lambda g: seen.append(g.data.copy()))
    (v * v).sum().backward()
    np.testing.assert_array_equal(v.grad.data, [4.0, 8.0, 12.0])
    np.testing.assert_array_equal(seen[0], [4.0, 8.0, 12.0])
    buffer = pargrad.tensor(np.zeros(4))
    tail = buffer[2:]
    buffer[:3] = x
    assert not tail.is_leaf and tail.requires_grad and tail.grad_fn.name() == "GetitemBackward"
    tail.retain_grad()
    (tail * 5.0).sum().backward()
    np.testing.assert_array_equal(tail.grad.data, [5.0, 5.0])


def test_retain_grad_moves_with_a_change_through_the_view(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    v = (x * 1.0)[0:3]
    v.retain_grad()
    v.mul_(3.0)
    assert v.retains_grad
    (v * v).sum().backward()
    np.testing.assert_array_equal(v.grad.data, 2 * v.data)  # of the new value, 3x


def test_double_backward_checks_the_outputs_it_saved(engine: pargrad.Engine) -> None:
    """With create_graph, a rule differentiates through the node's outputs: they keep
    their tensors' counters, so changing one in place before the second backward raises."""
    x = pargrad.tensor([0.5, 1.0], requires_grad=True)
    v = pargrad.tensor([1.0, 1.0], requires_grad=True)
    y = x.exp()
    (g,) = pargrad.grad(y, [x], grad_outputs=[v], create_graph=True)
    with pargrad.no_grad():
        y.mul_(100.0)
    with pytest.raises(pargrad.BackwardError, match=r"MultiplyBackward: .*argument 1 .* version 1"):
        pargrad.grad(g.sum(), [v])


@pytest.mark.timeout(60)
def test_threads_saving_one_leaf_share_its_counter() -> None:
    """The counter is made on first use, under a lock: graphs recorded at once on one
    shared leaf all see a later in-place change of it."""
    leaf = pargrad.tensor([1.0, 2.0], requires_grad=True)
    barrier = threading.Barrier(8)
    losses: list[Tensor] = []
    lock = threading.Lock()

    def record() -> None:
        barrier.wait()
        other = pargrad.tensor([3.0, 4.0], requires_grad=True)
        loss = (leaf * other).sum()  # other's gradient reads leaf
        with lock:
            losses.append(loss)

    threads = [threading.Thread(target=record) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pargrad.no_grad():
        leaf.add_(1)
    for loss in losses:
        with pytest.raises(pargrad.BackwardError, match=r"argument 0 .* at version 1"):
            loss.backward()

OPS = ["add_", "sub_", "mul_", "div_", "setitem", "fill_", "view_mul_", "slice_iadd"]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3)), min_size=1,
                      max_size=8))
def test_random_in_place_sequences_match_out_of_place(
    steps: list[tuple[str, int]], engine: pargrad.Engine
) -> None:
    """A random sequence of in-place ops on a non-leaf (some through views of it) gives
    the value and gradients of the same sequence written out of place."""

    def run(in_place: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x, y = leaves()
        h = x * 1.0
        for op, i in steps:
            other = y * float(i + 1)
            if op == "setitem":
                if in_place:
                    h[i] = other[i]
                else:
                    h = pargrad.concatenate([h[:i], other[i:i + 1], h[i + 1:]])
            elif op == "view_mul_":  # through a view of two elements
                if in_place:
                    h[i:i + 2].mul_(other[i:i + 2])
                else:
                    h = pargrad.concatenate([h[:i], h[i:i + 2] * other[i:i + 2], h[i + 2:]])
            elif op == "slice_iadd":  # h[i:] += ..., a view changed and assigned back
                if in_place:
                    h[i:] += other[i:]
                else:
                    h = pargrad.concatenate([h[:i], h[i:] + other[i:]])
            elif op == "fill_":
                h = h.fill_(other[i]) if in_place else pargrad.broadcast_to(other[i], (4,)) * 1.0
            elif in_place:
                getattr(h, op)(other)
            else:
                h = {"add_": h + other, "sub_": h - other, "mul_": h * other,
                     "div_": h / other}[op]
        loss = (h * h).sum()
        loss.backward(engine=engine if in_place else pargrad.SequentialEngine())
        gx = np.zeros(4) if x.grad is None else x.grad.data
        gy = np.zeros(4) if y.grad is None else y.grad.data
        return loss.data, gx, gy

    for got, want in zip(run(True), run(False)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
