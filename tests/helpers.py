"""Helpers that several test files share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

import pargrad
from pargrad import Tensor

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` from the repository root in a fresh interpreter (with
    ``env`` added to the environment), its output captured; a hang fails by ``timeout``."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


def blocking_function(wait: float) -> Any:
    """A new identity ``Function`` class whose backward sets its ``started`` event and then
    waits (at most ``wait`` seconds, failing after that) for its ``release`` event. Each
    call makes a class with events of its own, so test files do not share them."""

    class Block(pargrad.Function):
        """Identity whose backward says it started and then waits for ``release``."""

        started = threading.Event()
        release = threading.Event()

        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            Block.started.set()
            assert Block.release.wait(wait), "the test never released the node"
            return g

    return Block


def release_once_cancelled(future: pargrad.BackwardFuture[Any], block: Any,
                           wait: float = 30) -> None:
    """Set ``block.release`` (a ``blocking_function`` class's) from a helper thread once
    ``future``'s backward is cancelled, so that a ``cancel()`` that waits for the
    blocked node is released, and surely cancels: the node runs until it is."""
    task = cast(Any, future._work).task
    assert task is not None

    def release() -> None:
        deadline = time.monotonic() + wait
        while not task.cancelled and time.monotonic() < deadline:
            time.sleep(0.001)  # GraphTask.cancelled is a flag: poll it
        block.release.set()

    threading.Thread(target=release, daemon=True).start()


class Boom(pargrad.Function):
    """The identity, whose backward raises ``ValueError("boom")``: a node that fails
    (``BoomBackward`` in the errors)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise ValueError("boom")


def sleeping_function(seconds: float) -> Any:
    """A new identity ``Function`` class (``SleepBackward``) whose backward sleeps
    ``seconds``: a node that keeps the thread running it busy."""

    class Sleep(pargrad.Function):
        """Identity whose backward sleeps."""

        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            time.sleep(seconds)
            return g

    return Sleep


def assert_left_as_found(handler: object, where: object) -> None:
    """After a backward a SIGINT interrupted: SIGINT's handler is the one before it, no
    Gate is left installed, grad mode is on."""
    from pargrad.grad_mode import is_grad_enabled
    from pargrad.interrupts import current_gate

    assert signal.getsignal(signal.SIGINT) is handler, where
    assert current_gate().previous is None and current_gate().pending is None, where
    assert is_grad_enabled(), where
