"""Keep BLAS from oversubscribing the cores while engine threads run nodes in parallel
(``ThreadedEngine(limit_blas=True)``).

numpy's BLAS (OpenBLAS, MKL, ...) runs each matmul on threads of its own. Two engine
threads that each start such a matmul ask for twice the cores, and on a small machine
run slower than one thread alone. So while a backward runs on a ThreadedEngine that may
run ``n`` nodes at once, BLAS gets ``max(1, cores // n)`` threads; when the last such
backward in the process ends, BLAS gets back the count it had.

Why per backward call, and set by the calling thread: OpenBLAS lets any thread lower its
thread count, but a count lowered by the main thread can only be raised again by the
main thread (measured with OpenBLAS 0.3.31). Workers therefore never touch it; the
thread that called backward lowers it on entry and restores it on exit.

Guarantees: ``limit``/``restore`` are thread-safe; they cost a lock and, on the first
entry and the last exit, about a microsecond per BLAS library. Without threadpoolctl, or
with no BLAS it knows, they do nothing. Nested and concurrent calls are counted: the
count is restored when the last one leaves (if that is not the thread that lowered it,
OpenBLAS may keep the lower count).

Assumptions: the BLAS thread count is process-wide; a BLAS call already running keeps
the count it started with. A count the user sets while a backward runs is overwritten
when the backward ends.

Known limit (why it is not the default): OpenBLAS's threads keep spinning for roughly
0.1 s after a call that used them, so a backward that starts right after a forward full of
multi-threaded matmuls still shares the cores with them (docs/performance.md).
"""

from __future__ import annotations

import threading
from typing import Any

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


def thread_counts() -> list[int]:
    """The thread count of each BLAS library threadpoolctl finds (for tests and reports)."""
    with _lock:
        return [lib.get_num_threads() for lib in _blas_libraries()]
