"""``pargrad.backward``: check the roots, run an engine, commit the leaf gradients.

All-or-nothing: leaf gradients are committed to ``.grad`` only after the engine has
finished the whole graph, so a backward that raises leaves every ``.grad`` as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pargrad.engine.base import Engine, current_engine
from pargrad.engine.buffer import accumulate
from pargrad.grad_mode import enable_grad
from pargrad.graph import AccumulateGrad, Grad
from pargrad.ops import copy
from pargrad.tensor import Tensor, grad_lock


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    *,
    engine: Engine | None = None,
) -> None:
    """Accumulate the gradients of ``tensors`` into ``.grad`` of the leaves they depend on.

    ``grad_tensors`` gives d(loss)/d(tensor) for each tensor (one per tensor, or a single
    one for a single tensor); it may be omitted, or None for an entry, only for tensors
    with one element. Blocks until the backward is done; thread-safe for independent
    graphs. ``retain_graph`` (default: ``create_graph``) keeps saved values for another
    backward; ``create_graph=True`` records the backward so that it can be differentiated.

    Raises TypeError/ValueError/RuntimeError for bad roots or gradients, and
    ``BackwardError`` (naming the node, original exception chained) if a node fails;
    in both cases no ``.grad`` is changed.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> pargrad.backward((x ** 2).sum())
    >>> x.grad
    tensor([2., 4., 6.], dtype=float64)
    """
    roots = _as_tensors(tensors)
    grads = _root_grads(roots, grad_tensors, create_graph)
    if retain_graph is None:
        retain_graph = create_graph
    run = engine if engine is not None else current_engine()
    captured = run.execute(
        [t._edge() for t in roots], grads, retain_graph=retain_graph, create_graph=create_graph
    )
    _commit(captured, create_graph)


def _as_tensors(tensors: Any) -> tuple[Tensor, ...]:
    roots = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    for i, t in enumerate(roots):
        if not isinstance(t, Tensor):
            raise TypeError(f"backward: tensors[{i}] is a {type(t).__name__}, not a Tensor")
        if not t.requires_grad:
            raise RuntimeError(
                f"backward: tensors[{i}] does not require grad and has no grad_fn, so there "
                f"is nothing to differentiate; make its inputs with requires_grad=True"
            )
    return roots


def _root_grads(roots: tuple[Tensor, ...], grad_tensors: Any, create_graph: bool) -> list[Grad]:
    if grad_tensors is None:
        given: tuple[Any, ...] = (None,) * len(roots)
    elif len(roots) == 1 and not isinstance(grad_tensors, (list, tuple)):
        given = (grad_tensors,)
    else:
        given = tuple(grad_tensors)
    if len(given) != len(roots):
        raise ValueError(f"backward: got {len(given)} gradients for {len(roots)} tensors")
    return [_root_grad(i, t, g, create_graph) for i, (t, g) in enumerate(zip(roots, given))]


def _root_grad(i: int, root: Tensor, grad: Any, create_graph: bool) -> Grad:
    if grad is None:
        if root.size != 1:
            raise RuntimeError(
                f"backward: tensors[{i}] has shape {root.shape}; a gradient can be implied "
                f"only for a tensor with one element, so pass gradient= (same shape)"
            )
        array = np.ones(root.shape, root.dtype)
    else:
        array = grad.data if isinstance(grad, Tensor) else grad
        if not hasattr(array, "dtype"):  # Python numbers and lists take the root's dtype
            array = np.asarray(array, dtype=root.dtype)
        array = np.asarray(array)
        if array.shape != root.shape:
            raise ValueError(
                f"backward: gradient {i} has shape {array.shape}, but tensors[{i}] has shape "
                f"{root.shape}"
            )
        if array.dtype != root.dtype:
            raise TypeError(
                f"backward: gradient {i} has dtype {array.dtype}, but tensors[{i}] has dtype "
                f"{root.dtype}; cast it with .astype(np.{root.dtype})"
            )
    if create_graph:
        return grad if isinstance(grad, Tensor) else Tensor._make(array, device=root.device)
    return array


def _commit(captured: dict[AccumulateGrad, Grad], create_graph: bool) -> None:
    """Add each leaf's gathered gradient to its ``.grad``, never in place.

    A new ``.grad`` is a copy, so it never shares memory with a gradient that the
    caller, another leaf or the graph still holds. With ``create_graph`` the copy and
    the sum are recorded, so ``.grad`` can be differentiated. Holds ``grad_lock``.
    """
    with grad_lock, enable_grad():
        for accumulator, grad in captured.items():
            leaf = accumulator.variable
            old = leaf._grad
            if create_graph:
                leaf._grad = copy(grad) if old is None else accumulate(old, False, copy(grad))[0]
            elif old is None:
                leaf._grad = Tensor._make(np.array(grad), device=leaf.device)
            else:
                leaf._grad = Tensor._make(accumulate(old.data, False, grad)[0], device=leaf.device)
