"""Where Ctrl-C may land: ``deferred_interrupts()`` defers it across a short critical
section; ``Gate`` lets it raise inside a node and defers it elsewhere in an engine's loop.

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
from collections.abc import Callable
from types import FrameType
from typing import Any

try:  # CPython's own C functions, which signal.signal and getsignal wrap with enum
    # conversions that cost ~4 µs a call (an exception inside for a Python handler): a
    # backward calls them three times (its one Gate: getsignal, then signal twice).
    from _signal import getsignal as _getsignal
    from _signal import signal as _setsignal
except ImportError:  # pragma: no cover (an interpreter without them)
    _getsignal, _setsignal = signal.getsignal, signal.signal
_SIGINT = int(signal.SIGINT)


class deferred_interrupts:  # lower case: a context manager, used like a function
    """Run the block with SIGINT's Python handler deferred to its end (module doc).

    Inside a ``gate_installed`` block of the same thread it swaps no handler (two
    ``sigaction`` calls saved): it holds that Gate for the block instead, and on leaving
    puts the Gate's mode back, raising a signal that came if that mode is ``NODE``
    (where it would have been raised at once) and leaving it pending otherwise (for the
    Gate's next safe point, or the end of its block). A class rather than a generator:
    every backward enters one, and a ``contextmanager`` costs about 1 µs more a block.

    >>> from pargrad.interrupts import deferred_interrupts
    >>> with deferred_interrupts():
    ...     published = [1, 2, 3]
    """

    __slots__ = ("_arrived", "_gate", "_mode", "_previous")

    def __enter__(self) -> None:
        self._previous: Callable[[int, FrameType | None], Any] | None = None
        gate: Gate | None = getattr(_threads, "gate", None)
        if gate is not None and gate.previous is not None and (
                _getsignal(_SIGINT) == gate.handle):  # this thread's Gate is installed (and
            # not replaced since by a node's own handler)
            self._gate: Gate | None = gate
            self._mode, gate.mode = gate.mode, HELD
            return
        self._gate = None
        if threading.current_thread() is not threading.main_thread():
            return
        previous = _getsignal(_SIGINT)
        if not callable(previous):
            return
        self._arrived: list[tuple[int, FrameType | None]] = []
        self._previous = previous
        _setsignal(_SIGINT, self._record)  # may raise an interrupt that came before: fine

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._arrived.append((signum, frame))

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        if gate is not None:
            gate.mode = self._mode
            if self._mode == NODE:
                gate.raise_pending()
            return
        previous = self._previous
        if previous is None:
            return
        _setsignal(_SIGINT, previous)
        if self._arrived:
            previous(*self._arrived[0])


NODE, HELD = 0, 1
"""What the thread with a Gate is doing: running a node's code (a Ctrl-C raises at once,
where the node's own ``try`` catches it), or engine bookkeeping and waiting (it is
deferred to the next safe point; a wait polls, so it returns within ``POLL`` s)."""

POLL = 0.02
"""Seconds a thread with an installed Gate waits on a ReadyQueue before it looks for a
deferred Ctrl-C (a signal handler cannot wake the wait: it may run while the thread
holds the queue's lock)."""


class Gate:
    """The main thread's SIGINT handling while it runs a backward (``gate_installed``).

    Python calls ``handle`` between two bytecodes of the main thread. In ``NODE`` mode it
    calls the handler that was installed before (the default raises KeyboardInterrupt
    there); otherwise it keeps the signal in ``pending``, and the engine raises it at
    its next safe point (``raise_pending``), where every node it counted is accounted
    for. A Ctrl-C thus interrupts a node at once, a wait within ``POLL`` seconds, and
    bookkeeping a few bytecodes later; it never lands between two steps of it.

    Per thread: a thread that gets no signals (every thread but the main one, or the main
    thread without a Python SIGINT handler) has a disabled Gate (``previous`` None) whose
    ``pending`` stays None; its ``mode`` is written and never read. Each Gate is touched
    only by its own thread (a signal handler runs on that thread too), so no lock.
    """

    __slots__ = ("mode", "pending", "previous")

    def __init__(self, previous: Callable[[int, FrameType | None], Any] | None = None) -> None:
        self.mode = HELD
        self.pending: tuple[int, FrameType | None] | None = None
        self.previous = previous  # the handler to call; None: a disabled gate

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler while this gate is installed."""
        if self.mode == NODE and self.pending is None:
            assert self.previous is not None
            self.previous(signum, frame)
        elif self.pending is None:
            self.pending = (signum, frame)
    def raise_pending(self) -> None:
        """Call the previous handler for a deferred signal (it usually raises); no-op if
        none came."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            assert self.previous is not None
            self.previous(*pending)


_threads = threading.local()  # ``gate``: this thread's Gate, once made


def current_gate() -> Gate:
    """The calling thread's Gate (a disabled one unless ``gate_installed`` is open)."""
    gate: Gate | None = getattr(_threads, "gate", None)
    if gate is None:
        gate = _threads.gate = Gate()
    return gate


class gate_installed:  # lower case: a context manager, used like a function
    """Run the block in ``mode`` (``HELD`` by default) with a Gate as SIGINT's handler:
    on the main thread if its handler is a Python callable (else with the thread's
    disabled Gate). Nested blocks share the outer one (no handler swapped) and put its
    mode back on leaving, raising a signal that came if that mode is ``NODE`` (where it
    would have been raised at once; unless an exception is already propagating); the
    outermost puts the previous handler back, and then raises a signal still pending
    unless an exception is already propagating (which a Ctrl-C would only have
    replaced). ``with`` gives the Gate. A class rather than a generator, as
    ``deferred_interrupts``.

    A block in ``NODE`` mode must set ``HELD`` again as its last statement (and first
    thing in an ``except`` that leaves it): a Ctrl-C can land on the first bytecode of
    ``__exit__``, where in ``NODE`` mode it would raise before the handler is put back."""

    __slots__ = ("_block_mode", "_gate", "_mode", "_previous")

    def __init__(self, mode: int = HELD) -> None:
        self._block_mode = mode

    def __enter__(self) -> Gate:
        gate = self._gate = current_gate()
        self._mode, gate.mode = gate.mode, HELD
        self._previous: Callable[[int, FrameType | None], Any] | None = None
        try:
            if gate.previous is None and (
                    threading.current_thread() is threading.main_thread()):
                previous = _getsignal(_SIGINT)
                if callable(previous):  # else: the disabled gate
                    gate.previous, gate.pending = previous, None
                    self._previous = previous
                    _setsignal(_SIGINT, gate.handle)
            if self._block_mode == NODE:
                gate.mode = NODE
                gate.raise_pending()  # one that came while it was being installed
        except BaseException:  # an interrupt that came before: nothing left installed
            self._restore(raised=True)
            raise
        return gate

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._restore(raised=kind is not None)

    def _restore(self, raised: bool) -> None:
        gate = self._gate
        previous = self._previous
        try:
            if previous is not None:  # the outermost block on the main thread
                gate.mode = HELD  # signal.signal runs the handler for one that came first
                try:  # a Ctrl-C once it is back raises on return: the gate is reset anyway
                    _setsignal(_SIGINT, previous)
                finally:  # (no signal point in here)
                    pending, gate.pending, gate.previous = gate.pending, None, None
                if pending is not None and not raised:
                    previous(*pending)
        finally:
            gate.mode = self._mode
        if previous is None and self._mode == NODE and not raised:
            gate.raise_pending()  # held in this block, due at once outside it
