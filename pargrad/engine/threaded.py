"""ThreadedEngine: the backward pass run by a pool of worker threads, one ReadyQueue and
one set of workers per device.

How one backward runs (``execute``): the calling thread makes a ``GraphTask`` (the
reference engine's dependency counters, one locked gradient buffer per node), delivers
the root gradients, and then works on the ready nodes itself while it waits. A thread
that finishes a node delivers its gradients along the edges; of the nodes that became
ready, it keeps the cheap ones on a private heap and runs them itself, and puts the
expensive ones and those of other devices on the ReadyQueue of their device, where idle
workers take them (if it kept nothing, it keeps the newest expensive one). A hand-off
costs tens of microseconds, so only nodes with enough array work (``handoff_threshold``
elements) are worth one.

Guarantees:
- Every node runs on a thread of its device: a worker ``pargrad-<device>-<i>``, a
  helper ``pargrad-<device>-reentrant`` (below), or, for ``cpu``, the thread that
  called backward.
- The caller gets the first error, with the node's name and the original exception
  chained; the task's other nodes are skipped, the workers survive, and the caller
  returns only once no thread runs a node of the task any more. No ``.grad`` changes:
  leaf gradients are returned, and ``autograd.backward`` commits them only on success.
- A ``KeyboardInterrupt`` (or other BaseException) in the calling thread cancels the
  task and is re-raised at once; workers skip what is left of it. On the main thread
  (the only one Python delivers signals to) an ``interrupts.Gate`` is SIGINT's handler
  during the call: a Ctrl-C raises at once inside a node's code, and is deferred during
  the loop's bookkeeping and queue waits (polled every ``interrupts.POLL`` s) to the
  next safe point, so every node counted in a task is finished exactly once
  (docs/design.md §10).
- A waiting caller takes work from its device's shared queue, so it may run nodes of
  other callers' backward calls; an interrupt there fails that backward with a
  BackwardError and reaches only this caller.
- Ctrl-C in a future's ``result()`` cancels its backward, whichever line it lands on.
- Reentrant backward (a node that calls backward) does not deadlock: the waiting
  thread keeps running ready work of its device, deepest backward first; past
  ``MAX_REENTRANT_DEPTH`` nested calls on one thread, a helper thread with a fresh stack
  runs the inner backward while the thread blocks.
- Deterministic mode sums every buffer in the canonical order (docs/design.md §4):
  gradients are bitwise those of ``SequentialEngine``.
- Workers are daemon threads, started when their device first gets work; an engine that
  is shut down, or garbage collected, stops them once no backward is in flight. The
  interpreter never waits for them.
- ``execute_async`` returns a BackwardFuture at once; the workers alone finish the
  task, a thread waiting in its ``result()`` or ``cancel()`` helps, and a thread inside
  a node of the task that waits for it gets RuntimeError, not a deadlock (docs/async.md).
  A done-callback's exception never ends a worker; ``shutdown(wait=True)`` returns only
  after every future resolved and its callbacks ran.
- Deterministic mode with ``create_graph`` runs every node on the calling thread, so that
  the recorded graph, and a second backward through it, are the reference's too.

Assumptions: no GIL. Shared state is guarded by the locks named at each field
(docs/design.md keeps the table); thread-local state (``_local``) is per thread.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType

from pargrad import anomaly, callbacks
from pargrad.devices import CPU, Device, available_cores, device
from pargrad.engine import blas
from pargrad.engine.base import BackwardRequest, Engine, _engine_stack
from pargrad.engine.graph_task import GraphTask, InlineRun, NodeTask, Ready
from pargrad.engine.ready_queue import Flag, ReadyQueue
from pargrad.engine.sequential import run_graph
from pargrad.engine.trace import Counters, Log, Statistics, Trace, now, recording
from pargrad.futures import BackwardFuture
from pargrad.grad_mode import _set_enabled, is_grad_enabled
from pargrad.graph import (
    AccumulateGrad,
    BackwardError,
    Dependencies,
    Edge,
    Grad,
    Kept,
    Node,
    counting,
)
from pargrad.interrupts import (
    HELD,
    NODE,
    POLL,
    Gate,
    current_gate,
    deferred_interrupts,
    gate_installed,
)

MAX_REENTRANT_DEPTH = 32
"""Nested backward calls one thread runs on its own stack before handing off to a helper."""

DEFAULT_HANDOFF_THRESHOLD = 1 << 18
"""Array elements (inputs plus outputs of a node) above which a ready node is offered to
other workers instead of staying on the thread that made it ready. Measured here
(docs/performance.md, the wide-elementwise sweep): plain threads on 2 cores lose at
3*10^4-element arrays (0.44-0.57x one thread) and gain at 3*10^5 (1.07-1.39x), and
fan-in's 65,536-element nodes gained nothing on two threads (1.21 against 1.25)."""

ENGINE_HINT = "; set PARGRAD_ENGINE=sequential to rerun on the reference engine"

class _ThreadState(threading.local):
    """What the engine keeps per thread (so no lock), each field with its default:

    - ``pool``, ``device``: the pool and device a worker or helper thread works for
      (None and cpu in any other thread);
    - ``depth``: backward calls and waits for a future nested on this thread's stack;
    - ``running``: the tasks whose nodes this thread is inside, innermost last;
    - ``resolving``: the pools whose futures this thread is resolving (running their
      done-callbacks), innermost last.
    """

    pool: _Pool | None = None
    device: Device = CPU
    depth = 0

    def __init__(self) -> None:
        self.running: list[GraphTask | InlineRun] = []
        self.resolving: list[_Pool] = []


_local = _ThreadState()


# Guards _engines: every ThreadedEngine alive (weakly), for the fork handlers
# (pargrad/fork.py), which reset their pools in a child process.
_engines_lock = threading.Lock()
_engines: weakref.WeakSet[ThreadedEngine] = weakref.WeakSet()


def default_workers() -> int:
    """Workers per device by default: one less than the cores, since the thread that
    calls backward works too (at least one, so that nobody waiting still finishes)."""
    return max(1, available_cores() - 1)


class _Pool:
    """The ReadyQueues and worker threads of one engine, per device.

    Holds no reference to its engine, so an engine nobody uses can be collected (and
    its finalizer closes the pool).
    """

    def __init__(self, workers: int | Mapping[str | Device, int] | None) -> None:
        self._counts = _worker_counts(workers)
        # Guards _queues, _threads, _helpers, _active and _closed.
        self._lock = threading.Lock()
        # Notified when _active drops to zero (shutdown waits for it).
        self.all_tasks_done = threading.Condition(self._lock)
        self._queues: dict[Device, ReadyQueue[NodeTask]] = {}
        self._threads: list[threading.Thread] = []  # the workers
        self._helpers: list[threading.Thread] = []  # helper threads that may be alive
        self._active = 0  # graph tasks started and not yet done
        self._closed = False

    def workers(self, on: Device) -> int:
        """How many worker threads ``on`` gets."""
        return self._counts.get(on, self._counts[None])

    def queue(self, on: Device) -> ReadyQueue[NodeTask]:
        """The ReadyQueue of ``on``; its workers start on first use. Thread-safe."""
        with self._lock:
            found = self._queues.get(on)
            if found is None:
                found = self._queues[on] = ReadyQueue()
                for i in range(self.workers(on)):
                    thread = threading.Thread(target=_work, args=(self, on, found),
                                              name=f"pargrad-{on}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            return found

    def start_helper(self, task: GraphTask, ready: list[Ready], on: Device,
                     queue: ReadyQueue[NodeTask], name: str) -> None:
        """Start a helper thread that drives ``task`` (``_help``); ``shutdown(wait=True)``
        joins it. The task is counted in ``_active`` until it is over, so shutdown cannot
        miss a helper started for it."""
        thread = threading.Thread(target=_help, args=(task, ready, on, queue, self),
                                  name=name, daemon=True)
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
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.all_tasks_done.notify_all()
                if self._closed:
                    self._close_queues()

    def _close_queues(self) -> None:
        """Let the workers exit. Holds ``_lock``; only once no backward is in flight, so
        no work can be put on a queue after its workers left."""
        for q in self._queues.values():
            q.close()

    def threads(self) -> list[threading.Thread]:
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
            counts[device(name)] = _check_count(count, f"workers[{name!r}]")
        return counts
    return {None: _check_count(workers, "workers")}


def _check_count(count: object, what: str, minimum: int = 1) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"ThreadedEngine: {what} must be {kind}, got {count!r}")
    return count


def _work(pool: _Pool, on: Device, queue: ReadyQueue[NodeTask]) -> None:
    """A worker's loop: run the device's ready work until the queue is closed and empty.

    Never raises: everything a node raises is recorded in its GraphTask.
    """
    _local.pool, _local.device = pool, on
    while True:
        item = queue.get()
        if item is None:
            return
        _process_item(item, on, reraise=False)
        del item  # hold no graph alive while idle


Local = list[tuple[int, Node, list[Grad | None]]]
"""The work a thread keeps for itself: a heap of ``(-sequence_nr, node, gradients)``, all
of one GraphTask (whose sequence numbers are distinct). Newest first, as the reference
runs them, so a backward that stays on one thread sums in the reference's order."""


def _process_item(item: NodeTask, on: Device, *, reraise: bool,
                  owner: GraphTask | None = None, until: float | None = None) -> None:
    assert item.inputs is not None
    local: Local = [(-item.node.sequence_nr, item.node, item.inputs)]
    item.inputs = None
    _process(item.task, local, on, reraise=reraise, owner=owner, handed=item.node,
             until=until)


def _process(task: GraphTask, local: Local, on: Device, *, reraise: bool,
             owner: GraphTask | None = None, handed: Node | None = None,
             until: float | None = None) -> None:
    """Run the nodes on ``local`` and the work they keep, on this thread (see the module
    doc): each node's backward, then the delivery of its gradients along its edges.

    With ``reraise``, an exception that is not an ``Exception`` (KeyboardInterrupt) is
    recorded in the task and raised again here; otherwise nothing escapes. ``owner`` is
    the task of the backward this thread is waiting for: an interrupt while running
    another caller's node fails that task with a BackwardError saying so, and reaches
    only this thread's caller as the interrupt itself. ``handed`` is the node this
    thread took from a ReadyQueue (the others on ``local`` it runs inline). ``until``
    (a ``time.monotonic()`` deadline, from ``result(timeout)``): once it has passed,
    the nodes still on ``local`` go back on the ReadyQueue instead of running here.
    """
    engine = task.engine
    assert isinstance(engine, ThreadedEngine)
    counts = engine._counters.mine()
    records = recording(engine.trace)  # None unless tracing: checked once per node
    previous_mode = is_grad_enabled()
    previous_anomaly = anomaly.current_mode()
    engines = _engine_stack()
    running = _running()
    running.append(task)
    _set_enabled(task.create_graph)
    anomaly.set_mode(task.anomaly_mode)
    engines.append(engine)
    deliver, retain = task.deliver, task.retain_graph
    deterministic, sinks, wanted = task.deterministic, task.sinks, task.wanted
    gate = current_gate()  # Ctrl-C raises inside a node; elsewhere here, at the loop's top
    gate_mode, gate.mode = gate.mode, HELD
    try:
        while local:
            if gate.pending is not None:  # a Ctrl-C came during bookkeeping: now it lands
                _interrupted(task, local, gate, owner)
            if until is not None and time.monotonic() >= until:
                _requeue(engine, task, local)
                return
            _, node, inputs = heapq.heappop(local)
            ready: list[Ready] = []
            interrupt: BaseException | None = None
            if not task.cancelled:
                counts.nodes += 1
                if node is handed:
                    counts.handed_off += 1
                start = 0.0
                try:
                    gate.mode = NODE  # first in the try: a Ctrl-C from here on is caught
                    if node._hooks is not None or (wanted and node in wanted):
                        inputs = task.prepare(node, inputs)
                    gated = node.calls_blas
                    if gated:  # BLAS nodes: at most as many at once as the cores allow
                        blas.enter_gate()
                    if records is not None:
                        start = now()
                    try:
                        outputs = node.apply(inputs, retain_graph=retain)
                    finally:
                        if gated:
                            blas.leave_gate()
                    del inputs
                    seq = node.sequence_nr
                    for e, ((next_node, input_nr), grad) in enumerate(
                            zip(node.next_functions, outputs)):
                        if next_node is not None:
                            got = deliver(next_node, input_nr, grad,
                                          (1, -seq, e) if deterministic else None)
                            if got is None:
                                pass
                            elif next_node in sinks:
                                if not task.cancelled:  # no hook after a cancel
                                    task.sink(next_node, got)
                                    if records is not None:
                                        _record_ready(records, next_node, task)
                            else:
                                ready.append((next_node, got))
                    del outputs
                    gate.mode = HELD  # last in the try
                except BaseException as exc:
                    gate.mode = HELD  # first in the handler
                    _fail(task, exc, node, owner)
                    if reraise and not isinstance(exc, Exception):
                        interrupt = exc
                if records is not None:
                    record = (node.name(), node.sequence_nr, str(on), start, now(),
                              node is handed, task.number)
                    for log in records:
                        log.nodes.append(record)
            runnable = task.finish(ready)
            if interrupt is not None:
                for _ in range(len(local) + len(runnable)):  # all of this cancelled task
                    task.finish([])
                raise interrupt
            if len(runnable) == 1 and runnable[0][0].device is on:  # a chain
                heapq.heappush(local, (-runnable[0][0].sequence_nr, *runnable[0]))
            elif runnable:
                _schedule(engine, task, runnable, on, local)
    finally:
        gate.mode = gate_mode
        engines.pop()
        _set_enabled(previous_mode)
        anomaly.set_mode(previous_anomaly)
        running.pop()


def _fail(task: GraphTask, exc: BaseException, node: Node | None,
          owner: GraphTask | None) -> None:
    """Record what a node of ``task`` (or this thread's bookkeeping for it) raised. An
    interrupt of the backward this thread waits for (``owner``) cancels it: nothing is
    committed, and a future of it is cancelled (whichever line the Ctrl-C landed on). An
    interrupt while running another caller's node fails that backward with a
    BackwardError saying so."""
    if isinstance(exc, Exception) or owner is None:
        task.fail(exc, node)
    elif task is owner:
        task.cancel()
        task.fail(exc, node)
    else:
        name = node.name() if node is not None else "backward"
        other = BackwardError(name, f"interrupted by {exc!r} in "
                                    f"{threading.current_thread().name}")
        other.__cause__ = exc
        task.fail(other, node)


def _interrupted(task: GraphTask, local: Local, gate: Gate, owner: GraphTask | None) -> None:
    """Raise a Ctrl-C that the gate deferred, at the top of ``_process``'s loop, where the
    nodes counted and not finished are exactly those on ``local``: fail ``task`` as an
    interrupt in a node would, finish them (skipped), then raise."""
    try:
        gate.raise_pending()
    except BaseException as exc:
        _fail(task, exc, None, owner)
        for _ in range(len(local)):
            task.finish([])
        local.clear()
        raise


def _requeue(engine: ThreadedEngine, task: GraphTask, local: Local) -> None:
    """Put the nodes kept on ``local`` on their ReadyQueues (counted already, so the
    task's count is unchanged), for another thread to run."""
    assert not task.serial  # its nodes never reach a ReadyQueue, so never a waiter
    while local:
        _, node, inputs = heapq.heappop(local)
        engine._pool.queue(node.device).put(NodeTask(task, node, inputs), task.depth,
                                            node.sequence_nr)


def _resolving() -> list[_Pool]:
    """The pools whose futures this thread is resolving (running their done-callbacks),
    innermost last."""
    return _local.resolving


def _report(exc: BaseException) -> None:
    """Report an exception that must not unwind this engine thread, as an uncaught
    exception of a thread is (``threading.excepthook``; it ignores ``SystemExit``)."""
    threading.excepthook(threading.ExceptHookArgs(
        (type(exc), exc, exc.__traceback__, threading.current_thread())))


def _running() -> list[GraphTask | InlineRun]:
    """The tasks whose nodes this thread is inside, innermost last (a thread waiting in
    a node runs other nodes, of any task)."""
    return _local.running


def _current_task() -> GraphTask | InlineRun | None:
    """The task whose node this thread is running now, or None."""
    running = _running()
    return running[-1] if running else None


def _current_callbacks() -> callbacks.Callbacks | None:
    task = _current_task()
    return None if task is None else task.callbacks


callbacks.add_finder(_current_callbacks)  # pargrad.queue_callback finds our tasks


def _inside(task: GraphTask) -> bool:
    """Whether this thread is inside a node of ``task``, or of a reentrant backward
    that a node of ``task`` waits for: then waiting for ``task`` waits for itself."""
    for running in _running():
        outer: GraphTask | InlineRun | None = running
        while outer is not None:
            if outer is task:
                return True
            outer = outer.parent
    return False


def _resolve(future: BackwardFuture[dict[Edge, Grad]], task: GraphTask) -> None:
    """Resolve ``future`` with the result of ``task`` (succeeded) once its callbacks ran."""
    try:
        task.callbacks.run()
    except Exception as exc:
        future.set_exception(exc)
    else:
        future.set_result(task.captured())


def _record_ready(records: list[Log], node: Node, task: GraphTask) -> None:
    shape = node._output_meta[0][0]
    record = (node.sequence_nr, shape, now(), task.number)
    for log in records:
        log.ready.append(record)


def _schedule(engine: ThreadedEngine, task: GraphTask, runnable: list[Ready], on: Device,
              local: Local) -> None:
    """Keep on ``local`` the cheap ready nodes of device ``on``, and put the expensive ones
    on its ReadyQueue; if it keeps none and has nothing left to run, it keeps the newest
    expensive one rather than idle. Nodes of other devices go to the ReadyQueues of their
    devices.

    A cheap node often leads on into expensive work (the chain of adds that sums several
    branches), so it is the expensive nodes that are handed off, not the cheap ones. A
    node that runs BLAS is kept too while the BLAS gate lets only one such node run at a
    time (BLAS already uses every core): another thread would only wait at the gate."""
    if task.serial:  # every node on this thread, in the reference's order
        for node, inputs in runnable:
            heapq.heappush(local, (-node.sequence_nr, node, inputs))
        return
    runnable.sort(key=lambda r: r[0].sequence_nr, reverse=True)  # newest first
    pool = engine._pool
    expensive: list[Ready] = []
    kept_one = False
    blas_alone: bool | None = None  # the gate lets one BLAS node run at once (asked once)
    for node, inputs in runnable:
        if node.device is not on:
            pool.queue(node.device).put(NodeTask(task, node, inputs), task.depth,
                                        node.sequence_nr)
            continue
        if node.calls_blas and blas_alone is None:
            blas_alone = blas.gate_size() <= 1
        if node.cost < engine.handoff_threshold or (node.calls_blas and blas_alone):
            kept_one = True
            heapq.heappush(local, (-node.sequence_nr, node, inputs))
        else:
            expensive.append((node, inputs))
    if expensive and not kept_one and not local:
        node, inputs = expensive.pop(0)  # the newest: this thread would idle otherwise
        heapq.heappush(local, (-node.sequence_nr, node, inputs))
    if expensive:
        queue = pool.queue(on)
        for node, inputs in expensive:
            queue.put(NodeTask(task, node, inputs), task.depth, node.sequence_nr)


def _drive(task: GraphTask, ready: list[Ready], on: Device, queue: ReadyQueue[NodeTask],
           *, reraise: bool) -> None:
    """Run the task's first ready nodes, then ready work of device ``on`` until the task
    is done. The body of a backward call, on the caller's thread or a helper."""
    local: Local = []
    engine = task.engine
    assert isinstance(engine, ThreadedEngine)
    if ready:
        _schedule(engine, task, ready, on, local)
    del ready
    if local:
        _process(task, local, on, reraise=reraise, owner=task)
    gate = current_gate()
    stop = task.done if gate.previous is None else _Stop(task.done, gate)
    while True:
        item = _get(queue, stop, gate)
        if item is None:  # the task is done: queues close only when no task is in flight
            return
        _process_item(item, on, reraise=reraise, owner=task)
        del item


class _Stop:
    """The ``stop`` of a ReadyQueue wait on a thread with an installed Gate: set when the
    task is done, or when a Ctrl-C came."""

    __slots__ = ("_done", "_gate")

    def __init__(self, done: Flag, gate: Gate) -> None:
        self._done, self._gate = done, gate

    def is_set(self) -> bool:
        return self._done.is_set() or self._gate.pending is not None


def _get(queue: ReadyQueue[NodeTask], stop: Flag, gate: Gate,
         timeout: float | None = None) -> NodeTask | None:
    """``queue.get``; on a thread with an installed Gate, a Ctrl-C is deferred while it
    waits (polling every ``POLL`` s) and raised here once the item taken, if any, is back
    on its queue: no node is lost between the queue and the thread."""
    if gate.previous is None:
        return queue.get(stop=stop, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    item = None
    mode, gate.mode = gate.mode, HELD
    while item is None and not stop.is_set():
        left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
        if left <= 0:
            break
        item = queue.get(stop=stop, timeout=left)
    gate.mode = mode
    if gate.pending is not None:
        if item is not None:
            assert item.inputs is not None
            queue.put(item, item.task.depth, item.node.sequence_nr)
        gate.raise_pending()
    return item


def _help(task: GraphTask, ready: list[Ready], on: Device, queue: ReadyQueue[NodeTask],
          pool: _Pool) -> None:
    """A reentrant helper thread's whole life: drive ``task`` on a fresh stack."""
    _local.pool, _local.device = pool, on
    _drive(task, ready, on, queue, reraise=False)


def _home_device(pool: _Pool) -> Device:
    """The device whose queue this thread works on: its own in a pool thread, else cpu."""
    return _local.device if _local.pool is pool else CPU


@contextlib.contextmanager
def _outside(task: GraphTask) -> Iterator[None]:
    """Resolve ``task``'s future as outside its nodes: its done-callbacks run with grad
    mode on and anomaly mode off (a fresh thread's defaults), the engine of ``task`` no
    longer current (the one of an enclosing ``use_engine``, or the default), and a
    backward they start is not nested in ``task``."""
    running, engines = _running(), _engine_stack()
    popped = bool(running) and running[-1] is task  # in _process, which pushed both
    if popped:
        running.pop()
        engine = engines.pop()
    previous_mode, previous_anomaly = is_grad_enabled(), anomaly.current_mode()
    _set_enabled(True)
    anomaly.set_mode((anomaly._Mode.enabled, anomaly._Mode.check_nan))  # the defaults
    try:
        yield
    finally:
        _set_enabled(previous_mode)
        anomaly.set_mode(previous_anomaly)
        if popped:
            engines.append(engine)
            running.append(task)


class _AsyncWork:
    """What a BackwardFuture of a ThreadedEngine controls (``futures.Work``): its
    GraphTask, and the ReadyQueues where threads wait for it in ``result()``."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        # Set once before the task is published, and to None once the future resolved
        # (so the future does not keep the graph alive); readers read it once.
        self.task: GraphTask | None = None
        # Guards _helping: each queue with threads helping in result(), and how many.
        self._lock = threading.Lock()
        self._helping: dict[ReadyQueue[NodeTask], int] = {}

    def cancel(self) -> bool:
        task = self.task
        return task is not None and task.cancel()

    def inside(self) -> bool:
        task = self.task
        return task is not None and _inside(task)

    def wait(self, timeout: float | None) -> None:
        """Run ready work of this thread's device until the task is over, or until
        ``timeout``: checked between nodes, and once it has passed, the nodes this
        thread kept for itself go back on the ReadyQueue, so it returns at most one node
        late (the one it was running, with whatever that node waits for). The task's
        KeyboardInterrupt semantics are a waiting caller's (module doc). Nested in
        ``MAX_REENTRANT_DEPTH`` backward calls or waits on this thread, it blocks
        instead while a helper thread with a fresh stack runs ready work, as ``execute``
        does."""
        task = self.task
        if task is None:
            return
        pool = self.pool
        queue = pool.queue(on := _home_device(pool))
        deadline = None if timeout is None else time.monotonic() + timeout
        depth = _local.depth
        if depth >= MAX_REENTRANT_DEPTH:
            pool.start_helper(task, [], on, queue, f"pargrad-{on}-reentrant")
            task.done.wait(timeout)
            return
        with self._lock:
            self._helping[queue] = self._helping.get(queue, 0) + 1
        _local.depth = depth + 1
        try:
            with gate_installed() as gate:
                stop = task.done if gate.previous is None else _Stop(task.done, gate)
                while not task.done.is_set():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    item = _get(queue, stop, gate, left)
                    if item is not None:
                        _process_item(item, on, reraise=True, owner=task, until=deadline)
                        del item
        except BaseException as exc:  # Ctrl-C in result(): the backward is cancelled
            if not isinstance(exc, Exception):
                task.cancel()
            raise
        finally:
            _local.depth = depth
            with self._lock:
                self._helping[queue] -= 1
                if not self._helping[queue]:
                    del self._helping[queue]

    def wake_helpers(self) -> None:
        """Wake the threads helping in ``result()``: the task is over."""
        with self._lock:
            queues = list(self._helping)
        for queue in queues:
            queue.wake_all()


class ThreadedEngine(Engine):
    """The multi-threaded backward engine: pargrad's default.

    Args:
        workers: worker threads per device: an int for every device, or a mapping from
            device names to counts (devices not named get the default). Default:
            one less than the cores available (at least 1), since the thread that calls
            backward runs nodes of the ``cpu`` device too while it waits.
        deterministic: sum every gradient buffer in the canonical order, so results are
            bitwise those of ``SequentialEngine`` (it keeps each node's incoming
            gradients until the node runs). Otherwise buffers sum in arrival order and
            agree with the reference to rounding.
        handoff_threshold: a ready node whose gradients in and out have fewer array
            elements than this stays on the thread that made it ready.
        limit_blas: while a backward runs, give numpy's BLAS ``cores // (workers + 1)``
            threads (at least 1), so that engine threads running matmuls at once do not
            oversubscribe the cores (``engine/blas.py``, through threadpoolctl). Off by
            default: it pays off for graphs with parallel matmul branches, but a BLAS that
            just ran on all cores keeps its threads spinning for a while, and an MLP's
            backward ran 1.7x slower with it (docs/performance.md).
        trace: record every node it runs in ``engine.trace``, a ``Trace`` (thread, device,
            start and end, inline or handed off) that exports Chrome trace JSON
            (``engine.trace.save_chrome_trace(path)``); ``pargrad.profile()`` records
            the nodes of every engine for the length of a block instead.

    ``execute`` blocks the caller, who works meanwhile. Thread-safe: any number of
    threads may run backward calls on one engine at once, and nodes may call backward
    (reentrant). ``shutdown()`` stops the workers; ``with ThreadedEngine() as e:`` does
    it on exit.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> with pargrad.ThreadedEngine(workers=2, deterministic=True) as engine:
    ...     (x * x).sum().backward(engine=engine)
    >>> x.grad
    tensor([2., 4.], dtype=float64)
    """

    def __init__(
        self,
        workers: int | Mapping[str | Device, int] | None = None,
        *,
        deterministic: bool = False,
        handoff_threshold: int = DEFAULT_HANDOFF_THRESHOLD,
        limit_blas: bool = False,
        trace: bool = False,
    ) -> None:
        self._pool = _Pool(workers)
        self.trace = Trace() if trace else None
        self._counters = Counters()
        self.deterministic = bool(deterministic)
        self.handoff_threshold = _check_count(handoff_threshold, "handoff_threshold",
                                              minimum=0)  # 0: hand off every node
        self.limit_blas = bool(limit_blas)
        weakref.finalize(self, self._pool.shutdown, False)
        with _engines_lock:
            _engines.add(self)

    def __repr__(self) -> str:
        return (f"ThreadedEngine(workers={self._pool.workers(CPU)}, "
                f"deterministic={self.deterministic})")

    def workers(self, on: str | Device = "cpu") -> int:
        """How many worker threads the device ``on`` gets."""
        return self._pool.workers(device(on))

    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far (workers start when their device first
        gets work)."""
        return self._pool.threads()

    def statistics(self) -> Statistics:
        """What this engine did so far: nodes run per thread, inline and handed off,
        ReadyQueue waits, backward calls ended and failed. Thread-safe; exact for the
        backward calls that have returned.

        >>> import pargrad
        >>> engine = pargrad.ThreadedEngine(workers=1)
        >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> (x * x).sum().backward(engine=engine)
        >>> stats = engine.statistics()
        >>> stats.nodes, stats.graph_tasks_completed, stats.errors
        (2, 1, 0)
        """
        return self._counters.statistics(self._pool.queue_waits())

    def execute(self, request: BackwardRequest) -> dict[Edge, Grad]:
        pool = self._pool
        on = _home_device(pool)
        parent = _current_task()
        depth = _local.depth
        outermost = parent is None and _local.pool is None
        counted = None
        if depth < MAX_REENTRANT_DEPTH and recording(self.trace) is None and not (
                outermost and self.limit_blas):
            counted = counting([node for node, _ in request.roots if node is not None],
                               request.targets)
            if self._stays_inline(counted[0].counts, on):
                return self._execute_inline(request, counted, parent=parent, depth=depth)
        queue = pool.queue(on)
        caller = threading.current_thread()

        def on_done(task: GraphTask) -> None:
            pool.task_done()
            # The caller may be blocked in queue.get; if it finished the task itself,
            # it is not, and waking the idle workers would only cost GIL switches.
            if threading.current_thread() is not caller:
                queue.wake_all()

        # A Ctrl-C from here until _drive's loop is deferred to that loop's first safe
        # point (interrupts.Gate), so the roots _begin counts are always finished.
        with gate_installed():
            task, ready = self._begin(request, parent=parent, nested=parent is not None,
                                      on_done=on_done, counted=counted)
            self._drive_call(task, ready, parent, on, queue)
        error = task.error
        self._counters.task_ended(failed=error is not None)
        if error is not None:
            raise _with_hint(error)
        task.callbacks.run()
        return task.captured()

    def _drive_call(self, task: GraphTask, ready: list[Ready], parent: GraphTask | InlineRun | None,
                    on: Device, queue: ReadyQueue[NodeTask]) -> None:
        """The calling thread's part of ``execute``: run ``task`` until it is over; an
        interrupt (or any BaseException) cancels it and is raised again at once."""
        pool = self._pool
        depth = _local.depth
        outermost = parent is None and _local.pool is None
        limited = False
        try:
            if outermost and self.limit_blas:
                blas.limit(max(1, available_cores() // (pool.workers(CPU) + 1)))
                limited = True
            if depth >= MAX_REENTRANT_DEPTH:
                pool.start_helper(task, ready, on, queue, f"pargrad-{on}-reentrant")
                gate = current_gate()
                gate.mode = NODE  # a blocking wait that holds nothing: Ctrl-C raises here
                try:
                    task.done.wait()
                finally:
                    gate.mode = HELD
            else:
                _local.depth = depth + 1
                try:
                    _drive(task, ready, on, queue, reraise=True)
                finally:
                    _local.depth = depth
        except BaseException as exc:
            task.fail(exc)  # cancel what is left; the first error stays the first
            self._counters.task_ended(failed=True)
            raise
        finally:
            if limited:
                blas.restore()

    def _stays_inline(self, counts: Mapping[Node, object], on: Device) -> bool:
        """Whether a backward is better run on the calling thread alone: all its nodes
        are on device ``on`` and either none is worth handing to another thread (below
        the hand-off threshold), or BLAS work dominates while BLAS already uses every
        core (the gate admits one BLAS node at a time): another thread's nodes would
        then only compete with BLAS's own threads for the cores (measured on wide-matmul:
        plain threads at 0.6-0.8x the reference, docs/performance.md)."""
        threshold = self.handoff_threshold
        blas_cost = other_cost = 0
        for node in counts:
            if node.device is not on:
                return False
            cost = node.cost
            if cost >= threshold and not isinstance(node, AccumulateGrad):  # sinks never run
                if node.calls_blas:
                    blas_cost += cost
                else:
                    other_cost += cost
        if not (blas_cost or other_cost):
            return True
        return blas_cost >= other_cost and blas.gate_size() <= 1

    def _execute_inline(self, request: BackwardRequest,
                        counted: tuple[Dependencies, dict[Node, bool] | None], *,
                        parent: GraphTask | InlineRun | None, depth: int) -> dict[Edge, Grad]:
        """``execute`` of a backward that stays on the calling thread: the reference's
        algorithm (``sequential.run_graph``, so the reference's order and sums, bitwise),
        with this engine's contract around it: counted in the pool (shutdown waits for
        it), a node's error named and hinted, statistics, nested depth, and the running
        stack that reentrant and nested calls consult."""
        pool = self._pool
        # Ctrl-C (main thread): held during the bookkeeping around the run, so nothing is
        # left counted or pushed; at once inside it, where all state is this call's own
        # and nothing is committed (interrupts.Gate).
        with gate_installed() as gate:
            pool.task_started(nested=parent is not None)  # raises after shutdown
            failed = True
            try:
                kept = Kept(request.targets, request.on_kept)
                running, engines = _running(), _engine_stack()
                run = InlineRun(parent)
                running.append(run)
                engines.append(self)
                previous_mode = is_grad_enabled()
                _set_enabled(request.create_graph)
                _local.depth = depth + 1
                try:
                    gate.mode = NODE
                    run_graph(request.roots, request.grads, counted[0].counts, counted[1], kept,
                              retain_graph=request.retain_graph, name_errors=True,
                              tally=self._counters.mine())
                except BackwardError as exc:
                    raise _with_hint(exc) from exc.__cause__
                finally:
                    gate.mode = HELD
                    _local.depth = depth
                    _set_enabled(previous_mode)
                    engines.pop()
                    running.pop()
                failed = False
            finally:
                self._counters.task_ended(failed=failed)
                pool.task_done()
        run.callbacks.run()
        return kept.grads

    def execute_async(self, request: BackwardRequest) -> BackwardFuture[dict[Edge, Grad]]:
        """Start the backward and return its future at once: the workers alone run it
        (the calling thread runs no node unless it waits in ``result()``, where it
        helps). ``limit_blas`` does not apply. Errors of the arguments raise here; those
        of the backward go to the future."""
        pool = self._pool
        on = _home_device(pool)
        queue = pool.queue(on)
        work = _AsyncWork(pool)
        future: BackwardFuture[dict[Edge, Grad]] = BackwardFuture(work)
        counters = self._counters

        def on_done(task: GraphTask) -> None:
            queue.wake_all()  # a thread helping in result() or cancel() may wait on it
            work.wake_helpers()
            error = task.error
            counters.task_ended(failed=error is not None)
            resolving = _resolving()
            resolving.append(pool)  # shutdown(wait=True) from a callback would self-wait
            try:
                with _outside(task):
                    if task.was_cancelled:
                        future._set_cancelled()
                    elif error is not None:
                        future.set_exception(_with_hint(error))
                    else:
                        _resolve(future, task)
            except BaseException as exc:  # a done-callback's SystemExit: all callbacks ran
                if _local.pool is not pool:
                    raise  # a caller's thread (helping, or starting): it gets it
                _report(exc)  # an engine thread survives it
            finally:
                resolving.pop()
                work.task = None  # the future no longer holds the graph alive
                pool.task_done()  # last: shutdown(wait=True) returns after the future resolved

        # Not a reentrant backward even when a node starts it: that node does not wait.
        # Ctrl-C is deferred until every counted root has reached a thread; if it came,
        # the backward is cancelled (it commits nothing) and the interrupt raised here.
        try:
            with deferred_interrupts():
                task, ready = self._begin(request, parent=None,
                                          nested=_current_task() is not None,
                                          on_done=on_done, work=work)
                if task.done.is_set():  # nothing to run (every root a sink), or start failed
                    return future
                if task.serial:  # every node on one thread, in the reference's order
                    pool.start_helper(task, ready, on, queue, f"pargrad-{on}-async")
                else:
                    for node, gathered in ready:
                        pool.queue(node.device).put(NodeTask(task, node, gathered),
                                                    task.depth, node.sequence_nr)
        except BaseException as exc:
            if not isinstance(exc, Exception) and work.task is not None:
                work.task.cancel()
            raise
        return future

    def _begin(self, request: BackwardRequest, *, parent: GraphTask | InlineRun | None,
               nested: bool, on_done: Callable[[GraphTask], None],
               work: _AsyncWork | None = None,
               counted: tuple[Dependencies, dict[Node, bool] | None] | None = None,
               ) -> tuple[GraphTask, list[Ready]]:
        """Count a new backward call in the pool, make its GraphTask (``work.task``, if
        given, before any thread can see it) and deliver the root gradients; returns the
        task and its ready roots. Raises after shutdown. An ``Exception`` of delivering to
        the roots (a hook of a leaf that is a root) fails the task as a node's would: it
        is over (``on_done`` called) when this returns."""
        pool = self._pool
        pool.task_started(nested=nested)  # raises after shutdown
        previous_mode = is_grad_enabled()
        task: GraphTask | None = None
        try:
            task = GraphTask(request, deterministic=self.deterministic,
                             depth=0 if parent is None else parent.depth + 1,
                             engine=self, on_done=on_done, parent=parent, counted=counted)
            if work is not None:
                work.task = task
            _set_enabled(request.create_graph)
            try:
                return task, task.start()
            except Exception as exc:
                task.fail(exc)
                task.finish([], finished=0)  # nothing was counted: the task is over
                return task, []
        except BaseException:
            if task is None or not task.done.is_set():  # else on_done counted it already
                pool.task_done()  # nothing of the task was published
            raise
        finally:
            _set_enabled(previous_mode)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; later backward calls on this engine raise RuntimeError.

        With ``wait`` (the default), first let the backward calls in flight finish (their
        futures resolved, done-callbacks run) and then join the workers and helper
        threads. Raises RuntimeError from inside a backward, and with ``wait`` from a
        done-callback of this engine's futures (it would wait for itself; use
        ``wait=False`` there).
        """
        if _current_task() is not None:
            raise RuntimeError("ThreadedEngine.shutdown() called from inside a backward")
        if wait and self._pool in _resolving():
            raise RuntimeError(
                "ThreadedEngine.shutdown(wait=True) called from a done-callback of one of "
                "its futures: it would wait for that backward to end; call "
                "shutdown(wait=False) there, or shut down from outside the callback"
            )
        self._pool.shutdown(wait)

    def _after_fork_in_child(self) -> None:
        """Make this engine usable in a child process just forked (pargrad/fork.py):
        a fresh pool state, and the locks a parent thread may have held made anew."""
        self._pool.after_fork_in_child()
        self._counters._lock._at_fork_reinit()  # type: ignore[attr-defined]
        if self.trace is not None:
            self.trace._lock._at_fork_reinit()  # type: ignore[attr-defined]

    def __enter__(self) -> ThreadedEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def _with_hint(error: BaseException) -> BaseException:
    """Name the engine in the error of a node whose code raised (``__cause__``), and how
    to rerun on the reference; not in errors that say what the caller did wrong
    (a released graph, a changed saved tensor, a gradient of the wrong shape)."""
    if (isinstance(error, BackwardError) and error.__cause__ is not None
            and ENGINE_HINT not in error.detail):
        error.detail += ENGINE_HINT
        error.args = (f"{error.node_name}: {error.detail}",)
    return error
