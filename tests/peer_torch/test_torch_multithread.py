"""Ports of PyTorch's TestMultithreadAutograd: backward calls from several Python threads."""

from __future__ import annotations

import re
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest

import pargrad
from pargrad import Function
from tests.peer_torch._helpers import assert_equal, ones, rand, value


def _run_py_multithread_fn(fn: Callable[..., Any], args: tuple[Any, ...] = (),
                           num_threads: int = 10) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


def test_multithreaded_exception_propagation() -> None:
    def fn() -> None:
        raise AssertionError("raised in a thread")

    with pytest.raises(AssertionError):
        _run_py_multithread_fn(fn)


def test_simple_backward() -> None:
    def train_fn() -> None:
        x = ones(5, 5, requires_grad=True)
        y = (x + 3) * (x + 4) * 0.5
        y.sum().backward()
        assert_equal(x.grad, value(x) + 3.5)

    _run_py_multithread_fn(train_fn)


def test_simple_backward_same_input() -> None:
    def train_fn_backward(x: Any) -> None:
        y = (x + 3) * (x + 4) * 0.5
        y.sum().backward()

    x = ones(5, 5, requires_grad=True)
    _run_py_multithread_fn(train_fn_backward, (x,))
    assert_equal(x.grad, 10 * (value(x) + 3.5))

    def train_fn_grad(x: Any) -> None:
        y = (x + 3) * (x + 4) * 0.5
        grads = pargrad.grad(y.sum(), x)
        assert len(grads) == 1
        assert_equal(grads[0], value(x) + 3.5)

    _run_py_multithread_fn(train_fn_grad, (x,))


def test_python_thread_in_middle() -> None:
    success_vs_raises = [0, 0]
    lock = threading.Lock()

    def train_fn_no_retain_graph(x: Any) -> None:
        y = x + x ** 2
        try:
            y.sum().backward()
            with lock:
                success_vs_raises[0] += 1
        except RuntimeError as error:
            with lock:
                success_vs_raises[1] += 1
            assert re.search("retain_graph=True", str(error))

    x_no_retain = ones(5, 5, requires_grad=True)
    y_no_retain = x_no_retain + x_no_retain ** 2
    _run_py_multithread_fn(train_fn_no_retain_graph, (y_no_retain,), num_threads=5)
    assert success_vs_raises[0] >= 1

    def train_fn_retain_graph(x: Any) -> None:
        y = x + x ** 2
        y.sum().backward(retain_graph=True)

    x_retain = ones(5, 5, requires_grad=True)
    y_retain = x_retain + x_retain ** 2
    _run_py_multithread_fn(train_fn_retain_graph, (y_retain,), num_threads=5)
    xr = value(x_retain)
    assert_equal(x_retain.grad, 5 * (4 * xr ** 3 + 6 * (xr ** 2) + 4 * xr + 1))


def test_preserve_backtrace() -> None:
    class Foo(Function):
        @staticmethod
        def forward(ctx, input):  # type: ignore[no-untyped-def]
            return input

        @staticmethod
        def backward(ctx, *grad):  # type: ignore[no-untyped-def]
            raise ValueError("something")

    t = rand(10, requires_grad=True)
    try:
        Foo.apply(t).sum().backward()
    except Exception:
        tb = sys.exc_info()[2]
        tb_str = "\n".join(traceback.format_tb(tb))
        assert 'raise ValueError("something")' in tb_str
    else:
        pytest.fail("the backward did not raise")


def test_multi_grad_all_hooks() -> None:
    t1, t2, t3, t4 = (rand(2, requires_grad=True) for _ in range(4))
    res: list[Any] = [None]
    count = [0]
    hook_lock = threading.Lock()

    def hook(grads: Any) -> None:
        with hook_lock:
            count[0] += 1
            grad_is_none = [g is not None for g in grads]
            if res[0] is None:
                res[0] = grad_is_none
            else:
                assert res[0] == grad_is_none

    handle = pargrad.register_multi_grad_hook((t1, t2, t3, t4), hook)
    out = (t2 * t3).sum()

    def backward_retain_graph(out: Any, t2: Any, t3: Any) -> None:
        out.backward(inputs=(t2, t3), retain_graph=True)

    _run_py_multithread_fn(backward_retain_graph, (out, t2, t3), num_threads=5)
    assert count[0] == 5
    assert res[0] == [False, True, True, False]
    # Leave one hook partially applied
    res[0] = None
    count[0] = 0
    err_count = [0]
    bw_count = [0]
    bw_count_lock = threading.Lock()
    err_count_lock = threading.Lock()

    class Func(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            with bw_count_lock:
                bw_count[0] += 1
                if bw_count[0] == 1:
                    raise RuntimeError("error message")
                return gO

    out = (Func.apply(t2) * t3).sum()

    def backward_retain_graph2(out: Any, t2: Any, t3: Any) -> None:
        try:
            out.backward(inputs=(t2, t3), retain_graph=True)
        except RuntimeError:
            with err_count_lock:
                err_count[0] += 1

    _run_py_multithread_fn(backward_retain_graph2, (out, t2, t3), num_threads=5)
    assert count[0] == 4
    assert err_count[0] == 1
    assert res[0] == [False, True, True, False]
    handle.remove()


def test_multi_grad_any_hooks() -> None:
    t1, t2, t3, t4 = (rand(2, requires_grad=True) for _ in range(4))
    res: list[Any] = [None]
    count = [0]
    hook_lock = threading.Lock()

    def hook(grad: Any) -> None:
        with hook_lock:
            count[0] += 1
            if res[0] is None:
                res[0] = "foo"
            else:
                assert res[0] == "foo"

    pargrad.register_multi_grad_hook((t1, t2, t3, t4), hook, mode="any")
    out = (t2 * t3).sum()

    def backward_retain_graph(out: Any, t2: Any, t3: Any) -> None:
        out.backward(inputs=(t2, t3), retain_graph=True)

    _run_py_multithread_fn(backward_retain_graph, (out, t2, t3), num_threads=5)
    assert count[0] == 5
    assert res[0] == "foo"
    res[0] = None
    count[0] = 0
    err_count = [0]
    bw_count = [0]
    bw_count_lock = threading.Lock()
    err_count_lock = threading.Lock()

    class Func(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            with bw_count_lock:
                bw_count[0] += 1
                if bw_count[0] == 1:
                    raise RuntimeError("error message")
                return gO

    out = (Func.apply(t2) * t3).sum()

    def backward_retain_graph2(out: Any, t2: Any, t3: Any) -> None:
        try:
            out.backward(inputs=(t2, t3), retain_graph=True)
        except RuntimeError:
            with err_count_lock:
                err_count[0] += 1

    _run_py_multithread_fn(backward_retain_graph2, (out, t2, t3), num_threads=5)
    # all 5 threads count: the hook runs before the custom backward
    assert count[0] == 5
    assert err_count[0] == 1
    assert res[0] == "foo"

