"""ReadyQueue: the work of one device that is ready to run, best first.

Guarantees:
- ``put`` and ``get`` may be called from any number of threads; each item is returned
  by exactly one ``get``.
- Order: an item of a deeper reentrant backward first (its caller is blocked on it),
  then the higher forward sequence number (the reverse of creation order, as in the
  reference engine, so a buffer is freed soon after it filled), then first in, first out.
- ``get`` blocks until it has an item, or the queue is closed and empty, or the
  caller's ``stop`` event is set, or its ``timeout`` passed; ``wake_all`` makes blocked
  callers look again.
- ``offer`` hands an intra-op ``Job`` (pargrad/parallel.py) to threads blocked in
  ``get`` only, never to a later one while work is queued: an idle thread takes it
  before any item, and a busy one never sees it.

Assumptions: none on the GIL: every field is guarded by ``_lock``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from typing import Generic, Protocol, TypeVar

from pargrad.parallel import Job

T = TypeVar("T")


class Flag(Protocol):
    """What ``get`` reads of a caller's stop flag (a ``threading.Event``, a task's
    ``done``)."""

    def is_set(self) -> bool: ...


class ReadyQueue(Generic[T]):
    """A thread-safe priority queue of ready work for one device."""

    def __init__(self) -> None:
        # Guards _heap, _offers, _order, _closed, _waiting and _waits.
        self._lock = threading.Lock()
        # Notified when an item is put, when the queue is closed, and by wake_all (a
        # waiter's stop event was set). Waiters re-check their predicate on waking.
        self.not_empty = threading.Condition(self._lock)
        self._heap: list[tuple[int, int, int, T]] = []
        self._order = itertools.count()  # ties broken first in, first out
        self._closed = False
        self._waiting = 0  # threads blocked in get
        self._offers: deque[Job] = deque()  # jobs offered to the threads blocked in get
        self._waits = 0  # times a get blocked (for statistics)

    def put(self, item: T, depth: int, sequence_nr: int) -> None:
        """Add ``item`` (of a backward at reentrant ``depth``, for node ``sequence_nr``)."""
        with self._lock:
            heapq.heappush(self._heap, (-depth, -sequence_nr, next(self._order), item))
            if self._waiting:
                self.not_empty.notify()

    def get(self, stop: Flag | None = None,
            timeout: float | None = None) -> T | Job | None:
        """Remove and return an offered job, else the best item; block while there is
        neither.

        Returns None when ``stop`` is set (checked first, so a caller whose work is
        done takes no more), when the queue is closed and empty, or after ``timeout``
        seconds without an item.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if stop is not None and stop.is_set():
                    if self._offers or self._heap:  # a wake-up meant for work: pass it on
                        self.not_empty.notify()
                    return None
                if self._offers:
                    return self._offers.popleft()
                if self._heap:
                    return heapq.heappop(self._heap)[-1]
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._waiting += 1
                self._waits += 1
                try:
                    self.not_empty.wait(left)
                except BaseException:
                    # a notify meant for this waiter must not be lost
                    if self._heap or self._offers:
                        self.not_empty.notify()
                    raise
                finally:
                    self._waiting -= 1

    def offer(self, job: Job, count: int) -> int:
        """Give ``job`` to at most ``count`` of the threads blocked in ``get`` now (none
        if work is queued: they are about to take it); return how many entries were
        queued for them. A thread that wakes and finds its ``stop`` set passes the
        wake-up on; an entry nobody took is harmless (a finished job runs nothing) and
        is dropped by the next offer."""
        with self._lock:
            while self._offers and self._offers[0].finished:
                self._offers.popleft()
            if self._heap:
                return 0
            n = min(count, self._waiting - len(self._offers))
            if n <= 0:
                return 0
            self._offers.extend([job] * n)
            self.not_empty.notify(n)
            return n

    def idle(self) -> int:
        """How many threads blocked in ``get`` no offer has claimed yet: read without the
        lock, a hint that may be stale by the time it is used (a call then runs its
        chunks itself, or cuts where nobody came)."""
        return self._waiting - len(self._offers)

    @property
    def waits(self) -> int:
        """How many times a ``get`` found the queue empty and blocked."""
        with self._lock:
            return self._waits

    def wake_all(self) -> None:
        """Wake every blocked ``get`` so it re-checks its stop event."""
        with self._lock:
            self.not_empty.notify_all()

    def close(self) -> None:
        """Let ``get`` return None once the queue is empty (workers then exit)."""
        with self._lock:
            self._closed = True
            self.not_empty.notify_all()
