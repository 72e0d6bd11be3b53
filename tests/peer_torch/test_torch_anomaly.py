"""Ports of PyTorch's TestAutograd: anomaly mode."""

from __future__ import annotations

import traceback

import numpy as np
import pytest

import pargrad
from pargrad import Function
from tests.peer_torch._helpers import rand, randn

SIZE = 10


def test_anomaly_detect_nan() -> None:
    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp1, inp2, fail_0th):  # type: ignore[no-untyped-def]
            ctx.fail_0th = fail_0th
            return inp1.data.sum(0, keepdims=True)

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            gI = np.broadcast_to(gO.data, (SIZE,)).copy()
            gI[0] = 0
            with np.errstate(invalid="ignore"):
                gI[0] /= 0  # Generate a nan
            if ctx.fail_0th:
                return gI, None, None
            return None, gI, None

    inp = rand(SIZE, requires_grad=True)
    out = MyFunc.apply(inp, inp, True)
    out.backward()  # Should not fail
    # torch: "Function 'MyFuncBackward' returned nan values in its 0th output."
    inp = rand(SIZE, requires_grad=True)
    out = MyFunc.apply(inp, inp, True)
    with pytest.raises(RuntimeError, match="MyFuncBackward: returned nan .* input 0"):
        with pargrad.detect_anomaly():
            out.backward()
    inp = rand(SIZE, requires_grad=True)
    with pytest.raises(RuntimeError, match="MyFuncBackward: returned nan .* input 1") as info:
        with pargrad.detect_anomaly():
            out = MyFunc.apply(inp, inp, False)
            out.backward()
    assert "MyFunc.apply" in _trace(info.value)


def test_nested_anomaly_detect_nan() -> None:
    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp1, fail_0th):  # type: ignore[no-untyped-def]
            ctx.fail_0th = fail_0th
            ctx.save_for_backward(inp1)
            return inp1.data.sum(0, keepdims=True)

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            (inp,) = ctx.saved_tensors
            g = gO.broadcast_to((SIZE,))
            gI = MyFunc2.apply(g * inp, g + inp, ctx.fail_0th)
            return gI, None

    class MyFunc2(Function):
        @staticmethod
        def forward(ctx, inp1, inp2, fail_0th):  # type: ignore[no-untyped-def]
            ctx.fail_0th = fail_0th
            return inp1.data * 2.0 + inp2.data

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            g1 = gO.data.copy()
            g2 = gO.data.copy()
            g1[0] = 0
            g2[0] = 0
            with np.errstate(invalid="ignore"):
                if ctx.fail_0th:
                    g1[0] /= 0
                else:
                    g2[0] /= 0
            return g1, g2, None

    inp = rand(SIZE, requires_grad=True)
    out = MyFunc.apply(inp, True)
    (ginp,) = pargrad.grad(out, (inp,), create_graph=True)
    gsum = ginp.sum()
    gsum.backward()  # should not fail
    inp = rand(SIZE, requires_grad=True)
    out = MyFunc.apply(inp, True)
    (ginp,) = pargrad.grad(out, (inp,), create_graph=True)
    gsum = ginp.sum()
    with pytest.raises(RuntimeError, match="MyFunc2Backward: returned nan .* input 0"):
        with pargrad.detect_anomaly():
            gsum.backward()
    inp = rand(SIZE, requires_grad=True)
    with pytest.raises(RuntimeError, match="MyFunc2Backward: returned nan .* input 1") as info:
        with pargrad.detect_anomaly():
            out = MyFunc.apply(inp, False)
            (ginp,) = pargrad.grad(out, (inp,), create_graph=True)
            gsum = ginp.sum()
            gsum.backward()
    assert "MyFunc2.apply" in _trace(info.value)


def test_anomaly_mode_no_check_nan() -> None:
    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp):  # type: ignore[no-untyped-def]
            return inp.data.copy()

        @staticmethod
        def backward(ctx, gO):  # type: ignore[no-untyped-def]
            return np.broadcast_to(np.array(float("nan")), (10, 10))

    def run_fn(a):  # type: ignore[no-untyped-def]
        return MyFunc.apply(a).sum()

    with pargrad.detect_anomaly(check_nan=False):
        inp = rand(10, 10, requires_grad=True)
        out = run_fn(inp)
        out.backward(retain_graph=True)
        with pargrad.detect_anomaly(check_nan=True):
            with pytest.raises(RuntimeError, match="MyFuncBackward: returned nan .* input 0"):
                out.backward(retain_graph=True)
        out.backward()


def test_anomaly_grad_warnings() -> None:
    # torch also warns ("Anomaly Detection has been enabled", "Error detected in
    # PowBackward0"); here the error itself carries the note and the forward stack.
    with pytest.raises(RuntimeError, match="changed by an in-place operation") as info:
        with pargrad.detect_anomaly():
            a = randn(5, requires_grad=True)
            d1 = a + 1
            d2 = d1 ** 2
            d1 += 1
            pargrad.grad(d2.sum(), a)
    assert "PowerBackward" in str(info.value)


def _trace(error: BaseException) -> str:
    """The forward stack anomaly mode attached to ``error`` (torch prints it as a warning)."""
    return "".join(traceback.format_list(error.forward_trace))  # type: ignore[attr-defined]
