"""The loop every thread of a ThreadedEngine runs: workers, a caller waiting for its
backward, a reentrant or asynchronous helper, and a thread waiting in a future's
``result()``.

The work is cut as in PyTorch's engine:
- ``thread_main``: the one loop. Take a ready node of this thread's device from its
  ReadyQueue and run it, until the queue closes (a worker) or the task this thread
  waits for is over (everyone else), or a deadline passed (``result(timeout)``).
- ``run_nodes``: run a node and the ready nodes it keeps on this thread (a private
  heap), inside the task's scope (``TaskScope``), then hand the rest on (``schedule``).
  Each node in its frame: its tensor hooks and the gradients kept of it, its backward,
  then the delivery of its gradients along its edges; an error is triaged apart, by
  ``fail``.

Guarantees (the module doc of ``engine/threaded.py`` has the whole contract):
- Every node counted in a task is finished exactly once (``GraphTask.finish``), also when
  it fails, when its task is cancelled, and under Ctrl-C: the Gate lets a Ctrl-C raise
  only inside a node's code and at the top of ``run_nodes``' loop, where what is
  counted and not finished is exactly the private heap (and the chain's next node,
  which goes back on it first).
- A node runs with the thread state of its task (``TaskScope``): grad mode
  ``create_graph``, the caller's anomaly mode, its engine current, the task on the
  running stack; a thread's own state is restored when it leaves.

Assumptions: no GIL. Thread-local state is ``state`` (``ThreadState``); everything
shared is in the GraphTask and the ReadyQueues, guarded there.
"""

from __future__ import annotations

import functools
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, cast

from pargrad import anomaly, callbacks
from pargrad.devices import CPU, Device
from pargrad.engine import blas
from pargrad.engine.base import Engine, _engine_stack
from pargrad.engine.graph_task import GraphTask, InlineRun, NodeTask, Ready
from pargrad.engine.ready_queue import Flag, ReadyQueue
from pargrad.engine.trace import Counters, Log, Trace, now, recording
from pargrad.grad_mode import _set_enabled, is_grad_enabled
from pargrad.graph import ONE_EDGE, AccumulateGrad, BackwardError, Grad, Node
from pargrad.interrupts import HELD, NODE, POLL, Gate, current_gate
from pargrad.parallel import Job

if TYPE_CHECKING:
    from pargrad.engine.pool import Pool


class Scheduler(Protocol):
    """What the loop reads of the engine whose task it runs (a ThreadedEngine)."""

    _pool: Pool[NodeTask]
    _counters: Counters
    trace: Trace | None
    handoff_threshold: int


class ThreadState(threading.local):
    """What the engine keeps per thread (so no lock), each field with its default:

    - ``pool``, ``device``: the pool and device a worker or helper thread works for
      (None and cpu in any other thread);
    - ``depth``: backward calls and waits for a future nested on this thread's stack;
    - ``running``: the tasks whose nodes this thread is inside, innermost last;
    - ``resolving``: the pools whose futures this thread is resolving (running their
      done-callbacks), innermost last.
    """

    pool: Pool[NodeTask] | None = None
    device: Device = CPU
    depth = 0

    def __init__(self) -> None:
        self.running: list[GraphTask | InlineRun] = []
        self.resolving: list[Pool[NodeTask]] = []


state = ThreadState()


Local = list[tuple[int, Node, list[Grad | None]]]
"""The work a thread keeps for itself: a heap of ``(-sequence_nr, node, gradients)``, all
of one GraphTask (whose sequence numbers are distinct). Newest first, as the reference
runs them, so a backward that stays on one thread sums in the reference's order."""


# ----- the thread state of a task -----

class TaskScope:
    """Entered while this thread runs nodes of ``task``: the task on the running stack,
    ``engine`` current, grad mode ``grad_mode``, anomaly mode ``anomaly_mode`` (None:
    as it is), and the Ctrl-C ``gate`` HELD between nodes; all as they were on exit.
    The one place that sets and restores them."""

    __slots__ = ("_anomaly", "_engine", "_gate", "_grad", "_saved_anomaly",
                 "_saved_gate", "_saved_grad", "_task")

    def __init__(self, task: GraphTask | InlineRun, engine: Engine, grad_mode: bool,
                 anomaly_mode: tuple[bool, bool] | None, gate: Gate) -> None:
        self._task, self._engine, self._gate = task, engine, gate
        self._grad, self._anomaly = grad_mode, anomaly_mode

    def __enter__(self) -> None:
        state.running.append(self._task)
        _engine_stack().append(self._engine)
        self._saved_grad = is_grad_enabled()
        _set_enabled(self._grad)
        if self._anomaly is not None:
            self._saved_anomaly = anomaly.current_mode()
            anomaly.set_mode(self._anomaly)
        gate = self._gate
        self._saved_gate, gate.mode = gate.mode, HELD

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._gate.mode = self._saved_gate
        _set_enabled(self._saved_grad)
        if self._anomaly is not None:
            anomaly.set_mode(self._saved_anomaly)
        _engine_stack().pop()
        state.running.pop()


def current_task() -> GraphTask | InlineRun | None:
    """The task whose node this thread is running now, or None."""
    running = state.running
    return running[-1] if running else None


def _current_callbacks() -> callbacks.Callbacks | None:
    task = current_task()
    return None if task is None else task.callbacks


callbacks.add_finder(_current_callbacks)  # pargrad.queue_callback finds our tasks


def waits_for_itself(task: GraphTask) -> bool:
    """Whether this thread is inside a node of ``task``, or of a reentrant backward
    that a node of ``task`` waits for: then waiting for ``task`` waits for itself."""
    for running in state.running:
        outer: GraphTask | InlineRun | None = running
        while outer is not None:
            if outer is task:
                return True
            outer = outer.parent
    return False


def home_device(pool: Pool[NodeTask]) -> Device:
    """The device whose queue this thread works on: its own in a pool thread, else cpu."""
    return state.device if state.pool is pool else CPU


# ----- the loop -----

def worker_main(engine: Callable[[], Scheduler | None], pool: Pool[NodeTask], at: Device,
                queue: ReadyQueue[NodeTask]) -> None:
    """A worker's life: run the device's ready work until the queue is closed and empty.
    ``engine`` is a weak reference to the engine of ``pool`` (which keeps none, so that
    the engine can be collected), whose statistics count the chunks it helps with.
    Never raises: everything a node raises is recorded in its GraphTask."""
    state.pool, state.device = pool, at
    thread_main(queue, at, engine=engine)


def helper_main(task: GraphTask, ready: list[Ready], at: Device,
                queue: ReadyQueue[NodeTask], pool: Pool[NodeTask]) -> None:
    """A reentrant or asynchronous helper thread's life: drive ``task`` on a fresh
    stack."""
    state.pool, state.device = pool, at
    drive(task, ready, at, queue, reraise=False)


def drive(task: GraphTask, ready: list[Ready], at: Device, queue: ReadyQueue[NodeTask],
          *, reraise: bool) -> None:
    """Run the task's first ready nodes, then ready work of device ``at`` until the task
    is done. The body of a backward call, on the caller's thread or a helper."""
    local: Local = []
    if ready:
        schedule(task, ready, at, local)
    del ready
    if local:
        run_nodes(task, local, at, reraise=reraise, owner=task)
    thread_main(queue, at, task, reraise=reraise)


def thread_main(queue: ReadyQueue[NodeTask], at: Device, owner: GraphTask | None = None,
                *, reraise: bool = False, until: float | None = None,
                engine: Callable[[], Scheduler | None] | None = None) -> None:
    """Take ready work of device ``at`` from ``queue`` and run it (``run_nodes``), or
    chunks of another thread's intra-op call (``_help``), until:

    - ``owner`` None (a worker, whose ``engine`` this is): the queue is closed and empty;
    - else (a caller, a helper, a ``result()`` waiter): ``owner``, the task this thread
      waits for, is done; or ``until`` (a ``time.monotonic()`` deadline) has passed.

    With ``reraise``, a KeyboardInterrupt in a node is raised again here (``run_nodes``);
    on a thread with an installed Gate, a Ctrl-C while waiting is too (``_get``).
    """
    gate = current_gate()
    stop: Flag | None = None
    if owner is not None:
        stop = owner.done if gate.previous is None else _Stop(owner.done, gate)
    while owner is None or not owner.done.is_set():
        left = None if until is None else until - time.monotonic()
        if left is not None and left <= 0:
            return
        item = _get(queue, stop, gate, left)
        if item is None:
            if owner is None:
                return  # closed: queues close only when no task is in flight
            continue
        if isinstance(item, Job):  # chunks of a large elementwise call (pargrad/parallel.py)
            if owner is None:  # a worker: helps until no chunk is left
                _help(item, None if engine is None else engine(), None)
            else:  # stops when its task is over: the holder runs what is left
                _help(item, cast(Scheduler, owner.engine), lambda: _should_stop(stop, until))
            del item
            continue
        assert isinstance(item, NodeTask)
        node = item.node
        assert item.grads is not None
        local: Local = [(-node.sequence_nr, node, item.grads)]
        item.grads = None  # the heap holds the gradients alone: run_nodes frees them
        if item.kept is not None:  # what a waiter had kept at its deadline (_requeue)
            local += item.kept
            item.kept = None
            heapq.heapify(local)
        try:
            run_nodes(item.task, local, at, reraise=reraise, owner=owner, handed=node,
                      until=until)
        finally:
            if item.charged:
                item.task.release(item.charged)
        del item, node  # hold no graph alive while idle


def _help(job: Job, engine: Scheduler | None, stop: Callable[[], bool] | None) -> None:
    """Run chunks of another thread's large elementwise call (``job``) until none is left,
    or ``stop()`` (the holder runs what is left). Each chunk counts in this thread's
    statistics of ``engine`` (the engine whose ReadyQueue offered it), and in its
    trace, if anything records (``HelpEvent``); all on this path only, so a node pays
    nothing for it."""
    if engine is None:  # a worker whose engine was collected: nothing to count in
        job.help(stop)
        return
    counts = engine._counters.mine()
    records = recording(engine.trace)

    def ran(start: float, end: float) -> None:
        counts.chunks_helped += 1
        counts.helping_seconds += end - start
        if records is not None:
            for log in records:
                log.helping.append((start, end))

    job.help(stop, ran)


def _should_stop(stop: Flag | None, until: float | None) -> bool:
    """Whether a thread waiting for a task should stop helping with another call's
    chunks: the task is done (or a Ctrl-C came), or its deadline passed."""
    return ((stop is not None and stop.is_set())
            or (until is not None and time.monotonic() >= until))


# One frame for the whole per-node path: a call per node is most of what a small node
# costs (the reference's loop, sequential.run_graph, is cut the same way).
def run_nodes(task: GraphTask, local: Local, at: Device, *, reraise: bool,  # noqa: C901, PLR0912, PLR0915
              owner: GraphTask | None = None, handed: Node | None = None,
              until: float | None = None) -> None:
    """Run the nodes on ``local`` and the ready nodes they keep, on this thread, handing
    the rest on (``schedule``).

    Each node: its tensor hooks and the gradients kept of it, its backward (inside the
    BLAS gate if it runs BLAS), then the delivery of its gradients along its edges (with
    the canonical order's keys in deterministic mode), keeping those of the sinks that
    became ready. A node that exactly one edge reaches is ready with that gradient at
    once (``GraphTask.single``); when it is the only node made ready and nothing newer
    waits on ``local``, it runs next without the heap or ``GraphTask.finish`` (a chain:
    the count of ready nodes does not change). Gradients are held only until their
    node's backward returned.

    With ``reraise``, an exception that is not an ``Exception`` (KeyboardInterrupt) is
    recorded in the task and raised again here; otherwise nothing escapes. ``owner`` is
    the task of the backward this thread is waiting for: an interrupt while running
    another caller's node fails that task with a BackwardError saying so, and reaches
    only this thread's caller as the interrupt itself. ``handed`` is the node this
    thread took from a ReadyQueue (the others on ``local`` it runs inline). ``until``
    (a ``time.monotonic()`` deadline, from ``result(timeout)``): once it has passed,
    the nodes still on ``local`` go back on the ReadyQueue, together (``_requeue``),
    instead of running here.
    """
    engine = cast(Scheduler, task.engine)
    counts = engine._counters.mine()
    records = recording(engine.trace)
    gate = current_gate()  # Ctrl-C raises inside a node; elsewhere, at the loop's top
    view = task.view()  # this thread's copy of what the task says of its nodes
    single, sinks, wanted = view.single, view.sinks, view.wanted
    deliver, retain, deterministic = task.deliver, task.retain_graph, task.deterministic
    # Every node of the task is at ``at``: no node needs a look at its device.
    at_home = task.one_device and at is CPU
    heappush, heappop = heapq.heappush, heapq.heappop
    node: Node | None = None  # the next node of a chain, run without the heap
    grads: list[Grad | None] = []
    with TaskScope(task, task.engine, task.create_graph, task.anomaly_mode, gate):
        while True:
            if node is not None and (gate.pending is not None or task.cancelled
                                     or until is not None):
                heappush(local, (-node.sequence_nr, node, grads))  # for the checks below
                node = None
            if node is None:
                if not local:
                    return
                if gate.pending is not None:  # a Ctrl-C came during bookkeeping: it lands
                    _interrupted(task, local, gate, owner)
                if until is not None and time.monotonic() >= until:
                    _requeue(engine, task, local)
                    return
                if task.cancelled:
                    heappop(local)
                    task.finish([])
                    continue
                _, node, grads = heappop(local)
            counts.nodes += 1
            if node is handed:
                counts.handed_off += 1
            follow: Node | None = None  # the first node this one makes ready...
            first: list[Grad | None] = []  # ... with its gradients
            more: list[Ready] = []  # the others it makes ready
            start = 0.0
            try:
                gate.mode = NODE  # first in the try: a Ctrl-C from here on is caught
                if node._hooks is not None or (wanted and node in wanted):
                    grads = task.prepare(node, grads)
                gated = node.calls_blas
                if gated:  # BLAS nodes: at most as many at once as the cores allow
                    blas.enter_gate()
                if records is not None:
                    start = now()
                try:
                    outputs = node.apply(grads, retain_graph=retain)
                finally:
                    if gated:
                        blas.leave_gate()
                grads = first
                seq, e = node.sequence_nr, -1
                for next_node, input_nr, grad in zip(node.next_nodes, node.input_nrs, outputs):
                    e += 1
                    if next_node is None:
                        continue
                    if next_node in single:
                        gathered: list[Grad | None] = [grad]
                    else:
                        buffered = deliver(next_node, input_nr, grad,
                                           (1, -seq, e) if deterministic else None)
                        if buffered is None:
                            continue
                        gathered = buffered
                    if next_node in sinks:
                        if not task.cancelled:  # no hook after a cancel
                            task.sink(next_node, gathered)
                            if records is not None:
                                _record_ready(records, next_node, task)
                    elif follow is None:
                        follow, first = next_node, gathered
                    else:
                        more.append((next_node, gathered))
                del outputs
                gate.mode = HELD  # last in the try
            except BaseException as exc:
                gate.mode = HELD  # first in the handler
                fail(task, exc, node, owner)
                if reraise and not isinstance(exc, Exception):
                    for _ in range(len(local) + 1):  # finish this node and the rest, skipped
                        task.finish([])
                    raise
            finally:
                if records is not None:
                    record = (node.name(), node.sequence_nr, str(at), start, now(),
                              node is handed, task.number)
                    for log in records:
                        log.nodes.append(record)
            node = None
            if follow is None:
                task.finish([])
                continue
            if not more and (at_home or follow.device is at):
                # A chain: as many made ready as finished, so the count stays as it is.
                if not local or local[0][0] > -follow.sequence_nr:
                    node, grads = follow, first  # the newest: what the heap would give next
                else:
                    heappush(local, (-follow.sequence_nr, follow, first))
                continue
            more.append((follow, first))
            del follow, first
            runnable = task.finish(more)
            if len(runnable) == 1 and runnable[0][0].device is at:
                heappush(local, (-runnable[0][0].sequence_nr, *runnable[0]))
            elif runnable:
                schedule(task, runnable, at, local)
            del more, runnable


def fail(task: GraphTask, exc: BaseException, node: Node | None,
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
    """Raise a Ctrl-C that the gate deferred, at the top of ``run_nodes``' loop, where the
    nodes counted and not finished are exactly those on ``local``: fail ``task`` as an
    interrupt in a node would, finish them (skipped), then raise."""
    try:
        gate.raise_pending()
    except BaseException as exc:
        fail(task, exc, None, owner)
        for _ in range(len(local)):
            task.finish([])
        local.clear()
        raise


def _requeue(engine: Scheduler, task: GraphTask, local: Local) -> None:
    """Hand the nodes kept on ``local`` (counted already, so the task's count is
    unchanged) on to one other thread (``together``). Whole, because this thread kept
    them: cheap nodes not worth a hand-off each, or nodes the memory budget did not admit
    (``_hand_off``). Run by one thread in the reference's order, as this thread would
    have run them, they add no parallelism, so no gradients beyond the budget; one by
    one, each would be a hand-off the budget never admitted."""
    assert not task.serial  # its nodes never reach a ReadyQueue, so never a waiter
    together(engine, task, local)
    local.clear()


def together(engine: Scheduler, task: GraphTask, entries: Local) -> None:
    """Put ``entries`` (ready nodes of ``task``, counted) on the ReadyQueues as one
    NodeTask per device: that of the device's newest node, carrying the rest
    (``NodeTask.kept``), so that one thread runs them all, in the reference's order. (The
    thread that takes them counts the first as handed off in ``statistics()``, the rest
    as inline.)"""
    by_device: dict[Device, Local] = {}
    for entry in entries:
        by_device.setdefault(entry[1].device, []).append(entry)
    for device, heap in by_device.items():
        heapq.heapify(heap)
        _, node, grads = heapq.heappop(heap)
        enqueue(engine._pool.queue(device), NodeTask(task, node, grads, kept=heap or None))


def _record_ready(records: list[Log], node: Node, task: GraphTask) -> None:
    shape = node._output_meta[0][0]
    record = (node.sequence_nr, shape, now(), task.number)
    for log in records:
        log.ready.append(record)


def schedule(task: GraphTask, runnable: list[Ready], at: Device, local: Local) -> None:
    """Keep on ``local`` the cheap ready nodes of device ``at``, and put the expensive ones
    on its ReadyQueue; if it keeps none and has nothing left to run, it keeps the newest
    expensive one rather than idle. Nodes of other devices go to the ReadyQueues of their
    devices.

    A cheap node often leads on into expensive work (the chain of adds that sums several
    branches), so it is the expensive nodes that are handed off, not the cheap ones. A
    node that runs BLAS is kept too while the BLAS gate lets only one such node run at a
    time (BLAS already uses every core): another thread would only wait at the gate.

    With the task's ``branch`` (without the GIL), a cheap node that is not the newest
    one kept goes to the ReadyQueue too when it leads to a branch of at least that many
    nodes reached through it alone (``leads_to``): small nodes can then run on two
    threads at once, and a branch that long pays for its hand-off."""
    if task.serial:  # every node on this thread, in the reference's order
        for node, grads in runnable:
            heapq.heappush(local, (-node.sequence_nr, node, grads))
        return
    engine = cast(Scheduler, task.engine)
    runnable.sort(key=lambda r: r[0].sequence_nr, reverse=True)  # newest first
    pool, threshold = engine._pool, engine.handoff_threshold
    branch = task.branch
    view = task.view() if branch else None
    expensive: list[Ready] = []
    kept_one = False
    blas_alone: bool | None = None  # the gate lets one BLAS node run at once (asked once)
    for node, grads in runnable:
        if node.device is not at:
            enqueue(pool.queue(node.device), NodeTask(task, node, grads))
            continue
        if node.calls_blas and blas_alone is None:
            blas_alone = blas.gate_size() <= 1
        if node.cost < threshold or (node.calls_blas and blas_alone):
            if kept_one and view is not None and leads_to(node, branch, view.single,
                                                             view.sinks):
                expensive.append((node, grads))  # a branch worth another thread
                continue
            kept_one = True
            heapq.heappush(local, (-node.sequence_nr, node, grads))
        else:
            expensive.append((node, grads))
    if expensive and not kept_one and not local:
        node, grads = expensive.pop(0)  # the newest: this thread would idle otherwise
        heapq.heappush(local, (-node.sequence_nr, node, grads))
    if expensive:
        _hand_off(task, expensive, pool.queue(at), local)


def leads_to(node: Node, count: int, single: Container[Node], sinks: Container[Node]) -> bool:
    """Whether ``node`` and the nodes reached through it alone (each in ``single``: one
    edge reaches it, from a node of the branch) that run (not in ``sinks``) are ``count``
    or more: the work a thread that takes ``node`` surely has. Looks at ``count`` nodes
    at most."""
    stack = [node]
    while stack:
        count -= 1
        if count <= 0:
            return True
        for next_node in stack.pop().next_nodes:
            if next_node is not None and next_node in single and next_node not in sinks:
                stack.append(next_node)
    return False


class _OneEdge:
    """The nodes of ``counts`` that one edge reaches (no root): ``TaskView.single``, asked
    of a few nodes without making the set of all."""

    __slots__ = ("_counts", "_roots")

    def __init__(self, counts: dict[Node, list[int]], roots: AbstractSet[Node]) -> None:
        self._counts, self._roots = counts, roots

    def __contains__(self, node: object) -> bool:
        return self._counts.get(node) == ONE_EDGE and node not in self._roots  # type: ignore[call-overload]


class _Accumulators:
    """The sinks of a backward without targets: its leaves' accumulators."""

    __slots__ = ()

    def __contains__(self, node: object) -> bool:
        return isinstance(node, AccumulateGrad)



def has_branches(counts: dict[Node, list[int]], roots: AbstractSet[Node], count: int,
                 within: int = 32) -> bool:
    """Whether one of the first ``within`` nodes met from ``roots`` (breadth first) of a
    backward without targets is a fork with two branches of ``count`` nodes or more below
    it (``leads_to``): work that two threads could run at once. Bounded: graphs whose
    parallelism starts deeper than that are not seen, and run as if they had none."""
    single, sinks = _OneEdge(counts, roots), _Accumulators()
    find = counts.get
    seen = set(roots)
    queue = deque(seen)
    while queue and within > 0:
        within -= 1
        branches = []
        for next_node in queue.popleft().next_nodes:
            if next_node is None or next_node in seen:
                continue
            owed = find(next_node)
            if owed is None:
                continue
            seen.add(next_node)
            if isinstance(next_node, AccumulateGrad):
                continue
            queue.append(next_node)
            if owed == ONE_EDGE and next_node not in roots:
                branches.append(next_node)
        if (len(branches) >= 2
                and sum(leads_to(b, count, single, sinks) for b in branches) >= 2):
            return True
    return False


def _hand_off(task: GraphTask, expensive: list[Ready], queue: ReadyQueue[NodeTask],
              local: Local) -> None:
    """Put the ``expensive`` ready nodes on ``queue`` for idle threads; past the task's
    memory budget, keep them on ``local`` instead."""
    budgeted = task.memory_budget is not None
    for node, grads in expensive:
        charged = _nbytes(grads) if budgeted else 0
        if budgeted and not task.admit(charged):  # over the memory budget: run it here
            heapq.heappush(local, (-node.sequence_nr, node, grads))
            continue
        enqueue(queue, NodeTask(task, node, grads, charged))


def enqueue(queue: ReadyQueue[NodeTask], item: NodeTask) -> None:
    """Put ``item`` on ``queue`` at its priority: a deeper reentrant backward first, then
    the newer node (``ReadyQueue``'s order)."""
    queue.put(item, item.task.depth, item.node.sequence_nr)


def _nbytes(grads: list[Grad | None]) -> int:
    """The bytes of a ready node's gathered gradients (what handing it off keeps alive
    on another thread)."""
    return sum(int(getattr(g, "nbytes", 0)) for g in grads if g is not None)


# ----- waiting on a queue -----

class _Stop:
    """The ``stop`` of a ReadyQueue wait on a thread with an installed Gate: set when the
    task is done, or when a Ctrl-C came."""

    __slots__ = ("_done", "_gate")

    def __init__(self, done: Flag, gate: Gate) -> None:
        self._done, self._gate = done, gate

    def is_set(self) -> bool:
        return self._done.is_set() or self._gate.pending is not None


def _get(queue: ReadyQueue[NodeTask], stop: Flag | None, gate: Gate,
         timeout: float | None = None) -> NodeTask | Job | None:
    """``queue.get``; on a thread with an installed Gate, a Ctrl-C is deferred while it
    waits (polling every ``POLL`` s) and raised here once the item taken, if any, is back
    on its queue: no node is lost between the queue and the thread (an offered Job is
    dropped: its holder runs the chunks nobody took)."""
    if gate.previous is None:
        return queue.get(stop=stop, timeout=timeout)
    assert stop is not None  # a thread with a Gate waits for a task: never a worker
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
        if isinstance(item, NodeTask):
            assert item.grads is not None
            enqueue(queue, item)
        gate.raise_pending()
    return item


def start_helper(pool: Pool[NodeTask], task: GraphTask, ready: list[Ready], at: Device,
                 queue: ReadyQueue[NodeTask], kind: str) -> None:
    """Start a helper thread ``pargrad-<at>-<kind>`` that drives ``task`` (from its
    ``ready`` roots) on a fresh stack (``helper_main``)."""
    pool.start_helper(functools.partial(helper_main, task, ready, at, queue, pool),
                      f"pargrad-{at}-{kind}")
