"""Checkpointing: keep a function's inputs instead of its intermediates, and recompute.

``checkpoint(fn, *args)`` runs ``fn`` without recording a graph and keeps only ``args``.
Its backward node recomputes ``fn`` with grad mode on, on detached copies of the inputs,
and runs a backward through that fresh graph from inside its own backward (a reentrant
backward: both engines support it, at any nesting). Memory for ``fn``'s intermediates is
then needed only while its backward runs, one checkpointed segment at a time.

pargrad has no random ops, so the recomputation gives exactly the values of the forward
and nothing like PyTorch's ``preserve_rng_state`` is needed; a ``fn`` that draws random
numbers itself (``np.random``) must not be checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pargrad.autograd import _fn_outputs, _requires_grad, _vjp
from pargrad.function import Function, FunctionCtx
from pargrad.grad_mode import enable_grad, is_grad_enabled
from pargrad.graph import AccumulateGrad, Grad, Node, next_sequence_nr, reachable
from pargrad.tensor import Tensor


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and recomputing ``fn`` there.

    ``fn`` returns a Tensor or a tuple of Tensors, and must be deterministic. Every
    Tensor that ``fn`` differentiates through must be one of ``args`` (weights
    included): a backward that finds ``fn`` using another tensor that requires grad
    raises ``BackwardError`` rather than lose its gradient (PyTorch's reentrant
    checkpoint adds such gradients to ``.grad`` behind the engine's back). Other
    arguments (numbers, arrays, flags) are passed through as given. Works with
    ``create_graph=True``: the gradient is then recorded as another checkpoint, so
    it can be differentiated again (which recomputes ``fn`` once more). Thread-safe as
    a backward is: concurrent backward calls through one checkpoint each recompute
    on their own copies.

    >>> import pargrad
    >>> x = pargrad.tensor([0.5, 1.0], requires_grad=True)
    >>> y = pargrad.checkpoint(lambda t: (t.sin() * t).sum(), x)
    >>> y.grad_fn.name()
    'CheckpointBackward'
    >>> y.backward()
    >>> x.grad
    tensor([0.91821682, 1.38177329], dtype=float64)
    """
    return Checkpoint.apply(fn, *args)


class Checkpoint(Function):
    """The Function behind ``checkpoint``: positional arguments ``(fn, *args)``."""

    @staticmethod
    def forward(ctx: FunctionCtx, fn: Callable[..., Any], *args: Any) -> Any:
        ctx.fn = fn  # type: ignore[attr-defined]
        ctx.save_for_backward(*args)
        result = fn(*args)  # grad mode is off here: nothing of fn is recorded
        _fn_outputs(result, "checkpoint")
        return result

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple[Grad | None, ...]:
        args = ctx.saved_tensors
        fn: Callable[..., Any] = ctx.fn  # type: ignore[attr-defined]
        wrt = [i for i, a in enumerate(args) if _requires_grad(a)]
        if is_grad_enabled():
            # create_graph: the gradient must depend on args and grads differentiably, so
            # compute it as a checkpoint of the vector-Jacobian product itself.
            found = checkpoint(_VectorJacobianProduct(fn, len(args)), *args, *grads)
        else:
            found = _recompute_vjp(fn, [_detached(a) for a in args], grads, wrt, False)
        result: list[Grad | None] = [None] * (1 + len(args))  # no gradient for fn
        for i, g in zip(wrt, found):
            result[1 + i] = g
        return tuple(result)


class _VectorJacobianProduct:
    """``(*args, *grads) -> d(grads . fn(*args))/d(args that require grad)``, as a
    function that can be checkpointed (and so differentiated) in turn."""

    def __init__(self, fn: Callable[..., Any], n_args: int) -> None:
        self.fn = fn
        self.n_args = n_args

    def __call__(self, *values: Any) -> tuple[Tensor, ...]:
        args, grads = values[:self.n_args], values[self.n_args:]
        wrt = [i for i, a in enumerate(args) if _requires_grad(a)]
        if is_grad_enabled():  # recomputed by a backward: args are its detached leaves
            found = _recompute_vjp(self.fn, list(args), grads, wrt, True)
        else:  # the forward of a checkpoint: values only
            found = _recompute_vjp(self.fn, [_detached(a) for a in args], grads, wrt, False)
        return tuple(
            g if isinstance(g, Tensor)
            else Tensor._make(np.zeros(args[i].shape, args[i].dtype) if g is None else g,
                              device=args[i].device)
            for i, g in zip(wrt, found)
        )


def _recompute_vjp(fn: Callable[..., Any], inputs: list[Any], grads: Sequence[Any],
                   wrt: list[int], create_graph: bool) -> tuple[Tensor | None, ...]:
    """Run ``fn`` on ``inputs`` (leaves where they require grad) recording a graph, and
    backpropagate ``grads`` from its outputs to the inputs ``wrt`` (None where none
    arrives), on the current engine: from inside a node, a reentrant backward."""
    start = next_sequence_nr()  # every node fn records gets a larger number
    with enable_grad():
        outputs = _fn_outputs(fn(*inputs), "checkpoint")
    leaves = [inputs[i] for i in wrt]
    _check_closed(outputs, leaves, start)
    return _vjp(outputs, grads, leaves, create_graph=create_graph, retain_graph=create_graph)


def _check_closed(outputs: list[Tensor], leaves: list[Tensor], start: int) -> None:
    """Raise RuntimeError if the graph of ``fn``'s outputs reaches a tensor that requires
    grad other than ``leaves``: a leaf fn closed over, or a node recorded before fn ran.
    Its gradient could not reach it: the checkpoint node has no edge to it."""
    ours = {id(leaf) for leaf in leaves}
    roots: list[Node] = []
    for o in outputs:
        if o.grad_fn is not None:
            roots.append(o.grad_fn)
        elif o.requires_grad and id(o) not in ours:
            _not_closed(f"a leaf of shape {o.shape}")
    for node in reachable(roots):  # all recorded by fn, unless it is not closed
        if isinstance(node, AccumulateGrad):
            if id(node.variable) not in ours:
                _not_closed(f"a leaf of shape {node.variable.shape}")
        elif node.sequence_nr < start:
            _not_closed(f"{node.name()}, computed before fn was called")


def _not_closed(what: str) -> None:
    raise RuntimeError(
        f"checkpoint: fn uses a tensor that requires grad but is not an argument of "
        f"checkpoint ({what}), so its gradient would be lost; pass every tensor fn "
        f"differentiates through as an argument: checkpoint(fn, x, weight)"
    )


def _detached(a: Any) -> Any:
    """A new leaf with ``a``'s data that requires grad as ``a`` does (other values as given)."""
    return a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
