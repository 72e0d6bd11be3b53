"""Ports of PyTorch's TestAutograd: grad mode (context managers, decorators on functions,
generators and coroutines, thread-locality) and its interplay with Functions."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Function
from tests.peer_torch._helpers import ones, rand, zeros


def test_no_grad() -> None:
    x = ones(5, 5, requires_grad=True)
    y = ones(5, 5) * 4
    with pargrad.no_grad():
        w = x + y

    def adder(x: Any, y: Any) -> Any:
        return x + y

    adders = [pargrad.no_grad()(adder), pargrad.no_grad(adder)]
    for adder in adders:
        z = adder(x, y)
        assert not w.requires_grad
        with pytest.raises(RuntimeError):
            w.backward(np.ones((5, 5)))
        assert w.grad_fn is None
        assert not z.requires_grad
        with pytest.raises(RuntimeError):
            z.backward(np.ones((5, 5)))
        assert z.grad_fn is None
    # nested decorator and with-statement on no_grad
    with pargrad.no_grad():
        assert not pargrad.is_grad_enabled()
        w = adder(x, y)
        assert not pargrad.is_grad_enabled()


def test_enable_grad_decorator_no_paren() -> None:
    x = ones(1, requires_grad=True)

    @pargrad.enable_grad
    def doubler(x: Any) -> Any:
        return x * 2

    with pargrad.no_grad():
        z = doubler(x)
    assert z.requires_grad


def test_set_grad_generator_functions() -> None:
    @pargrad.no_grad()
    def gen_no_grad() -> Generator[int, None, None]:
        for i in range(10):
            assert pargrad.is_grad_enabled() is False
            yield i

    with pargrad.enable_grad():
        for _ in gen_no_grad():
            assert pargrad.is_grad_enabled() is True

    @pargrad.enable_grad()
    def gen_enable_grad() -> Generator[int, None, None]:
        for i in range(10):
            assert pargrad.is_grad_enabled() is True
            yield i

    with pargrad.no_grad():
        for _ in gen_enable_grad():
            assert pargrad.is_grad_enabled() is False


def test_set_grad_generator_functions_recursive() -> None:
    @pargrad.enable_grad()
    def enable_grad_decorator_recursive(depth: int) -> None:
        assert pargrad.is_grad_enabled()
        if depth > 0:
            no_grad_decorator_recursive(depth - 1)
            assert pargrad.is_grad_enabled()

    @pargrad.no_grad()
    def no_grad_decorator_recursive(depth: int) -> None:
        assert not pargrad.is_grad_enabled()
        if depth > 0:
            enable_grad_decorator_recursive(depth - 1)
            assert not pargrad.is_grad_enabled()

    def enable_grad_context_manager_recursive(depth: int) -> None:
        with pargrad.enable_grad():
            assert pargrad.is_grad_enabled()
            if depth > 0:
                no_grad_context_manager_recursive(depth - 1)
                assert pargrad.is_grad_enabled()

    def no_grad_context_manager_recursive(depth: int) -> None:
        with pargrad.no_grad():
            assert not pargrad.is_grad_enabled()
            if depth > 0:
                enable_grad_context_manager_recursive(depth - 1)
                assert not pargrad.is_grad_enabled()

    with pargrad.enable_grad():
        assert pargrad.is_grad_enabled()
        enable_grad_decorator_recursive(10)
        assert pargrad.is_grad_enabled()
        enable_grad_context_manager_recursive(10)
        assert pargrad.is_grad_enabled()
    with pargrad.no_grad():
        assert not pargrad.is_grad_enabled()
        enable_grad_decorator_recursive(10)
        assert not pargrad.is_grad_enabled()
        enable_grad_context_manager_recursive(10)
        assert not pargrad.is_grad_enabled()


def test_set_grad_coroutines() -> None:
    @pargrad.no_grad()
    def coro_no_grad(n: int = 10) -> Generator[int, int, None]:
        assert not pargrad.is_grad_enabled()
        for i in range(n):
            assert not pargrad.is_grad_enabled()
            r = yield i
            assert not pargrad.is_grad_enabled()
            assert i == r
        assert not pargrad.is_grad_enabled()

    @pargrad.enable_grad()
    def coro_enable_grad(n: int = 10) -> Generator[int, int, None]:
        assert pargrad.is_grad_enabled()
        for i in range(n):
            assert pargrad.is_grad_enabled()
            r = yield i
            assert pargrad.is_grad_enabled()
            assert i == r
        assert pargrad.is_grad_enabled()

    with pargrad.enable_grad():
        assert pargrad.is_grad_enabled()
        coro, r = coro_no_grad(), None
        try:
            while True:
                assert pargrad.is_grad_enabled()
                r = coro.send(r)  # type: ignore[arg-type]
                assert pargrad.is_grad_enabled()
        except StopIteration:
            pass
    with pargrad.no_grad():
        assert not pargrad.is_grad_enabled()
        coro, r = coro_enable_grad(), None
        try:
            while True:
                assert not pargrad.is_grad_enabled()
                r = coro.send(r)  # type: ignore[arg-type]
                assert not pargrad.is_grad_enabled()
        except StopIteration:
            pass


def test_set_grad_coroutines_benign_exceptions() -> None:
    class RecoverableException(Exception):
        pass

    @pargrad.no_grad()
    def coro_no_grad(n: int = 10) -> Generator[int, None, None]:
        has_raised = False
        for i in range(n):
            try:
                assert not pargrad.is_grad_enabled()
                yield (-i if has_raised else i)
            except RecoverableException:
                assert not pargrad.is_grad_enabled()
                has_raised = True

    @pargrad.enable_grad()
    def coro_enable_grad(n: int = 10) -> Generator[int, None, None]:
        has_raised = False
        for i in range(n):
            try:
                assert pargrad.is_grad_enabled()
                yield (-i if has_raised else i)
            except RecoverableException:
                assert pargrad.is_grad_enabled()
                has_raised = True

    with pargrad.enable_grad():
        coro = coro_no_grad()
        assert next(coro) == 0
        try:
            while True:
                r = coro.throw(RecoverableException)
                assert r < 0
        except StopIteration:
            pass
    with pargrad.no_grad():
        coro = coro_enable_grad()
        assert next(coro) == 0
        try:
            while True:
                r = coro.throw(RecoverableException)
                assert r < 0
        except StopIteration:
            pass


def test_set_grad_coroutines_critical_exceptions() -> None:
    class UnrecoverableException(Exception):
        pass

    class SecondaryException(Exception):
        pass

    @pargrad.no_grad()
    def coro_no_grad(n: int = 10) -> Generator[int, None, None]:
        has_raised = False
        for i in range(n):
            try:
                assert not pargrad.is_grad_enabled()
                yield (-i if has_raised else i)
            except UnrecoverableException:
                assert not pargrad.is_grad_enabled()
                raise SecondaryException from None

    @pargrad.enable_grad()
    def coro_enable_grad(n: int = 10) -> Generator[int, None, None]:
        has_raised = False
        for i in range(n):
            try:
                assert pargrad.is_grad_enabled()
                yield (-i if has_raised else i)
            except UnrecoverableException:
                assert pargrad.is_grad_enabled()
                raise SecondaryException from None

    with pargrad.enable_grad():
        coro = coro_no_grad()
        assert next(coro) == 0
        with pytest.raises(SecondaryException):
            coro.throw(UnrecoverableException)
    with pargrad.no_grad():
        coro = coro_enable_grad()
        assert next(coro) == 0
        with pytest.raises(SecondaryException):
            coro.throw(UnrecoverableException)


def test_set_grad_coroutines_exit() -> None:
    @pargrad.no_grad()
    def coro_no_grad(state: set[str]) -> Generator[int, None, None]:
        for i in range(10):
            try:
                assert not pargrad.is_grad_enabled()
                yield i
            except GeneratorExit:
                assert not pargrad.is_grad_enabled()
                state.add("GeneratorExit")
                raise

    @pargrad.enable_grad()
    def coro_enable_grad(state: set[str]) -> Generator[int, None, None]:
        for i in range(10):
            try:
                assert pargrad.is_grad_enabled()
                yield i
            except GeneratorExit:
                assert pargrad.is_grad_enabled()
                state.add("GeneratorExit")
                raise

    state: set[str] = set()
    with pargrad.enable_grad():
        coro = coro_no_grad(state)
        for _ in range(5):
            next(coro)
        coro.close()
    assert "GeneratorExit" in state
    state = set()
    with pargrad.no_grad():
        coro = coro_enable_grad(state)
        for _ in range(5):
            next(coro)
        coro.close()
    assert "GeneratorExit" in state


def test_no_grad_python_function() -> None:
    """Python Functions should respect grad mode."""
    x = ones(5, 5, requires_grad=True)

    class MyOp(Function):
        @staticmethod
        def forward(self, x):  # type: ignore[no-untyped-def]
            return x.data + 1

        @staticmethod
        def backward(self, dy):  # type: ignore[no-untyped-def]
            return dy

    with pargrad.no_grad():
        y = MyOp.apply(x)
    assert not y.requires_grad


def test_no_grad_input() -> None:
    class MyFunction(Function):
        @staticmethod
        def forward(self, x):  # type: ignore[no-untyped-def]
            return x

        @staticmethod
        def backward(self, grad_output):  # type: ignore[no-untyped-def]
            return grad_output

    x = rand(5, requires_grad=True)
    with pargrad.no_grad():
        y = MyFunction.apply(x)
    assert x.requires_grad
    assert y.grad_fn is None


def test_set_grad_enabled() -> None:
    x = pargrad.tensor([1.0], requires_grad=True)
    with pargrad.set_grad_enabled(False):
        y = x * 2
    assert not y.requires_grad
    with pargrad.set_grad_enabled(True):
        y = x * 2
    assert y.requires_grad
    with pargrad.set_grad_enabled(False):
        pargrad.set_grad_enabled(True)
        y = x * 2
    assert y.requires_grad


def test_set_grad_enabled_wraps() -> None:
    for decorator in [True, False]:
        with pargrad.enable_grad():
            assert pargrad.is_grad_enabled()
            if decorator:
                @pargrad.set_grad_enabled(False)
                def inner_func(x: Any) -> Any:
                    return x.sin()
            else:
                def inner_func(x: Any) -> Any:
                    return x.sin()

                obj = pargrad.set_grad_enabled(False)
                assert not pargrad.is_grad_enabled()
                inner_func = obj(inner_func)
                assert pargrad.is_grad_enabled()
            assert pargrad.is_grad_enabled()
            x = zeros(1, requires_grad=True)
            assert not inner_func(x).requires_grad


def test_grad_mode_restored_reentrant() -> None:
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, inp):  # type: ignore[no-untyped-def]
            return inp.data.copy()

        @staticmethod
        def backward(ctx, go):  # type: ignore[no-untyped-def]
            original = pargrad.is_grad_enabled()
            with pargrad.enable_grad():
                assert pargrad.is_grad_enabled()
                foo = rand(*go.shape, requires_grad=True)
                (grad,) = pargrad.grad(foo ** 3, foo, grad_outputs=go)
                assert pargrad.is_grad_enabled()
            assert pargrad.is_grad_enabled() == original
            return grad

    inp = rand(3, requires_grad=True)
    # Case where original==False
    MyFunction.apply(inp).sum().backward()
    # Case where original==True
    MyFunction.apply(inp).sum().backward(create_graph=True)
