"""Ports of PyTorch's TestAutograd: hooks of every kind and their order, retain_grad,
post-accumulate-grad hooks, hooks and in-place changes, multi-grad hooks."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Function
from tests.peer_torch._helpers import assert_equal, ones, rand, randn, value


def _acc(t: pargrad.Tensor) -> pargrad.Node:
    """``t.view_as(t).grad_fn.next_functions[0][0]``: a leaf's AccumulateGrad node."""
    node = t.reshape(t.shape).grad_fn.next_functions[0][0]
    assert node is not None
    return node


def test_hooks() -> None:
    x = ones(5, 5, requires_grad=True)
    y = ones(5, 5) * 4
    y.requires_grad_(True)
    counter = [0]

    def bw_hook(inc: int, grad: Any) -> None:
        assert isinstance(grad, pargrad.Tensor)
        counter[0] += inc

    z = x ** 2 + x * 2 + x * y + y
    x.register_hook(lambda *args: bw_hook(0, *args))
    test = z.register_hook(lambda *args: bw_hook(1, *args))
    z.backward(np.ones((5, 5)), retain_graph=True)
    assert counter[0] == 1
    test2 = z.register_hook(lambda *args: bw_hook(2, *args))
    z.backward(np.ones((5, 5)), retain_graph=True)
    assert counter[0] == 4
    test2.remove()
    z.backward(np.ones((5, 5)), retain_graph=True)
    assert counter[0] == 5

    def bw_hook_modify(grad: Any) -> Any:
        return grad * 2

    test.remove()
    z.register_hook(bw_hook_modify)
    with pargrad.no_grad():
        y.grad.zero_()
    z.backward(np.ones((5, 5)), retain_graph=True)
    assert_equal(y.grad, (value(x) + 1) * 2)
    y.register_hook(bw_hook_modify)
    with pargrad.no_grad():
        y.grad.zero_()
    z.backward(np.ones((5, 5)))
    assert_equal(y.grad, (value(x) + 1) * 4)


def _get_mul2(use_custom_function: bool) -> Any:
    if use_custom_function:
        class Mul2(Function):
            @staticmethod
            def forward(ctx, x):  # type: ignore[no-untyped-def]
                return x.data * 2

            @staticmethod
            def backward(ctx, gO):  # type: ignore[no-untyped-def]
                return gO * 2

        return Mul2.apply
    return lambda x: x * 2


def test_grad_fn_prehooks() -> None:
    for use_custom_function in (True, False):
        mul2 = _get_mul2(use_custom_function)
        a = pargrad.tensor([1.0], requires_grad=True)
        b = mul2(a)
        post_counter = [0]
        pre_counter = [0]

        def posthook(grad_input: Any, grad_output: Any) -> Any:
            assert pre_counter[0] == 3
            assert np.allclose(value(grad_output[0]), np.ones(1) * 8)
            assert np.allclose(value(grad_input[0]), np.ones(1) * 16)
            post_counter[0] += 1
            return grad_input

        def prehook(grad_output: Any) -> Any:
            pre_counter[0] += 1
            return (grad_output[0] * 2,)

        b.grad_fn.register_hook(posthook)
        b.grad_fn.register_hook(posthook)
        b.grad_fn.register_prehook(prehook)
        b.grad_fn.register_prehook(lambda x: None)
        b.grad_fn.register_prehook(prehook)
        b.grad_fn.register_prehook(prehook)
        b.grad_fn.register_prehook(lambda x: x)
        b.grad_fn.register_prehook(lambda x: None)
        b.sum().backward()
        assert post_counter[0] == 2
        assert pre_counter[0] == 3
        # Return None
        a = rand(3, 3, requires_grad=True)
        b = mul2(a)

        def prehook2(grad_output: Any) -> None:
            pre_counter[0] += 1

        b.grad_fn.register_prehook(prehook2)
        b.sum().backward()
        assert pre_counter[0] == 4
        assert np.allclose(value(a.grad), np.ones((3, 3)) * 2)


def test_grad_fn_prehooks_multiple_outputs() -> None:
    # The custom Function half (torch.var_mean has no counterpart here).
    class DoubleMul2(Function):
        @staticmethod
        def forward(ctx, x, a, y):  # type: ignore[no-untyped-def]
            ctx.a = a
            return a * x.data * 2, a, a * y.data * 2

        @staticmethod
        def backward(ctx, g1, _a, g2):  # type: ignore[no-untyped-def]
            return ctx.a * g1 * 2, None, ctx.a * g2 * 2

    counter = [0]

    def prehook(grad_output: Any) -> Any:
        g1, ga, g2 = grad_output
        assert ga is None
        counter[0] += 1
        return (g1 * 2, None, g2 * 2)

    a = randn(3, 3, requires_grad=True)
    b = randn(3, 3, requires_grad=True)
    k = 3
    c, _, d = DoubleMul2.apply(a, k, b)
    c.grad_fn.register_prehook(prehook)
    (c + d).sum().backward()
    assert counter[0] == 1
    assert np.allclose(value(a.grad), np.ones(1) * 4 * k)
    assert np.allclose(value(b.grad), np.ones(1) * 4 * k)


def test_grad_fn_prehooks_remove_hooks() -> None:
    for use_custom_function in (True, False):
        mul2 = _get_mul2(use_custom_function)
        a = rand(3, 3, requires_grad=True)
        b = mul2(a)
        counter = [0]

        def prehook(grad_output: Any) -> None:
            counter[0] += 1

        handle = b.grad_fn.register_prehook(prehook)
        b.grad_fn.register_prehook(prehook)
        handle.remove()
        b.sum().backward()
        assert np.allclose(value(a.grad), np.ones((3, 3)) * 2)
        assert counter[0] == 1
        # Remove hooks during backward
        a = rand(3, 3, requires_grad=True)
        b = mul2(a)
        counter = [0]

        def prehook1(grad_output: Any) -> None:
            handle2.remove()
            handle3.remove()  # removing a removed hook is OK

        def prehook2(grad_output: Any) -> None:
            counter[0] += 1

        b.grad_fn.register_prehook(prehook1)
        handle2 = b.grad_fn.register_prehook(prehook2)
        handle3 = b.grad_fn.register_prehook(prehook2)
        handle3.remove()
        b.sum().backward()
        assert np.allclose(value(a.grad), np.ones((3, 3)) * 2)
        assert counter[0] == 1


def test_hook_none() -> None:
    class NoneGradientFunction(Function):
        @staticmethod
        def forward(ctx, x, y):  # type: ignore[no-untyped-def]
            assert ctx.needs_input_grad[0]
            assert not ctx.needs_input_grad[1]
            return x.data.copy(), y.data.copy()

        @staticmethod
        def backward(ctx, grad_x, grad_y):  # type: ignore[no-untyped-def]
            return grad_x, None

    was_called = [False]

    def hook(grad: Any) -> None:
        assert grad is not None
        was_called[0] = True

    x = randn(5, 5, requires_grad=True)
    y = randn(5, 5)
    rx, ry = NoneGradientFunction.apply(x, y)
    rx.register_hook(hook)
    ry.register_hook(hook)
    sum([rx, ry]).sum().backward()
    assert was_called[0]


def test_retain_grad() -> None:
    inp = rand(1, 3, requires_grad=True)
    h1 = inp * 3
    out = (h1 * h1).sum()
    h1.retain_grad()
    h1.retain_grad()
    out.backward(retain_graph=True)
    assert_equal(value(h1) * 2, h1.grad)
    out.backward(retain_graph=True)
    assert_equal(value(h1) * 4, h1.grad)
    with pargrad.no_grad():
        inp.grad.zero_()
    inp.retain_grad()
    inp.retain_grad()
    out.backward()
    assert_equal(value(inp) * 18, inp.grad)


def test_retain_grad_inplace() -> None:
    a = pargrad.tensor([1.0], requires_grad=True).copy()
    a.retain_grad()
    a.mul_(2)
    a.sum().backward()
    assert_equal(a.grad, np.array([1.0]))
    a = pargrad.tensor([1.0], requires_grad=True).copy()
    a.retain_grad()
    a.mul_(2)
    a.mul_(2)
    a.sum().backward()
    assert_equal(a.grad, np.array([1.0]))
    x = pargrad.tensor([1.0], requires_grad=True).copy()
    x.retain_grad()
    x_view = x[:]
    x_view *= 2
    x *= 2
    x.sum().backward()
    assert_equal(a.grad, np.array([1.0]))
    x = pargrad.tensor(np.zeros(4))
    y = x.reshape(2, 2)
    y.add_(randn(2, 2, requires_grad=True))


def test_retains_grad_inplace_multiple_outputs() -> None:
    class DoubleMul(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.data * 2, x.data * 3

        @staticmethod
        def backward(ctx, g1, g2):  # type: ignore[no-untyped-def]
            return g1 * 2 + g2 * 3

    b = rand(3, 3, requires_grad=True)
    var, mean = DoubleMul.apply(b)
    var.retain_grad()
    mean.retain_grad()
    var.mul_(2)
    (var + mean).sum().backward()
    gvar = var.grad
    gmean = mean.grad
    a = b.detach().requires_grad_(True)
    var, mean = DoubleMul.apply(a)
    var.mul_(2)
    out = (var + mean).sum()
    gvar_expected, gmean_expected = pargrad.grad(out, inputs=(var, mean))
    assert np.allclose(value(gvar), value(gvar_expected))
    assert np.allclose(value(gmean), value(gmean_expected))


def test_retain_grad_inplace_over_view() -> None:
    base = pargrad.tensor([1.0], requires_grad=True).copy()
    view = base[:]
    view2 = base[:]
    view.retain_grad()
    view2.retain_grad()
    view.mul_(2)
    (view + view2).sum().backward()
    assert_equal(view.grad, view2.grad)
    assert_equal(view.grad, np.array([1.0]))


def test_tensor_hooks_inplace() -> None:
    count1 = [0]
    count2 = [0]

    def fn1(grad: Any) -> Any:
        count1[0] += 1
        assert_equal(grad, np.array([4.0]))  # x2 from mul, x2 from fn2
        return grad * 2

    def fn2(grad: Any) -> Any:
        count2[0] += 1
        assert_equal(grad, np.array([1.0]))
        return grad * 2

    a = pargrad.tensor([1.0], requires_grad=True)
    b = a.copy()
    b.register_hook(fn1)
    b.mul_(2)
    b.register_hook(fn2)
    b.sum().backward()
    assert count1[0] == 1
    assert count2[0] == 1
    assert_equal(a.grad, np.array([8.0]))
    count3 = [0]

    def fn3(grad: Any) -> Any:
        count3[0] += 1
        assert_equal(grad, np.array([4.0]))
        return grad * 2

    a = pargrad.tensor([1.0], requires_grad=True)
    b = a.copy()
    b.register_hook(fn3)
    b.mul_(2)
    b.mul_(2)
    b.sum().backward()
    assert count1[0] == 1
    assert_equal(a.grad, np.array([8.0]))


def test_tensor_hooks_inplace_multiple_outputs() -> None:
    class DoubleMul(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.data * 2, x.data * 3

        @staticmethod
        def backward(ctx, g1, g2):  # type: ignore[no-untyped-def]
            return g1 * 2 + g2 * 3

    counts = [0, 0, 0]
    b = rand(3, 3, requires_grad=True)
    out1, out2 = DoubleMul.apply(b)

    def fn0(grad: Any) -> None:
        counts[0] += 1
        assert_equal(grad, np.ones_like(value(out1)) * 2)

    def fn1(grad: Any) -> None:
        counts[1] += 1
        assert_equal(grad, np.ones_like(value(out1)) * 3)

    def fn2(grad: Any) -> None:
        counts[2] += 1
        assert_equal(grad, np.ones_like(value(out1)))

    h1 = out1.register_hook(fn0)
    h2 = out2.register_hook(fn1)
    out1.mul_(2)
    h3 = out1.register_hook(fn2)
    (out1 + out2 * 3).sum().backward()
    assert counts == [1, 1, 1]
    h1.remove()
    h2.remove()
    h3.remove()


def test_tensor_hooks_inplace_over_view() -> None:
    count = [0]

    def fn0(grad: Any) -> None:
        pytest.fail("fn0 must not run")

    def fn1(grad: Any) -> None:
        pytest.fail("fn1 must not run")

    def fn2(grad: Any) -> None:
        count[0] += 1
        assert_equal(grad, np.array([1.0]))

    base = pargrad.tensor([1.0], requires_grad=True).copy()
    view = base[:]
    view2 = base[:]
    view.register_hook(fn0)
    view2.register_hook(fn1)
    view.mul_(2)
    # We need to explicitly trigger an update to view to update its grad_fn
    view2.grad_fn  # noqa: B018
    view2.register_hook(fn2)
    (view + view2).sum().backward()
    assert count[0] == 1


def test_post_accumulate_grad_hook_on_non_leaf() -> None:
    def hook(tensor: Any) -> None:
        tensor.sub_(1.0)

    leaf = rand(3, requires_grad=True)
    non_leaf = 2.0 * leaf
    with pytest.raises(RuntimeError, match="post-accumulate-grad hooks can only be "
                                           "registered on leaf"):
        non_leaf.register_post_accumulate_grad_hook(hook)


def test_post_accumulate_grad_hook_multiple_hooks() -> None:
    def hook1(tensor: Any) -> None:
        tensor.sub_(tensor.grad)

    def hook2(tensor: Any) -> None:
        tensor.mul_(4.0)

    tensor = rand(3, requires_grad=True)
    tensor_ref = value(tensor).copy()
    tensor.register_post_accumulate_grad_hook(hook1)
    tensor.register_post_accumulate_grad_hook(hook2)
    tensor.sum().backward()
    assert_equal(4.0 * (tensor_ref - 1.0), tensor)


def test_post_accumulate_grad_hook_multiple_tensors() -> None:
    def hook(tensor: Any) -> None:
        tensor.sub_(tensor.grad)

    tensor1 = rand(3, requires_grad=True)
    tensor1_ref = value(tensor1).copy()
    tensor2 = rand(5, requires_grad=True)
    tensor2_ref = value(tensor2).copy()
    tensor1.register_post_accumulate_grad_hook(hook)
    tensor2.register_post_accumulate_grad_hook(hook)
    tensor1.sum().backward()
    tensor2.sum().backward()
    assert_equal(tensor1_ref - 1.0, tensor1)
    assert_equal(tensor2_ref - 1.0, tensor2)


def test_post_accumulate_grad_hook_returns_not_None() -> None:
    def bad_hook(tensor: Any) -> Any:
        return tensor.grad

    tensor = rand(2, 3, requires_grad=True)
    tensor.register_post_accumulate_grad_hook(bad_hook)
    with pytest.raises(RuntimeError, match="hooks should return None"):
        tensor.sum().backward()


def test_post_accumulate_grad_hook_gets_cleaned_up() -> None:
    def fun_stuff_with_hook() -> tuple[Any, Any]:
        thing_to_put_in_hook = rand(3)

        def hook(tensor: Any) -> None:
            tensor.sub_(tensor.grad)
            tensor.add_(thing_to_put_in_hook)

        tensor = rand(3, requires_grad=True)
        tensor.register_post_accumulate_grad_hook(hook)
        tensor.sum().backward()
        ref = weakref.ref(thing_to_put_in_hook)
        gc.collect()
        return tensor, ref

    tensor, ref = fun_stuff_with_hook()
    assert ref() is not None  # kept alive by tensor
    del tensor
    gc.collect()
    assert ref() is None


def test_post_accumulate_grad_hook_ordering() -> None:
    tensor = rand(3, requires_grad=True)

    def pre_hook(grad: Any) -> Any:
        return grad - 2.0

    def acc_grad_node_pre_hook(grad_out: Any) -> Any:
        return (grad_out[0] / 5.0,)

    def post_acc_grad_hook(tensor: Any) -> None:
        tensor.grad.add_(0.5)

    def acc_grad_node_post_hook(grad_in: Any, grad_out: Any) -> None:
        tensor.grad = grad_out[0] * 10

    acc_grad = _acc(tensor)
    tensor.register_hook(pre_hook)
    acc_grad.register_prehook(acc_grad_node_pre_hook)
    tensor.register_post_accumulate_grad_hook(post_acc_grad_hook)
    acc_grad.register_hook(acc_grad_node_post_hook)
    tensor.sum().backward()
    # tensor prehook, acc_grad prehook, post acc_grad hook, acc_grad posthook:
    # ((1 - 2) / 5 + 0.5) * 10 = 3
    assert_equal(np.array([3.0, 3.0, 3.0]), tensor.grad)


def test_hook_with_no_name() -> None:
    class MyHookClass:
        def __call__(self, grad: Any) -> Any:
            return grad.copy()

    x = randn(5, requires_grad=True).copy()
    x.register_hook(MyHookClass())
    x.sum().backward()


@pytest.mark.xfail(strict=True, reason="deliberate difference: backward(inputs=[a "
                   "non-leaf]) does not run that tensor's own grad_fn (PyTorch runs it and "
                   "drops its result), so that node's pre-hooks do not fire; "
                   "docs/autograd.md")
def test_prehook_ordering() -> None:
    log: list[int] = []

    def hook1(g: Any) -> Any:
        log.append(1)
        return g * 3

    def hook2(gs: Any) -> Any:
        log.append(2)
        return tuple(g * 2 for g in gs)

    a = pargrad.tensor(1.0, requires_grad=True)
    b = a.copy()
    b.grad_fn.register_prehook(hook2)
    b.register_hook(hook1)
    b.grad_fn.register_prehook(hook2)
    acc = b.grad_fn.next_functions[0][0]
    a.register_hook(hook1)
    acc.register_prehook(hook2)
    a.register_hook(hook1)
    b.sum().backward(retain_graph=True)
    assert log == [1, 2, 2, 1, 1, 2]
    log.clear()
    pargrad.grad(b.sum(), inputs=(a,), retain_graph=True)
    assert log == [1, 2, 2, 1, 1]
    log.clear()
    b.sum().backward(inputs=(b,))
    assert log == [1, 2, 2]
    assert b.grad.item() == 3


def test_retains_grad_can_always_observe_tensor_prehook() -> None:
    def tensor_prehook(g: Any) -> Any:
        return g * 2

    a = pargrad.tensor(1.0, requires_grad=True)
    b = a.copy()
    b.register_hook(tensor_prehook)
    b.retain_grad()
    b.register_hook(tensor_prehook)
    b.copy().backward()
    assert b.grad.item() == 4
    a = pargrad.tensor(1.0, requires_grad=True)
    b = a.copy()
    b.retain_grad()
    b.register_hook(tensor_prehook)
    b.copy().backward()
    assert b.grad.item() == 2


def test_accumulate_grad_posthooks_can_observe_tensor_prehook() -> None:
    a = pargrad.tensor(1.0, requires_grad=True)

    def tensor_prehook(g: Any) -> Any:
        return g * 2

    def posthook(gO: Any, gI: Any) -> None:
        assert np.allclose(value(gI[0]), value(a) * 2)
        assert len(gO) == 0

    def prehook(gI: Any) -> None:
        assert np.allclose(value(gI[0]), value(a) * 2)
        assert len(gI) == 1

    b = a.copy()
    acc = b.grad_fn.next_functions[0][0]
    acc.register_hook(posthook)
    acc.register_prehook(prehook)
    a.register_hook(tensor_prehook)
    b.backward()


def test_accumulate_grad_posthooks_should_not_execute() -> None:
    def tensor_prehook(g: Any) -> None:
        raise RuntimeError

    def posthook(gO: Any, gI: Any) -> None:
        raise RuntimeError

    a = pargrad.tensor(1.0, requires_grad=True)
    a.register_hook(tensor_prehook)
    b = pargrad.tensor(1.0, requires_grad=True)
    c = a.copy()
    acc = c.grad_fn.next_functions[0][0]
    acc.register_hook(posthook)
    out = a + b + c
    out.sum().backward(inputs=[b])


def test_hook_edge_case_when_called_with_grad() -> None:
    a = pargrad.tensor(1.0, requires_grad=True)
    b = a * 2
    c = b * 2
    counts = {"tensor": 0, "pre": 0, "post": 0}

    def tensor_prehook(g: Any) -> None:
        counts["tensor"] += 1

    def prehook(g: Any) -> None:
        counts["pre"] += 1

    def posthook(gI: Any, gO: Any) -> None:
        counts["post"] += 1

    a.register_hook(tensor_prehook)
    b.register_hook(tensor_prehook)
    acc = b.grad_fn.next_functions[0][0]
    acc.register_hook(posthook)
    acc.register_prehook(prehook)
    b.grad_fn.register_hook(posthook)
    b.grad_fn.register_prehook(prehook)

    def check(tensor: int, post: int, pre: int) -> None:
        assert (counts["tensor"], counts["post"], counts["pre"]) == (tensor, post, pre)
        counts.update(tensor=0, pre=0, post=0)

    pargrad.grad(c, inputs=(b), retain_graph=True)
    check(1, 0, 0)
    pargrad.grad(c, inputs=(a, b), retain_graph=True)
    check(2, 1, 1)
    c.backward(retain_graph=True)
    check(2, 2, 2)
    c.backward(inputs=(a, b), retain_graph=True)
    check(2, 2, 2)


def test_return_leaf() -> None:
    class Identity(Function):
        @staticmethod
        def forward(ctx, a, b):  # type: ignore[no-untyped-def]
            return a, a.data + b.data

        @staticmethod
        def backward(ctx, grad_a, grad_b):  # type: ignore[no-untyped-def]
            return grad_a + grad_b, grad_b

    hook_called = [False]
    x = randn(5, 5, requires_grad=True)
    y = randn(5, 5, requires_grad=True)
    q, p = Identity.apply(x, y)

    def hook(grad: Any) -> None:  # only grad from usage of q, not x
        hook_called[0] = True
        assert_equal(grad, np.ones((5, 5)))

    q.register_hook(hook)
    (q + p + x).sum().backward()
    assert_equal(x.grad, np.ones((5, 5)) * 3)
    assert_equal(y.grad, np.ones((5, 5)))
    assert hook_called[0]


def test_reentrant_with_leaf_variable_hook() -> None:
    handle = None
    param = rand(10, requires_grad=True)

    def add_gradient_penalty_to_grad(grad: Any) -> Any:
        handle.remove()
        old_param_grad = grad
        param.grad = None
        with pargrad.enable_grad():
            g = grad.detach().requires_grad_()
            new_param = param.detach().requires_grad_()
            out = ((g * 2) + new_param).sum()
            out.backward()
        res = g.grad + grad
        param.grad = old_param_grad
        return res

    handle = param.register_hook(add_gradient_penalty_to_grad)
    tmp = param * param
    loss = tmp.sum()
    loss.backward()


def test_reentrant_with_non_leaf_variable_hook() -> None:
    handle = None
    param = rand(10, requires_grad=True)

    def manual_increase_gradient(grad: Any) -> Any:
        handle.remove()
        with pargrad.enable_grad():
            g = grad.detach().requires_grad_()
            out = ((g * 2) + 5).sum()
            out.backward()
        return g.grad + grad

    tmp = param * param
    handle = tmp.register_hook(manual_increase_gradient)
    loss = tmp.sum()
    loss.backward()
    assert_equal(param.grad, 6 * value(param))


def test_multi_grad_all_hooks() -> None:
    # The single-threaded half of TestAutograd's multi-grad hook tests (the concurrent
    # ones are in test_multithread.py).
    t1, t2, t3, t4 = (rand(2, requires_grad=True) for _ in range(4))
    res: list[Any] = []

    def hook(grads: Any) -> None:
        res.append([g is not None for g in grads])

    handle = pargrad.register_multi_grad_hook((t1, t2, t3, t4), hook)
    out = (t2 * t3).sum()
    out.backward(inputs=(t2, t3), retain_graph=True)
    assert res == [[False, True, True, False]]
    out.backward(retain_graph=True)
    assert len(res) == 2
    handle.remove()
    out.backward()
    assert len(res) == 2


def test_multi_grad_any_hooks() -> None:
    t1, t2, t3, t4 = (rand(2, requires_grad=True) for _ in range(4))
    calls: list[Any] = []
    pargrad.register_multi_grad_hook((t1, t2, t3, t4), calls.append, mode="any")
    out = (t2 * t3).sum()
    out.backward(inputs=(t2, t3), retain_graph=True)
    assert len(calls) == 1
    out.backward()
    assert len(calls) == 2
