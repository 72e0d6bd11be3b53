"""The Engine interface, and the calling thread's stack of engines (``use_engine``).

An engine runs the backward pass over a graph: it asks ``Dependencies`` which nodes are
ready, calls ``Node.apply`` on them, and moves gradients along edges. It never touches
``.grad``: it returns what each leaf's ``AccumulateGrad`` gathered, and the caller
commits that once the whole backward has succeeded.

Which engine runs a backward: the ``engine=`` argument if given, else the innermost
``use_engine`` block of the calling thread, else the process-wide default
(``pargrad/engine/selection.py``, which sits above the engines it makes).
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pargrad.futures import BackwardFuture
from pargrad.graph import Edge, Grad
from pargrad.parallel import Helpers


@dataclass(frozen=True, slots=True)
class BackwardRequest:
    """One backward call, as the caller hands it to an engine (``Engine.execute``).

    - ``roots``: the edges the backward starts from (the outputs' ``(node, output_nr)``),
      and ``grads``: one gradient for each (an array, or a Tensor with
      ``create_graph``).
    - ``retain_graph``: keep the saved values, so the graph can be run again.
    - ``create_graph``: run the nodes' backwards with grad mode on, recording a graph
      of the gradients.
    - ``targets``: the edges whose gradients are wanted (``pargrad.grad``'s inputs):
      then only the nodes on a path to them run; None runs the whole graph down to the
      leaves.
    - ``on_kept``: sees each gradient the engine keeps (``graph.Kept``), first, on the
      thread that keeps it, and may take it.
    """

    roots: Sequence[Edge]
    grads: Sequence[Grad]
    retain_graph: bool = False
    create_graph: bool = False
    targets: Sequence[Edge] | None = None
    on_kept: Callable[[Edge, Grad], bool] | None = None


class Engine(ABC):
    """Runs the backward pass of one call.

    Subclasses: ``SequentialEngine`` (the reference) and ``ThreadedEngine`` (the default).
    """

    @abstractmethod
    def execute(self, request: BackwardRequest) -> dict[Edge, Grad]:
        """Backpropagate ``request.grads`` from the ``request.roots`` edges through the
        graph.

        Blocks until done. Returns the gradients kept by ``graph.Kept``, by edge: the
        total gathered at each leaf's ``(AccumulateGrad, 0)``, at each output marked by
        ``retain_grad``, and at each edge of ``targets``; entries that got no gradient
        are absent. With ``targets``, only the nodes on a path to them run
        (``graph.needed``). Each node's tensor hooks run before its gradients are kept;
        ``on_kept`` sees each kept gradient first, on the thread that keeps it, and
        may take it (``graph.Kept``).
        ``SequentialEngine`` (and ``ThreadedEngine(deterministic=True)``) sum gradients
        in the canonical order of docs/design.md §4; an engine that does not says so.
        Runs node backwards with grad mode set to ``create_graph``, with this engine
        current; frees saved values unless ``retain_graph``. Raises the
        ``BackwardError`` of the first failing node.
        """

    def execute_async(self, request: BackwardRequest) -> BackwardFuture[dict[Edge, Grad]]:
        """Start the backward of ``execute`` and return a future of its result.

        This default runs ``execute`` to the end on the calling thread and returns a
        future that is done already (carrying the result or the ``Exception``; a
        KeyboardInterrupt is raised here): what ``SequentialEngine`` does, so that the
        reference stays one loop on one thread. ``ThreadedEngine`` returns at once while
        its workers run the backward. ``on_kept`` and the tensor hooks run as in
        ``execute``, on the engine's threads, before the future resolves.
        """
        future: BackwardFuture[dict[Edge, Grad]] = BackwardFuture()
        try:
            kept = self.execute(request)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(kept)
        return future

    def intra_op_helpers(self) -> Helpers | None:
        """Where a large elementwise call made on this thread while this engine is
        current (a node's rule, or a forward op) may offer its chunks to idle threads
        (pargrad/parallel.py); None: it runs them all on the calling thread. This default
        (the reference engine's) is None."""
        return None


# Per-thread stack of engines chosen with use_engine; each thread touches only its own.
_local = threading.local()


@contextlib.contextmanager
def use_engine(engine: Engine) -> Iterator[Engine]:
    """Run backward calls made by this thread inside the block on ``engine``.

    Affects only the calling thread (other threads keep theirs); blocks nest. Raises
    TypeError if ``engine`` is not an Engine.

    >>> import pargrad
    >>> x = pargrad.tensor(3.0, requires_grad=True)
    >>> with pargrad.use_engine(pargrad.SequentialEngine()):
    ...     (x * x).backward()
    >>> x.grad
    tensor(6., dtype=float64)
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"expected a pargrad Engine, got {type(engine).__name__}")
    stack = _engine_stack()
    stack.append(engine)
    try:
        yield engine
    finally:
        stack.pop()


def _engine_stack() -> list[Engine]:
    stack: list[Engine] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack
