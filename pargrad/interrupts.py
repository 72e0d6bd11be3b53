"""Deferring Ctrl-C across a short critical section: ``deferred_interrupts()``.

Python runs a signal's handler in the main thread only, between two bytecodes (at a
function call, a loop's back edge, or a blocking call that was interrupted), and the
default SIGINT handler raises KeyboardInterrupt there. A loop that publishes several
values (the commit of a backward's leaf gradients) can therefore be stopped midway.
``signal.pthread_sigmask`` cannot help: it blocks the OS signal, but the handler that
raises is Python's own, run from the eval loop. So this swaps the Python handler
instead: inside the block, a SIGINT is only recorded; on leaving, the previous handler
is put back and, if a SIGINT came, called then (the default one raises
KeyboardInterrupt right after the block, which therefore ran to its end).

Guarantees:
- Inside the block no SIGINT handler runs, on the main thread; a SIGINT that arrived is
  handled once, by the handler installed before the block, as the block is left (also
  when the block raised: then the block's own exception propagates, with the
  KeyboardInterrupt as its context, as for any handler raising in an ``except``).
- An interrupt that lands before the block is entered is raised there, before any of it
  ran (nothing published); one that lands after it left is raised after all of it ran.

Assumptions: only the main thread ever gets signal handlers called, so on other threads
(which never see KeyboardInterrupt from a signal) the block does nothing. A handler that
is not a Python callable (``SIG_IGN``, ``SIG_DFL``, or one installed from C) is left
alone. Keep the block short and non-blocking: Ctrl-C waits for it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block with SIGINT's Python handler deferred to its end (module doc).

    >>> from pargrad.interrupts import deferred_interrupts
    >>> with deferred_interrupts():
    ...     published = [1, 2, 3]
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    arrived: list[tuple[int, FrameType | None]] = []

    def record(signum: int, frame: FrameType | None) -> None:
        arrived.append((signum, frame))

    signal.signal(signal.SIGINT, record)  # may raise an interrupt that came before: fine
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if arrived:
            handler: Any = previous
            handler(*arrived[0])
