"""The backward graph: nodes, edges, sequence numbers and dependency counting.

A ``Node`` is one step of the backward pass. ``node.next_functions`` holds one edge per
input of the forward operation, ``(next_node, input_nr)``, where ``input_nr`` says which
output of ``next_node`` that input was; the edge is ``(None, 0)`` where the input needs
no gradient. A node keeps its edges as two tuples, ``next_nodes`` and ``input_nrs``
(edge ``i`` is ``(next_nodes[i], input_nrs[i])``), which is what engines read: one
object per node for the garbage collector to track, not one per edge and one around
them (``input_nrs`` holds small ints only, so the collector drops it, and the common
ones are shared). A leaf that requires grad is reached through an ``AccumulateGrad``
node, the sink that owns the leaf's gradient.

This module knows nothing of engines or threads (the sequence counter's lock aside): an
engine asks ``Dependencies`` when a node is ready and calls ``Node.apply``; everything a
node needs to turn output gradients into input gradients lives here and in the node.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pargrad import anomaly
from pargrad.devices import CPU, Device, gil_enabled
from pargrad.hooks import Hook, NodeHooks, RemovableHandle
from pargrad.replay import recorder
from pargrad.shapes import sum_to

if TYPE_CHECKING:
    from pargrad.tensor import Tensor

Grad = Any
"""A gradient: a numpy array, or a Tensor while a backward records its own graph."""

Edge = tuple["Node | None", int]
"""``(node, input_nr)``: the node that produced an input, and which of its outputs it was."""

NO_EDGE: Edge = (None, 0)
"""The edge of an input that needs no gradient."""

ONE_NR = tuple((i,) for i in range(16))
"""``(i,)``, made once: the ``input_nrs`` of a one-input node (``input_nrs_of``)."""

NR_AND_ZERO = tuple((i, 0) for i in range(16))
"""``(i, 0)``, made once: an op on a Tensor and a constant (``Op.call``'s lean path)."""

SHARED_NRS: dict[tuple[int, ...], tuple[int, ...]] = {
    **{(i, j): (i, j) for i in range(16) for j in range(16)},
    **{nrs: nrs for nrs in NR_AND_ZERO}, **{nrs: nrs for nrs in ONE_NR}}
"""Every one- and two-edge ``input_nrs`` of outputs 0-15, each made once (read-only)."""


def input_nrs_of(nrs: Sequence[int]) -> tuple[int, ...]:
    """``tuple(nrs)``, shared if it is one of ``SHARED_NRS`` (most are: one or two
    zeros), so that nodes hold one tuple between them instead of each its own."""
    found = tuple(nrs)
    return SHARED_NRS.get(found, found)


def split_edges(edges: Iterable[Edge]) -> tuple[tuple[Node | None, ...], tuple[int, ...]]:
    """``(next_nodes, input_nrs)`` of the edges ``edges``."""
    nodes: list[Node | None] = []
    nrs: list[int] = []
    for node, nr in edges:
        nodes.append(node)
        nrs.append(nr)
    return tuple(nodes), input_nrs_of(nrs)

Meta = tuple[tuple[int, ...], np.dtype]
"""``(shape, dtype)`` of a tensor, remembered so that a gradient can be checked against it."""

# The sequence counter must hand out unique, increasing numbers even when several
# threads build graphs at once. ``next`` on an ``itertools.count`` is one C call that
# runs no Python code and releases nothing, so with the GIL it is atomic and needs no
# lock (it costs a third of the locked version, on every node). A free-threaded
# interpreter (``sys._is_gil_enabled()`` false) gives no such promise for ``count``, so
# there ``_sequence_lock`` guards ``_sequence_counter``.
_sequence_lock = threading.Lock()
_sequence_counter = itertools.count()


def _next_locked() -> int:
    with _sequence_lock:
        return next(_sequence_counter)


next_sequence_nr: Callable[[], int] = (
    _sequence_counter.__next__ if gil_enabled() else _next_locked)
"""Return the next forward sequence number (unique, increasing, thread-safe)."""


class BackwardError(RuntimeError):
    """A node's backward failed, or produced gradients that do not fit its inputs.

    ``node_name`` names the node; the original exception, if any, is ``__cause__``.
    """

    def __init__(self, node_name: str, message: str) -> None:
        super().__init__(f"{node_name}: {message}")
        self.node_name = node_name
        self.detail = message


class Node:
    """One step of the backward pass (PyTorch's ``Node``).

    Subclasses implement ``backward`` (output gradients -> input gradients) and, if they
    keep saved values, ``_free_saved``. Engines call ``apply``, which also checks every
    gradient against the shape and dtype of the input it is for, sums a broadcast
    gradient back to that shape (the one place un-broadcasting happens), and frees the
    saved values unless the graph is retained.

    A node's ``backward`` records a graph of its own exactly when grad mode is enabled
    while it runs; engines enable it only for ``create_graph=True``.
    """

    __slots__ = ("__weakref__", "_forward_trace", "_hooks", "_input_meta", "_output_meta",
                 "_released", "cost", "device", "input_nrs", "next_nodes", "sequence_nr")

    # Its backward runs BLAS, which has threads of its own: a parallel engine runs only
    # as many such nodes at once as the cores allow (engine/blas.py).
    calls_blas = False
    # Whether outputs that got no gradient reach ``backward`` as zeros (else as None);
    # a Function's ``ctx.set_materialize_grads(False)`` turns it off for its node.
    materialize_grads = True
    # Whether ``backward`` runs when no output got a gradient (else ``apply`` returns
    # Nones at once); a custom Function's node does, as in PyTorch.
    runs_without_grads = False
    # Whether it saved its output 0 and holds that output's version counter in an
    # ``output_counter`` of its own (``versions.counter_of``); an OpNode's slot says.
    reads_output = False

    def __init__(
        self,
        next_functions: tuple[Edge, ...],
        input_meta: tuple[Meta | None, ...],
        output_meta: tuple[Meta, ...],
        device: Device = CPU,
    ) -> None:
        self.next_nodes, self.input_nrs = split_edges(next_functions)
        self._input_meta = input_meta
        self._output_meta = output_meta
        # The array elements its backward reads and writes, gradients in and out: what a
        # parallel engine weighs before handing the node to another thread.
        self.cost = sum(math.prod(meta[0]) for meta in (*input_meta, *output_meta)
                        if meta is not None)
        self._released = False
        self.device = device
        self.sequence_nr = next_sequence_nr()
        self._hooks: NodeHooks | None = None  # made by the first hook registered
        # Where the forward created this node: recorded only under anomaly mode.
        self._forward_trace = (anomaly.forward_trace() if anomaly.on and anomaly.mode.enabled
                               else None)

    @property
    def next_functions(self) -> tuple[Edge, ...]:
        """One edge ``(next_node, input_nr)`` per input of the forward operation, as
        PyTorch's ``grad_fn.next_functions`` (made from ``next_nodes`` and ``input_nrs``)."""
        return tuple(zip(self.next_nodes, self.input_nrs))

    def register_prehook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(grad_outputs)`` before this node's backward runs.

        ``grad_outputs`` is a tuple with one Tensor (or None) per output; the hook may
        return a tuple of replacements. Returns a handle whose ``remove()`` unregisters it.
        """
        return self._hooks_made().add("pre", hook)

    def register_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(grad_inputs, grad_outputs)`` after this node's backward ran.

        ``grad_inputs`` has one Tensor (or None) per edge in ``next_functions``; the hook
        may return a tuple of replacements. Returns a handle with ``remove()``.
        """
        return self._hooks_made().add("post", hook)

    def _hooks_made(self) -> NodeHooks:
        if recorder.active:
            recorder.fail("a hook is registered (or retain_grad called) on a tensor or node")
        with _hooks_made_lock:
            if self._hooks is None:
                self._hooks = NodeHooks()
            return self._hooks

    def run_tensor_hooks(self, grads: list[Grad | None]) -> list[Grad | None]:
        """Pass each output's gradient through the tensor hooks registered on it.

        Engines call this before keeping or using the gradients of a node that has hooks.
        Raises ``BackwardError`` naming this node if a hook fails or returns a gradient
        that does not fit.
        """
        hooks = self._hooks
        if hooks is None or not hooks.tensor:
            return grads
        grads = list(grads)
        for output_nr, registered in hooks.tensor.items():
            grad = grads[output_nr]
            if grad is None:
                if self.num_outputs > 1:  # an output that got no gradient: PyTorch
                    for _, hook in registered:  # calls its hooks with None
                        self._call(hook, "tensor hook", None)
                continue
            for _, hook in registered:
                grad = self._replace(grad, self._call(hook, "tensor hook", _wrap(grad, self)),
                                     self._output_meta[output_nr], f"output {output_nr}")
            grads[output_nr] = grad
        return grads

    def _call(self, hook: Hook, kind: str, *args: Any) -> Any:
        try:
            return hook(*args)
        except BackwardError:
            raise
        except Exception as exc:
            name = getattr(hook, "__qualname__", type(hook).__name__)
            raise BackwardError(self.name(), f"{kind} {name} raised {type(exc).__name__}: "
                                             f"{exc}").with_traceback(exc.__traceback__) from exc

    def _replace(self, old: Grad, new: Any, meta: Meta | None, what: str) -> Grad:
        """``new`` (a hook's result) in place of the gradient ``old``, checked."""
        if new is None:
            return old
        array = getattr(new, "data", new)
        if meta is not None and (np.shape(array) != meta[0] or
                                 getattr(array, "dtype", None) != meta[1]):
            raise BackwardError(
                self.name(),
                f"a hook returned a gradient of shape {np.shape(array)} and dtype "
                f"{getattr(array, 'dtype', type(array).__name__)} for {what}, which has shape "
                f"{meta[0]} and dtype {meta[1]}",
            )
        keeps_graph = not isinstance(old, np.ndarray)  # recording a graph: Tensors
        return new if keeps_graph or not hasattr(new, "data") else new.data

    def _run_pre_hooks(self, hooks: NodeHooks, grads: tuple[Grad, ...]) -> tuple[Grad, ...]:
        for _, hook in hooks.pre:
            result = self._call(hook, "pre-hook", tuple(_wrap(g, self) for g in grads))
            if result is not None:
                replaced = zip(grads, _fit(self, result, grads), self._output_meta)
                grads = tuple(self._replace(old, new, meta, f"output {i}")
                              for i, (old, new, meta) in enumerate(replaced))
        return grads

    def _run_post_hooks(self, hooks: NodeHooks, grad_inputs: list[Grad | None],
                        grads: tuple[Grad, ...]) -> list[Grad | None]:
        outputs = tuple(_wrap(g, self) for g in grads)
        for _, hook in hooks.post:
            result = self._call(hook, "hook", tuple(_wrap(g, self) for g in grad_inputs),
                                outputs)
            if result is not None:
                grad_inputs = [old if new is None else self._replace(old, new, meta, f"input {i}")
                               for i, (old, new, meta)
                               in enumerate(zip(grad_inputs, _fit(self, result, grad_inputs),
                                                self._input_meta))]
        return grad_inputs

    def name(self) -> str:
        """The node's name as shown in errors, e.g. ``MultiplyBackward``."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{self.name()} sequence_nr={self.sequence_nr}>"

    @property
    def num_outputs(self) -> int:
        """How many outputs the forward operation produced (each has its own counter)."""
        return len(self._output_meta)

    @property
    def output_meta(self) -> tuple[Meta, ...]:
        """The ``(shape, dtype)`` of each output of the forward operation."""
        return self._output_meta

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

        Under anomaly mode (of the calling thread) it also raises ``BackwardError`` if a
        returned gradient holds NaN or Inf, and any error it raises carries the stack of
        the forward call that created this node (``anomaly.add_forward_trace``).
        """
        if not (anomaly.on and anomaly.mode.enabled):  # all anomaly mode costs when it is off
            return self._apply(grads, retain_graph)
        try:
            checked = self._apply(grads, retain_graph)
            found = anomaly.first_nonfinite(checked) if anomaly.mode.check_nan else None
            if found is not None:
                i, what, index = found
                raise BackwardError(self.name(), f"returned nan or inf values in its gradient "
                                                 f"for input {i} ({what} at index {index})")
        except BackwardError as exc:
            inner = hasattr(exc, "forward_trace")
            anomaly.add_forward_trace(exc, self.name(), self._forward_trace, inner=inner)
            raise
        return checked

    def _apply(self, grads: Sequence[Grad | None], retain_graph: bool) -> list[Grad | None]:
        if not self.runs_without_grads:
            for g in grads:  # (a loop: all() would make a generator per node)
                if g is not None:
                    break
            else:
                return [None] * len(self.next_nodes)
        if self._released:
            raise BackwardError(
                self.name(),
                "trying to backward through the graph a second time, but its saved values "
                "were already freed; pass retain_graph=True to the first backward call",
            )
        full = _with_zeros(grads, self._output_meta) if self.materialize_grads else tuple(grads)
        hooks = self._hooks
        if hooks is not None and hooks.pre:
            full = self._run_pre_hooks(hooks, full)
        try:
            outputs = self.backward(full)
        except BackwardError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc
        checked = self._check(outputs)
        if hooks is not None and hooks.post:
            checked = self._run_post_hooks(hooks, checked, full)
        if not retain_graph and self._free_saved():
            self._released = True
        return checked

    def _failure(self, exc: Exception) -> BackwardError:
        """The error to raise, ``from exc``, for ``exc`` (not a ``BackwardError``) raised
        by this node's ``backward``: one naming this node, whose traceback goes on to the
        failing line itself."""
        return BackwardError(self.name(), f"{type(exc).__name__}: {exc}"
                             ).with_traceback(exc.__traceback__)

    def _check(self, outputs: Sequence[Grad | None]) -> list[Grad | None]:
        if len(outputs) != len(self.next_nodes):
            raise BackwardError(
                self.name(),
                f"backward returned {len(outputs)} gradients, but the forward had "
                f"{len(self.next_nodes)} inputs",
            )
        checked: list[Grad | None] = []
        for i, (next_node, g, meta) in enumerate(
            zip(self.next_nodes, outputs, self._input_meta)
        ):
            if next_node is None or g is None or meta is None:
                checked.append(None)
                continue
            if type(g) is not np.ndarray:  # (an array: the common case, no checks)
                if isinstance(g, (np.generic, int, float, list, tuple)):
                    g = np.asarray(g)
                if not hasattr(g, "shape") or not hasattr(g, "dtype"):
                    raise BackwardError(
                        self.name(),
                        f"backward returned a {type(g).__name__} for input {i}; expected "
                        f"an array, a Tensor or None",
                    )
            shape, dtype = meta
            fitted = g if g.shape == shape else sum_to(g, shape)
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


def _with_zeros(grads: Sequence[Grad | None], metas: tuple[Meta, ...]) -> tuple[Grad, ...]:
    """``grads`` with zeros (of each output's shape and dtype) for the outputs that got no
    gradient."""
    for g in grads:  # (a loop: most nodes get every gradient, and this makes nothing)
        if g is None:
            return tuple(np.zeros(shape, dtype) if g is None else g
                         for g, (shape, dtype) in zip(grads, metas))
    return tuple(grads)


# Guards the creation of every node's _hooks (two threads registering a first hook at
# once must share one NodeHooks).
_hooks_made_lock = threading.Lock()


# How hooks see an array gradient: ``tensor.py`` registers ``Tensor._make`` here when it
# is imported (``set_gradient_view``), since the graph sits below Tensor and cannot import
# it. Written once at import time (under the import lock), read-only after.
_gradient_view: Callable[[np.ndarray, Device], Any] | None = None


def set_gradient_view(view: Callable[[np.ndarray, Device], Any]) -> None:
    """Make ``view(array, device)`` the object hooks receive for an array gradient.

    Called once, by ``pargrad/tensor.py`` at import: hooks get Tensors sharing the array.
    """
    global _gradient_view
    _gradient_view = view


def _wrap(grad: Grad | None, node: Node) -> Any:
    """A gradient as hooks see it: a Tensor (sharing the array), or None."""
    if grad is None or not isinstance(grad, np.ndarray) or _gradient_view is None:
        return grad
    return _gradient_view(grad, node.device)


def _fit(node: Node, result: Any, like: Sequence[Any]) -> tuple[Any, ...]:
    """A hook's replacement tuple, checked to have one entry per gradient it replaces."""
    if not isinstance(result, (tuple, list)) or len(result) != len(like):
        raise BackwardError(node.name(), f"a hook returned {type(result).__name__} "
                                         f"{result!r:.60}; expected a tuple of {len(like)} "
                                         f"gradients (or None to keep them)")
    return tuple(result)


ACCUMULATOR_PRIORITY = 1 << 62
"""Added to an ``AccumulateGrad``'s sequence number (see there)."""


class AccumulateGrad(Node):
    """The sink for a leaf tensor: engines gather the leaf's total gradient here.

    Engines never call its ``backward``; they hand what it gathered back to the caller,
    which adds it to ``variable.grad`` once the whole backward has succeeded.
    """

    __slots__ = ("variable",)

    def __init__(self, variable: Tensor) -> None:
        super().__init__((), (), ((variable.shape, variable.dtype),), variable.device)
        # Above every other node's (still unique): an accumulator whose gradient is
        # complete is taken first, so its leaf's hooks run as soon as they can (PyTorch
        # gives AccumulateGrad the highest sequence number too). It runs no backward, so
        # this changes no buffer's summation order.
        self.sequence_nr += ACCUMULATOR_PRIORITY
        self.variable = variable
        self._hooks = variable._hooks  # the leaf's tensor hooks (shared, see hooks.py)

    def register_prehook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook((grad,))`` before ``backward`` adds the leaf's gradient to its
        ``.grad`` (after the leaf's tensor hooks); it may return a replacement tuple.
        ``pargrad.grad`` does not call it (it accumulates nothing)."""
        return super().register_prehook(hook)

    def register_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook((), (grad,))`` after ``backward`` updated the leaf's ``.grad`` (and
        after its post-accumulate-grad hooks); ``grad`` is the new ``.grad`` when there
        was none before. ``pargrad.grad`` does not call it."""
        return super().register_hook(hook)

    def _hooks_made(self) -> NodeHooks:
        return self.variable._leaf_hooks()  # one NodeHooks for the leaf and its accumulator


def reachable(roots: Iterable[Node], within: Container[Node] | None = None
              ) -> dict[Node, list[int]]:
    """Every node reachable from ``roots`` along ``next_functions``, each mapped to how
    many edges lead into each of its outputs (one count per output): the one graph walk
    (dependency counting, ``needed``, ``viz.nodes``, checkpoint's closure check).

    With ``within``, only the nodes in it are entered (and counted). Iterative, so
    graphs of any depth work; the insertion order is that of discovery, roots first.
    Every backward calls it: keep the loop tight.
    """
    counts: dict[Node, list[int]] = {}
    stack: list[Node] = []
    for root in roots:
        if root not in counts and (within is None or root in within):
            counts[root] = [0] * len(root._output_meta)
            stack.append(root)
    find, push, pop = counts.get, stack.append, stack.pop
    while stack:
        node = pop()
        nrs = node.input_nrs
        i = -1  # (an index, not a zip: most nodes have one edge, and a zip costs more)
        for next_node in node.next_nodes:
            i += 1
            if next_node is None:
                continue
            owed = find(next_node)
            if owed is not None:
                owed[nrs[i]] += 1
            elif within is None or next_node in within:  # found: counted from this edge
                outputs = len(next_node._output_meta)
                if outputs == 1:
                    counts[next_node] = [1]
                else:
                    owed = counts[next_node] = [0] * outputs
                    owed[nrs[i]] = 1
                push(next_node)
    return counts


ONE_EDGE = [1]
"""The counts of a one-output node that exactly one edge reaches (or that one edge still
owes a gradient): compared with ``==``, never changed."""


class Dependencies:
    """The dependency counters of one backward call (PyTorch's ``dependencies``).

    For every node reachable from the roots, one counter per output: how many edges
    still have to deliver a gradient to that output. A node is ready when the counters
    of all its outputs are zero.

    Thread-safety: ``counts`` gains no keys after construction, and ``is_ready(node)`` /
    ``release(node, ...)`` read and write only ``counts[node]``. Calls for one node must
    be serialised (a parallel engine holds that node's buffer lock); calls for different
    nodes may run concurrently.
    """

    __slots__ = ("counts",)

    def __init__(self, roots: Iterable[Node], within: Container[Node] | None = None) -> None:
        """Count the edges into every (node, output) reachable from ``roots``.

        With ``within`` (``needed``'s nodes), only the nodes in it are counted: a backward
        that runs just what some inputs need.
        """
        self.counts = reachable(roots, within)

    def is_ready(self, node: Node) -> bool:
        """True when no edge still owes ``node`` a gradient."""
        return not any(self.counts[node])

    def release(self, node: Node, output_nr: int) -> bool:
        """Note that one edge into ``(node, output_nr)`` delivered; return True if ready now."""
        counts = self.counts[node]
        counts[output_nr] -= 1
        return not any(counts)


def needed(roots: Iterable[Node], targets: Iterable[Edge]) -> dict[Node, bool]:
    """The nodes a backward from ``roots`` must reach to get gradients to the edges
    ``targets``.

    Maps every node on a path from a root to a target (targets included) to whether it
    must run: True when one of its edges leads on to another needed node, False for a
    node whose gradients are only to be kept (a target with nothing needed beyond it, and
    every ``AccumulateGrad``). Targets not reachable from the roots are absent.
    """
    return _needed(reachable(roots), targets)


def _needed(reached: dict[Node, list[int]], targets: Iterable[Edge]) -> dict[Node, bool]:
    """``needed`` among the nodes ``reached`` (what ``reachable`` returned for the roots)."""
    parents: dict[Node, list[Node]] = {node: [] for node in reached}
    for node in reached:
        for next_node in node.next_nodes:
            if next_node is not None:
                parents[next_node].append(node)
    runs: dict[Node, bool] = {}
    stack = [t for t in dict.fromkeys(node for node, _ in targets) if t in parents]
    for target in stack:
        runs[target] = False
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in runs:
                stack.append(parent)
            runs[parent] = not isinstance(parent, AccumulateGrad)
    return runs


def counting(root_nodes: Collection[Node], inputs: Iterable[Edge] | None
             ) -> tuple[Dependencies, dict[Node, bool] | None]:
    """The dependencies of a backward from ``root_nodes`` and, with ``inputs`` (the
    edges ``pargrad.grad`` wants), the nodes it needs (``needed``), counted only among
    those: what every engine counts with."""
    if inputs is None:
        return Dependencies(root_nodes), None
    reached = reachable(root_nodes)
    runs = _needed(reached, inputs)
    # Every parent of a needed node is needed (``_needed`` walks up through all of
    # them), so the edges into a needed node all come from needed nodes: its counts
    # among the needed nodes are the ones ``reached`` holds, and no second walk is due.
    dependencies = Dependencies(())
    dependencies.counts = {node: owed for node, owed in reached.items() if node in runs}
    return dependencies, runs


class Kept:
    """The gradients one backward hands back to its caller, by edge ``(node, output_nr)``.

    ``select(node, grads)`` is called once per node that became ready, with its gathered
    gradients (after its tensor hooks), and picks what to keep: an ``AccumulateGrad``'s
    (a leaf's total), the outputs asked for as ``inputs`` (``pargrad.grad``), and the
    outputs marked by ``Tensor.retain_grad``. ``on_kept(edge, grad)``, if given, sees
    each first and may take it (return True), so that it is not kept here. ``select``
    writes nothing shared; ``store`` does, and a parallel engine serialises it.
    """

    __slots__ = ("grads", "on_kept", "wanted")

    def __init__(self, inputs: Iterable[Edge] | None,
                 on_kept: Callable[[Edge, Grad], bool] | None = None) -> None:
        self.grads: dict[Edge, Grad] = {}
        self.on_kept = on_kept
        self.wanted: dict[Node, list[int]] = {}
        for node, output_nr in inputs or ():
            if node is not None and not isinstance(node, AccumulateGrad):
                self.wanted.setdefault(node, []).append(output_nr)

    def select(self, node: Node, grads: Sequence[Grad | None]) -> list[tuple[Edge, Grad]]:
        if isinstance(node, AccumulateGrad):
            outputs: Iterable[int] = (0,)
        else:
            outputs = self.wanted.get(node, ())
            if node._hooks is not None and node._hooks.retains:
                outputs = [*outputs, *node._hooks.retains]
        on_kept = self.on_kept
        return [((node, nr), grads[nr]) for nr in outputs if grads[nr] is not None
                and (on_kept is None or not on_kept((node, nr), grads[nr]))]

    def store(self, kept: list[tuple[Edge, Grad]]) -> None:
        self.grads.update(kept)
