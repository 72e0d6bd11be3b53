"""Engine callbacks: functions queued during a backward, run once it has finished.

PyTorch's ``Variable._execution_engine.queue_callback``: a node's backward, or a hook,
calls ``pargrad.queue_callback(fn)``, and ``fn()`` runs after the last node of the
backward it belongs to (the innermost one, for a reentrant backward), on the thread that
called backward, before the call returns (for ``backward_async``: before its future
resolves). Callbacks run in the order they were queued; one may queue more, which run
too. They do not run if the backward fails; an exception a callback raises is the
backward call's.

Guarantees:
- ``queue_callback`` may be called from any thread that runs a node (or a hook) of a
  backward; the callback belongs to that node's backward.
- Each queued callback runs at most once.

Assumptions: none on the GIL: ``Callbacks`` guards its list with a lock; the current
backward of a thread is thread-local state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

Callback = Callable[[], object]


class Callbacks:
    """The callbacks of one backward call."""

    __slots__ = ("__weakref__", "_lock", "_queued")

    def __init__(self) -> None:
        # Guards _queued: hooks on several engine threads may queue at once.
        self._lock = threading.Lock()
        self._queued: list[Callback] = []

    def queue(self, fn: Callback) -> None:
        """Run ``fn()`` once the backward is over."""
        if not callable(fn):
            raise TypeError(f"queue_callback takes a callable, got {type(fn).__name__}")
        with self._lock:
            self._queued.append(fn)

    def run(self) -> None:
        """Run the queued callbacks in order, including those they queue; raise the first
        exception (the rest do not run)."""
        # Read without the lock: run() is called once the backward's nodes are over, and
        # only they (or callbacks, on this thread) queue; most backward calls queue none.
        if not self._queued:
            return
        with running(self):  # a callback may queue more
            while True:
                with self._lock:
                    if not self._queued:
                        return
                    fn = self._queued.pop(0)
                fn()


# Per-thread state, so no lock: ``stack``, the Callbacks of the backward calls whose
# nodes this thread runs, innermost last (SequentialEngine pushes its own).
_local = threading.local()
# Engines that keep their current backward elsewhere register a function returning its
# Callbacks (or None) for the calling thread. Written at import time only.
_finders: list[Callable[[], Callbacks | None]] = []


def add_finder(finder: Callable[[], Callbacks | None]) -> None:
    """Let ``current`` ask ``finder`` for the calling thread's backward."""
    _finders.append(finder)


@contextlib.contextmanager
def running(callbacks: Callbacks) -> Iterator[None]:
    """Make ``callbacks`` the calling thread's current backward's inside the block."""
    stack: list[Callbacks] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(callbacks)
    try:
        yield
    finally:
        stack.pop()


def current() -> Callbacks | None:
    """The Callbacks of the backward whose node the calling thread runs, or None."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    for finder in _finders:
        found = finder()
        if found is not None:
            return found
    return None


def queue_callback(fn: Callback) -> None:
    """Run ``fn()`` when the backward now running on this thread has finished.

    Call it from a node's backward (a custom ``Function``) or a hook. Raises
    RuntimeError outside a backward, TypeError if ``fn`` is not callable.

    >>> import pargrad
    >>> done = []
    >>> x = pargrad.tensor(2.0, requires_grad=True)
    >>> _ = x.register_hook(lambda g: pargrad.queue_callback(lambda: done.append(x.grad)))
    >>> (x * x).backward()
    >>> done  # ran at the end of the backward, before .grad was committed
    [None]
    """
    callbacks = current()
    if callbacks is None:
        raise RuntimeError("queue_callback can only be called during the backward pass "
                           "(from a node's backward or a hook)")
    callbacks.queue(fn)
