"""GraphTask: the state of one backward call on the threaded engine; NodeTask: one node
that is ready to run, with its gathered gradients.

Guarantees:
- The dependency counters are the reference engine's (``graph.Dependencies``), so a
  node runs exactly when, and as often as, it would in ``SequentialEngine``: once, after
  every edge into it has delivered.
- A node becomes ready exactly once: the delivery that brings its last counter to zero
  (under the lock of the node's stripe) is the one that takes its buffer and makes its
  NodeTask.
- Buffers are made on a node's first delivery and dropped when it becomes ready, so a
  gradient is alive only between its node's producers and the node itself.
- Completion is detected by ``outstanding`` reaching zero, never by a queue looking
  empty. ``outstanding`` counts ready nodes made and not yet finished; a ready node is
  counted (``finish`` of the node that made it) before any other thread can see it, so
  the count cannot touch zero while work remains. ``done`` is then set exactly once.
- The first error is kept and cancels the task: NodeTasks not yet started are finished
  without running, so the count still drains and the caller is woken. ``cancel`` (a
  BackwardFuture cancelled) records a ``CancelledError`` as that error, unless the task
  is over already.

Assumptions: no GIL. Nodes are spread over up to ``STRIPES`` lock stripes (a power of
two, fewer for small graphs) by sequence number;
a stripe's lock guards its buffers and the counters of its nodes (``dependencies.counts``
gains no keys after ``__init__``, so finding a node's counters needs no lock). One lock
per node would cost its allocation on every node of every backward; one lock per task
would serialise every delivery. Everything else that changes is guarded as its comment
says.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import CancelledError
from itertools import compress, repeat
from typing import Any

from pargrad import anomaly, devices
from pargrad.callbacks import Callbacks
from pargrad.engine import trace
from pargrad.engine.base import BackwardRequest, Engine
from pargrad.engine.buffer import InputBuffer, Key, OrderedInputBuffer
from pargrad.graph import (
    ONE_EDGE,
    AccumulateGrad,
    BackwardError,
    Dependencies,
    Edge,
    Grad,
    Kept,
    Node,
    counting,
)

Ready = tuple[Node, list[Grad | None]]
"""A node that became ready, with the gradients gathered for its outputs."""


class NodeTask:
    """A ready node of one GraphTask and the gradients gathered for its outputs: what a
    ReadyQueue holds. (Work a thread keeps for itself needs no task and stays a Ready.)"""

    __slots__ = ("charged", "grads", "kept", "node", "task")

    def __init__(self, task: GraphTask, node: Node, grads: list[Grad | None] | None,
                 charged: int = 0, kept: list[tuple[int, Node, list[Grad | None]]] | None = None,
                 ) -> None:
        self.task = task
        self.node = node
        self.grads = grads  # set to None once a thread took them to run the node
        # Bytes of ``grads`` counted against the engine's memory budget (GraphTask.admit),
        # released once the thread that took it has run it and what it kept.
        self.charged = charged
        # More ready nodes of the task that go with this one, to the one thread that takes
        # it: what a thread waiting in ``result(timeout)`` had kept for itself when its
        # deadline passed (``loop._requeue``), as ``(-sequence_nr, node, grads)`` entries.
        self.kept = kept


STRIPES = 64  # the most stripes of a task; a power of two


class Once:
    """A flag set once, read like a ``threading.Event`` (``is_set``, ``wait``), made
    without a lock or condition of its own: it shares its task's lock, and the Event
    that waiters block on is made by the first thread that waits (most backward calls
    are never waited on that way, and two Events cost more than a small graph's
    backward). ``lock`` guards ``_event``; ``_flag`` is written under it and read
    without it (a thread that sees it a moment late looks again when woken)."""

    __slots__ = ("_event", "_flag", "_lock")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._lock:
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or for ``timeout`` seconds; return whether it is set."""
        with self._lock:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class _Stripe:
    """The gradient buffers of the nodes whose ``sequence_nr`` modulo the task's stripe
    count is this stripe's."""

    __slots__ = ("buffers", "lock")

    def __init__(self) -> None:
        # Guards ``buffers`` and ``dependencies.counts[node]`` of this stripe's nodes.
        self.lock = threading.Lock()
        self.buffers: dict[Node, InputBuffer | OrderedInputBuffer] = {}


class TaskView:
    """What a task says of its nodes, read by one thread for every node it runs: the
    nodes that one edge reaches (``single``), the sinks, and the nodes whose gradients
    are kept too (``wanted``). Read-only.

    Without the GIL every thread that runs nodes of a task gets copies of its own
    (``GraphTask.view``): reading an object, even to test membership, writes its
    reference count, and two threads doing that for every node to the same set would
    pass its cache line back and forth (measured on 3.13t: a set shared by two threads
    that read it in a loop ran at 0.8x one thread's rate, copies at 1.8x)."""

    __slots__ = ("single", "sinks", "wanted")

    def __init__(self, single: AbstractSet[Node], sinks: AbstractSet[Node],
                 wanted: AbstractSet[Node]) -> None:
        self.single, self.sinks, self.wanted = single, sinks, wanted

    def copy(self) -> TaskView:
        """New sets with the same nodes (``frozenset(s)`` of a frozenset is ``s`` itself)."""
        return TaskView(set(self.single), set(self.sinks), set(self.wanted))


def classify(counts: dict[Node, list[int]], root_nodes: AbstractSet[Node],
             must_run: dict[Node, bool] | None = None, kept: Iterable[Node] = ()) -> TaskView:
    """The TaskView of a task's counted nodes. ``single``: the nodes that exactly one edge
    reaches, and no root gradient: their one delivery makes them ready with just that
    gradient, so they need no buffer, no counter and no lock (most nodes of a chain).
    ``sinks``: the nodes whose gradients are kept and that do not run (leaves; with
    targets, a target with nothing needed beyond it). ``wanted``: the nodes that run and
    whose gradients are kept too."""
    # Loops in C (compress, map): every backward on the threaded path makes these.
    single = frozenset(compress(counts, map(ONE_EDGE.__eq__, counts.values())))
    if not single.isdisjoint(root_nodes):
        single = single.difference(root_nodes)
    sinks = list(compress(counts, map(isinstance, counts, repeat(AccumulateGrad))))
    if must_run is not None:
        sinks += [node for node in counts if not must_run[node]]
    sink_set = frozenset(sinks)
    return TaskView(single, sink_set, frozenset(kept).difference(sink_set))


class InlineRun:
    """A backward that ``ThreadedEngine`` runs on the calling thread alone, without a
    GraphTask: what a thread's stack of running tasks needs of it (its reentrant depth,
    and the task whose node called it)."""

    __slots__ = ("callbacks", "depth", "parent")

    def __init__(self, parent: GraphTask | InlineRun | None) -> None:
        self.parent = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        # pargrad.queue_callback's callbacks: run by the engine once the backward succeeded.
        self.callbacks = Callbacks()


class GraphTask:
    """The state of one backward call: counters, buffers, outstanding work, first error.

    Made by ``engine`` on the calling thread; shared by every thread that runs one of
    its nodes. ``on_done`` is called once, by the thread that finishes the last node.
    """

    def __init__(
        self,
        request: BackwardRequest,
        *,
        deterministic: bool,
        depth: int,
        memory_budget: int | None = None,
        branch: int = 0,
        engine: Engine,
        on_done: Callable[[GraphTask], None],
        parent: GraphTask | InlineRun | None = None,
        counted: tuple[Dependencies, dict[Node, bool] | None] | None = None,
    ) -> None:
        roots = request.roots
        retain_graph, create_graph = request.retain_graph, request.create_graph
        self.engine = engine  # the engine running it: the current engine inside its nodes
        self.roots = roots
        self.root_grads = request.grads
        self.retain_graph = retain_graph
        self.create_graph = create_graph
        self.deterministic = deterministic
        # Deterministic and recording a graph: run every node on the calling thread in
        # the reference's order, so the recorded graph (its sequence numbers, hence the
        # order a second backward sums in) is the reference's too.
        self.serial = deterministic and create_graph
        # The calling thread's anomaly mode: every thread that runs a node of this task
        # runs it under this mode (as under grad mode ``create_graph``).
        self.anomaly_mode = anomaly.current_mode()
        # No device but cpu exists, so every node of the task is on cpu (read-only).
        self.one_device = devices.cpu_only
        # The engine's handoff_branch for this backward (0: off; read-only).
        self.branch = branch
        self.depth = depth  # reentrant nesting: 0 for a backward not called from a node
        # The task whose node waits for this one (a reentrant backward), or None.
        self.parent = parent
        self.number = trace.next_task_number()  # tells backward calls apart in a trace
        # pargrad.queue_callback's callbacks: run by the engine once the task succeeded.
        self.callbacks = Callbacks()
        self._on_done = on_done
        root_nodes = {node for node, _ in roots if node is not None}
        # With targets (pargrad.grad): the nodes on a path to them, and which of those run.
        # ``counted``: both, already made by the engine (``graph.counting``).
        self.dependencies, must_run = counted or counting(root_nodes, request.targets)
        self._kept = Kept(request.targets, request.on_kept)  # its grads guarded by _lock
        # What the task says of its nodes (TaskView, read-only): the calling thread's,
        # and every thread's with the GIL on; without it, each other thread makes its
        # own copy (``view``), kept in ``_views`` (guarded by _lock).
        self._shared = classify(self.dependencies.counts, root_nodes, must_run,
                                 self._kept.wanted)
        self.single, self.sinks, self.wanted = (
            self._shared.single, self._shared.sinks, self._shared.wanted)
        self._creator, self._views = threading.get_ident(), dict[int, TaskView]()
        buffered = len(self.dependencies.counts) - len(self.single)
        # Deterministic mode: the keys each buffered node's outputs will receive, in
        # the canonical order, so its buffer folds them as soon as the order allows
        # (read-only after __init__).
        self._expected = self._expected_keys(roots) if deterministic else None
        # About one stripe per 8 buffered nodes, up to STRIPES: each stripe costs memory.
        stripes = min(STRIPES, 1 << max(0, (buffered - 1) // 8).bit_length())
        self._mask = stripes - 1
        self._stripes = tuple(_Stripe() for _ in range(stripes))
        # Guards _outstanding, _over, _error, _kept.grads, _handed and done's event.
        self._lock = threading.Lock()
        self._outstanding = 0
        # The engine's memory budget (None: none): the bytes of gradients handed to
        # other threads and not yet run (_handed) may not exceed it (``admit``).
        self.memory_budget = memory_budget
        self._handed = 0
        self._over = False  # _outstanding reached zero: nothing runs any more
        self._error: BaseException | None = None
        # True from the first error (or an interrupt) on: nodes not started are skipped.
        # Written under _lock, read without it by every thread before each node: a
        # thread that reads it a moment late runs one node more, as with an Event.
        self.cancelled = False
        # Set once, when _outstanding reached zero: the task is over.
        self.done = Once(self._lock)

    def start(self) -> list[Ready]:
        """Deliver the root gradients and return the roots that are ready, counted.

        Call once, on the calling thread, before any other thread can see this task.
        Sinks reached directly as roots are kept here, not returned.
        """
        counted = self.dependencies.counts
        for i, ((node, output_nr), grad) in enumerate(zip(self.roots, self.root_grads)):
            if node in counted:
                self._buffer(self._stripe(node), node).accumulate(output_nr, grad, (0, i))
        ready: list[Ready] = []
        for node in dict.fromkeys(n for n, _ in self.roots if n in counted):
            if self.dependencies.is_ready(node):
                buffer = self._buffer(stripe := self._stripe(node), node)
                del stripe.buffers[node]
                if node in self.sinks:
                    self.sink(node, buffer.take())
                else:
                    ready.append((node, buffer.take()))
        return self.finish(ready, finished=0)

    def view(self) -> TaskView:
        """This thread's TaskView of the task (see there): the task's own on the thread
        that made it or with the GIL on; else a copy made on this thread's first call."""
        ident = threading.get_ident()
        if ident == self._creator or devices.gil_enabled():
            return self._shared
        view = self._views.get(ident)
        if view is None:
            view = self._shared.copy()
            with self._lock:
                self._views[ident] = view
        return view

    def _stripe(self, node: Node) -> _Stripe:
        return self._stripes[node.sequence_nr & self._mask]

    def _buffer(self, stripe: _Stripe, node: Node) -> InputBuffer | OrderedInputBuffer:
        """``node``'s buffer in its ``stripe``, made on first use. The caller holds the
        stripe's lock, or is ``start``."""
        buffer = stripe.buffers.get(node)
        if buffer is None:
            expected = self._expected
            buffer = stripe.buffers[node] = (
                InputBuffer(node.num_outputs) if expected is None
                else OrderedInputBuffer(node.num_outputs, expected[node]))
        return buffer

    def _expected_keys(self, roots: Sequence[Edge]) -> dict[Node, list[list[Key]]]:
        """For every node with a buffer: per output, the keys of the contributions it
        will receive (one per counted edge into it, one per root gradient), sorted. The
        deliveries are exactly these: a counted node that runs delivers along each edge
        to a counted node (``Dependencies`` counts the same edges)."""
        counts, single = self.dependencies.counts, self.single
        expected: dict[Node, list[list[Key]]] = {}
        for i, (node, output_nr) in enumerate(roots):
            if node in counts:
                expected.setdefault(node, [[] for _ in counts[node]])[output_nr].append((0, i))
        for producer in counts:
            seq = producer.sequence_nr
            for e, (node, input_nr) in enumerate(zip(producer.next_nodes, producer.input_nrs)):
                if node is None:
                    continue
                owed = counts.get(node)
                if owed is None or node in single:
                    continue  # not counted, or delivered to without a buffer
                keys = expected.get(node)
                if keys is None:
                    keys = expected[node] = [[] for _ in owed]
                keys[input_nr].append((1, -seq, e))
        for keys in expected.values():
            for output_keys in keys:
                output_keys.sort()
        return expected

    def deliver(self, node: Node, output_nr: int, grad: Grad | None,
                key: Key | None) -> list[Grad | None] | None:
        """Add one edge's gradient to ``node``'s buffer and release that edge.

        If this delivery made the node ready (exactly one caller sees that), returns its
        gathered gradients, which the caller must pass to ``finish``; else None.
        """
        if node in self.single:
            return [grad]  # what its buffer would hold: the one gradient, or None
        if node not in self.dependencies.counts:
            return None  # with targets: a node that leads to none of them
        stripe = self._stripes[node.sequence_nr & self._mask]
        with stripe.lock:
            buffer = self._buffer(stripe, node)
            buffer.accumulate(output_nr, grad, key)
            if not self.dependencies.release(node, output_nr):
                return None
            del stripe.buffers[node]
        return buffer.take()  # out of its stripe: no other thread can reach it now

    def finish(self, ready: list[Ready], finished: int = 1) -> list[Ready]:
        """Account for ``finished`` nodes done and the ``ready`` ones they made.

        The ready nodes (never sinks, which ``sink`` handles) are counted and returned
        for the caller to run or enqueue. The call that brings the count to zero
        completes the task.
        """
        runnable = ready
        if finished and len(runnable) == finished:
            # As many made as finished (a chain): the count stays as it is, and it counts
            # the new node already, so no lock is needed to leave it unchanged.
            return runnable
        with self._lock:
            self._outstanding += len(runnable) - finished
            complete = self._over = self._outstanding == 0
        if complete:
            for stripe in self._stripes:  # a failed task leaves buffers behind: drop them
                with stripe.lock:
                    stripe.buffers.clear()
            self.done.set()
            self._on_done(self)
        return runnable

    def admit(self, nbytes: int) -> bool:
        """Whether a ready node whose gradients hold ``nbytes`` may be handed to another
        thread within the memory budget; if so, they are counted until ``release``."""
        budget = self.memory_budget
        if budget is None:
            return True
        if budget == 0:  # nothing at all, not even a node without array gradients
            return False
        with self._lock:
            if self._handed + nbytes > budget:
                return False
            self._handed += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """The gradients ``admit`` counted have been consumed."""
        with self._lock:
            self._handed -= nbytes

    def sink(self, node: Node, grads: list[Grad | None]) -> None:
        """Keep the gradients of a sink that became ready (after its tensor hooks), on
        the thread whose delivery made it ready. Raises what a hook raises."""
        self.prepare(node, grads)

    def prepare(self, node: Node, grads: list[Grad | None]) -> list[Grad | None]:
        """Run the tensor hooks of a node about to run and keep the gradients asked of it;
        return the gradients it runs on. Raises what a hook (or ``on_kept``) raises."""
        if node._hooks is not None:
            grads = node.run_tensor_hooks(grads)
        kept = self._kept.select(node, grads)  # on_kept runs here, outside the lock
        if kept:
            with self._lock:
                self._kept.store(kept)
        return grads

    def fail(self, exc: BaseException, node: Node | None = None) -> None:
        """Record ``exc`` if it is the first error, and cancel the task.

        An ordinary exception that is not yet a ``BackwardError`` is wrapped in one that
        names ``node``, with the original as ``__cause__``.
        """
        if isinstance(exc, Exception) and not isinstance(exc, BackwardError):
            name = node.name() if node is not None else "backward"
            wrapped = BackwardError(name, f"{type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        with self._lock:
            if self._error is None:
                self._error = exc
            self.cancelled = True

    def cancel(self) -> bool:
        """Cancel the task, unless it is over or failed already: nodes not started are
        skipped and the task fails with a ``CancelledError``. Returns whether the task
        is cancelled (by this call or an earlier one)."""
        with self._lock:
            if self._error is None and not self._over:
                self._error = CancelledError("the backward was cancelled")
            cancelled = isinstance(self._error, CancelledError)
            if cancelled:
                self.cancelled = True
        return cancelled

    @property
    def was_cancelled(self) -> bool:
        """Whether the task failed by ``cancel`` (a node's error is a BackwardError)."""
        return isinstance(self.error, CancelledError)

    @property
    def error(self) -> BaseException | None:
        """The first error, or None."""
        with self._lock:
            return self._error

    def captured(self) -> dict[Edge, Any]:
        """The gradients kept (``graph.Kept``), by edge (after ``done``)."""
        with self._lock:
            return self._kept.grads
