"""Logical devices: naming, placement of tensors, ``Tensor.to``, and where nodes run."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import numpy as np
import pytest

import pargrad
from tests.helpers import run_python


def test_device_names() -> None:
    assert pargrad.device("cpu") is pargrad.device("cpu:0") is pargrad.device(" cpu ")
    one = pargrad.device("cpu:1")
    assert one is pargrad.device(one) and (one.type, one.index) == ("cpu", 1)
    assert str(one) == "cpu:1" and repr(one) == "device('cpu:1')"
    assert pargrad.device("cpu") != one and len({pargrad.device("cpu"), one}) == 2
    assert pickle.loads(pickle.dumps(one)) is one
    assert one.xp is np
    with pytest.raises(ValueError, match="unknown device type 'cuda'"):
        pargrad.device("cuda:0")
    with pytest.raises(ValueError, match="non-negative integer"):
        pargrad.device("cpu:-1")
    with pytest.raises(TypeError, match="named by a string"):
        pargrad.device(1)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        one.index = 2  # type: ignore[misc]


def test_a_name_parsed_once_is_not_parsed_again_and_bad_names_always_raise() -> None:
    from pargrad import devices

    two = pargrad.device("cpu:2")
    assert devices._named["cpu:2"] is two is pargrad.device("cpu:2")
    devices._named["cpu:2"] = pargrad.device("cpu:3")  # a parse would not find this one
    try:
        assert pargrad.device("cpu:2") is pargrad.device("cpu:3")
    finally:
        devices._named["cpu:2"] = two
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown device type 'gpu'"):
            pargrad.device("gpu")
    assert "gpu" not in devices._named
    x = pargrad.tensor([1.0], requires_grad=True)
    assert x.to("cpu") is x and x.to(pargrad.device("cpu")) is x
    y = x.to("cpu:2")
    assert y.device is two and y.to("cpu:2") is y and y.grad_fn.name() == "ToBackward"


def test_tensors_carry_their_device() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True, device="cpu:1")
    assert x.device is pargrad.device("cpu:1")
    assert pargrad.tensor([1.0]).device is pargrad.device("cpu")
    y = x * 2 + 1
    assert y.device is x.device and y.grad_fn.device is x.device
    with pargrad.no_grad():
        assert (x * 2).device is x.device
    assert x.detach().device is x.device
    assert "device='cpu:1'" in repr(x) and "device" not in repr(pargrad.tensor(1.0))
    copy = pickle.loads(pickle.dumps(x))
    assert copy.device is x.device and copy.requires_grad


def test_mixing_devices_is_an_error() -> None:
    a = pargrad.tensor([1.0], device="cpu:1")
    b = pargrad.tensor([1.0], device="cpu:2")
    with pytest.raises(RuntimeError, match=r"multiply: expected all tensors on one device, "
                                           r"but found cpu:1 and cpu:2; move them with \.to"):
        a * b
    assert (a * np.ones(1)).device is a.device  # arrays and numbers fit any device
    x = pargrad.tensor([1.0], requires_grad=True)
    with pytest.raises(ValueError, match="assigned grad is on cpu:1"):
        x.grad = pargrad.tensor([0.0], device="cpu:1")


def test_to_is_a_differentiable_copy(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    assert x.to("cpu") is x
    y = x.to("cpu:1")
    assert y.device is pargrad.device("cpu:1") and y.grad_fn.name() == "ToBackward"
    assert not np.shares_memory(y.data, x.data)
    z = (y * y).to("cpu:2").sum()
    z.backward()
    np.testing.assert_array_equal(x.grad.data, [2.0, 4.0])
    assert x.grad.device is x.device


def test_second_derivative_through_devices(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    (x.to("cpu:1") ** 3).sum().backward(create_graph=True)
    g = x.grad
    assert g.device is x.device
    x.grad = None
    g.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [6.0, 12.0])


class Where(pargrad.Function):
    """Identity that records the thread its backward ran on."""

    threads: dict[str, str] = {}  # noqa: RUF012

    @staticmethod
    def forward(ctx: Any, x: pargrad.Tensor, tag: str) -> np.ndarray:
        ctx.tag = tag
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: pargrad.Tensor) -> tuple[pargrad.Tensor, None]:
        Where.threads[ctx.tag] = threading.current_thread().name
        return g, None


@pytest.mark.parametrize("deterministic", [False, True])
def test_nodes_run_on_workers_of_their_device(deterministic: bool) -> None:
    engine = pargrad.ThreadedEngine({"cpu": 1, "cpu:1": 2, "cpu:2": 1},
                                    deterministic=deterministic)
    Where.threads = {}
    x = pargrad.tensor(np.ones(3), requires_grad=True)
    parts = []
    for name in ["cpu", "cpu:1", "cpu:2"]:
        for k in range(3):
            parts.append(Where.apply(x.to(name) * float(k + 1), f"{name}/{k}").sum().to("cpu"))
    pargrad.stack(parts).sum().backward(engine=engine)
    np.testing.assert_array_equal(x.grad.data, np.full(3, 18.0))
    caller = threading.current_thread().name
    for tag, thread in Where.threads.items():
        name = tag.split("/")[0]
        if name == "cpu":
            assert thread == caller or thread.startswith("pargrad-cpu-"), (tag, thread)
        else:
            assert thread.startswith(f"pargrad-{name}-"), (tag, thread)
    assert len(Where.threads) == 9
    assert engine.workers("cpu:1") == 2 and engine.workers("cpu:3") >= 1
    names = sorted(t.name for t in engine.threads())
    assert names == ["pargrad-cpu-0", "pargrad-cpu:1-0", "pargrad-cpu:1-1", "pargrad-cpu:2-0"]
    engine.shutdown()


def test_a_backward_on_another_device_only() -> None:
    # No node runs on the caller's device: the caller just waits for the workers.
    engine = pargrad.ThreadedEngine(1)
    x = pargrad.tensor(np.ones(2), requires_grad=True, device="cpu:3")
    (pargrad.tanh(x) * 2).sum().backward(engine=engine)
    np.testing.assert_allclose(x.grad.data, 2 * (1 - np.tanh(1.0) ** 2))
    assert x.grad.device is x.device
    engine.shutdown()


FIRST_OTHER_DEVICE = """
import queue, threading
import numpy as np
import pargrad
from pargrad import devices

class Where(pargrad.Function):
    threads = []

    @staticmethod
    def forward(ctx, x):
        return x.data.copy()

    @staticmethod
    def backward(ctx, g):
        Where.threads.append(threading.current_thread().name)
        return g

engine = pargrad.ThreadedEngine(1)
x = pargrad.tensor(np.ones(3), requires_grad=True)
assert devices.cpu_only
Where.apply(x * 2).sum().backward(engine=engine)  # nothing to hand off: inline
assert Where.threads == [threading.current_thread().name], Where.threads
assert engine.statistics().handed_off == 0
handed = queue.Queue()  # another thread makes the first device but cpu, and a node on it
threading.Thread(target=lambda: handed.put(Where.apply(x.to(OTHER) * 2).sum())).start()
loss = handed.get(timeout=30)
assert not devices.cpu_only
loss.to("cpu").backward(engine=engine)
assert Where.threads[-1].startswith("pargrad-cpu:5-"), Where.threads
np.testing.assert_array_equal(x.grad.data, np.full(3, 4.0))
"""


@pytest.mark.parametrize("other", ['"cpu:5"', 'pargrad.Device("cpu", 5)'])
def test_a_first_device_but_cpu_sends_its_nodes_to_its_workers(other: str) -> None:
    # While no device but cpu exists the threaded engine skips its check of every
    # node's device; the first other device, made on another thread, by name or as a
    # Device made directly (not interned), ends that. Run in a fresh interpreter: this
    # one has made other devices already.
    script = FIRST_OTHER_DEVICE.replace("OTHER", other)
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
