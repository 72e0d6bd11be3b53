"""Views: tensors that share the memory of another tensor, their base, and how their
history follows in-place changes of that memory (as PyTorch's views do).

A view op (``Op(view=True)``: reshape, basic indexing, transpose...) whose output shares
its input's memory makes the output a view. It shares the base's version counter
(pargrad/versions.py) and remembers the chain of view ops that made it from its base
(the base is never a view itself). With that chain:

- an in-place change of a view while a graph is recorded is differentiable: the base takes
  a ``CopySlicesBackward`` node (its old value with the view's region replaced by the new
  one), and the view is made again from the new base (pargrad/ops/inplace.py);
- a view made before its base's history changed is made again from the base the next
  time it is used (``refresh``: recorded through, asked for ``requires_grad`` or
  ``is_leaf``, given a hook or ``retain_grad``), so it never hands out a stale gradient
  path. So is a view made under ``no_grad`` of a base that requires grad, when it is
  changed in place with grad mode on.

An output of a custom Function that shares an input's memory is a view without a chain:
it can be changed in place only while no graph is recorded, and recording through it
after its base's history changed raises.

Refreshing writes the view's ``grad_fn``; two threads refreshing one view at once both
compute the same history, and either result is a valid one (docs/design.md §9).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pargrad.grad_mode import enable_grad

if TYPE_CHECKING:
    from pargrad.graph import Node
    from pargrad.tensor import Tensor

Step = tuple[Any, dict[str, Any], int]
"""One view op of a chain: ``(op, params, output index)``."""


class View:
    """What a view tensor knows of its base: the base, the chain of view ops from it
    (None for a Function's output), and the base's ``grad_fn`` when the view's history
    was last made."""

    __slots__ = ("base", "base_grad_fn", "chain")

    def __init__(self, base: Tensor, chain: tuple[Step, ...] | None) -> None:
        self.base = base
        self.chain = chain
        self.base_grad_fn: Node | None = base.grad_fn


def view_of(source: Tensor, step: Step | None) -> View:
    """The View of a tensor made from ``source`` by ``step`` (None: by a Function)."""
    view = source._view
    if view is None:
        return View(source, None if step is None else (step,))
    chain = None if view.chain is None or step is None else (*view.chain, step)
    return View(view.base, chain)


def refresh(t: Tensor, *, recording: bool = False, force: bool = False) -> None:
    """If ``t`` is a view whose base's history changed since ``t``'s was made (or if
    ``force``), make its history again from the base; a ``retain_grad`` mark moves along.

    A Function's output has no chain to replay: recording through it (``recording``)
    after its base's history changed raises RuntimeError; elsewhere it stays as it is.
    """
    view = t._view
    if view is None or (view.base.grad_fn is view.base_grad_fn and not force):
        return
    if view.chain is None:
        if not recording:
            return
        raise RuntimeError(
            "this tensor is an output of a custom Function that shares the memory of an "
            "input, and that input was changed in place since (its history changed), so "
            "its own history is stale; apply the Function again after the change"
        )
    with enable_grad():
        fresh = replay(view.base, view.chain)
    t._rebase(fresh.grad_fn, fresh.output_nr)
    view.base_grad_fn = view.base.grad_fn


def replay(x: Any, chain: tuple[Step, ...]) -> Any:
    """Apply the view ops of ``chain`` to ``x`` (a Tensor: recorded, if grad mode is on)."""
    for op, params, i in chain:
        x = op.outputs(x, **params)[i]
    return x


def replay_array(array: Any, chain: tuple[Step, ...]) -> Any:
    """Apply the numpy forwards of ``chain`` to ``array``: a numpy view of it."""
    for op, params, i in chain:
        out = op.forward(array, **params)
        array = out[i] if op.multi_output else out
    return array
