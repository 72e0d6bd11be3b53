"""Keep BLAS from oversubscribing the cores while engine threads run nodes in parallel.

Two tools, both process-wide because BLAS's thread count is:

- **The BLAS gate** (always on): a node whose backward runs BLAS (``Node.calls_blas``:
  matmul) enters the gate, which lets ``max(1, cores // BLAS threads)`` of them run at
  once. With BLAS on every core already (OpenBLAS's default), BLAS nodes of parallel
  branches then run one after another, each on all cores, while other nodes still run
  beside them; with BLAS at one thread they run ``cores`` at a time. Without the gate,
  engine threads that each start a multi-threaded matmul ask for several times the
  cores, and ran up to several times slower than one thread (docs/performance.md).
- **The BLAS limit** (``ThreadedEngine(limit_blas=True)``): while a backward runs on a
  ThreadedEngine that may run ``n`` nodes at once, BLAS gets ``max(1, cores // n)``
  threads; when the last such backward in the process ends, BLAS gets back the count
  it had.

Why the limit is per backward call, and set by the calling thread: OpenBLAS lets any
thread lower its thread count, but a count lowered by the main thread can only be raised
again by the main thread (measured with OpenBLAS 0.3.31). Workers therefore never touch
it; the thread that called backward lowers it on entry and restores it on exit.

Guarantees: ``limit``/``restore`` and ``enter_gate``/``leave_gate`` are thread-safe.
``limit``/``restore`` cost a lock and, on the first entry and the last exit, about a
microsecond per BLAS library; entering the gate costs a lock and a look at the BLAS
thread count (a microsecond or so, next to a matmul's milliseconds). Without
threadpoolctl, or with no BLAS it knows, the limit does nothing and the gate counts BLAS
as one thread. Nested and concurrent limits are counted: the count is restored when the
last one leaves (if that is not the thread that lowered it, OpenBLAS may keep the lower
count). A thread inside the gate runs only a node's numpy code and never waits for
other work, so waiting at the gate cannot deadlock.

Assumptions: the BLAS thread count is process-wide; a BLAS call already running keeps
the count it started with. A count the user sets while a backward runs is overwritten
when the backward ends.

Known limit of ``limit_blas`` (why it is not the default): OpenBLAS's threads keep
spinning for roughly 0.1 s after a call that used them, so a backward that starts right
after a forward full of multi-threaded matmuls still shares the cores with them
(docs/performance.md).
"""

from __future__ import annotations

import threading
from typing import Any

from pargrad.devices import available_cores

# Guards _entered, _original and _libraries (and every call into the libraries).
_lock = threading.Lock()
_entered = 0  # backward calls holding the limit now
_original: list[int] = []  # the libraries' counts before the first of them lowered them
_libraries: list[Any] | None = None  # threadpoolctl's BLAS controllers, found lazily


def _blas_libraries() -> list[Any]:
    global _libraries
    if _libraries is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # an optional helper: without it BLAS is left alone
            _libraries = []
        else:
            _libraries = list(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _libraries


def limit(threads: int) -> None:
    """Give BLAS at most ``threads`` threads until the matching ``restore``."""
    global _entered
    with _lock:
        if _entered == 0:
            libraries = _blas_libraries()
            _original[:] = [lib.get_num_threads() for lib in libraries]
            for lib, original in zip(libraries, _original):
                if threads < original:
                    lib.set_num_threads(threads)
        _entered += 1


def restore() -> None:
    """End one ``limit``; the last one gives BLAS back its original counts."""
    global _entered
    with _lock:
        _entered -= 1
        if _entered == 0:
            for lib, original in zip(_blas_libraries(), _original):
                if lib.get_num_threads() != original:
                    lib.set_num_threads(original)


# Guards _in_gate. Condition ``gate_open``: notified when a node leaves the gate.
_gate_lock = threading.Lock()
gate_open = threading.Condition(_gate_lock)
_in_gate = 0  # BLAS nodes running now, in every engine of the process


def gate_size() -> int:
    """How many BLAS nodes may run at once: the cores over BLAS's threads (at least 1)."""
    threads = max(thread_counts(), default=1)
    return max(1, available_cores() // max(1, threads))


def busy() -> bool:
    """Whether a BLAS node runs now, anywhere in the process (read without the lock: a
    hint, for intra-op chunks, which stay off the cores while BLAS's threads use them)."""
    return _in_gate > 0


def enter_gate() -> None:
    """Wait (blocking) until another BLAS node may run, and count this one in. Pair with
    ``leave_gate``."""
    global _in_gate
    size = gate_size()  # outside _gate_lock: it takes _lock
    with gate_open:
        while _in_gate >= size:
            try:
                gate_open.wait()
            except BaseException:  # a notify meant for this waiter must not be lost
                gate_open.notify()
                raise
        _in_gate += 1


def leave_gate() -> None:
    """Count a BLAS node out of the gate and let one waiter in."""
    global _in_gate
    with gate_open:
        _in_gate -= 1
        gate_open.notify()


def thread_counts() -> list[int]:
    """The thread count of each BLAS library threadpoolctl finds (for tests and reports)."""
    with _lock:
        return [lib.get_num_threads() for lib in _blas_libraries()]
