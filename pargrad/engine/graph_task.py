"""GraphTask: the state of one backward call on the threaded engine; NodeTask: one node
that is ready to run, with its gathered gradients.

Guarantees:
- The dependency counters are the reference engine's (``graph.Dependencies``), so a
  node runs exactly when, and as often as, it would in ``SequentialEngine``: once, after
  every edge into it has delivered.
- A node becomes ready exactly once: the delivery that brings its last counter to zero
  (under that node's lock) is the one that takes its buffer and makes its NodeTask.
- Completion is detected by ``outstanding`` reaching zero, never by a queue looking
  empty. ``outstanding`` counts NodeTasks made and not yet finished; a NodeTask is
  counted (``finish`` of the task that made it) before any other thread can see it, so
  the count cannot touch zero while work remains. ``done`` is then set exactly once.
- The first error is kept and cancels the task: NodeTasks not yet started are finished
  without running, so the count still drains and the caller is woken.

Assumptions: no GIL. ``slots`` and ``dependencies.counts`` gain no keys after
``__init__`` (so reading them needs no lock); everything else that changes is guarded
as its comment says. The roots are delivered by ``start`` on the calling thread before
any NodeTask of this graph exists, so nothing else can touch the buffers then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from pargrad.engine.base import Engine
from pargrad.engine.buffer import InputBuffer, Key, OrderedInputBuffer
from pargrad.graph import AccumulateGrad, BackwardError, Dependencies, Edge, Grad, Node


class NodeTask:
    """A ready node of one GraphTask and the gradients gathered for its outputs."""

    __slots__ = ("inputs", "node", "task")

    def __init__(self, task: GraphTask, node: Node, inputs: list[Grad | None] | None) -> None:
        self.task = task
        self.node = node
        self.inputs = inputs  # set to None once the node has consumed them


class _Slot:
    """One node's gradient buffer and the lock that guards it and the node's counters."""

    __slots__ = ("buffer", "lock")

    def __init__(self, buffer: InputBuffer | OrderedInputBuffer) -> None:
        # Guards ``buffer`` and ``dependencies.counts[node]`` of this slot's node.
        self.lock = threading.Lock()
        self.buffer = buffer


class GraphTask:
    """The state of one backward call: counters, buffers, outstanding work, first error.

    Made by ``engine`` on the calling thread; shared by every thread that runs one of
    its nodes. ``on_done`` is called once, by the thread that finishes the last node.
    """

    def __init__(
        self,
        roots: Sequence[Edge],
        grads: Sequence[Grad],
        *,
        retain_graph: bool,
        create_graph: bool,
        deterministic: bool,
        depth: int,
        engine: Engine,
        on_done: Callable[[GraphTask], None],
    ) -> None:
        self.engine = engine  # the engine running it: the current engine inside its nodes
        self.roots = roots
        self.root_grads = grads
        self.retain_graph = retain_graph
        self.create_graph = create_graph
        self.deterministic = deterministic
        self.depth = depth  # reentrant nesting: 0 for a backward not called from a node
        self._on_done = on_done
        self.dependencies = Dependencies([node for node, _ in roots if node is not None])
        make = OrderedInputBuffer if deterministic else InputBuffer
        self.slots = {node: _Slot(make(node.num_outputs)) for node in self.dependencies.counts}
        # Guards _outstanding, _error and _captured.
        self._lock = threading.Lock()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._captured: dict[AccumulateGrad, Grad] = {}
        # Set with the first error (or an interrupt): nodes not started are skipped.
        self.cancelled = threading.Event()
        # Set once, when _outstanding reached zero: the task is over.
        self.done = threading.Event()

    def start(self) -> list[NodeTask]:
        """Deliver the root gradients and return the roots that are ready, counted.

        Call once, on the calling thread, before any other thread can see this task.
        Leaves reached directly as roots are captured here, not returned.
        """
        for i, ((node, output_nr), grad) in enumerate(zip(self.roots, self.root_grads)):
            if node is not None:
                self.slots[node].buffer.accumulate(output_nr, grad, (0, i))
        ready = [NodeTask(self, node, self.slots[node].buffer.take())
                 for node in dict.fromkeys(n for n, _ in self.roots if n is not None)
                 if self.dependencies.is_ready(node)]
        return self.finish(ready, finished=0)

    def deliver(self, node: Node, output_nr: int, grad: Grad | None,
                key: Key | None) -> NodeTask | None:
        """Add one edge's gradient to ``node``'s buffer and release that edge.

        Returns the node's NodeTask if this delivery made it ready (exactly one caller
        gets it), else None. The caller must pass it to ``finish``.
        """
        slot = self.slots[node]
        with slot.lock:
            slot.buffer.accumulate(output_nr, grad, key)
            if not self.dependencies.release(node, output_nr):
                return None
            inputs = slot.buffer.take()
        return NodeTask(self, node, inputs)

    def finish(self, ready: list[NodeTask], finished: int = 1) -> list[NodeTask]:
        """Account for ``finished`` NodeTasks done and the ``ready`` ones they made.

        Ready leaves (``AccumulateGrad``) are captured, not run; the other NodeTasks are
        counted and returned for the caller to run or enqueue. The call that brings the
        count to zero completes the task.
        """
        runnable: list[NodeTask] = []
        with self._lock:
            for item in ready:
                node = item.node
                if isinstance(node, AccumulateGrad):
                    assert item.inputs is not None
                    if item.inputs[0] is not None:
                        self._captured[node] = item.inputs[0]
                else:
                    runnable.append(item)
            self._outstanding += len(runnable) - finished
            complete = self._outstanding == 0
        if complete:
            self.done.set()
            self._on_done(self)
        return runnable

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
        self.cancelled.set()

    @property
    def error(self) -> BaseException | None:
        """The first error, or None."""
        with self._lock:
            return self._error

    def captured(self) -> dict[AccumulateGrad, Any]:
        """The total gradient gathered at each leaf (after ``done``)."""
        with self._lock:
            return self._captured
