"""Checkpointing: keep a function's inputs instead of its intermediates, and recompute.

``checkpoint(fn, *args)`` runs ``fn`` once to learn which tensors outside ``args`` it
differentiates through (tensors it closes over, such as a layer's weights), keeps
``args`` and those tensors, and drops the graph ``fn`` recorded. Its backward node has
an edge to each of them; it recomputes ``fn`` with grad mode on, on detached copies of
``args``, and runs a backward through that fresh graph from inside its own backward (a
reentrant backward: every engine supports it, at any nesting), handing each gradient to
its edge. Memory for ``fn``'s intermediates is then needed only while one checkpointed
segment runs, forward or backward.

``fn`` must compute the same graph both times: a tensor it differentiates through in
backward that it did not reach in forward (``fn`` changed its mind, or a non-leaf it
closes over was changed in place since) raises rather than lose a gradient, and a leaf
it closes over that was changed in place since raises as any saved tensor does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pargrad.autograd import _fn_outputs, _requires_grad, _vjp
from pargrad.function import Function, FunctionCtx
from pargrad.grad_mode import enable_grad, is_grad_enabled
from pargrad.graph import AccumulateGrad, Grad, Node, next_sequence_nr, reachable
from pargrad.tensor import Tensor


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping only its inputs for backward and recomputing ``fn`` there.

    ``fn`` returns a Tensor or a tuple of Tensors, and must be deterministic. Tensors it
    differentiates through may be arguments or reached otherwise (closed over, globals,
    attributes): each gets its gradient as in the plain graph. Other arguments (numbers,
    arrays, flags) are passed through as given. ``fn`` runs twice, both times with grad
    mode on: once here (its graph is dropped at once) and once in backward (under
    ``no_grad``: once, here, recording nothing). Works with ``create_graph=True``: the
    gradient is then recorded as another checkpoint, so it can be differentiated again
    (which recomputes ``fn`` once more). Thread-safe as a backward is: concurrent
    backward calls through one checkpoint each recompute on their own copies.
    Assumption: ``fn`` does not read a tensor that another thread records while ``fn``
    runs (nodes are told apart by sequence number, which all threads share); if it
    does, the backward raises as for a tensor reached only in backward (never a wrong
    gradient).

    >>> import pargrad
    >>> w = pargrad.tensor([2.0, -1.0], requires_grad=True)
    >>> x = pargrad.tensor([0.5, 1.0], requires_grad=True)
    >>> y = pargrad.checkpoint(lambda t: (t.sin() * w).sum(), x)   # w is closed over
    >>> y.grad_fn.name()
    'CheckpointBackward'
    >>> y.backward()
    >>> x.grad
    tensor([ 1.75516512, -0.54030231], dtype=float64)
    >>> w.grad
    tensor([0.47942554, 0.84147098], dtype=float64)
    """
    if not is_grad_enabled():  # nothing is recorded, so there is nothing to drop
        result = fn(*args)
        _fn_outputs(result, "checkpoint")
        return result
    inputs = [_detached(a) for a in args]
    start = next_sequence_nr()  # every node fn records gets a larger number
    result = fn(*inputs)
    outputs = _fn_outputs(result, "checkpoint")
    outside = list(_outside(outputs, inputs, start).values())
    run = _Run(fn, len(args), isinstance(result, tuple), [o.data for o in outputs])
    del result, outputs  # fn's graph goes here: only its values are kept
    return Checkpoint.apply(run, *args, *outside)


@dataclass
class _Run:
    """What ``checkpoint`` found by running ``fn``, for ``Checkpoint.forward``."""

    fn: Callable[..., Any]
    n_args: int
    several: bool  # fn returned a tuple
    values: list[np.ndarray] | None  # its outputs' arrays, taken by forward


class Checkpoint(Function):
    """The Function behind ``checkpoint``: positional arguments ``(run, *args, *outside)``,
    ``outside`` being the tensors ``fn`` reached that are not among ``args``."""

    @staticmethod
    def forward(ctx: FunctionCtx, run: _Run, *tensors: Any) -> Any:
        ctx.fn, ctx.n_args = run.fn, run.n_args  # type: ignore[attr-defined]
        ctx.save_for_backward(*tensors)  # a leaf changed in place since raises in backward
        values, run.values = run.values, None
        assert values is not None, "a checkpoint's run is applied once"
        return tuple(values) if run.several else values[0]

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple[Grad | None, ...]:
        saved = ctx.saved_tensors
        n_args: int = ctx.n_args  # type: ignore[attr-defined]
        args, outside = saved[:n_args], list(saved[n_args:])
        fn: Callable[..., Any] = ctx.fn  # type: ignore[attr-defined]
        wrt = [i for i, a in enumerate(args) if _requires_grad(a)]
        if is_grad_enabled():
            # create_graph: the gradient must depend on args, outside and grads
            # differentiably, so compute it as a checkpoint of the vector-Jacobian product.
            found = checkpoint(_VectorJacobianProduct(fn, n_args, outside), *args, *grads)
        else:
            found = _recompute_vjp(fn, [_detached(a) for a in args], grads, wrt, outside,
                                   create_graph=False)
        result: list[Grad | None] = [None] * (1 + len(saved))  # no gradient for the run
        for i, g in zip([*wrt, *range(n_args, len(saved))], found):
            result[1 + i] = g
        return tuple(result)


class _VectorJacobianProduct:
    """``(*args, *grads) -> d(grads . fn(*args))/d(args that require grad, then outside)``,
    as a function that can be checkpointed (and so differentiated) in turn."""

    def __init__(self, fn: Callable[..., Any], n_args: int, outside: list[Tensor]) -> None:
        self.fn = fn
        self.n_args = n_args
        self.outside = outside

    def __call__(self, *values: Any) -> tuple[Tensor, ...]:
        args, grads = values[:self.n_args], values[self.n_args:]
        wrt = [i for i, a in enumerate(args) if _requires_grad(a)]
        # Recording (args are leaves made for this call: record through them), or a
        # checkpoint under no_grad (values only, on copies).
        recording = is_grad_enabled()
        inputs = list(args) if recording else [_detached(a) for a in args]
        found = _recompute_vjp(self.fn, inputs, grads, wrt, self.outside,
                               create_graph=recording)
        return tuple(
            Tensor._make(np.zeros(t.shape, t.dtype), device=t.device) if g is None else g
            for t, g in zip([*(args[i] for i in wrt), *self.outside], found))


def _recompute_vjp(fn: Callable[..., Any], inputs: list[Any], grads: Sequence[Any],
                   wrt: list[int], outside: list[Tensor], *, create_graph: bool
                   ) -> tuple[Tensor | None, ...]:
    """Run ``fn`` on ``inputs`` (leaves where they require grad) recording a graph, and
    backpropagate ``grads`` from its outputs to the inputs ``wrt`` and to ``outside`` (None
    where none arrives), on the current engine: from inside a node, a reentrant backward."""
    start = next_sequence_nr()
    with enable_grad():
        outputs = _fn_outputs(fn(*inputs), "checkpoint")
    known = {_key(t) for t in outside}
    for key, t in _outside(outputs, inputs, start).items():
        if key not in known:
            raise RuntimeError(
                f"checkpoint: recomputed in backward, fn reached a tensor that requires grad "
                f"which it did not reach in forward ({_describe(t)}); fn must compute the "
                f"same graph both times, and a tensor it closes over must not be changed in "
                f"place between its forward and backward")
    leaves = [inputs[i] for i in wrt] + outside
    return _vjp(outputs, grads, leaves, create_graph=create_graph, retain_graph=create_graph)


class _RecordedSince:
    """The nodes ``fn`` recorded: those numbered from ``start`` on (a leaf's accumulator,
    numbered above every node, belongs to its leaf, not to fn)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __contains__(self, node: object) -> bool:
        return (isinstance(node, Node) and node.sequence_nr >= self.start
                and not isinstance(node, AccumulateGrad))


def _outside(outputs: list[Tensor], inputs: Sequence[Any], start: int
             ) -> dict[tuple[int, int], Tensor]:
    """The tensors that require grad which the graph of ``fn``'s ``outputs`` reaches but
    ``fn`` did not make from ``inputs``: leaves it closed over, and tensors computed before
    it ran (a Tensor with the same edge stands in for one that is not an output), keyed by
    ``_key``, in the order found."""
    ours = {id(t) for t in inputs if isinstance(t, Tensor)}
    found: dict[tuple[int, int], Tensor] = {}
    fns = _RecordedSince(start)
    roots: list[Node] = []
    for o in outputs:
        if o.grad_fn in fns:
            roots.append(o.grad_fn)  # type: ignore[arg-type]
        elif o.requires_grad and id(o) not in ours:
            found.setdefault(_key(o), o)  # fn returned a tensor it did not make
    for node in reachable(roots, within=fns):
        for next_node, nr in zip(node.next_nodes, node.input_nrs):
            if next_node is None or next_node in fns:
                continue
            if isinstance(next_node, AccumulateGrad):
                if id(next_node.variable) not in ours:
                    found.setdefault(_key(next_node.variable), next_node.variable)
            elif (id(next_node), nr) not in found:
                shape, dtype = next_node._output_meta[nr]
                stand_in = np.broadcast_to(np.zeros((), dtype), shape)  # (no memory)
                found[(id(next_node), nr)] = Tensor._make(stand_in, next_node, nr)
    return found


def _key(t: Tensor) -> tuple[int, int]:
    """What identifies a tensor outside ``fn`` across the two runs: a leaf itself, or the
    edge into the node that computed it."""
    return (id(t), -1) if t.grad_fn is None else (id(t.grad_fn), t.output_nr)


def _describe(t: Tensor) -> str:
    if t.grad_fn is None:
        return f"a leaf of shape {t.shape}"
    return f"output {t.output_nr} of {t.grad_fn.name()}, of shape {t.shape}"


def _detached(a: Any) -> Any:
    """A new leaf with ``a``'s data that requires grad as ``a`` does (other values as given)."""
    return a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
