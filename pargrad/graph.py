"""The backward graph: nodes, edges, sequence numbers and dependency counting.

A ``Node`` is one step of the backward pass. ``node.next_functions`` holds one edge per
input of the forward operation, ``(next_node, input_nr)``, where ``input_nr`` says which
output of ``next_node`` that input was (the seed's ``previous_functions``); the edge is
``(None, 0)`` where the input needs no gradient. A leaf that requires grad is reached
through an ``AccumulateGrad`` node, the sink that owns the leaf's gradient.

This module knows nothing of engines or threads (the sequence counter's lock aside): an
engine asks ``Dependencies`` when a node is ready and calls ``Node.apply``; everything a
node needs to turn output gradients into input gradients lives here and in the node.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pargrad.devices import CPU, Device
from pargrad.shapes import sum_to

if TYPE_CHECKING:
    from pargrad.tensor import Tensor

Grad = Any
"""A gradient: a numpy array, or a Tensor while a backward records its own graph."""

Edge = tuple["Node | None", int]
"""``(node, input_nr)``: the node that produced an input, and which of its outputs it was."""

Meta = tuple[tuple[int, ...], np.dtype]
"""``(shape, dtype)`` of a tensor, remembered so that a gradient can be checked against it."""

# Guards _sequence_counter. The counter must hand out unique, increasing numbers even
# when several threads build graphs at once, and ``next`` on a shared iterator is only
# atomic under the GIL, which we do not assume.
_sequence_lock = threading.Lock()
_sequence_counter = itertools.count()


def next_sequence_nr() -> int:
    """Return the next forward sequence number (unique, increasing, thread-safe)."""
    with _sequence_lock:
        return next(_sequence_counter)


class BackwardError(RuntimeError):
    """A node's backward failed, or produced gradients that do not fit its inputs.

    ``node_name`` names the node; the original exception, if any, is ``__cause__``.
    """

    def __init__(self, node_name: str, message: str) -> None:
        super().__init__(f"{node_name}: {message}")
        self.node_name = node_name
        self.detail = message


class Node:
    """One step of the backward pass (PyTorch's ``Node``; the seed's ``Function``).

    Subclasses implement ``backward`` (output gradients -> input gradients) and, if they
    keep saved values, ``_free_saved``. Engines call ``apply``, which also checks every
    gradient against the shape and dtype of the input it is for, sums a broadcast
    gradient back to that shape (the one place un-broadcasting happens), and frees the
    saved values unless the graph is retained.

    A node's ``backward`` records a graph of its own exactly when grad mode is enabled
    while it runs; engines enable it only for ``create_graph=True``.
    """

    __slots__ = ("__weakref__", "_input_meta", "_output_meta", "_released", "device",
                 "next_functions", "sequence_nr")

    # Its backward runs BLAS, which has threads of its own: a parallel engine runs only
    # as many such nodes at once as the cores allow (engine/blas.py).
    calls_blas = False

    def __init__(
        self,
        next_functions: tuple[Edge, ...],
        input_meta: tuple[Meta | None, ...],
        output_meta: tuple[Meta, ...],
        device: Device = CPU,
    ) -> None:
        self.next_functions = next_functions
        self._input_meta = input_meta
        self._output_meta = output_meta
        self._released = False
        self.device = device
        self.sequence_nr = next_sequence_nr()

    def name(self) -> str:
        """The node's name as shown in errors, e.g. ``MultiplyBackward``."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{self.name()} sequence_nr={self.sequence_nr}>"

    @property
    def num_outputs(self) -> int:
        """How many outputs the forward operation produced (each has its own counter)."""
        return len(self._output_meta)

    def backward(self, grads: tuple[Grad, ...]) -> Sequence[Grad | None]:
        """Return one gradient (or None) per edge, given one gradient per output."""
        raise NotImplementedError(f"{self.name()} has no backward")

    def _free_saved(self) -> bool:
        """Drop saved values; return True if there were any (later calls must then fail)."""
        return False

    def apply(self, grads: Sequence[Grad | None], *, retain_graph: bool) -> list[Grad | None]:
        """Run ``backward`` on gathered output gradients and check what it returns.

        ``grads`` has one entry per output, ``None`` where no gradient arrived. Returns one
        entry per edge in ``next_functions``. Raises ``BackwardError`` naming this node,
        with the original exception chained, if the backward fails or returns gradients
        that do not fit the inputs.
        """
        if all(g is None for g in grads):
            return [None] * len(self.next_functions)
        if self._released:
            raise BackwardError(
                self.name(),
                "trying to backward through the graph a second time, but its saved values "
                "were already freed; pass retain_graph=True to the first backward call",
            )
        full = tuple(
            np.zeros(shape, dtype) if g is None else g
            for g, (shape, dtype) in zip(grads, self._output_meta)
        )
        try:
            outputs = self.backward(full)
        except BackwardError:
            raise
        except Exception as exc:
            raise BackwardError(self.name(), f"{type(exc).__name__}: {exc}") from exc
        checked = self._check(outputs)
        if not retain_graph and self._free_saved():
            self._released = True
        return checked

    def _check(self, outputs: Sequence[Grad | None]) -> list[Grad | None]:
        if len(outputs) != len(self.next_functions):
            raise BackwardError(
                self.name(),
                f"backward returned {len(outputs)} gradients, but the forward had "
                f"{len(self.next_functions)} inputs",
            )
        checked: list[Grad | None] = []
        for i, ((next_node, _), g, meta) in enumerate(
            zip(self.next_functions, outputs, self._input_meta)
        ):
            if next_node is None or g is None or meta is None:
                checked.append(None)
                continue
            if isinstance(g, (np.generic, int, float, list, tuple)):
                g = np.asarray(g)
            if not hasattr(g, "shape") or not hasattr(g, "dtype"):
                raise BackwardError(
                    self.name(),
                    f"backward returned a {type(g).__name__} for input {i}; expected an "
                    f"array, a Tensor or None",
                )
            shape, dtype = meta
            fitted = sum_to(g, shape)
            if fitted is None:
                raise BackwardError(
                    self.name(),
                    f"backward returned a gradient of shape {tuple(g.shape)} for input {i}, "
                    f"which has shape {shape}",
                )
            if fitted.dtype != dtype:
                fitted = fitted.astype(dtype)
            checked.append(fitted)
        return checked


class AccumulateGrad(Node):
    """The sink for a leaf tensor: engines gather the leaf's total gradient here.

    Engines never call its ``backward``; they hand what it gathered back to the caller,
    which adds it to ``variable.grad`` once the whole backward has succeeded.
    """

    __slots__ = ("variable",)

    def __init__(self, variable: Tensor) -> None:
        super().__init__((), (), ((variable.shape, variable.dtype),), variable.device)
        self.variable = variable


class Dependencies:
    """The dependency counters of one backward call: the seed's ``dependencies``.

    For every node reachable from the roots, one counter per output: how many edges
    still have to deliver a gradient to that output. A node is ready when the counters
    of all its outputs are zero.

    Thread-safety: ``counts`` gains no keys after construction, and ``is_ready(node)`` /
    ``release(node, ...)`` read and write only ``counts[node]``. Calls for one node must
    be serialised (a parallel engine holds that node's buffer lock); calls for different
    nodes may run concurrently.
    """

    __slots__ = ("counts",)

    def __init__(self, roots: Iterable[Node]) -> None:
        """Count the edges into every (node, output) reachable from ``roots`` (iteratively)."""
        self.counts: dict[Node, list[int]] = {}
        stack: list[Node] = []
        for root in roots:
            if root not in self.counts:
                self.counts[root] = [0] * root.num_outputs
                stack.append(root)
        while stack:
            node = stack.pop()
            for next_node, input_nr in node.next_functions:
                if next_node is None:
                    continue
                counts = self.counts.get(next_node)
                if counts is None:
                    counts = self.counts[next_node] = [0] * next_node.num_outputs
                    stack.append(next_node)
                counts[input_nr] += 1

    def is_ready(self, node: Node) -> bool:
        """True when no edge still owes ``node`` a gradient (the seed's readiness test)."""
        return not any(self.counts[node])

    def release(self, node: Node, output_nr: int) -> bool:
        """Note that one edge into ``(node, output_nr)`` delivered; return True if ready now."""
        counts = self.counts[node]
        counts[output_nr] -= 1
        return not any(counts)
