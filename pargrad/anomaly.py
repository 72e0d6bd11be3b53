"""Anomaly mode: find the forward operation behind a failing or non-finite backward.

Under anomaly mode every node records the stack of the forward call that created it,
and a backward checks the gradients each node returns: NaN or Inf raises a
``BackwardError`` naming the node, and any error of a node's backward carries the
forward stack where that node was created (as a note: ``exc.__notes__``, printed under
the traceback, and as ``exc.forward_trace``).

Anomaly mode is per thread, like grad mode (PyTorch's is one process-wide flag): it
costs something only where it is on, so one thread can debug while others run at
full speed. Two moments decide, each in its own thread:

- the mode of the thread that *creates* a node (the forward, or a backward recording
  its graph) decides whether the node records its stack;
- the mode of the thread that *calls backward* decides whether the checks run. The
  threaded engine runs nodes on worker threads, so it sets each worker to the caller's
  mode while it runs a node of that backward, as it does with grad mode.

This module knows nothing of nodes or engines: ``graph.Node`` reads ``mode`` and calls
the helpers below.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from pargrad.grad_mode import ModeContext, SetModeContext

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Mode(threading.local):
    """Per-thread state, so no lock: ``enabled`` and ``check_nan`` (the flags), and
    ``saved`` (the modes to restore when enclosing blocks exit, innermost last)."""

    enabled = False
    check_nan = True

    def __init__(self) -> None:
        self.saved: list[tuple[bool, bool]] = []


mode = _Mode()
"""The calling thread's anomaly mode; change it only through the functions and blocks
below. On hot paths read ``on and mode.enabled`` (see ``on``)."""

on = 0
"""How many threads have anomaly mode on now: each thread counts itself from before it
turns its mode on until after it turns it off, so while this thread's mode is on ``on``
is at least 1. So ``on and mode.enabled`` is this thread's mode, and reads no
thread-local while no thread debugs (as ``grad_mode.off``)."""
_on_lock = threading.Lock()
"""Guards ``on``'s updates (a read is one load)."""


def is_anomaly_enabled() -> bool:
    """True if anomaly mode is on in the calling thread."""
    return bool(on) and mode.enabled


def is_anomaly_check_nan_enabled() -> bool:
    """True if a backward called from this thread checks gradients for NaN and Inf."""
    return bool(on) and mode.enabled and mode.check_nan


def current_mode() -> tuple[bool, bool]:
    """``(enabled, check_nan)`` of the calling thread, for an engine to carry to workers."""
    return mode.enabled, mode.check_nan


def set_mode(state: tuple[bool, bool]) -> None:
    """Set the calling thread's ``(enabled, check_nan)`` (what ``current_mode`` returned)."""
    global on
    enabled, mode.check_nan = bool(state[0]), state[1]
    if enabled is mode.enabled:
        return
    if enabled:
        with _on_lock:
            on += 1
        mode.enabled = True
    else:
        mode.enabled = False
        with _on_lock:
            on -= 1


def _saved_modes() -> list[tuple[bool, bool]]:
    return mode.saved


class _AnomalyModeContext(ModeContext):
    """Base for anomaly-mode switches: the mode is ``current_mode()``."""

    _read = staticmethod(current_mode)
    _write = staticmethod(set_mode)
    _saved = staticmethod(_saved_modes)


class detect_anomaly(_AnomalyModeContext):
    """Context manager and decorator that turns anomaly mode on in this thread.

    Nodes created inside record the forward stack; a backward called inside checks
    every node's gradients for NaN and Inf (unless ``check_nan=False``) and adds the
    forward stack of a failing node to its error. Slow: for debugging only. One
    instance may be entered by several threads (the mode to restore is kept per thread).

    >>> import numpy as np, pargrad
    >>> x = pargrad.tensor([0.0, 1.0], requires_grad=True)
    >>> with pargrad.detect_anomaly(), np.errstate(invalid="ignore"):  # doctest: +ELLIPSIS
    ...     y = (x.sqrt() * 0).sum()   # sqrt's rule computes 0 / 0 at x = 0
    ...     try:
    ...         y.backward(engine=pargrad.SequentialEngine())
    ...     except pargrad.BackwardError as error:
    ...         print(error)
    ...         print(error.__notes__[0].splitlines()[0])
    SqrtBackward: returned nan or inf values in its gradient for input 0 (nan at index (0,))
    Traceback of the forward call that created SqrtBackward, the node that failed (most recent ...
    """

    def __init__(self, check_nan: bool = True) -> None:
        self._mode = (True, bool(check_nan))


class set_detect_anomaly(SetModeContext, _AnomalyModeContext):
    """Set anomaly mode for this thread; as a context manager, restore it on exit; as a
    decorator, run every call of the function under it.

    Like ``torch.autograd.set_detect_anomaly``: the mode changes as soon as the object
    is created, so ``pargrad.set_detect_anomaly(True)`` works as a plain call too. An
    instance belongs to the thread that created it.
    """

    def __init__(self, mode_: bool, check_nan: bool = True) -> None:
        self._start((bool(mode_), bool(check_nan)))


# ----- what nodes record and report -----
def forward_trace() -> traceback.StackSummary:
    """The caller's stack, outermost first, without pargrad's own frames at its end
    (the last frame is the user's line that called into pargrad).

    ``traceback.extract_stack`` without reading source lines now: a frame's line is
    read when the trace is formatted, so recording stays cheap."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
    stack.reverse()
    return stack


def first_nonfinite(grads: Sequence[Any]) -> tuple[int, str, tuple[int, ...]] | None:
    """``(input, "nan" or "inf", index)`` of the first non-finite gradient entry, or None.

    Gradients are arrays or Tensors (``np.asarray`` reads a Tensor's array); None and
    non-float entries are skipped.
    """
    for i, g in enumerate(grads):
        if g is None:
            continue
        array = np.asarray(g)
        if array.dtype.kind not in "fc":
            continue
        finite = np.isfinite(array)
        if not finite.all():
            flat = int(np.argmin(finite.reshape(-1)))
            value = array.reshape(-1)[flat]
            index = tuple(int(n) for n in np.unravel_index(flat, array.shape))
            return i, "nan" if np.isnan(value) else "inf", index
    return None


def add_forward_trace(exc: BaseException, node_name: str,
                      trace: traceback.StackSummary | None, *, inner: bool) -> None:
    """Note on ``exc`` where the node ``node_name`` was created in the forward pass.

    The first node an error passes through is the one that failed (``exc.forward_trace``
    is set to its stack); ``inner`` says the error comes from a backward run inside this
    node's backward (a checkpoint or a custom Function calling backward).
    """
    if not inner:
        exc.forward_trace = trace  # type: ignore[attr-defined]
    if trace is None:
        text = (f"{node_name} was created outside anomaly mode, so its forward stack is "
                f"unknown; create the graph under pargrad.detect_anomaly() to see it")
    else:
        what = "whose backward called the one that failed" if inner else "the node that failed"
        text = (f"Traceback of the forward call that created {node_name}, {what} "
                f"(most recent call last):\n" + "".join(trace.format()).rstrip("\n"))
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:  # Python 3.11+
        add_note(text)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), text]  # type: ignore[attr-defined]
