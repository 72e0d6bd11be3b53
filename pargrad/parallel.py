"""Intra-op parallelism: one large elementwise numpy call cut into chunks, which the
thread that makes the call runs, helped by engine threads that are idle.

``elementwise(fn, args, params)`` computes ``fn(*args, **params)`` for an elementwise
``fn`` (a forward or a gradient rule an op names in ``cut=``) whose array
arguments all have one shape: it runs ``fn`` on one chunk of every argument at a time
and writes each result into its slice of one output array. The chunks are a ``Job``;
the calling thread (the holder) offers it to the threads that wait idle for work on its
device's ReadyQueue, then runs chunks itself until none is left, and returns once every
chunk has been written. numpy releases the GIL inside each chunk's loops, so the
helpers' chunks run on other cores.

Guarantees:
- The result is bitwise the unchunked call's: every element is computed by the same
  numpy loop from the same inputs (chunk boundaries are multiples of ``chunk_elements``,
  so the loops see the same alignment). ``fn``'s arguments are never written.
- A busy thread is never taken from other work: the job goes only to threads blocked
  waiting for work (``ReadyQueue.offer``), and the holder runs every chunk no helper
  took. Where no thread could help (the reference engine, ``intra_op=False``, one core,
  a BLAS node running) the call is not cut at all.
- A chunk's exception is raised by the holder once no chunk runs any more; the chunks
  not yet started are then skipped. So is every chunk after the holder was interrupted.
- What a helper runs is seen in the engine's ``statistics()`` (``chunks_helped``,
  ``helping_seconds``) and trace (``Trace.helping()``): ``Job.help``'s ``ran``.
- Which threads help is decided by the engine that is current (``set_helpers_finder``,
  registered by ``engine/selection.py``): a ``ThreadedEngine`` made with
  ``intra_op=True`` (the default) offers chunks to its workers; the reference engine
  never does.

Assumptions: no GIL; ``Job._lock`` guards a job's claims (its comment says what).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from pargrad import memory

Offer = Callable[["Job", int], int]
"""Hands a job to up to ``count`` idle threads; returns how many took it."""


class Helpers(Protocol):
    """The idle threads a call may offer its chunks to (a device's ReadyQueue)."""

    def offer(self, job: Job, count: int) -> int:
        """Hand ``job`` to up to ``count`` idle threads; return how many took it."""

    def idle(self) -> int:
        """How many threads are idle now (a hint, read without a lock)."""

min_elements_ = 1 << 19
"""``thresholds()[0]``, read as it is by the forward's hot path (``Op.call``); set it
with ``set_thresholds``."""
_chunk_elements = 1 << 16
STREAMING_MIN = 1 << 21
"""Elements from which a call that only streams memory (``streaming=True``) is cut: on
two cores a streaming pass gains from a second thread only on several million elements
(measured in docs/performance.md, "Intra-op parallelism")."""
_helpers_finder: Callable[[], Helpers | None] = lambda: None


def thresholds() -> tuple[int, int]:
    """``(min_elements, chunk_elements)``: calls with fewer output elements than the
    first are not cut; chunks have the second's elements (the last one fewer)."""
    return min_elements_, _chunk_elements


def set_thresholds(min_elements: int, chunk_elements: int) -> tuple[int, int]:
    """Set ``thresholds()`` (for tests and tuning); return the previous ones. Not meant
    to change while other threads compute."""
    global min_elements_, _chunk_elements
    if chunk_elements < 1 or min_elements < 1:
        raise ValueError("parallel.set_thresholds: both must be positive, got "
                         f"{min_elements!r}, {chunk_elements!r}")
    previous = min_elements_, _chunk_elements
    min_elements_, _chunk_elements = min_elements, chunk_elements
    return previous


def set_helpers_finder(finder: Callable[[], Helpers | None]) -> None:
    """Register how a call finds the idle threads it may offer chunks to (the current
    engine's), or None to run them all on the calling thread. Called once, at import."""
    global _helpers_finder
    _helpers_finder = finder


def large(arrays: Sequence[Any], minimum: int | None = None) -> bool:
    """Whether one of ``arrays`` is an array of at least ``minimum`` elements (default
    ``min_elements``; cheap: the forward asks it of every elementwise op)."""
    if minimum is None:
        minimum = min_elements_
    for a in arrays:  # noqa: SIM110 (a loop: any() would make a generator per op)
        if type(a) is np.ndarray and a.size >= minimum:
            return True
    return False


def elementwise(fn: Callable[..., Any], args: Sequence[Any],
                params: dict[str, Any], *, streaming: bool = False) -> np.ndarray | None:
    """``fn(*args, **params)`` computed in chunks (module doc), or None where it is not
    cut: fewer elements than ``min_elements``, array arguments of different shapes (a
    broadcast) or not C-contiguous, no thread that could help, or ``fn`` returning
    something other than a fresh array of its chunk's shape (a view of an argument,
    which the caller computes unchunked at no cost). The caller then calls ``fn``
    itself. ``streaming``: ``fn`` only streams memory (a gradient rule of a few passes),
    so it is cut only from ``STREAMING_MIN`` elements and only while a thread is idle
    to help now (cut and run by the holder alone, it measured slower than whole).

    A chunk of a ``fn`` that is not a ufunc runs with ``memory.into`` set to its slice
    of the output: a rule that makes its result with ``memory.empty`` computes it there,
    with no copy (any other result is copied into the slice)."""
    shape = _common_shape(args)
    if shape is None:
        return None
    size = int(np.prod(shape))
    helpers = _helpers(size, STREAMING_MIN if streaming else min_elements_)
    if helpers is None:  # small, or nobody could help: the plain call, as the reference's
        return None
    if streaming and helpers.idle() <= 0:
        return None  # only streams memory: cut, it pays only where a thread helps now
    chunk = _chunk_elements
    flat = [a.reshape(-1) if type(a) is np.ndarray and a.ndim else None for a in args]

    def part(i: int) -> Any:
        piece = slice(i * chunk, (i + 1) * chunk)
        return fn(*[a if f is None else f[piece] for a, f in zip(args, flat)], **params)

    first = part(0)
    if type(first) is not np.ndarray or first.shape != (chunk,) or not memory.owns_itself(first):
        return None
    out = memory.empty((size,), first.dtype)  # from pargrad's pool (memory.py)
    out[:chunk] = first
    del first

    if isinstance(fn, np.ufunc) and fn.nout == 1 and not params:
        def run(i: int) -> None:  # the ufunc writes its chunk in place: no copy
            piece = slice(i * chunk, (i + 1) * chunk)
            fn(*[a if f is None else f[piece] for a, f in zip(args, flat)], out=out[piece])
    else:
        def run(i: int) -> None:
            target = out[i * chunk:(i + 1) * chunk]
            try:
                memory.into(target)  # a rule making its result with memory.empty: there
                result = part(i)
            finally:
                memory.into(None)
            if result is not target:
                target[...] = result

    count = -(-size // chunk)
    Job(run, count, first=1).run_here(helpers.offer, count - 2)  # the holder runs one at least
    return out.reshape(shape)


_SCALARS = (int, float, complex, bool, np.generic, type(None))


def _helpers(size: int, minimum: int) -> Helpers | None:
    """Where a call of ``size`` elements may offer its chunks, or None where a cut would
    not pay: fewer than ``minimum`` elements, one chunk's worth, or no thread that could
    help (``set_helpers_finder``)."""
    if size < minimum or size <= _chunk_elements:
        return None
    return _helpers_finder()


def _common_shape(args: Sequence[Any]) -> tuple[int, ...] | None:
    """The one shape of the array arguments (0-d arrays and scalars aside), if they are
    all C-contiguous numbers; else None. Anything else (an ndarray subclass, a memmap, a
    masked array, another array-like) is not cut: a chunk would get all of it."""
    shape: tuple[int, ...] | None = None
    for a in args:
        if type(a) is np.ndarray:
            if not a.ndim:
                continue
            if shape is None:
                shape = a.shape
            elif a.shape != shape:
                return None
            if not a.flags.c_contiguous or a.dtype.hasobject:
                return None
        elif not isinstance(a, _SCALARS):
            return None
    return shape


def for_chunks(size: int, body: Callable[[slice], None], minimum: int | None = None) -> bool:
    """Run ``body(piece)`` for every chunk ``piece`` of ``range(size)``, helped by idle
    threads (a kernel that writes each chunk of its output in place, e.g. a numba
    kernel that releases the GIL); return True. Return False, having run nothing, where
    a cut would not pay: fewer than ``minimum`` elements (default ``min_elements``; a
    kernel that only streams memory gains later), or no thread could help. ``body``
    must write only its own piece."""
    helpers = _helpers(size, min_elements_ if minimum is None else minimum)
    if helpers is None:
        return False
    chunk = _chunk_elements
    count = -(-size // chunk)
    job = Job(lambda i: body(slice(i * chunk, (i + 1) * chunk)), count)
    job.run_here(helpers.offer, count - 1)  # the holder runs one chunk at least
    return True


class Job:
    """The chunks ``first .. count - 1`` of one call, claimed one at a time: by the
    holder (``run_here``) and by idle threads that took the job from a ReadyQueue
    (``help``)."""

    __slots__ = ("_count", "_errstate", "_idle", "_lock", "_next", "_run", "_running",
                 "error")

    def __init__(self, run: Callable[[int], None], count: int, first: int = 0) -> None:
        # Guards _next, _running, error and _run (the closure over the arrays).
        self._lock = threading.Lock()
        # Notified when _running drops to zero: the holder waits for the helpers' chunks.
        self._idle = threading.Condition(self._lock)
        self._run: Callable[[int], None] | None = run
        self._count = count
        self._next = first  # the next chunk to claim
        self._running = 0  # chunks claimed and not finished
        self.error: BaseException | None = None  # the first chunk's exception
        # The holder's numpy error state (np.errstate is per thread): helpers run their
        # chunks under it, so a chunk raises, warns or ignores as the unchunked call would.
        self._errstate = np.geterr()

    @property
    def finished(self) -> bool:
        """Whether the call is over (its holder returned): a helper that takes the job
        now runs nothing."""
        return self._run is None

    def _claim(self) -> tuple[int, Callable[[int], None]] | None:
        with self._lock:
            run = self._run
            if run is None or self._next >= self._count or self.error is not None:
                return None
            i = self._next
            self._next += 1
            self._running += 1
            return i, run

    def _finished(self, exc: BaseException | None) -> None:
        with self._lock:
            self._running -= 1
            if exc is not None and self.error is None:
                self.error = exc
            if self._running == 0:
                self._idle.notify_all()

    def help(self, stop: Callable[[], bool] | None = None,
             ran: Callable[[float, float], None] | None = None) -> None:
        """Run chunks until none is left, or until ``stop()`` says to (checked between
        chunks: the holder runs what is left). For an idle thread that took the job; it
        runs them under the holder's numpy error state. ``ran(start, end)``
        (``time.perf_counter()`` seconds) is called after each chunk it ran, before the
        holder can see that chunk finished: what it records is complete once the call
        returned (the engine's statistics and trace of helping). Never raises: a
        chunk's exception goes to the holder. (A warning a chunk issues is issued on
        this thread, not the holder's.)"""
        with np.errstate(**self._errstate):
            self._drain(BaseException, stop, ran)

    def _drain(self, catch: type[BaseException], stop: Callable[[], bool] | None = None,
               ran: Callable[[float, float], None] | None = None) -> None:
        """Claim and run chunks until none is left (or ``stop()``), each followed by
        ``ran(start, end)``; a chunk's exception of type ``catch`` becomes ``error``
        (the first one) instead of propagating."""
        while (stop is None or not stop()) and (claimed := self._claim()) is not None:
            i, run = claimed
            del claimed
            exc = None
            start = time.perf_counter() if ran is not None else 0.0
            try:
                run(i)
            except catch as e:
                exc = e
            del run
            try:
                if ran is not None:
                    ran(start, time.perf_counter())
            finally:
                self._finished(exc)

    def run_here(self, offer: Offer, count: int) -> None:
        """The holder's part: offer the job to up to ``count`` idle threads, run chunks
        until none is left, wait for the helpers' chunks, and raise the first chunk's
        exception. An interrupt of the holder (from the offer on) skips the chunks not
        yet claimed and lets the job's arrays go."""
        try:
            if count > 0:
                offer(self, count)
            self._drain(Exception)  # an interrupt propagates: the holder's caller gets it
            with self._lock:
                while self._running:
                    self._idle.wait()
                self._run = None  # an offer still queued must not keep the arrays alive
        except BaseException:
            with self._lock:
                self._next = self._count
                self._run = None
            raise
        error, self.error = self.error, None  # its traceback holds the chunk's arrays
        if error is not None:
            raise error
