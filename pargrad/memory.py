"""pargrad's caching allocator: the memory of large arrays, kept and handed out again.

A large numpy array is a fresh mapping from the C allocator, and on Linux glibc gives it
back to the kernel when it is freed: the next array of that size faults its pages in
again, one at a time (about 2 µs a page on the project's machine, as much as the
arithmetic of a streaming kernel). A backward or a training step makes and frees the
same sizes over and over, so pargrad keeps that memory instead: the ops' forwards and
gradient rules, gradient accumulation and the fused kernels take arrays of at least
``MIN_BYTES`` from ``empty``, and the memory of each comes back to a pool of free blocks
once nothing can see it any more. In steady state nothing is faulted in again.

How ownership stays exact, by construction: a pool owns *blocks* (numpy arrays of bytes,
of a private subclass); ``empty`` hands out an array made on a fresh *lease*, a plain
view of the block's first bytes, which the array and every array derived from it hold
through their ``base`` (numpy collapses a chain of views only down to an array of
another type, so it stops at the lease, above the block). The pool holds the block, and
only a weak reference to the lease. The lease dies
when the last array that reaches it does, whoever held it: a ``.grad``, a user's hook,
a retained graph, a view, a memoryview, another thread. Only then does the interpreter
call the weak reference's callback, which appends it to the pool's ``_returned`` deque
(a C call: no Python code runs in a finalizer, so Ctrl-C cannot land there), and the
next call into the pool puts the block back on the free list. No recycled memory is
ever visible: there is nothing left that could see it.

So the engines' dependency counters decide when a gradient is dead, as they always
did: the engine drops its reference when the last consumer has run, and with it the
memory goes back to the pool, within one backward (the next rule reuses it: the seed's
"double buffering") and across calls.

Guarantees:
- ``empty(shape, dtype)`` returns a C-contiguous, writable array of that shape and
  dtype, uninitialised, at the same alignment as ``np.empty``'s (a block's start). It
  does not own its data (``.flags.owndata`` is False, so ``ndarray.resize`` refuses);
  everything else is a numpy array like any other.
- A block is reused for a request of its size, or up to an eighth smaller (a block is
  allocated at the size asked, so peak memory is what numpy's own arrays would take);
  free blocks are kept up to ``cache_limit()`` bytes, the rest given back to numpy.
- Thread-safe: one lock per pool (``Pool._lock``), held for a few dictionary operations,
  never while numpy allocates or anything else of pargrad's runs. A finalizer that a
  collection runs inside those operations and that calls the pool gets numpy's memory
  instead of waiting for the lock. A Ctrl-C anywhere leaves the pool consistent (at
  worst one block given back to numpy, or a count one off).
- A block comes back at the pool's next call after its arrays died (the interpreter
  cannot run the pool's code when they die): ``memory_stats()`` makes it come back now.
- ``memory_stats()`` / ``empty_cache()`` / ``reset_peak_memory_stats()`` after PyTorch's
  names for its own caching allocator; ``set_enabled(False)`` (or ``PARGRAD_CACHING=0``
  before import) makes ``empty`` plain ``np.empty``, for comparison.

Devices: the logical CPU devices (``cpu``, ``cpu:1``, ...) share one memory, so they
share one pool (``pool("cpu")``); another device type would have a pool of its own.

Assumptions: the user keeps an array (or a view of it) to keep its memory, not a raw
pointer to its data (``__array_interface__``, ``ctypes.data``), nor the block two
``base`` steps above it.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import deque
from typing import Any

import numpy as np

MIN_BYTES = 1 << 17
"""Arrays from this many bytes come from the pool (128 KiB: glibc's default threshold
for giving an allocation its own mapping, which is what faults in again)."""

_Descr = type(np.dtype(np.float64))
_local = threading.local()
"""Per thread: ``holding``, the pool whose lock it holds; ``target``, ``into``'s array."""


def _default_limit() -> int:
    """A quarter of the machine's memory (1 GiB where it cannot be read), or
    ``PARGRAD_CACHE_LIMIT`` bytes."""
    if (text := os.environ.get("PARGRAD_CACHE_LIMIT")) is not None:
        return int(text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class _Block(np.ndarray):
    """Bytes a pool owns. A type of its own, so that numpy's collapse of view chains
    stops at the lease above it (module doc)."""


class Pool:
    """The free blocks of one device and the leases handed out of them."""

    def __init__(self, limit: int) -> None:
        # Guards _free, _sizes, _leased, _cached, _limit and the counters. Held for a few
        # dictionary and list operations; a collection that runs inside them may run a
        # finalizer that calls the pool on this thread: that call does not wait for the
        # lock (``_mine``) but bypasses the pool.
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = {}  # block bytes -> free blocks (maybe none)
        self._sizes: list[int] = []  # the keys of _free, sorted
        self._leased: dict[int, tuple[weakref.ref[np.ndarray], _Block]] = {}
        # Weak references whose lease died, appended by the interpreter (deque.append is
        # one C call, safe from any thread and from a collection inside _lock).
        self._returned: deque[weakref.ref[np.ndarray]] = deque()
        self._cached = 0  # bytes of the free blocks
        self._limit = limit
        # The counters of memory_stats().
        self._reused = self._new = self._back = self._released = 0
        self._leased_bytes = self._peak = 0

    def _mine(self) -> bool:
        """Whether this thread holds ``_lock`` already (a finalizer run by a collection
        inside a locked section called the pool): the caller must not take it."""
        return getattr(_local, "holding", None) is self and self._lock.locked()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int) -> np.ndarray:
        """A fresh array of ``nbytes`` (``shape``'s elements of ``dtype``) on a block."""
        if self._mine():
            return np.empty(shape, dtype)
        block = None
        with self._lock:
            _local.holding = self
            if self._returned:
                self._reclaim()
            blocks = self._free.get(nbytes) or self._near(nbytes)
            if blocks:
                block = blocks.pop()
                self._cached -= block.size
                self._reused += 1
            else:
                self._new += 1
            _local.holding = None
        if block is None:
            block = np.ndarray.__new__(_Block, (nbytes,), np.uint8)
        # The lease: a plain view of the block's first bytes, which the array handed out
        # and all its views hold (the array's base).
        lease = np.ndarray((nbytes,), np.uint8, block)
        out = np.ndarray(shape, dtype, lease)
        entry = (weakref.ref(lease, self._returned.append), block)
        with self._lock:
            self._leased[id(entry[0])] = entry
            self._leased_bytes += block.size
            if self._leased_bytes > self._peak:
                self._peak = self._leased_bytes
        return out

    def _near(self, size: int) -> list[_Block] | None:
        """Free blocks of the smallest size that fits ``size`` and wastes at most an
        eighth of it, or None (under ``_lock``)."""
        sizes = self._sizes
        i = bisect.bisect_left(sizes, size)
        while i < len(sizes) and sizes[i] - (sizes[i] >> 3) <= size:
            blocks = self._free.get(sizes[i])
            if blocks:
                return blocks
            i += 1
        return None

    def _reclaim(self) -> None:
        """Put back the blocks whose arrays all died (under ``_lock``). Interrupted
        anywhere, what it leaves is consistent: at worst a block is given back to numpy
        instead of kept, or a count is one off."""
        returned = self._returned
        while returned:
            found = self._leased.pop(id(returned.popleft()), None)
            if found is None:  # its lease died before it was registered (an interrupt)
                continue
            block = found[1]
            size = block.size
            self._leased_bytes -= size
            self._back += 1
            if self._cached + size > self._limit:
                self._released += 1
                continue
            blocks = self._free.get(size)
            if blocks is None:
                blocks = self._free.setdefault(size, [])
                bisect.insort(self._sizes, size)
            blocks.append(block)
            self._cached += size

    def _drop_largest(self) -> None:
        """Give one free block of the largest size back to numpy (under ``_lock``)."""
        for size in reversed(self._sizes):
            blocks = self._free[size]
            if blocks:
                blocks.pop()
                self._cached -= size
                self._released += 1
                return

    def stats(self, reset_peak: bool = False) -> dict[str, int]:
        """``memory_stats()`` of this pool (first putting back the blocks of dead
        arrays); ``reset_peak``: then start the peak again from the bytes in use."""
        if self._mine():  # a finalizer inside a locked section: what it can read now
            return self._snapshot()
        with self._lock:
            _local.holding = self
            self._reclaim()
            if reset_peak:
                self._peak = self._leased_bytes
            found = self._snapshot()
            _local.holding = None
        return found

    def _snapshot(self) -> dict[str, int]:
        return {"leases": self._reused + self._new, "reused": self._reused,
                "allocated_blocks": self._new, "returned": self._back,
                "released_blocks": self._released,
                "leased_bytes": self._leased_bytes, "peak_leased_bytes": self._peak,
                "leased_blocks": len(self._leased), "cached_bytes": self._cached,
                "free_blocks": sum(map(len, list(self._free.values()))),
                "cache_limit": self._limit}

    def empty_cache(self) -> int:
        """Give every free block back; return their bytes."""
        return self.set_limit(self._limit, keep=0)[1]

    def set_limit(self, limit: int, keep: int | None = None) -> tuple[int, int]:
        """Set the limit of free bytes and give back the largest blocks over it (over
        ``keep`` bytes, if given); return the previous limit and the bytes given back."""
        if self._mine():
            return self._limit, 0
        with self._lock:
            _local.holding = self
            previous, self._limit = self._limit, limit
            self._reclaim()
            before = self._cached
            bound = limit if keep is None else keep
            while self._cached > bound:
                self._drop_largest()
            if keep == 0:
                self._free.clear()
                self._sizes.clear()
            _local.holding = None
        return previous, before - self._cached

    def reset_peak(self) -> None:
        """Start the peak again from the bytes in use now."""
        self.stats(reset_peak=True)


_host = Pool(_default_limit())
_enabled = os.environ.get("PARGRAD_CACHING", "1") != "0"
_lock = _host._lock
"""The host pool's lock, for the fork handler's list of process-wide locks."""


def pool(device: Any = None) -> Pool:
    """The pool of ``device`` (a Device, a name, or None: ``cpu``). Every logical CPU
    device shares the host's one pool."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    if kind != "cpu":
        raise ValueError(f"pargrad.memory: no pool for device {device!r}")
    return _host


def empty(shape: tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
    """An uninitialised C-contiguous array: this thread's ``into`` target if it has this
    shape and dtype; else from the pool if it has at least ``MIN_BYTES`` and caching is
    on; else ``np.empty``'s."""
    if type(dtype) is not _Descr:
        dtype = np.dtype(dtype)
    target = getattr(_local, "target", None)
    if target is not None and target.shape == shape and target.dtype == dtype:
        _local.target = None
        return target
    count = 1
    for n in shape:
        count *= n
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or not _enabled or dtype.hasobject:
        if not _enabled and _host._returned:  # arrays handed out before: give them back
            _host.stats()
        return np.empty(shape, dtype)
    return _host.empty(shape, dtype, nbytes)


def copy(a: np.ndarray) -> np.ndarray:
    """``np.array(a)``: a copy with its own memory, from the pool if it is large and
    ``a`` is C-contiguous or a broadcast of one value (any other layout is copied by
    numpy, which keeps it: a reduction over the copy then sums in the same order)."""
    if (a.nbytes >= MIN_BYTES and _enabled and not a.dtype.hasobject
            and (a.flags.c_contiguous or not any(a.strides))):
        out = _host.empty(a.shape, a.dtype, a.nbytes)
        np.copyto(out, a)
        return out
    return np.array(a)


def owns_itself(a: np.ndarray) -> bool:
    """Whether ``a`` is an array of its own, not a view of another: one that owns its
    data, or one ``empty`` handed out (its base is the lease, a view of all its bytes on
    the pool's block; a view of all of it, ``a.T``, counts as it too)."""
    base = a.base
    return base is None or (type(base) is np.ndarray and type(base.base) is _Block
                            and base.nbytes == a.nbytes)


def owner(a: np.ndarray) -> Any:
    """The object whose memory ``a`` is in: ``a.base`` (numpy points every view at it),
    or ``a`` if it owns its data; for ``empty``'s arrays and their views, the block."""
    while isinstance(base := a.base, np.ndarray):
        a = base
    return a if base is None else base


def enabled() -> bool:
    """Whether ``empty`` takes large arrays from the pool."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the pool on or off for new arrays (arrays already handed out still come back
    to it); return the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def memory_stats(device: Any = None) -> dict[str, int]:
    """The pool's counters, every one an int:

    - ``leases``: arrays handed out; ``reused`` of them on a free block,
      ``allocated_blocks`` on a new one;
    - ``returned``: leases whose arrays all died; ``released_blocks``: blocks given back
      to numpy (over the limit, or by ``empty_cache``);
    - ``leased_bytes`` / ``peak_leased_bytes``: bytes of the blocks in use now / at most
      since the start or ``reset_peak_memory_stats``; ``leased_blocks``: how many;
    - ``cached_bytes`` / ``free_blocks``: the free blocks kept; ``cache_limit``.
    """
    return pool(device).stats()


def empty_cache(device: Any = None) -> int:
    """Give every free block back to numpy; return their bytes. Blocks in use are not
    touched (they come back to the pool when their arrays die)."""
    return pool(device).empty_cache()


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start ``peak_leased_bytes`` again from the bytes in use now."""
    pool(device).reset_peak()


def cache_limit(device: Any = None) -> int:
    """The most bytes of free blocks the pool keeps."""
    return pool(device).stats()["cache_limit"]


def set_cache_limit(nbytes: int, device: Any = None) -> int:
    """Keep at most ``nbytes`` of free blocks (giving back the largest over it now);
    return the previous limit. 0 keeps none: every block goes back to numpy once its
    arrays died (at the pool's next call), as without the pool. Default: a quarter of
    the machine's memory, or ``PARGRAD_CACHE_LIMIT``."""
    if nbytes < 0:
        raise ValueError(f"pargrad.memory.set_cache_limit: a limit of {nbytes} bytes")
    return pool(device).set_limit(int(nbytes))[0]


def into(target: np.ndarray | None) -> None:
    """Have this thread's next ``empty`` of ``target``'s shape and dtype return
    ``target`` itself (None: no longer). A caller that wants a computation's result
    in a slice of its own array sets it: a rule that makes its result with ``empty``
    then writes it there, with no copy (parallel.elementwise)."""
    _local.target = target
