"""Seeing what the threaded engine did: a trace of every node it ran, of the moment each
leaf's gradient was final, and of every intra-op chunk an idle thread ran for another
thread's call (exported as Chrome trace JSON, for Perfetto or chrome://tracing), and its
statistics.

- ``ThreadedEngine(trace=True)`` keeps a ``Trace`` of every backward it runs
  (``engine.trace``); ``with pargrad.profile() as trace:`` records the nodes that any
  ThreadedEngine runs while the block is open, on any thread.
- ``engine.statistics()`` returns a ``Statistics``: nodes run per thread, inline and
  handed off, queue waits, backward calls ended and failed, and the intra-op chunks
  threads ran for another thread's call (pargrad/parallel.py) and the time they took.
  Always on: counting costs one integer increment per node, and two per chunk helped
  (nothing per node for helping).

Guarantees: recording is thread-safe without a GIL: each thread appends to lists of its
own (registered once under a lock) and readers merge them. ``Trace.events()`` and
``statistics()`` are exact for every backward call that has returned; while one runs
they may miss its latest nodes (all of them for a call run inline on the calling thread,
which adds its count when it ends; a Ctrl-C landing in that one addition loses it). A
ThreadedEngine that traces nothing pays one check per ``_process`` call (a batch of
nodes), not per node.

Assumptions: threads are told apart by name in ``Statistics`` (give threads that call
backward distinct names to see them apart) and by identity in a trace.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

Record = tuple[str, int, str, float, float, bool, int]
"""What a thread appends per node: ``(node name, sequence_nr, device, start, end,
handed off, task number)``; the thread is the list's owner."""
ReadyRecord = tuple[int, tuple[int, ...], float, int]
"""What a thread appends when a leaf's gradient is final: ``(sequence_nr of its
AccumulateGrad, the leaf's shape, time, task number)``."""
HelpRecord = tuple[float, float]
"""What a thread appends per chunk it ran for another thread's call: ``(start, end)``."""


class Log:
    """One thread's records in one Trace; only that thread appends to them."""

    __slots__ = ("helping", "nodes", "ready")

    def __init__(self) -> None:
        self.nodes: list[Record] = []
        self.ready: list[ReadyRecord] = []
        self.helping: list[HelpRecord] = []


@dataclass(frozen=True)
class NodeEvent:
    """One node run by a ThreadedEngine."""

    node: str  # the node's name, e.g. ``MultiplyBackward``
    sequence_nr: int
    thread: str  # the thread that ran it: ``pargrad-cpu-0``, or the caller's name
    device: str
    start: float  # ``time.perf_counter()`` seconds
    end: float
    handed_off: bool  # taken from a ReadyQueue; False: run by the thread that made it ready
    task: int  # which backward call (numbered per process, from 1)


@dataclass(frozen=True)
class LeafReady:
    """The moment a leaf's gradient became final in a ThreadedEngine's backward (all the
    edges into its AccumulateGrad delivered): its post-accumulate-grad hooks run now."""

    sequence_nr: int  # of the leaf's AccumulateGrad
    shape: tuple[int, ...]  # the leaf's
    thread: str  # the thread whose delivery completed it
    time: float  # ``time.perf_counter()`` seconds
    task: int


@dataclass(frozen=True)
class HelpEvent:
    """One chunk of another thread's large elementwise call (intra-op parallelism,
    pargrad/parallel.py; a node's rule, or a forward op while a ThreadedEngine is
    current) that an idle thread of a ThreadedEngine took from its ReadyQueue and ran.
    The calling thread's own chunks are part of its node's event (or of its forward)."""

    thread: str  # the helping thread: ``pargrad-cpu-0``, or a waiting caller's name
    start: float  # ``time.perf_counter()`` seconds
    end: float


class Trace:
    """The nodes run by ThreadedEngines, recorded from any number of threads.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> with pargrad.profile() as trace:
    ...     (x * x).sum().backward(engine=pargrad.ThreadedEngine(workers=1))
    >>> [event.node for event in trace.events()]
    ['SumBackward', 'MultiplyBackward']
    """

    def __init__(self) -> None:
        # Guards _threads (each Log in it is appended to only by its thread).
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, Log]] = []
        self._local = threading.local()  # ``log``: this thread's Log, once made

    def log(self) -> Log:
        """This thread's records (made and registered on first use)."""
        mine: Log | None = getattr(self._local, "log", None)
        if mine is None:
            mine = self._local.log = Log()
            with self._lock:
                self._threads.append((threading.current_thread(), mine))
        return mine

    def events(self) -> list[NodeEvent]:
        """Every node recorded so far, by start time."""
        with self._lock:
            threads = [(thread, list(log.nodes)) for thread, log in self._threads]
        events = [NodeEvent(name, seq, thread.name, device, start, end, handed, task)
                  for thread, records in threads
                  for name, seq, device, start, end, handed, task in records]
        return sorted(events, key=lambda e: e.start)

    def leaves_ready(self) -> list[LeafReady]:
        """Every moment a leaf's gradient became final, recorded so far, by time."""
        with self._lock:
            threads = [(thread, list(log.ready)) for thread, log in self._threads]
        ready = [LeafReady(seq, shape, thread.name, at, task)
                 for thread, records in threads for seq, shape, at, task in records]
        return sorted(ready, key=lambda r: r.time)

    def helping(self) -> list[HelpEvent]:
        """Every chunk run for another thread's call recorded so far, by start time."""
        with self._lock:
            threads = [(thread, list(log.helping)) for thread, log in self._threads]
        chunks = [HelpEvent(thread.name, start, end)
                  for thread, records in threads for start, end in records]
        return sorted(chunks, key=lambda h: h.start)

    def clear(self) -> None:
        """Forget what was recorded (threads recording now may still add to it)."""
        with self._lock:
            for _, log in self._threads:
                log.nodes.clear()
                log.ready.clear()
                log.helping.clear()

    def chrome_trace(self) -> dict[str, Any]:
        """The events in Chrome's trace event format: one track per thread, one slice
        per node (its category says inline or handed off), one slice ``help`` (category
        ``intra-op``) per chunk run for another thread's call, an instant event
        ``ready`` per leaf whose gradient became final, times in microseconds from the
        first slice."""
        events = self.events()
        helping = self.helping()
        starts = [s[0].start for s in (events, helping) if s]
        origin = min(starts) if starts else 0.0
        pid = os.getpid()
        tids: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        for e in events:
            tid = tids.setdefault(e.thread, len(tids) + 1)
            out.append({"name": e.node, "cat": "handed off" if e.handed_off else "inline",
                        "ph": "X", "pid": pid, "tid": tid,
                        "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
                        "args": {"sequence_nr": e.sequence_nr, "device": e.device,
                                 "task": e.task}})
        for h in helping:
            tid = tids.setdefault(h.thread, len(tids) + 1)
            out.append({"name": "help", "cat": "intra-op", "ph": "X", "pid": pid, "tid": tid,
                        "ts": (h.start - origin) * 1e6, "dur": (h.end - h.start) * 1e6})
        for r in self.leaves_ready():
            tid = tids.setdefault(r.thread, len(tids) + 1)
            out.append({"name": "ready", "cat": "leaf", "ph": "i", "s": "t", "pid": pid,
                        "tid": tid, "ts": (r.time - origin) * 1e6,
                        "args": {"sequence_nr": r.sequence_nr, "shape": list(r.shape),
                                 "task": r.task}})
        for thread, tid in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": thread}})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write ``chrome_trace()`` as JSON to ``path`` (open it in ui.perfetto.dev or
        chrome://tracing)."""
        with open(path, "w") as file:
            json.dump(self.chrome_trace(), file)


# Guards _profiles: replaced whole (never mutated), so readers need no lock.
_profiles_lock = threading.Lock()
_profiles: tuple[Trace, ...] = ()


@contextmanager
def profile() -> Iterator[Trace]:
    """Record every node that any ThreadedEngine runs while the block is open (backward
    calls that start inside it; nested and concurrent blocks each get them all).

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> with pargrad.profile() as trace:
    ...     (x * 3).sum().backward()
    >>> trace.save_chrome_trace("/dev/null")  # a file for ui.perfetto.dev
    """
    global _profiles
    trace = Trace()
    with _profiles_lock:
        _profiles = (*_profiles, trace)
    try:
        yield trace
    finally:
        with _profiles_lock:
            _profiles = tuple(p for p in _profiles if p is not trace)


def recording(own: Trace | None) -> list[Log] | None:
    """This thread's Logs in an engine's own trace and the open profiles; None when
    nothing records (the common case, one check)."""
    profiles = _profiles
    if own is None and not profiles:
        return None
    traces = profiles if own is None else (own, *profiles)
    return [t.log() for t in traces]


def now() -> float:
    return time.perf_counter()


# Guards _task_counter (``next`` on a shared iterator is atomic only under the GIL).
_task_lock = threading.Lock()
_task_counter = itertools.count(1)


def next_task_number() -> int:
    """A number for a new backward call, to tell calls apart in a trace."""
    with _task_lock:
        return next(_task_counter)


# ----- statistics -----
@dataclass(frozen=True)
class Statistics:
    """What a ThreadedEngine did since it was made (``engine.statistics()``)."""

    nodes_per_thread: Mapping[str, int]  # nodes run, by thread name
    inline: int  # run by the thread that made them ready (or by the caller)
    handed_off: int  # taken from a ReadyQueue
    queue_waits: int  # times a thread found its ReadyQueue empty and blocked
    graph_tasks_completed: int  # backward calls that returned or raised
    errors: int  # backward calls that raised
    # Intra-op chunks (pargrad/parallel.py) that threads took from a ReadyQueue while
    # idle and ran for another thread's call, by thread name (threads that ran some).
    chunks_helped_per_thread: Mapping[str, int]
    helping_seconds: float  # the time spent running those chunks, all threads together

    @property
    def nodes(self) -> int:
        return sum(self.nodes_per_thread.values())

    @property
    def chunks_helped(self) -> int:
        return sum(self.chunks_helped_per_thread.values())


class ThreadCounts:
    """One thread's counts for one engine; only that thread writes them."""

    __slots__ = ("chunks_helped", "errors", "handed_off", "helping_seconds", "nodes", "tasks",
                 "thread")

    def __init__(self, thread: str) -> None:
        self.thread = thread
        self.nodes = 0
        self.handed_off = 0
        self.tasks = 0  # backward calls that ended on this thread (returned or raised)
        self.errors = 0  # those that raised
        self.chunks_helped = 0  # intra-op chunks run for another thread's call
        self.helping_seconds = 0.0  # the time spent running them


class Counters:
    """An engine's counts, per thread (merged on read): nodes and backward calls."""

    def __init__(self) -> None:
        # Guards _threads (each ThreadCounts in it is written only by its thread).
        self._lock = threading.Lock()
        self._threads: list[ThreadCounts] = []
        self._local = threading.local()  # ``counts``: this thread's ThreadCounts

    def mine(self) -> ThreadCounts:
        """This thread's counts (made and registered on first use)."""
        counts: ThreadCounts | None = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = ThreadCounts(threading.current_thread().name)
            with self._lock:
                self._threads.append(counts)
        return counts

    def task_ended(self, failed: bool, counts: ThreadCounts | None = None) -> None:
        """Count a backward call that ended on this thread (``counts``: its
        ``mine()``, if the caller has it at hand)."""
        if counts is None:
            counts = self.mine()
        counts.tasks += 1
        counts.errors += failed

    def statistics(self, queue_waits: int) -> Statistics:
        per_thread: dict[str, int] = {}
        helped: dict[str, int] = {}
        tasks = errors = 0
        with self._lock:
            handed = 0
            helping = 0.0
            for counts in self._threads:
                tasks += counts.tasks
                errors += counts.errors
                per_thread[counts.thread] = per_thread.get(counts.thread, 0) + counts.nodes
                handed += counts.handed_off
                if counts.chunks_helped:
                    helped[counts.thread] = helped.get(counts.thread, 0) + counts.chunks_helped
                helping += counts.helping_seconds
        nodes = sum(per_thread.values())
        return Statistics(MappingProxyType(per_thread), nodes - handed, handed, queue_waits,
                          tasks, errors, MappingProxyType(helped), helping)
