"""BackwardFuture: the handle of a backward that runs while its caller goes on
(``pargrad.backward_async``, ``pargrad.grad_async``).

It is a ``concurrent.futures.Future``, so ``result(timeout)``, ``exception()``,
``done()``, ``add_done_callback``, ``concurrent.futures.wait`` / ``as_completed`` and
``asyncio.wrap_future`` work as with any future. What it adds (docs/async.md):

Guarantees:
- It resolves once the backward is over: no thread runs a node of it any more and, for
  ``backward_async``, the ``.grad`` of every leaf is committed (success) or as it was
  (error, cancellation). Done-callbacks therefore see the final ``.grad``.
- ``cancel()`` stops a backward in flight: its nodes not yet started are skipped. It
  returns once the nodes already running have finished, with the future cancelled and
  no ``.grad`` changed (but see docs/async.md on a leaf another backward committed to
  meanwhile, and ``cancel()`` on an undo that raises). While it waits it helps as
  ``result()`` does (it takes the skipped nodes off the queue), so it cannot deadlock
  when it holds the only worker. (A standard Future refuses to cancel a call that is
  running; a backward can always be stopped between two nodes, so this one can be
  cancelled until it resolves. The future stays PENDING until then; ``running()`` says
  whether the backward is still in flight.)
- ``result()``, ``exception()`` and ``cancel()`` may help: on a ThreadedEngine the
  waiting thread runs ready nodes of its device until the backward is over, so a
  backward finishes even when every worker is busy (or waits itself).
- Waiters (``concurrent.futures.wait``, ``result()``) are woken before the
  done-callbacks run, also when the future is cancelled, so a callback may wait for the
  future it was called for. A callback that raises an ``Exception`` is logged, as by any
  Future; one that raises another ``BaseException`` (``SystemExit``) does not stop the
  callbacks after it: the first such one is raised again once all have run (the engine
  reports it through ``threading.excepthook``, and its worker survives).
- Called from inside a node or hook of the very backward they wait for, ``result()``
  and ``exception()`` raise RuntimeError instead of waiting for themselves forever, and
  ``cancel()`` cancels without waiting (it returns True; the future is cancelled once
  the node it was called from has finished).

Assumptions: no GIL. The state, result and waiters are the base class's, used only
through its public methods (``set_result``, ``set_exception``, ``cancel``,
``set_running_or_notify_cancel``, ``done``, ...). The done-callbacks are this class's
own (``_callbacks``, guarded by ``_callbacks_lock``), so that it decides when they run:
after every waiter is woken, past a callback's ``BaseException``. ``_work`` is set in
``__init__`` and read-only after. One exception, for the fork handler only:
``_fail_after_fork`` drops the base class's ``_waiters`` (the parent's threads').
``tests/test_async.py`` checks the behaviour.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, wait
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Work(Protocol):
    """What a future needs of the backward it stands for; an engine provides it."""

    def cancel(self) -> bool:
        """Cancel the backward unless it is over; True if it is cancelled (by this call
        or an earlier one), False if it completed or failed."""

    def inside(self) -> bool:
        """Whether the calling thread is inside a node (or hook) of the backward."""

    def resolving(self) -> bool:
        """Whether the backward is over and another thread is resolving its future now
        (running its done-callbacks: a commit of .grad among them)."""

    def wait(self, timeout: float | None) -> None:
        """Return once the backward is over, or after ``timeout`` seconds; may run
        ready nodes meanwhile."""


# Guards _in_flight: the futures of engines' backward calls (weakly), so that a child
# process just forked can fail those its parent's threads would have resolved
# (pargrad/fork.py).
_in_flight_lock = threading.Lock()
_in_flight: weakref.WeakSet[BackwardFuture[Any]] = weakref.WeakSet()

# Guards every BackwardFuture's _callbacks, _called and _cancelling (held only to read
# or swap them, never while a callback runs). One lock for all futures, so that the
# fork handler can hold it across a fork (fork.GLOBAL_LOCKS).
_callbacks_lock = threading.Lock()

# The logger of concurrent.futures, which logs a done-callback's exception.
_LOGGER = logging.getLogger("concurrent.futures")


class BackwardFuture(Future[T]):
    """A ``concurrent.futures.Future`` of a backward; see the module doc.

    Made by engines (``Engine.execute_async``), not by users.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> future = pargrad.backward_async((x * x).sum())
    >>> future.result() is None, x.grad
    (True, tensor([2., 4.], dtype=float64))
    """

    def __init__(self, work: Work | None = None) -> None:
        super().__init__()
        self._work = work  # None: resolved by whoever made it, nothing to cancel or help
        # The done-callbacks not yet run, and whether they have been (the future is
        # resolved): guarded by _callbacks_lock.
        self._callbacks: list[Callable[[Future[T]], object]] = []
        self._called = False
        self._cancelling = False  # whether _set_cancelled was called
        if work is not None:
            with _in_flight_lock:
                _in_flight.add(self)

    def running(self) -> bool:
        """Whether the backward is still in flight (not resolved)."""
        return super().running() if self._work is None else not self.done()

    def cancel(self) -> bool:
        """Stop the backward if it is in flight; True if the future is (or will be,
        when called from inside the backward) cancelled, False if it resolved otherwise
        (it is then done, with its result or error, except when called from inside a
        node of this backward, which cannot wait for it).

        Blocks until the nodes already running have finished, unless called from inside
        a node or hook of this backward; meanwhile it helps as ``result()`` does, so the
        skipped nodes of the backward are taken off the queue even when the calling
        thread is the only worker. No ``.grad`` changes; the engine stays usable.

        One case returns True and yet leaves the future not cancelled: if a function a
        hook queued with ``pargrad.autograd.queue_undo`` raises while the cancelled
        backward is undone, the future resolves with that exception (its
        ``__context__`` a ``concurrent.futures.CancelledError``, unless it had a context
        of its own), so ``cancelled()`` is False and ``result()`` raises it: the undo
        failed, and that must not pass unseen.
        """
        work = self._work
        if work is None or self.done():
            cancelled = super().cancel()
            if cancelled and work is None:  # it may have been pending: its callbacks run
                self._run_callbacks()  # now, as the base class's cancel runs them
            return cancelled
        cancelled = work.cancel()  # False: it completed, or a node's error came first
        if not work.inside():
            # Either way, return only once the future is resolved: a False must mean
            # "resolved otherwise", never "still pending" (a node that failed first does
            # not make the backward over: nodes already running still finish).
            work.wait(None)  # help until the task is over (its skipped nodes drained)
            wait([self])  # then until the thread that finished it has resolved it
        return cancelled

    def result(self, timeout: float | None = None) -> T:
        """The backward's result; blocks until it is over (at most ``timeout`` s).

        Raises what the backward raised (``BackwardError`` naming the node),
        ``CancelledError`` if it was cancelled, ``TimeoutError`` after ``timeout``, and
        RuntimeError if called from inside a node or hook of this backward.
        """
        try:
            return super().result(self._wait(timeout))
        except BaseException as exc:
            self._interrupted(exc)
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The backward's exception, or None; blocks and raises as ``result``."""
        try:
            return super().exception(self._wait(timeout))
        except BaseException as exc:
            self._interrupted(exc)
            raise

    def _wait(self, timeout: float | None) -> float | None:
        """Help until the backward is over or ``timeout`` passed; return the time left."""
        work = self._work
        if work is None or self.done():
            return timeout
        if work.inside():
            raise RuntimeError(
                "BackwardFuture.result() called from inside a node or hook of the backward "
                "it waits for: it would wait for itself; read the gradient in a "
                "post-accumulate-grad hook, or wait from outside the backward"
            )
        start = time.monotonic()
        work.wait(timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))

    def _interrupted(self, exc: BaseException) -> None:
        """On a Ctrl-C (``exc`` not an ``Exception``) in ``result`` or ``exception``: the
        backward was cancelled if it still ran (``Work.wait`` does that; so does this).
        If it was over already, the thread that finished it is resolving this future
        right now (committing .grad, or undoing what hooks did): wait for that, so that
        whoever catches the interrupt sees all of it or none of it. (Without the GIL, a
        caller that went on at once could see part of a commit.)"""
        work = self._work
        if isinstance(exc, Exception) or work is None or self.done():
            return
        if not work.cancel():
            # Only while its resolution runs: one whose done-callback raised a
            # BaseException may never resolve, and a failed backward commits nothing.
            with self._condition:
                while not self.done() and work.resolving():
                    self._condition.wait(0.01)

    def _fail_after_fork(self) -> None:
        """In a child process just forked: this future's backward ran on the parent's
        threads, which the child does not have, so it can never finish here. Resolve it
        with a RuntimeError that says so (its done-callbacks run now), unless done.
        The caller has made its condition anew (``_condition._at_fork_reinit()``), and
        that of every future its callbacks may resolve: a parent thread may have held
        one."""
        self._waiters.clear()  # the parent's threads
        if not self.done():
            self.set_exception(RuntimeError(
                "this backward was in flight in the parent process when it forked; its "
                "threads do not exist in the child, so it cannot finish here: run the "
                "backward again in the child (the engine is usable there)"))

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """Call ``fn(future)`` once the future is resolved (at once if it is): on the
        thread that resolves it, after every waiter has been woken. An ``Exception``
        it raises is logged, as by any Future."""
        with _callbacks_lock:
            if not self._called:
                self._callbacks.append(fn)
                return
        try:
            fn(self)
        except BaseException:  # as the base class's: nobody else could get it
            _LOGGER.exception("a done-callback of %r raised", self)

    def set_result(self, result: T) -> None:
        """Resolve with ``result``, wake the waiters, then run the callbacks (as
        ``_run_callbacks``). For engines."""
        super().set_result(result)
        self._run_callbacks()

    def set_exception(self, exception: BaseException | None) -> None:
        """Resolve with ``exception``, wake the waiters, then run the callbacks (as
        ``_run_callbacks``). For engines."""
        super().set_exception(exception)
        self._run_callbacks()

    # ----- for engines -----
    def _set_cancelled(self) -> None:
        """Resolve as cancelled (the backward was cancelled and is over): wake every
        waiter, ``concurrent.futures.wait`` included, then run the callbacks. (The base
        class's ``cancel`` wakes only ``result()``'s waiters and leaves those of
        ``wait`` to ``set_running_or_notify_cancel``; this class's callbacks run after
        both, so a callback may wait for this future.)"""
        with _callbacks_lock:
            if self._cancelling:  # another call does it
                return
            self._cancelling = True
        if super().cancel():  # PENDING -> CANCELLED (False: it finished first)
            self.set_running_or_notify_cancel()  # -> CANCELLED_AND_NOTIFIED: wakes wait()
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        """Run every done-callback not yet run (the future is resolved), in the order
        they were added: an ``Exception`` is logged, as by the base class, and another
        ``BaseException`` does not stop the callbacks after it: the first one is raised
        once all have run."""
        with _callbacks_lock:
            self._called = True
            callbacks, self._callbacks = self._callbacks, []
        escaped: BaseException | None = None
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                _LOGGER.exception("a done-callback of %r raised", self)
            except BaseException as exc:
                escaped = escaped if escaped is not None else exc
        if escaped is not None:
            raise escaped

    def _then(self, fn: Callable[[T], U], undo: Callable[[], None]) -> BackwardFuture[U]:
        """A future of ``fn(result)``, computed on the thread that resolves this one;
        ``undo()`` runs instead when this one fails or is cancelled, and after ``fn`` if
        ``fn`` raises (so a failed commit is undone as ``autograd._run`` undoes it).
        Cancelling the new future cancels this one; they share the backward."""
        derived: BackwardFuture[U] = BackwardFuture(self._work)

        def chain(source: Future[T]) -> None:
            cancelled = source.cancelled()
            error = None if cancelled else source.exception()
            if not cancelled and error is None:
                try:
                    value = fn(source.result())
                except BaseException as exc:  # a callback must not raise: the future
                    error = exc               # carries it, once undone below
                else:
                    derived.set_result(value)
                    return
            try:
                undo()
            except BaseException as exc:  # (autograd.queue_undo) the future carries it,
                # chained to what it undid, as a synchronous call would chain it. A
                # cancel() that returned True then resolves with this error instead:
                # its context says that it was cancelled.
                exc.__context__ = exc.__context__ or error or CancelledError(
                    "the backward was cancelled, then its undo raised")
                derived.set_exception(exc)
                return
            if cancelled:
                derived._set_cancelled()
            else:
                derived.set_exception(error)

        self.add_done_callback(chain)
        return derived
