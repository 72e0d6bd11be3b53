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
(docs/design.md keeps the table); thread-local state (``loop.state``) is per thread.

The loop itself (one ``thread_main`` for workers, callers, helpers and ``result()``
waiters; ``run_nodes`` for the nodes a thread runs) is ``engine/loop.py``; the queues
and threads are ``engine/pool.py``'s ``Pool``. This module is the engine: ``execute``,
``execute_async`` and ``shutdown``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from itertools import repeat
from operator import attrgetter, is_
from types import TracebackType

from pargrad import devices
from pargrad.anomaly import set_detect_anomaly
from pargrad.devices import CPU, Device, available_cores, gil_enabled
from pargrad.devices import device as as_device
from pargrad.engine import blas
from pargrad.engine.base import BackwardRequest, Engine, _engine_stack
from pargrad.engine.graph_task import GraphTask, InlineRun, NodeTask, Ready
from pargrad.engine.loop import (
    TaskScope,
    current_task,
    drive,
    enqueue,
    has_branches,
    home_device,
    start_helper,
    state,
    thread_main,
    together,
    waits_for_itself,
    worker_main,
)
from pargrad.engine.pool import Pool, check_count, default_workers
from pargrad.engine.ready_queue import ReadyQueue
from pargrad.engine.sequential import MAX_REENTRANT_DEPTH, run_graph
from pargrad.engine.trace import Counters, Statistics, Trace, recording
from pargrad.futures import BackwardFuture
from pargrad.grad_mode import set_grad_enabled
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
from pargrad.interrupts import HELD, NODE, current_gate, deferred_interrupts, gate_installed
from pargrad.parallel import Helpers

__all__ = ["DEFAULT_HANDOFF_BRANCH", "DEFAULT_HANDOFF_THRESHOLD", "MAX_REENTRANT_DEPTH",
           "ThreadedEngine", "default_workers"]


DEFAULT_HANDOFF_THRESHOLD = 1 << 18
"""Array elements (inputs plus outputs of a node) above which a ready node is offered to
other workers instead of staying on the thread that made it ready. Measured here
(docs/performance.md, the wide-elementwise sweep): plain threads on 2 cores lose at
3*10^4-element arrays (0.44-0.57x one thread) and gain at 3*10^5 (1.07-1.39x), and
fan-in's 65,536-element nodes gained nothing on two threads (1.21 against 1.25)."""

DEFAULT_HANDOFF_BRANCH = 32
"""Without the GIL: nodes that a cheap ready node leads to, each reached through it alone,
for it to be handed to another thread at a fork (its branch is then worth a hand-off).
Measured on 3.13t here: a hand-off costs about as much as a few small nodes, and branches
of 300 small nodes ran at 1.25x the reference on two threads (docs/performance.md)."""

ENGINE_HINT = "; set PARGRAD_ENGINE=sequential to rerun on the reference engine"

# Guards _engines: every ThreadedEngine alive (weakly), for the fork handlers
# (pargrad/fork.py), which reset their pools in a child process.
_engines_lock = threading.Lock()
_engines: weakref.WeakSet[ThreadedEngine] = weakref.WeakSet()


_device_of, _cost_of = attrgetter("device"), attrgetter("cost")


def _resolving() -> list[Pool[NodeTask]]:
    """The pools whose futures this thread is resolving (running their done-callbacks),
    innermost last."""
    return state.resolving


def _report(exc: BaseException) -> None:
    """Report an exception that must not unwind this engine thread, as an uncaught
    exception of a thread is (``threading.excepthook``; it ignores ``SystemExit``)."""
    threading.excepthook(threading.ExceptHookArgs(
        (type(exc), exc, exc.__traceback__, threading.current_thread())))


def _resolve(future: BackwardFuture[dict[Edge, Grad]], task: GraphTask) -> None:
    """Resolve ``future`` with the result of ``task`` (succeeded) once its callbacks ran."""
    try:
        task.callbacks.run()
    except Exception as exc:
        future.set_exception(exc)
    else:
        future.set_result(task.captured())


@contextlib.contextmanager
def _outside(task: GraphTask) -> Iterator[None]:
    """Resolve ``task``'s future as outside its nodes: its done-callbacks run with grad
    mode on and anomaly mode off (a fresh thread's defaults), the engine of ``task`` no
    longer current (the one of an enclosing ``use_engine``, or the default), and a
    backward they start is not nested in ``task``."""
    running, engines = state.running, _engine_stack()
    popped = bool(running) and running[-1] is task  # in run_nodes, inside its TaskScope
    if popped:
        running.pop()
        engine = engines.pop()
    try:
        with set_grad_enabled(True), set_detect_anomaly(False):  # a fresh thread's modes
            yield
    finally:
        if popped:
            engines.append(engine)
            running.append(task)


class _AsyncWork:
    """What a BackwardFuture of a ThreadedEngine controls (``futures.Work``): its
    GraphTask, and the ReadyQueues where threads wait for it in ``result()``."""

    def __init__(self, pool: Pool[NodeTask]) -> None:
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
        return task is not None and waits_for_itself(task)

    def resolving(self) -> bool:
        task = self.task  # None once _settle resolved the future (or gave up on it)
        return task is not None and task.done.is_set()

    def wait(self, timeout: float | None) -> None:
        """Run ready work of this thread's device until the task is over, or until
        ``timeout``: checked between nodes, and once it has passed, the nodes this
        thread kept for itself go back on the ReadyQueue (together, for one thread:
        within the memory budget), so it returns at most one node late (the one it was
        running, with whatever that node waits for). The task's KeyboardInterrupt
        semantics are a waiting caller's (module doc). Nested in
        ``MAX_REENTRANT_DEPTH`` backward calls or waits on this thread, it blocks
        instead while a helper thread with a fresh stack runs ready work, as ``execute``
        does."""
        task = self.task
        if task is None:
            return
        pool = self.pool
        queue = pool.queue(at := home_device(pool))
        deadline = None if timeout is None else time.monotonic() + timeout
        depth = state.depth
        if depth >= MAX_REENTRANT_DEPTH:
            start_helper(pool, task, [], at, queue, "reentrant")
            task.done.wait(timeout)
            return
        with self._lock:
            self._helping[queue] = self._helping.get(queue, 0) + 1
        state.depth = depth + 1
        try:
            with gate_installed():
                thread_main(queue, at, task, reraise=True, until=deadline)
        except BaseException as exc:  # Ctrl-C in result(): the backward is cancelled
            if not isinstance(exc, Exception):
                task.cancel()
            raise
        finally:
            state.depth = depth
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
            elements than this stays on the thread that made it ready (unless
            ``handoff_branch`` hands it off).
        handoff_branch: where a node makes several nodes ready, a cheap one that leads
            to at least this many nodes reached through it alone goes to the ReadyQueue
            for an idle thread, the newest staying on this thread (0: never). Default
            None: by interpreter, at each backward call: 0 with the GIL on (small nodes
            cannot run at the same time), ``DEFAULT_HANDOFF_BRANCH`` on a free-threaded
            Python with the GIL off.
        limit_blas: while a backward runs, give numpy's BLAS ``cores // (workers + 1)``
            threads (at least 1), so that engine threads running matmuls at once do not
            oversubscribe the cores (``engine/blas.py``, through threadpoolctl). Off by
            default: it pays off for graphs with parallel matmul branches, but a BLAS that
            just ran on all cores keeps its threads spinning for a while, and an MLP's
            backward ran 1.7x slower with it (docs/performance.md).
        intra_op: let a large elementwise call (an op's forward or rule on arrays of
            ``parallel.thresholds()[0]`` elements or more, made while this engine is
            current) offer its chunks to this engine's idle workers of the calling
            thread's device (pargrad/parallel.py): a chain of large elementwise nodes
            then uses every core. Results are bitwise the same either way.
        memory_budget: bytes of gradients a backward may hand to other threads at once
            (None, the default: no limit). Every branch handed off holds its gradients
            while it runs, so a wide graph's peak memory grows with the branches in
            flight; past the budget, a ready node stays on the thread that made it ready
            and runs in the reference's order, which frees each buffer soonest. ``0``
            hands nothing off: the reference's order and peak memory (nodes of other
            devices still go to their threads).
        trace: record every node it runs in ``engine.trace``, a ``Trace`` (thread, device,
            start and end, inline or handed off), and every intra-op chunk its idle
            threads run for another thread's call (``Trace.helping()``), that exports
            Chrome trace JSON (``engine.trace.save_chrome_trace(path)``);
            ``pargrad.profile()`` records the nodes of every engine for the length of
            a block instead.

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
        handoff_branch: int | None = None,
        limit_blas: bool = False,
        intra_op: bool = True,
        memory_budget: int | None = None,
        trace: bool = False,
    ) -> None:
        # The workers count the chunks they help with in this engine's statistics; a weak
        # reference, since the pool must not keep its engine alive.
        self._pool: Pool[NodeTask] = Pool(workers, functools.partial(worker_main,
                                                                     weakref.ref(self)))
        self.trace = Trace() if trace else None
        self._counters = Counters()
        self.deterministic = bool(deterministic)
        self.handoff_threshold = check_count(handoff_threshold, "handoff_threshold",
                                              minimum=0)  # 0: hand off every node
        self.handoff_branch = (None if handoff_branch is None
                               else check_count(handoff_branch, "handoff_branch", minimum=0))
        self.limit_blas = bool(limit_blas)
        self.intra_op = bool(intra_op)
        self.memory_budget = (None if memory_budget is None
                              else check_count(memory_budget, "memory_budget", minimum=0))
        weakref.finalize(self, self._pool.shutdown, False)
        with _engines_lock:
            _engines.add(self)

    def __repr__(self) -> str:
        return (f"ThreadedEngine(workers={self._pool.workers(CPU)}, "
                f"deterministic={self.deterministic})")

    def workers(self, device: str | Device = "cpu") -> int:
        """How many worker threads ``device`` gets."""
        return self._pool.workers(as_device(device))

    def intra_op_helpers(self) -> Helpers | None:
        """The ReadyQueue of this thread's device, whose idle threads take offered
        chunks (its workers start if they had not); None with ``intra_op=False``, on one
        core, while a BLAS node runs (BLAS's own threads use the cores then), or after
        ``shutdown``."""
        if not self.intra_op or available_cores() < 2 or blas.busy():
            return None
        return self._pool.open_queue(home_device(self._pool))

    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far (workers start when their device first
        gets work)."""
        return self._pool.threads()

    def statistics(self) -> Statistics:
        """What this engine did so far: nodes run per thread, inline and handed off,
        ReadyQueue waits, backward calls ended and failed, and the intra-op chunks its
        idle threads ran for another thread's call (``chunks_helped_per_thread``,
        ``helping_seconds``). Thread-safe; exact for the backward calls (and cut
        calls) that have returned.

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
        home = home_device(pool)
        parent = current_task()
        depth = state.depth
        outermost = parent is None and state.pool is None
        counted = None
        if depth < MAX_REENTRANT_DEPTH and recording(self.trace) is None and not (
                outermost and self.limit_blas):
            roots = {node for node, _ in request.roots if node is not None}
            counted = counting(roots, request.targets)
            if self._stays_inline(counted[0].counts, home, roots):
                return self._execute_inline(request, counted, parent=parent, depth=depth)
        queue = pool.queue(home)
        caller = threading.current_thread()

        def on_done(task: GraphTask) -> None:
            pool.task_done()
            # The caller may be blocked in queue.get; if it finished the task itself,
            # it is not, and waking the idle workers would only cost GIL switches.
            if threading.current_thread() is not caller:
                queue.wake_all()

        # A Ctrl-C from here until the loop is deferred to that loop's first safe
        # point (interrupts.Gate), so the roots _begin counts are always finished.
        with gate_installed():
            task, ready = self._begin(request, parent=parent, nested=parent is not None,
                                      on_done=on_done, counted=counted)
            self._drive_call(task, ready, parent, home, queue)
            # counted held: a Ctrl-C kept in the block may raise as it is left
            self._counters.task_ended(failed=task.error is not None)
        error = task.error
        if error is not None:
            raise _with_hint(error)
        task.callbacks.run()
        return task.captured()

    def _drive_call(self, task: GraphTask, ready: list[Ready], parent: GraphTask | InlineRun | None,
                    home: Device, queue: ReadyQueue[NodeTask]) -> None:
        """The calling thread's part of ``execute``: run ``task`` until it is over; an
        interrupt (or any BaseException) cancels it and is raised again at once."""
        pool = self._pool
        depth = state.depth
        outermost = parent is None and state.pool is None
        limited = False
        try:
            if outermost and self.limit_blas:
                blas.limit(max(1, available_cores() // (pool.workers(CPU) + 1)))
                limited = True
            if depth >= MAX_REENTRANT_DEPTH:
                start_helper(pool, task, ready, home, queue, "reentrant")
                gate = current_gate()
                gate.mode = NODE  # a blocking wait that holds nothing: Ctrl-C raises here
                try:
                    task.done.wait()
                finally:
                    gate.mode = HELD
            else:
                state.depth = depth + 1
                try:
                    drive(task, ready, home, queue, reraise=True)
                finally:
                    state.depth = depth
        except BaseException as exc:
            task.fail(exc)  # cancel what is left; the first error stays the first
            self._counters.task_ended(failed=True)
            raise
        finally:
            if limited:
                blas.restore()

    def branch_now(self) -> int:
        """``handoff_branch`` as it applies to a backward starting now (0: off)."""
        if self.handoff_branch is not None:
            return self.handoff_branch
        return 0 if gil_enabled() else DEFAULT_HANDOFF_BRANCH

    def _stays_inline(self, counts: dict[Node, list[int]], home: Device,
                      roots: AbstractSet[Node]) -> bool:
        """Whether a backward is better run on the calling thread alone: all its nodes
        are on device ``home`` and either none is worth handing to another thread (below
        the hand-off threshold), or BLAS work dominates while BLAS already uses every
        core (the gate admits one BLAS node at a time): another thread's nodes would
        then only compete with BLAS's own threads for the cores (measured on wide-matmul:
        plain threads at 0.6-0.8x the reference, docs/performance.md). With a memory
        budget of 0 nothing may be handed off either."""
        threshold = self.handoff_threshold
        branch = self.branch_now()
        if (branch and len(counts) >= 2 * branch and self.memory_budget != 0
                and has_branches(counts, roots, branch)):
            return False  # two branches worth a thread each (``schedule`` hands them off)
        # Most backward calls of small nodes are decided here, by loops in C (~35 ns a
        # node each; a Python loop cost ~0.15 µs): every node at home (known without a
        # look while no device but cpu exists), none above the threshold.
        if not (home is CPU and devices.cpu_only) and not all(
                map(is_, map(_device_of, counts), repeat(home))):
            return False
        if max(map(_cost_of, counts), default=0) < threshold:
            return True
        blas_cost = other_cost = 0
        for node in counts:
            cost = node.cost
            if cost >= threshold and not isinstance(node, AccumulateGrad):  # sinks never run
                if node.calls_blas:
                    blas_cost += cost
                else:
                    other_cost += cost
        if not (blas_cost or other_cost) or self.memory_budget == 0:  # nothing to hand off
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
            tally = self._counters.mine()
            pool.task_started(nested=parent is not None)  # raises after shutdown
            failed = True
            try:
                kept = Kept(request.targets, request.on_kept)
                run = InlineRun(parent)
                with TaskScope(run, self, request.create_graph, None, gate):
                    state.depth = depth + 1
                    try:
                        gate.mode = NODE
                        run_graph(request.roots, request.grads, counted[0].counts, counted[1],
                                  kept, retain_graph=request.retain_graph, name_errors=True,
                                  tally=tally)
                    except BackwardError as exc:
                        raise _with_hint(exc) from exc.__cause__
                    finally:
                        gate.mode = HELD
                        state.depth = depth
                failed = False
            finally:
                self._counters.task_ended(failed, tally)
                pool.task_done()
        run.callbacks.run()
        return kept.grads

    def execute_async(self, request: BackwardRequest) -> BackwardFuture[dict[Edge, Grad]]:
        """Start the backward and return its future at once: the workers alone run it
        (the calling thread runs no node unless it waits in ``result()``, where it
        helps). ``limit_blas`` does not apply. Errors of the arguments raise here; those
        of the backward go to the future."""
        pool = self._pool
        home = home_device(pool)
        queue = pool.queue(home)
        work = _AsyncWork(pool)
        future: BackwardFuture[dict[Edge, Grad]] = BackwardFuture(work)

        def on_done(task: GraphTask) -> None:
            queue.wake_all()  # a thread helping in result() or cancel() may wait on it
            work.wake_helpers()
            self._counters.task_ended(failed=task.error is not None)
            _settle(future, task, work)

        # Not a reentrant backward even when a node starts it: that node does not wait.
        # Ctrl-C is deferred until every counted root has reached a thread; if it came,
        # the backward is cancelled (it commits nothing) and the interrupt raised here.
        try:
            with deferred_interrupts():
                task, ready = self._begin(request, parent=None,
                                          nested=current_task() is not None,
                                          on_done=on_done, work=work)
                if task.done.is_set():  # nothing to run (every root a sink), or start failed
                    return future
                if task.serial:  # every node on one thread, in the reference's order
                    start_helper(pool, task, ready, home, queue, "async")
                elif self.memory_budget is not None:
                    # The roots go to one thread together, which hands on what they make
                    # ready within the budget: one each, they would be hand-offs the
                    # budget never admitted (with 0, several would run at once).
                    together(self, task, [(-node.sequence_nr, node, gathered)
                                          for node, gathered in ready])
                else:
                    for node, gathered in ready:
                        enqueue(pool.queue(node.device), NodeTask(task, node, gathered))
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
        task: GraphTask | None = None
        try:
            task = GraphTask(request, deterministic=self.deterministic,
                             memory_budget=self.memory_budget, branch=self.branch_now(),
                             depth=0 if parent is None else parent.depth + 1,
                             engine=self, on_done=on_done, parent=parent, counted=counted)
            if work is not None:
                work.task = task
            with set_grad_enabled(request.create_graph):  # the roots' hooks may record
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

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; later backward calls on this engine raise RuntimeError.

        With ``wait`` (the default), first let the backward calls in flight finish (their
        futures resolved, done-callbacks run) and then join the workers and helper
        threads. Raises RuntimeError from inside a backward, and with ``wait`` from a
        done-callback of this engine's futures (it would wait for itself; use
        ``wait=False`` there).
        """
        if current_task() is not None:
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


def _settle(future: BackwardFuture[dict[Edge, Grad]], task: GraphTask,
            work: _AsyncWork) -> None:
    """Resolve the future of an asynchronous backward that is over (result, error with
    the engine hint, or cancelled), outside its nodes (``_outside``), then let the pool
    count it done: last, so ``shutdown(wait=True)`` returns after every future resolved
    and its done-callbacks ran."""
    pool = work.pool
    resolving = _resolving()
    resolving.append(pool)  # shutdown(wait=True) from a callback would wait for itself
    try:
        with _outside(task):
            error = task.error
            if task.was_cancelled:
                future._set_cancelled()
            elif error is not None:
                future.set_exception(_with_hint(error))
            else:
                _resolve(future, task)
    except BaseException as exc:  # a done-callback's SystemExit: all callbacks ran
        if state.pool is not pool:
            raise  # a caller's thread (helping, or starting): it gets it
        _report(exc)  # an engine thread survives it
    finally:
        resolving.pop()
        work.task = None  # the future no longer holds the graph alive
        pool.task_done()


def _with_hint(error: BaseException) -> BaseException:
    """Name the engine in the error of a node whose code raised (``__cause__``), and how
    to rerun on the reference; not in errors that say what the caller did wrong
    (a released graph, a changed saved tensor, a gradient of the wrong shape)."""
    if (isinstance(error, BackwardError) and error.__cause__ is not None
            and ENGINE_HINT not in error.detail):
        error.detail += ENGINE_HINT
        error.args = (f"{error.node_name}: {error.detail}",)
    return error
