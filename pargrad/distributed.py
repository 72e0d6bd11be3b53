"""Data-parallel training over MPI: every rank (process) runs the backward of its own
shard of the batch, and the gradients are averaged across ranks, in buckets whose
all-reduce starts while the rest of the backward still runs (as PyTorch's
DistributedDataParallel and its Reducer do). docs/distributed.md has the whole story.

The rest of pargrad never imports this module, and this module imports ``mpi4py`` only
when it makes an ``MPICommunicator`` (``pip install -e '.[distributed]'``).

Guarantees:
- After ``DataParallel.backward`` (or a backward followed by ``synchronize()``) every
  rank holds the same ``.grad``: the mean (``average=True``) or sum of the ranks' own
  gradients, for every parameter that got a gradient on some rank; a parameter that got
  none on any rank keeps its ``.grad``.
- Buckets start their collective in one order on every rank (bucket 0, 1, ...), whatever
  thread or order the hooks run in, so ranks never mismatch collectives.
- ``deterministic=True``: the buckets are all-gathered and summed in rank order, so the
  gradients are bitwise equal on every rank and bitwise the result of ``overlap=False``
  and of any bucket size (MPI's own reduction order may depend on the message size).
- A backward that fails on one rank fails on all: each rank still reaches
  ``synchronize()``, every rank raises ``DistributedError`` naming the failed ranks, and
  ``DataParallel.backward`` leaves every rank's ``.grad`` as it was before the step.
  With ``timeout=``, a rank that waits longer than that in ``synchronize()`` (another
  rank died or never called it) aborts the whole job with a message instead of hanging.

Assumptions: no GIL. MPI is initialized with ``MPI_THREAD_MULTIPLE`` (mpi4py's default):
hooks start collectives from engine threads. Every rank builds the same parameters in
the same order, and calls ``synchronize()`` once per backward (``DataParallel.backward``
does). Each ``DataParallel`` duplicates its communicator, so its collectives never mix
with the caller's.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np

import pargrad
from pargrad.nn.module import Module
from pargrad.tensor import Tensor

if TYPE_CHECKING:
    from pargrad.engine import Engine
    from pargrad.hooks import RemovableHandle

__all__ = ["BucketTiming", "Communicator", "DataParallel", "DistributedError",
           "MPICommunicator", "Request", "SyncStatistics", "broadcast_parameters", "mpiexec_path",
           "shard"]


class DistributedError(RuntimeError):
    """A data-parallel step failed on at least one rank; raised on every rank."""


# ----- the communicator: what a backend provides -----
class Request(Protocol):
    """A collective in flight."""

    def test(self) -> bool:
        """Whether it has completed (never blocks; lets the collective progress)."""

    def wait(self) -> None:
        """Block until it has completed."""


class Communicator(Protocol):
    """The collectives DataParallel needs; an NCCL- or Gloo-style backend implements
    these six members (docs/distributed.md). Every method is collective except
    ``abort``: all ranks call it, in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def start_allreduce(self, buffer: np.ndarray) -> Request:
        """Start summing ``buffer`` across ranks, in place."""

    def start_allgather(self, buffer: np.ndarray, out: np.ndarray) -> Request:
        """Start gathering every rank's ``buffer`` into ``out[rank]`` on every rank."""

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        """Overwrite ``buffer`` with ``root``'s, in place; blocks."""

    def abort(self, message: str) -> NoReturn:
        """End every rank of the job at once, after printing ``message``."""


class _MPIRequest:
    __slots__ = ("_request",)

    def __init__(self, request: Any) -> None:
        self._request = request

    def test(self) -> bool:
        return bool(self._request.Test())

    def wait(self) -> None:
        self._request.Wait()


class MPICommunicator:
    """``Communicator`` over an mpi4py communicator (default ``MPI.COMM_WORLD``), which
    it duplicates (a collective call), so that its collectives never mix with others.

    Raises ImportError (with the install command) without mpi4py, and RuntimeError if
    MPI was initialized without ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, comm: Any = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError("pargrad.distributed needs mpi4py and an MPI library: "
                              "pip install -e '.[distributed]' (mpi4py and mpich)") from exc
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "pargrad.distributed needs MPI initialized with MPI_THREAD_MULTIPLE (hooks "
                "start collectives from engine threads); mpi4py asks for it unless "
                "mpi4py.rc.thread_level was lowered")
        self._mpi = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()

    @property
    def rank(self) -> int:
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self._comm.Get_size())

    def start_allreduce(self, buffer: np.ndarray) -> Request:
        return _MPIRequest(self._comm.Iallreduce(self._mpi.IN_PLACE, buffer, self._mpi.SUM))

    def start_allgather(self, buffer: np.ndarray, out: np.ndarray) -> Request:
        return _MPIRequest(self._comm.Iallgather(buffer, out))

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        self._comm.Bcast(buffer, root)

    def abort(self, message: str) -> NoReturn:
        print(message, file=sys.stderr, flush=True)
        self._comm.Abort(1)
        raise SystemExit(1)  # not reached: Abort ends the process


def _communicator(comm: Any) -> Communicator:
    """``comm`` itself if it is a Communicator, else an MPICommunicator over it."""
    return comm if hasattr(comm, "start_allreduce") else MPICommunicator(comm)


# ----- helpers -----
def shard(length: int, rank: int, size: int) -> slice:
    """The contiguous part of ``range(length)`` that ``rank`` of ``size`` ranks takes:
    the first ``length % size`` ranks take one item more (as ``numpy.array_split``).

    >>> [shard(10, r, 3) for r in range(3)]
    [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
    """
    if not 0 <= rank < size:
        raise ValueError(f"shard: rank {rank} is not in range({size})")
    base, extra = divmod(length, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def mpiexec_path() -> str | None:
    """The ``mpiexec`` that goes with this interpreter, or None.

    The mpich wheel installs it beside ``python`` (the environment's ``bin``, or
    ``Scripts``), which is on PATH only when the environment is activated; so look there
    first, then on PATH.
    """
    for directory in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        for name in ("mpiexec", "mpiexec.exe"):
            if (directory / name).is_file():
                return str(directory / name)
    return shutil.which("mpiexec")


def _parameter_list(parameters: Iterable[Tensor] | Module) -> list[Tensor]:
    """A Module's ``parameters()``, or the iterable's items, as a list."""
    if isinstance(parameters, Module):
        return list(parameters.parameters())
    return list(parameters)


def broadcast_parameters(parameters: Iterable[Tensor] | Module, comm: Any = None,
                         root: int = 0) -> None:
    """Give every rank ``root``'s values of ``parameters`` (Tensors, or a Module's
    parameters); an in-place write under ``no_grad``, so each parameter's version
    counter moves. Collective; blocks."""
    communicator = _communicator(comm)
    for p in _parameter_list(parameters):
        values = np.ascontiguousarray(p.data).copy()
        communicator.broadcast(values, root)
        with pargrad.no_grad():
            p[...] = values


# ----- DataParallel -----
@dataclass(frozen=True)
class BucketTiming:
    """One bucket in the last step (``time.perf_counter()`` seconds)."""

    index: int
    parameters: tuple[int, ...]  # indices into the parameters, in the bucket's order
    nbytes: int
    started: float  # when its request started
    finished: float  # when a test or wait first saw it complete (an upper bound)


@dataclass(frozen=True)
class SyncStatistics:
    """When the last step's collectives ran, against the caller's ``synchronize()``."""

    buckets: tuple[BucketTiming, ...]
    synchronize_called: float  # the backward had returned by then
    synchronized: float  # the averaged gradients were in .grad


@dataclass
class _Bucket:
    """Parameters whose gradients travel in one collective, in one flat buffer.
    ``missing``, ``request``, ``started`` and ``finished`` are guarded by
    ``DataParallel._lock``; ``buffer`` is written under it, read after ``request``."""

    index: int
    parameters: tuple[int, ...]
    offsets: tuple[int, ...]  # of each parameter in ``buffer``
    buffer: np.ndarray
    gathered: np.ndarray | None  # deterministic mode: every rank's buffer, by rank
    missing: int = 0
    request: Request | None = None
    started: float = 0.0
    finished: float = 0.0


class _GradReady:
    """DataParallel's post-accumulate-grad hook of one parameter."""

    __slots__ = ("index", "owner")
    # No other hook may take this gradient too (pargrad/hooks.py): an optimizer's update
    # during backward would use it before it is averaged.
    takes_final_grad = "DataParallel averages it across ranks after the backward"

    def __init__(self, owner: DataParallel, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, leaf: Tensor) -> None:
        self.owner._ready(self.index, leaf)


class DataParallel:
    """Average the gradients of ``parameters`` (leaf Tensors that require grad, or a
    ``pargrad.nn.Module``, whose ``parameters()`` it takes) across the ranks of ``comm``
    (default: ``MPI.COMM_WORLD``; any ``Communicator`` works), overlapping the
    all-reduce with the backward. Collective: every rank makes one, with the same
    parameters in the same order; it broadcasts rank 0's values to all (as PyTorch's DDP
    does).

    - Each parameter gets a post-accumulate-grad hook: when its gradient is final, the
      hook copies it into its bucket; a bucket whose parameters are all in starts a
      non-blocking all-reduce at once, from the thread that completed it
      (``overlap=False``: in ``synchronize()``). Buckets hold about ``bucket_bytes``
      (a larger parameter has its own), one dtype each, filled in the reverse of the
      parameters' order at first and, after the first step, in the order the gradients
      became ready on rank 0.
    - ``synchronize()`` (called by ``backward``) waits and writes the averages (sums if
      ``average=False``) into ``.grad``. A parameter that got no gradient on this rank
      adds zeros; one that got none on any rank keeps its ``.grad``. Nothing is needed
      to declare unused parameters (PyTorch's ``find_unused_parameters``): their bucket
      simply starts in ``synchronize()`` rather than during the backward.
    - ``deterministic=True``: bitwise equal gradients on every rank, equal to those of
      ``overlap=False`` and any bucket size (the buckets are all-gathered and summed in
      rank order, at ``size`` times the buffer memory). Pair it with
      ``ThreadedEngine(deterministic=True)`` for a bitwise reproducible local backward.
    - ``timeout``: seconds ``synchronize()`` waits for the other ranks before it aborts
      the job (``Communicator.abort``); None waits forever.
    - It does not combine with an optimizer's updates during backward
      (``Optimizer.step_in_backward``), which would use each rank's own gradient before
      the average: making a DataParallel over a parameter such an optimizer updates
      raises RuntimeError (and so does ``step_in_backward()`` over a parameter a
      DataParallel averages). Call the optimizer's ``step()`` after ``backward``.

    Thread-safety: the hooks may run on any threads at once. ``synchronize`` and
    ``backward`` are called by one thread per rank, between backward calls.

    Example (every rank, under ``mpiexec``; docs/distributed.md has a whole one)::

        dp = DataParallel(params)       # every rank now holds rank 0's values
        mine = shard(len(x), dp.rank, dp.size)
        dp.backward(loss_fn(params, x[mine], y[mine]))   # .grad: the mean over ranks
    """

    def __init__(self, parameters: Iterable[Tensor] | Module, comm: Any = None, *,
                 bucket_bytes: int = 1 << 20, average: bool = True, overlap: bool = True,
                 deterministic: bool = False, timeout: float | None = None) -> None:
        self.parameters = _parameter_list(parameters)
        for i, p in enumerate(self.parameters):
            if not isinstance(p, Tensor) or not p.requires_grad or not p.is_leaf:
                raise TypeError(f"DataParallel: parameters[{i}] is not a leaf Tensor that "
                                "requires grad")
        self.comm = _communicator(comm)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.bucket_bytes, self.average, self.overlap = bucket_bytes, average, overlap
        self.deterministic, self.timeout = deterministic, timeout
        # Guards the buckets' state (see _Bucket), _next, _filled, _ready_order and the
        # collectives started and tested from hooks. Takes nothing of pargrad's.
        self._lock = threading.Lock()
        self._next = 0  # the bucket that starts next: they start in index order
        self._filled = [False] * len(self.parameters)  # got a gradient in this step
        self._ready_order: list[int] = []  # parameter indices, as their hooks ran
        self._rebuilt = False  # the buckets follow rank 0's readiness order
        self._statistics: SyncStatistics | None = None
        self._make_buckets(list(reversed(range(len(self.parameters)))))
        self._handles: list[RemovableHandle] = []
        try:  # raises if an optimizer updates a parameter during backward (then: none)
            for i, p in enumerate(self.parameters):
                self._handles.append(p.register_post_accumulate_grad_hook(_GradReady(self, i)))
            # The collectives come last: a refusal above leaves every value as it was.
            self._check_same_parameters()
            broadcast_parameters(self.parameters, self.comm)
        except BaseException:
            self.remove()
            raise

    # ----- the step -----
    def backward(self, tensors: Tensor | Sequence[Tensor], grad_tensors: Any = None, *,
                 retain_graph: bool | None = None, engine: Engine | None = None) -> None:
        """``pargrad.backward`` on this rank's loss, then ``synchronize()``: afterwards
        every rank's ``.grad`` holds the average over ranks. Collective; blocks.

        Raises ``DistributedError`` on every rank if the backward failed on any rank
        (on the failing rank its error is the ``__cause__``); then no rank's ``.grad``
        has changed.
        """
        before = [p.grad for p in self.parameters]
        error: Exception | None = None
        try:
            pargrad.backward(tensors, grad_tensors, retain_graph=retain_graph, engine=engine)
        except Exception as exc:  # every rank must still reach the collectives below
            error = exc
        try:
            self.synchronize(error)
        except DistributedError:
            for p, grad in zip(self.parameters, before):
                p.grad = grad
            raise

    def synchronize(self, error: BaseException | None = None) -> None:
        """Finish this step's collectives and write the averaged gradients into
        ``.grad``. Collective: every rank calls it once after each backward, also one
        whose backward raised (pass that ``error``). Blocks until every rank is here
        (or ``timeout`` passed: then it aborts the job).

        Raises ``DistributedError`` on every rank if any rank passed an error; then no
        ``.grad`` is written.
        """
        called = time.perf_counter()
        with self._lock:  # a hook that never ran: its parameter adds zeros
            for bucket in self._buckets[self._next:]:
                for i, offset in zip(bucket.parameters, bucket.offsets):
                    if not self._filled[i]:
                        bucket.buffer[offset:offset + self.parameters[i].size] = 0
                bucket.missing = 0
            self._start_ready()
            status = np.zeros(self.size + len(self.parameters), np.int64)
            status[self.rank] = error is not None
            status[self.size:] = self._filled
            order = list(self._ready_order)
        try:
            self._wait(status)
            failed = np.flatnonzero(status[:self.size]).tolist()
            if failed:
                raise DistributedError(
                    f"the backward failed on rank(s) {failed} of {self.size}; every rank "
                    f"raises this and no .grad was written") from error
            self._write(status[self.size:] > 0)
            self._statistics = SyncStatistics(
                tuple(BucketTiming(b.index, b.parameters, b.buffer.nbytes, b.started,
                                   b.finished) for b in self._buckets),
                called, time.perf_counter())
            if not self._rebuilt:
                self._rebuild(order)
        finally:
            with self._lock:
                self._next, self._filled, self._ready_order = 0, [False] * len(self._filled), []
                for bucket in self._buckets:
                    bucket.missing, bucket.request = len(bucket.parameters), None

    def statistics(self) -> SyncStatistics | None:
        """When the last successful step's buckets started and finished (None before)."""
        return self._statistics

    def remove(self) -> None:
        """Unregister the hooks; later backward calls are not averaged."""
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ----- inside -----
    def _check_same_parameters(self) -> None:
        """Raise on every rank unless every rank has the same shapes and dtypes."""
        layout = repr([(p.shape, str(p.dtype)) for p in self.parameters]).encode()
        mine = np.frombuffer(hashlib.sha256(layout).digest(), np.uint8).astype(np.int64)
        theirs = mine.copy()
        self.comm.broadcast(theirs, 0)
        differ = np.array([int(not np.array_equal(mine, theirs))], np.int64)
        self.comm.start_allreduce(differ).wait()
        if differ[0]:
            raise ValueError(f"DataParallel: {differ[0]} rank(s) have parameters of other "
                             "shapes, dtypes or order than rank 0; build the same model on "
                             "every rank")

    def _make_buckets(self, order: list[int]) -> None:
        """Cut ``order`` (parameter indices, expected readiness order) into buckets."""
        open_: dict[np.dtype, tuple[list[int], int]] = {}  # dtype: (indices, bytes)
        groups: list[list[int]] = []
        for i in order:
            dtype = self.parameters[i].dtype
            group, nbytes = open_.get(dtype, ([], 0))
            group.append(i)
            open_[dtype] = group, nbytes + self.parameters[i].data.nbytes
            if open_[dtype][1] >= self.bucket_bytes:
                groups.append(open_.pop(dtype)[0])
        groups += [group for group, _ in open_.values()]
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for index, group in enumerate(groups):
            sizes = [self.parameters[i].size for i in group]
            offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]]))
            buffer = np.zeros(sum(sizes), self.parameters[group[0]].dtype)
            gathered = (np.empty((self.size, buffer.size), buffer.dtype)
                        if self.deterministic else None)
            bucket = _Bucket(index, tuple(group), offsets, buffer, gathered, len(group))
            self._buckets.append(bucket)
            self._where.update({i: (bucket, o) for i, o in zip(group, offsets)})

    def _rebuild(self, order: list[int]) -> None:
        """Once, after the first step: buckets in the order rank 0's gradients became
        ready (its parameters without a gradient last). Collective."""
        seen = set(order)
        full = np.array(order + [i for i in reversed(range(len(self.parameters)))
                                 if i not in seen], np.int64)
        self.comm.broadcast(full, 0)
        with self._lock:
            self._make_buckets(full.tolist())
            self._rebuilt = True

    def _ready(self, index: int, leaf: Tensor) -> None:
        """Parameter ``index``'s gradient is final (its hook, ``_GradReady``, on any
        thread): copy it into its bucket, and start the buckets that are complete."""
        grad = leaf.grad
        assert grad is not None
        with self._lock:
            bucket, offset = self._where[index]
            if self._filled[index] and bucket.request is not None:
                raise RuntimeError(
                    "DataParallel: a parameter's gradient became final twice before "
                    "synchronize(); call synchronize() (or DataParallel.backward) "
                    "after every backward")
            bucket.buffer[offset:offset + leaf.size] = grad.data.reshape(-1)
            if not self._filled[index]:
                self._filled[index] = True
                self._ready_order.append(index)
                bucket.missing -= 1
            if self.overlap:
                self._start_ready()
                self._test_started()

    def _start_ready(self) -> None:
        """Start the complete buckets that are next in index order. Holds ``_lock``."""
        while self._next < len(self._buckets) and self._buckets[self._next].missing == 0:
            bucket = self._buckets[self._next]
            bucket.started = time.perf_counter()
            if bucket.gathered is None:
                bucket.request = self.comm.start_allreduce(bucket.buffer)
            else:
                bucket.request = self.comm.start_allgather(bucket.buffer, bucket.gathered)
            bucket.finished = 0.0
            self._next += 1

    def _test_started(self) -> None:
        """Let the collectives in flight progress (MPI progresses them only inside its
        calls) and note when they finished. Holds ``_lock``."""
        for bucket in self._buckets[:self._next]:
            if not bucket.finished and bucket.request is not None and bucket.request.test():
                bucket.finished = time.perf_counter()

    def _wait(self, status: np.ndarray) -> None:
        """Sum ``status`` across ranks and wait for it and every bucket, or abort after
        ``timeout``."""
        requests: list[tuple[_Bucket | None, Request]] = [
            (b, b.request) for b in self._buckets if b.request is not None]
        requests.append((None, self.comm.start_allreduce(status)))
        deadline = None if self.timeout is None else time.perf_counter() + self.timeout
        for bucket, request in requests:
            if bucket is not None and bucket.finished:
                continue
            if deadline is None:
                request.wait()
            else:
                while not request.test():
                    if time.perf_counter() > deadline:
                        self.comm.abort(
                            f"pargrad.distributed: rank {self.rank} waited {self.timeout} s "
                            "in synchronize() for the other ranks (one died, hangs, or "
                            "skipped synchronize()); aborting the job")
                    time.sleep(1e-4)
            if bucket is not None:
                bucket.finished = time.perf_counter()

    def _write(self, used: np.ndarray) -> None:
        """Write each bucket's sum (or mean) into the ``.grad`` of its used parameters."""
        for bucket in self._buckets:
            if bucket.gathered is None:
                total = bucket.buffer
            else:  # rank order, whatever MPI's algorithm: bitwise the same everywhere
                total = bucket.gathered[0].copy()
                for r in range(1, self.size):
                    total += bucket.gathered[r]
            if self.average:
                total = total / np.asarray(self.size, total.dtype)
            for i, offset in zip(bucket.parameters, bucket.offsets):
                if used[i]:
                    p = self.parameters[i]
                    p.grad = pargrad.tensor(total[offset:offset + p.size].reshape(p.shape),
                                            dtype=p.dtype, device=p.device)
