"""Pool: the ReadyQueues and worker threads of one ThreadedEngine, one queue and one set
of workers per device, and the count of backward calls in flight that ``shutdown``
waits for.

The pool knows nothing of graphs or tasks: its workers run the loop they were given
(``engine/loop.py``'s ``worker_main``), and it counts backward calls only as numbers.

Guarantees:
- A device's workers start when its queue is first asked for, never before.
- ``shutdown`` refuses new backward calls at once; the queues close (and the workers
  exit) only once no backward is in flight, so no work is ever put on a queue whose
  workers left.
- Holds no reference to its engine, so an engine nobody uses can be collected (and its
  finalizer closes the pool).

Assumptions: no GIL; ``_lock`` guards everything that changes (see its comment).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from pargrad.devices import Device, available_cores, device
from pargrad.engine.ready_queue import ReadyQueue

T = TypeVar("T")


def default_workers() -> int:
    """Workers per device by default: one less than the cores, since the thread that
    calls backward works too (at least one, so that nobody waiting still finishes)."""
    return max(1, available_cores() - 1)


class Pool(Generic[T]):
    """The ReadyQueues and worker threads of one engine, per device; ``T`` is what the
    queues hold."""

    def __init__(self, workers: int | Mapping[str | Device, int] | None,
                 worker_main: Callable[[Pool[T], Device, ReadyQueue[T]], None]) -> None:
        self._counts = _worker_counts(workers)
        self._worker_main = worker_main
        # Guards _queues, _threads, _helpers, _active and _closed.
        self._lock = threading.Lock()
        # Notified when _active drops to zero (shutdown waits for it).
        self.all_tasks_done = threading.Condition(self._lock)
        self._queues: dict[Device, ReadyQueue[T]] = {}
        self._threads: list[threading.Thread] = []  # the workers
        self._helpers: list[threading.Thread] = []  # helper threads that may be alive
        self._active = 0  # backward calls started and not yet done
        self._closed = False

    def workers(self, at: Device) -> int:
        """How many worker threads the device ``at`` gets."""
        return self._counts.get(at, self._counts[None])

    def queue(self, at: Device) -> ReadyQueue[T]:
        """The ReadyQueue of the device ``at``; its workers start on first use.
        Thread-safe."""
        with self._lock:
            return self._queue(at)

    def open_queue(self, at: Device) -> ReadyQueue[T] | None:
        """``queue(at)``, or None once the pool is shut down (whose workers are leaving,
        and must not be started again). Thread-safe."""
        with self._lock:
            return None if self._closed else self._queue(at)

    def _queue(self, at: Device) -> ReadyQueue[T]:
        """``queue``'s body; the caller holds ``_lock``."""
        found = self._queues.get(at)
        if found is None:
            found = self._queues[at] = ReadyQueue()
            for i in range(self.workers(at)):
                thread = threading.Thread(target=self._worker_main, args=(self, at, found),
                                          name=f"pargrad-{at}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return found

    def start_helper(self, run: Callable[[], None], name: str) -> None:
        """Start a helper thread that calls ``run`` (a reentrant or asynchronous backward
        driven on a fresh stack); ``shutdown(wait=True)`` joins it. The backward it
        drives is counted (``task_started``) until it is over, so shutdown cannot miss a
        helper started for it."""
        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:  # started under it, so shutdown never joins one not yet started
            self._helpers = [t for t in self._helpers if t.is_alive()]
            self._helpers.append(thread)
            thread.start()

    def task_started(self, nested: bool) -> None:
        """Count a new backward call; refused after shutdown unless ``nested`` (called
        from a node of a backward still in flight, which shutdown waits for)."""
        with self._lock:
            if self._closed and not nested:
                raise RuntimeError("this ThreadedEngine was shut down; make a new one")
            self._active += 1

    def task_done(self) -> None:
        """A backward call counted by ``task_started`` is over."""
        with self._lock:
            self._active -= 1
            # Only shutdown waits on all_tasks_done, and only after setting _closed under
            # this lock: an open pool has no waiter to wake.
            if self._active == 0 and self._closed:
                self.all_tasks_done.notify_all()
                self._close_queues()

    def _close_queues(self) -> None:
        """Let the workers exit. Holds ``_lock``; only once no backward is in flight, so
        no work can be put on a queue after its workers left."""
        for q in self._queues.values():
            q.close()

    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far."""
        with self._lock:
            return list(self._threads)

    def queue_waits(self) -> int:
        """How often a thread blocked on one of the ReadyQueues, all devices together."""
        with self._lock:
            queues = list(self._queues.values())
        return sum(q.waits for q in queues)

    def after_fork_in_child(self) -> None:
        """In a child process just forked (pargrad/fork.py): the workers, helpers and
        the backward calls in flight were the parent's threads and are gone. Forget them
        (the queues too, with what was on them: their futures are failed by the fork
        handler), so that workers start afresh on first use; ``_lock`` is made anew,
        since a parent thread may have held it."""
        self.all_tasks_done._at_fork_reinit()  # type: ignore[attr-defined]  # and _lock
        self._queues, self._threads, self._helpers = {}, [], []
        self._active = 0

    def shutdown(self, wait: bool) -> None:
        """Refuse new backward calls; the ones in flight still finish, and the workers
        exit after them. With ``wait``, block until then and join the workers.
        Idempotent."""
        with self._lock:
            self._closed = True
            if wait:
                while self._active:
                    self.all_tasks_done.wait()
            if not self._active:
                self._close_queues()
            threads = self._threads + self._helpers
        if wait:
            for thread in threads:
                thread.join()


def _worker_counts(workers: int | Mapping[str | Device, int] | None) -> dict[Device | None, int]:
    """Normalise ``workers``; the key None holds the count for devices not named."""
    if workers is None:
        return {None: default_workers()}
    if isinstance(workers, Mapping):
        counts: dict[Device | None, int] = {None: default_workers()}
        for name, count in workers.items():
            counts[device(name)] = check_count(count, f"workers[{name!r}]")
        return counts
    return {None: check_count(workers, "workers")}


def check_count(count: object, what: str, minimum: int = 1) -> int:
    """``count`` if it is an int of at least ``minimum``; else a ValueError naming
    ``what``."""
    if isinstance(count, bool) or not isinstance(count, int) or count < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"ThreadedEngine: {what} must be {kind}, got {count!r}")
    return count
