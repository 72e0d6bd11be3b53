"""SequentialEngine: the reference backward engine, and the oracle for every other.

The reference algorithm (docs/design.md §2), one node at a time on the calling thread:

1. Count, for every (node, output) reachable from the roots, the edges that will
   deliver a gradient to it (``Dependencies``).
2. Put the root gradients into the roots' buffers; roots owed nothing are ready.
3. Pop the ready node with the highest sequence number, call its backward, and add
   each result into the buffer of the node at the other end of the edge. Each delivery
   lowers one counter (``Dependencies.release``); a node whose counters are all zero is
   ready and joins the ready list.
4. A leaf's AccumulateGrad is not called: its gathered gradient is returned.

A call with ``inputs`` (``pargrad.grad``) counts and runs only the nodes on a path to
them (``graph.needed``), and returns just their gradients.

Popping the highest sequence number runs nodes in exactly reverse creation order (the
newest unrun node is always ready, since everything that consumed it was created
later), so gradients reach each buffer in the canonical order of docs/design.md. (An
``AccumulateGrad``'s number is raised above all others, so a leaf is kept as soon as its
gradient is complete; it runs nothing, so no buffer's order changes.) A reentrant
backward nested deeper than ``MAX_REENTRANT_DEPTH`` on one thread continues on a fresh
thread, so that no depth exhausts the stack; ``pargrad.queue_callback``'s callbacks run
after the loop.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pargrad import anomaly, callbacks
from pargrad.engine.base import BackwardRequest, Engine, use_engine
from pargrad.engine.buffer import InputBuffer
from pargrad.engine.trace import ThreadCounts
from pargrad.grad_mode import set_grad_enabled
from pargrad.graph import (
    ONE_EDGE,
    AccumulateGrad,
    BackwardError,
    Edge,
    Grad,
    Kept,
    Node,
    counting,
)


class SequentialEngine(Engine):
    """The reference engine: runs the backward on the calling thread, node by node.

    Thread-safe in the sense that independent calls from several threads do not share
    state; it holds none.
    """

    def __repr__(self) -> str:
        return "SequentialEngine()"

    def execute(self, request: BackwardRequest) -> dict[Edge, Grad]:
        depth = _local.depth
        if depth >= MAX_REENTRANT_DEPTH:  # a reentrant backward this deep: a fresh stack
            return _on_fresh_stack(lambda: self._execute(request))
        _local.depth = depth + 1
        try:
            return self._execute(request)
        finally:
            _local.depth = depth

    def _execute(self, request: BackwardRequest) -> dict[Edge, Grad]:
        roots, targets = request.roots, request.targets
        dependencies, must_run = counting([node for node, _ in roots if node is not None], targets)
        kept = Kept(targets, request.on_kept)
        queued = callbacks.Callbacks()  # pargrad.queue_callback's, run after the loop
        with (set_grad_enabled(request.create_graph), use_engine(self),
              callbacks.running(queued)):
            run_graph(roots, request.grads, dependencies.counts, must_run, kept,
                      retain_graph=request.retain_graph)
        queued.run()
        return kept.grads


# The reference's loop, one node per turn, on every backward: kept in one frame, since a
# call per node is most of what a small node costs.
def run_graph(roots: Sequence[Edge], grads: Sequence[Grad], counts: dict[Node, list[int]],  # noqa: C901, PLR0912, PLR0915
              must_run: dict[Node, bool] | None, kept: Kept, *, retain_graph: bool,
              name_errors: bool = False, tally: ThreadCounts | None = None) -> None:
    """Run the backward of steps 2-4 on the calling thread: ``counts`` are the roots'
    ``Dependencies`` (only of ``runs``' nodes, with ``inputs``), and the gradients to
    keep go into ``kept``. ``tally.nodes``, if given, counts the nodes run.

    With ``name_errors``, an ordinary exception that is not a ``BackwardError`` (one of
    ``kept``'s ``on_kept``) is raised as a ``BackwardError`` naming the node, with the
    original as its cause, as a parallel engine reports it.
    """
    wanted = kept.wanted
    buffers: dict[Node, InputBuffer] = {}
    find, heappush, heappop = counts.get, heapq.heappush, heapq.heappop
    # Seed the roots' buffers. A root of one output that no edge reaches, given once
    # (most roots), is ready with its gradient as given (what its buffer would hold).
    given_once: dict[Node, list[Grad | None]] = {}
    for (node, output_nr), grad in zip(roots, grads):
        if node is None or (owed := find(node)) is None:
            continue
        if owed == _NONE_OWED and node not in given_once and node not in buffers:
            given_once[node] = [grad]
            continue
        buffer = buffers.get(node)
        if buffer is None:
            buffer = buffers[node] = InputBuffer(len(owed))
            if node in given_once:  # given before: that gradient first
                buffer.accumulate(0, given_once.pop(node)[0])
        buffer.accumulate(output_nr, grad)
    # The ready list: (-sequence_nr, node, its gathered gradients), newest first.
    ready: list[tuple[int, Node, list[Grad | None]]] = [
        (-node.sequence_nr, node, grads_) for node, grads_ in given_once.items()]
    for node, buffer in list(buffers.items()):  # roots only, so far
        if not any(counts[node]):
            del buffers[node]
            ready.append((-node.sequence_nr, node, buffer.take()))
    heapq.heapify(ready)
    ran = 0  # nodes run, for tally (a local costs 4 instructions a node, tally.nodes 9)
    try:
        while ready:
            _, node, grads_ = heappop(ready)
            while True:  # node, then the node it made ready, straight, while that is the newest
                try:
                    hooks = node._hooks
                    if hooks is not None:
                        grads_ = node.run_tensor_hooks(grads_)
                    sink = isinstance(node, AccumulateGrad) or (must_run is not None
                                                                and not must_run[node])
                    if sink or (wanted and node in wanted) or (hooks is not None and hooks.retains):
                        kept.store(kept.select(node, grads_))
                    if sink:
                        break  # its gradients are kept, not used
                    ran += 1
                    outputs = node.apply(grads_, retain_graph=retain_graph)
                except BackwardError:
                    raise
                except Exception as exc:
                    if not name_errors:
                        raise
                    raise BackwardError(node.name(), f"{type(exc).__name__}: {exc}") from exc
                del grads_
                # Deliver each gradient to the next node's buffer, releasing the edge it came
                # along; a node whose counters reach zero is ready. One found ready while the
                # heap is empty (``follow``, with its gradients in ``grads_``) skips the heap
                # if it is still the newest at the end: in a chain, every node.
                follow = None
                for next_node, input_nr, grad in zip(node.next_nodes, node.input_nrs, outputs):
                    if next_node is None:
                        continue
                    owed = find(next_node)
                    if owed is None:  # leads nowhere needed (with inputs)
                        continue
                    # The one edge into a one-output node: ready with just this gradient,
                    # no buffer needed.
                    if owed == ONE_EDGE and next_node not in buffers:
                        owed[0] = 0
                        if ready or follow is not None:
                            heappush(ready, (-next_node.sequence_nr, next_node, [grad]))
                        else:
                            follow, grads_ = next_node, [grad]
                        continue
                    buffer = buffers.get(next_node)
                    if buffer is None:
                        buffer = buffers[next_node] = InputBuffer(len(owed))
                    buffer.accumulate(input_nr, grad)
                    owed[input_nr] -= 1
                    if not any(owed):
                        if ready or follow is not None:
                            heappush(ready, (-next_node.sequence_nr, next_node,
                                             buffers.pop(next_node).take()))
                        else:
                            follow, grads_ = next_node, buffers.pop(next_node).take()
                if follow is None:
                    break
                if ready and ready[0][0] < -follow.sequence_nr:  # a newer one came after it
                    heappush(ready, (-follow.sequence_nr, follow, grads_))
                    break
                node = follow  # what heappop would return next (sequence numbers are distinct)
    finally:
        if tally is not None:
            tally.nodes += ran


_NONE_OWED = [0]
"""The counts of a one-output node that no edge owes a gradient."""

MAX_REENTRANT_DEPTH = 32
"""Nested backward calls one thread runs on its own stack; a deeper one runs on a new
thread (the caller waits for it), so that thousands of nested calls fit in no stack.
``ThreadedEngine`` uses the same bound before a helper thread takes over."""

class _ThreadState(threading.local):
    """Per-thread state, so no lock: ``depth``, the backward calls nested on this
    thread (a class default, so a new thread reads 0 without a miss)."""

    depth = 0


_local = _ThreadState()


def _on_fresh_stack(run: Callable[[], Any]) -> Any:
    """``run()`` on a new thread, with the calling thread's anomaly mode; blocks until
    it is done and returns its result or raises its exception."""
    mode = anomaly.current_mode()
    outcome: list[Any] = []

    def target() -> None:
        anomaly.set_mode(mode)
        try:
            outcome.append((True, run()))
        except BaseException as exc:  # handed to the waiting caller
            outcome.append((False, exc))
        finally:  # a thread ends with its modes as it began (anomaly.on counts it)
            anomaly.set_mode((False, True))

    thread = threading.Thread(target=target, name="pargrad-sequential-reentrant")
    thread.start()
    thread.join()
    ok, result = outcome[0]
    if not ok:
        raise result
    return result
