"""Fork safety: ``os.register_at_fork`` handlers, so that a child process made by
``os.fork`` (or ``multiprocessing`` with the fork start method) can use pargrad, its
default engine and every engine it inherited.

``fork`` copies only the thread that calls it. Whatever the parent's other threads were
doing is frozen in the child: a lock one of them held stays held forever, and the
engines' worker threads, and the backward calls they ran, do not exist there.

Guarantees:
- Before the fork, the forking thread takes every process-wide lock of pargrad, in the
  order of the lock table (docs/design.md §9, ``GLOBAL_LOCKS`` here), so that no other
  thread is inside a critical section at the moment of the fork: the data they guard is
  consistent in the child. After the fork, the parent releases them; the child releases
  them too (it is the only thread, and holds them).
- In the child, every ThreadedEngine forgets the parent's workers, helper threads,
  ReadyQueues and backward calls in flight, and makes anew the per-engine locks a parent
  thread may have held; its workers start afresh on first use. The BLAS gate and limit
  counts (``engine/blas.py``) start from zero.
- In the child, the counts of threads with grad mode off and with anomaly mode on
  (``grad_mode.off``, ``anomaly.on``) count the forking thread alone, and their locks
  are made anew. Those two locks are not in ``GLOBAL_LOCKS``: an at-fork ``before``
  handler registered before pargrad's runs after it, and may switch grad or anomaly
  mode (``no_grad``, ``detect_anomaly``); had pargrad taken them, it would deadlock.
  Such a handler's ``after_in_child`` runs before pargrad's: if another parent thread
  held one of the two locks at the fork (a few instructions while it switches its mode),
  switching a mode there still deadlocks; pargrad's own handler is the first safe point.
- In the child, the futures of the parent's asynchronous backward calls that had not
  resolved are resolved with a RuntimeError that says why (their done-callbacks run in
  the child, then); ``result()`` raises it at once instead of waiting forever.

Assumptions: fork is not called from inside a backward (a node, hook or done-callback),
nor while the forking thread holds a pargrad lock (neither happens in ordinary code:
hooks and callbacks run with no pargrad lock held). A backward that was in flight on
another thread of the parent is lost in the child, as that thread is; the parent is
unaffected. The per-backward locks (a GraphTask's, an ``_EarlyCommits``') belong to the
lost backward calls and are not made anew, except through their futures as above.
"""

from __future__ import annotations

import os
import threading

from pargrad import anomaly, devices, grad_mode, graph, hooks, memory, tensor, versions
from pargrad import futures as _futures
from pargrad.engine import blas, selection, threaded, trace
from pargrad.replay import recorder

GLOBAL_LOCKS: tuple[threading.Lock, ...] = (
    # The chain of the lock table's order: grad_lock -> _accumulator_lock -> _sequence_lock.
    tensor.grad_lock,
    tensor._accumulator_lock,
    graph._sequence_lock,
    # Locks held while taking no other pargrad lock (any order among themselves), except
    # _default_lock, held while a default ThreadedEngine is made: it takes
    # _devices_lock and threaded._engines_lock, so it comes before them.
    graph._hooks_made_lock,
    hooks._lock,
    versions._lock,
    selection._default_lock,
    devices._devices_lock,
    threaded._engines_lock,
    _futures._in_flight_lock,
    _futures._callbacks_lock,
    blas._lock,
    blas._gate_lock,
    trace._profiles_lock,
    trace._task_lock,
    memory._lock,
    recorder._lock,
)
"""Every process-wide lock of pargrad but the mode counts' two (made anew in the child
instead), in the order the fork handler takes them."""


def _before() -> None:
    for lock in GLOBAL_LOCKS:
        lock.acquire()


def _after_in_child() -> None:
    engines = list(threaded._engines)
    futures = list(_futures._in_flight)
    for future in futures:  # before done() takes it: a parent thread may have held it
        future._condition._at_fork_reinit()  # type: ignore[attr-defined]
    in_flight = [f for f in futures if not f.done()]
    blas._in_gate = 0  # the parent's BLAS nodes are not running here
    recorder.after_fork_in_child()  # the parent's other threads record nothing here
    # Only this thread is left: it alone is counted with grad mode off or anomaly on.
    # The counts' locks are not taken before the fork (an at-fork handler registered
    # before pargrad's may switch a mode, which takes them): a parent thread may have
    # held one, so they are made anew, and the counts recomputed.
    grad_mode._off_lock._at_fork_reinit()  # type: ignore[attr-defined]
    anomaly._on_lock._at_fork_reinit()  # type: ignore[attr-defined]
    grad_mode.off = int(not grad_mode.mode.enabled)
    anomaly.on = int(anomaly.mode.enabled)
    if blas._entered:  # a parent's backward held the BLAS limit: give it back
        blas._entered = 1
        _release_locks()
        blas.restore()
    else:
        _release_locks()
    for engine in engines:
        engine._after_fork_in_child()
    for future in in_flight:  # callbacks run: every condition was made usable first
        future._fail_after_fork()


def _release_locks() -> None:
    for lock in reversed(GLOBAL_LOCKS):
        lock.release()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before, after_in_parent=_release_locks,
                        after_in_child=_after_in_child)
