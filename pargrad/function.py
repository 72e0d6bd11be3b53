"""Custom differentiable functions: ``pargrad.Function``, as ``torch.autograd.Function``.

Subclass it with two static methods, ``forward(ctx, *args)`` and
``backward(ctx, *grads)``, and call ``MyFn.apply(*args)``:

>>> import numpy as np, pargrad
>>> class Cube(pargrad.Function):
...     @staticmethod
...     def forward(ctx, x):
...         ctx.save_for_backward(x)
...         return x.data ** 3
...     @staticmethod
...     def backward(ctx, g):
...         (x,) = ctx.saved_tensors
...         return g * 3 * x ** 2
>>> x = pargrad.tensor(2.0, requires_grad=True)
>>> Cube.apply(x).backward()
>>> x.grad
tensor(12., dtype=float64)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from pargrad import anomaly, grad_mode
from pargrad.devices import Device, common_device
from pargrad.grad_mode import is_grad_enabled, no_grad
from pargrad.graph import BackwardError, Grad, Node
from pargrad.hooks import NodeHooks
from pargrad.ops.inplace import check_recordable, rebase_view
from pargrad.tensor import Tensor, check_saved_data, input_edges, saved_versions
from pargrad.versions import Saved, check, counter_of
from pargrad.views import view_of


class _Saved:
    """What ``save_for_backward`` kept: the tensors, and their arrays when saved."""

    __slots__ = ("arrays", "tensors")

    def __init__(self) -> None:
        self.tensors: tuple[Any, ...] | None = ()  # None: freed by a backward
        self.arrays: tuple[Any, ...] = ()


class FunctionCtx:
    """What ``forward`` leaves for ``backward``, and what it says about its outputs.

    Attributes:
        needs_input_grad: one bool per positional argument of ``apply``: whether that
            argument needs a gradient (backward may return None for the others).
    """

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        # What forward saved, held here until the node is made; then the node holds it
        # and this ctx reaches it through the node (``_store``), so that it dies with the
        # graph even when the ctx is kept elsewhere.
        self._own: _Saved | None = _Saved()
        self._versions: Saved = ()  # recorded by apply, after forward
        self._dirty: tuple[Tensor, ...] = ()
        self._non_differentiable: tuple[Any, ...] = ()
        self._materialize_grads = True
        self._node_name = ""
        # Saved tensors that are this Function's own outputs: saved index -> output
        # index, which they come back as.
        self._saved_outputs: dict[int, int] = {}
        # The node of this ctx, weakly (the node holds this ctx), None before it is made:
        # once the graph is gone, a ctx kept elsewhere hands out nothing (as PyTorch's).
        self._node: weakref.ref[Node] | None = None

    def _store(self) -> _Saved | None:
        """Where the saved tensors are: this ctx's own, or its node's; None once the node
        is gone."""
        if self._own is not None:
            return self._own
        node = None if self._node is None else self._node()
        return None if node is None else cast(FunctionNode, node).saved

    @property
    def _saved(self) -> tuple[Any, ...] | None:
        store = self._store()
        return None if store is None else store.tensors

    def _own_outputs(self, node: Node, results: tuple[Any, ...], outputs: list[Any],
                     args: tuple[Any, ...]) -> None:
        """Note the saved tensors that ``forward`` returned as differentiable outputs:
        ``saved_tensors`` gives them back as those outputs, with this node as their
        history, so that a backward recording a graph differentiates through them. An
        input returned unchanged stays the input (its output is another tensor), unless
        it was marked dirty (then it is the output)."""
        def made_here(t: Any) -> bool:
            return not any(t is a for a in args) or any(t is d for d in self._dirty)

        for k, saved in enumerate(self._saved or ()):
            for i, r in enumerate(results):
                if (saved is r and isinstance(saved, Tensor) and outputs[i].grad_fn is node
                        and made_here(saved)):
                    self._saved_outputs[k] = i
                    break

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep tensors (or arrays) for backward; read them back with ``saved_tensors``.

        Their versions are recorded when ``forward`` returns; changing one in place
        before the backward makes ``saved_tensors`` raise.
        """
        store = self._store()
        if store is not None:
            store.tensors = tensors
            store.arrays = tuple(t.data if isinstance(t, Tensor) else None for t in tensors)

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """What ``save_for_backward`` kept.

        Raises RuntimeError if they were freed by a backward without ``retain_graph``,
        if a saved tensor was given new ``.data`` since it was saved, or (a
        ``BackwardError`` naming the node) if one was changed in place since.
        """
        node = None if self._node is None else self._node()
        store = self._own if node is None else cast(FunctionNode, node).saved
        if store is None or store.tensors is None:  # its graph is gone, or a backward freed it
            raise RuntimeError(
                "saved tensors were freed after the first backward; pass retain_graph=True "
                "to backward through this graph more than once"
            )
        check_saved_data(store.tensors, store.arrays, "saved tensor")
        check(self._node_name, self._versions, "saved tensor")
        if node is None or not self._saved_outputs:
            return store.tensors
        saved = list(store.tensors)
        for k, i in self._saved_outputs.items():  # (the node's outputs, as PyTorch's)
            output = Tensor._make(store.arrays[k], node, i, node.device)
            output._counter = counter_of(saved[k])
            saved[k] = output
        return tuple(saved)

    def mark_dirty(self, *tensors: Tensor) -> None:
        """Declare input Tensors that ``forward`` changed in place (and returns).

        Each one's version is bumped, and where a graph is recorded it takes this
        Function's node as its history, as after ``x.add_(y)``. A leaf that requires
        grad, or a view, cannot be marked while recording (``apply`` raises).
        """
        self._dirty = tensors

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Declare outputs (the Tensors or arrays ``forward`` returns) that get no
        gradient: they do not require grad, and ``backward`` receives zeros for them
        (None with ``set_materialize_grads(False)``)."""
        self._non_differentiable = outputs

    def set_materialize_grads(self, value: bool) -> None:
        """With False, ``backward`` receives None instead of zeros for outputs that got
        no gradient (default True)."""
        self._materialize_grads = bool(value)


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a ``Function.backward`` that cannot itself be differentiated.

    It runs with grad mode off even under ``create_graph=True``; the gradients it
    returns then carry a node that raises ``BackwardError`` if a later backward tries to
    differentiate through them (as PyTorch's ``once_differentiable``).

    >>> import pargrad
    >>> class Square(pargrad.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.data ** 2
    ...     @staticmethod
    ...     @pargrad.once_differentiable
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 2 * x.data * g.data
    >>> x = pargrad.tensor(3.0, requires_grad=True)
    >>> Square.apply(x).backward()
    >>> x.grad
    tensor(6., dtype=float64)
    """

    @functools.wraps(backward)
    def wrapper(ctx: FunctionCtx, *grads: Any) -> Any:
        with no_grad():
            return backward(ctx, *grads)

    wrapper.once_differentiable = True  # type: ignore[attr-defined]
    return wrapper


class Function:
    """Base class for custom ops with a hand-written backward (see the module example).

    ``forward(ctx, *args, **kwargs)`` runs with grad mode off and receives the arguments
    as given (Tensors stay Tensors); it returns an array or Tensor, or a tuple of them
    for several outputs. ``backward(ctx, *grads)`` receives one Tensor per output and
    returns one gradient (Tensor, array or None) per positional argument of ``apply``.

    As in PyTorch: an output that shares memory with an input (the input returned
    unchanged, or a view of its data) is a view of it: it shares the input's version
    counter and cannot be changed in place while a graph is recorded. See also
    ``FunctionCtx.mark_dirty``, ``mark_non_differentiable``, ``set_materialize_grads``
    and ``once_differentiable``.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a Function must define a static forward(ctx, *args)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        raise NotImplementedError("a Function must define a static backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward`` and, if any argument requires grad, record a node for ``backward``."""
        for key, value in kwargs.items():
            if isinstance(value, Tensor) and value.requires_grad:
                raise TypeError(
                    f"{cls.__name__}.apply: Tensor {key}= requires grad but keyword "
                    f"arguments get no gradient; pass it positionally"
                )
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx = FunctionCtx(needs)
        ctx._node_name = f"{cls.__name__}Backward"
        with no_grad():
            result = cls.forward(ctx, *args, **kwargs)
        for t in ctx._dirty:  # forward changed their memory, whatever happens next
            if isinstance(t, Tensor):
                counter_of(t).bump()
        several = isinstance(result, tuple)
        results = result if several else (result,)
        arrays = [_array(r) for r in results]  # None: not a tensor, returned as it is
        device = common_device(args, f"{cls.__name__}.apply")
        records = is_grad_enabled() and any(needs)
        _check_dirty(cls.__name__, ctx._dirty, args, results, records)
        node: FunctionNode | None = None
        if records:
            node = FunctionNode(cls, ctx, args, arrays, device)
        outputs: list[Any] = []
        for i, (r, a) in enumerate(zip(results, arrays)):
            first = next(j for j, earlier in enumerate(results) if earlier is r)
            if first < i:  # the same object returned again: the same output again
                outputs.append(outputs[first])
            else:
                outputs.append(r if a is None else _output(ctx, node, i, r, a, args, device))
        ctx._versions = saved_versions(ctx._saved or ())
        if node is not None:
            ctx._own_outputs(node, results, outputs, args)
        return tuple(outputs) if several else outputs[0]


def _array(result: Any) -> np.ndarray | None:
    """The array of a ``forward`` result, or None for a result that is not a tensor
    (None, a string, a Python number or bool: it is returned as it is, as in PyTorch)."""
    if isinstance(result, Tensor):
        return result.data
    if isinstance(result, (np.ndarray, np.generic)):
        return np.asarray(result)
    return None


def _check_dirty(name: str, dirty: tuple[Tensor, ...], args: tuple[Any, ...],
                 results: tuple[Any, ...], records: bool) -> None:
    for t in dirty:
        if not any(t is a for a in args):
            raise ValueError(f"{name}.forward: mark_dirty takes input Tensors only, got "
                             f"{type(t).__name__}")
        if not any(t is r for r in results):
            raise RuntimeError(f"{name}.forward: a tensor marked dirty must be returned as "
                               f"an output (return the input itself)")
        if records and t._view is not None and sum(_array(r) is not None for r in results) > 1:
            raise RuntimeError(f"{name}.forward: a view marked dirty by a Function with "
                               f"several outputs is not supported (as in PyTorch); mark "
                               f"its base, or return the view alone")
        if records:
            check_recordable(t, f"{name}.forward (mark_dirty)")


def _output(ctx: FunctionCtx, node: Node | None, i: int, result: Any, array: np.ndarray,
            args: tuple[Any, ...], device: Device) -> Tensor:
    """Output ``i`` of ``Function.apply``: ``result`` as ``forward`` returned it."""
    differentiable = (node is not None and array.dtype.kind == "f"
                      and not any(result is n for n in ctx._non_differentiable))
    if any(result is t for t in ctx._dirty):  # changed in place: the input itself
        if differentiable and result._view is not None:  # its base takes the change
            rebase_view(result, Tensor._make(array, node, i, device))
        elif differentiable:
            result._rebase(node, i)
        return result
    out = Tensor._make(array, node if differentiable else None, i, device)
    if isinstance(result, Tensor):  # an input returned unchanged, or a Tensor forward made
        out._counter = counter_of(result)
    for a in args:  # sharing an input's memory: a view of it, without a chain to replay
        if isinstance(a, Tensor) and np.may_share_memory(array, a.data):
            out._counter, out._view = counter_of(a), view_of(a, None)
            break
    return out


class FunctionNode(Node):
    """The backward node of one ``Function.apply`` call."""

    __slots__ = ("ctx", "function", "materialize_grads", "not_tensors", "saved")

    # PyTorch calls a custom backward even when none of its outputs got a gradient
    # (with zeros, or Nones under set_materialize_grads(False)).
    runs_without_grads = True

    def __init__(
        self, function: type[Function], ctx: FunctionCtx, args: tuple[Any, ...],
        outputs: list[np.ndarray | None], device: Device,
    ) -> None:
        edges, metas = input_edges(args)
        super().__init__(edges, metas, tuple(_NOT_A_TENSOR if o is None else (o.shape, o.dtype)
                                             for o in outputs), device)
        self.function = function
        self.ctx = ctx
        # The node holds what forward saved; the ctx reaches it through a weak reference
        # (not a __del__ of the node, which would run Python code wherever the node is
        # freed, so that a Ctrl-C could land in it and be lost).
        saved = ctx._own
        assert saved is not None  # a ctx gets one node, made right after its forward
        self.saved, ctx._own = saved, None
        ctx._node = weakref.ref(self)
        self.materialize_grads = ctx._materialize_grads
        # Outputs that are not tensors: their gradient is always None.
        self.not_tensors = tuple(i for i, o in enumerate(outputs) if o is None)

    def name(self) -> str:
        return f"{self.function.__name__}Backward"

    def _free_saved(self) -> bool:
        had_saved = bool(self.saved.tensors)
        self.saved.tensors = None
        return had_saved

    def _run_pre_hooks(self, hooks: NodeHooks, grads: tuple[Grad, ...]) -> tuple[Grad, ...]:
        return super()._run_pre_hooks(hooks, self._tensor_grads(grads))

    def _tensor_grads(self, grads: tuple[Grad, ...]) -> tuple[Grad, ...]:
        """``grads`` with None for the outputs that are not tensors."""
        if not self.not_tensors:
            return grads
        return tuple(None if i in self.not_tensors else g for i, g in enumerate(grads))

    # Run for every custom Function's node of a backward: the common case in one frame.
    def apply(self, grads: Sequence[Grad | None], *, retain_graph: bool) -> list[Grad | None]:
        """``Node.apply``, with a lean path for the common case: no hooks, every output a
        tensor, anomaly mode off, no graph of the backward recorded. The gradients are
        wrapped as Tensors in one pass (zeros for an output that got none, unless the
        Function turned that off), the user's ``backward`` runs, and its results go
        through ``Node._check`` as on the general path, which raises the same errors."""
        if (self._hooks is not None or self.not_tensors or self._released
                or (anomaly.on and anomaly.mode.enabled)
                or not grad_mode.off or grad_mode.mode.enabled):
            return Node.apply(self, grads, retain_graph=retain_graph)
        device, materialize = self.device, self.materialize_grads
        wrapped: list[Tensor | None] = []
        for g, (shape, dtype) in zip(grads, self._output_meta):
            if g is None:
                wrapped.append(Tensor._make(np.zeros(shape, dtype), None, 0, device)
                               if materialize else None)
            elif isinstance(g, Tensor):
                wrapped.append(g)
            else:
                wrapped.append(Tensor._make(np.asarray(g), None, 0, device))
        try:
            results = self._results(self.function.backward(self.ctx, *wrapped))
        except BackwardError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc
        checked = self._check([r.data if isinstance(r, Tensor) else r for r in results])
        if not retain_graph and self._free_saved():
            self._released = True
        return checked

    def backward(self, grads: tuple[Grad, ...]) -> list[Grad | None]:
        wrapped = [g if g is None or isinstance(g, Tensor)
                   else Tensor._make(np.asarray(g), device=self.device)
                   for g in self._tensor_grads(grads)]
        backward = self.function.backward
        results = self._results(backward(self.ctx, *wrapped))
        if not is_grad_enabled():
            return [r.data if isinstance(r, Tensor) else r for r in results]
        if getattr(backward, "once_differentiable", False):
            return _delayed_error(self, wrapped, results)
        return list(results)

    def _results(self, result: Any) -> tuple[Any, ...]:
        """What the user's ``backward`` returned, as a tuple of one entry per input."""
        results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        inputs = len(self.next_nodes)
        if len(results) > inputs and all(r is None for r in results[inputs:]):
            results = results[:inputs]  # trailing Nones beyond the inputs: accepted
        return results


def _delayed_error(node: FunctionNode, grads: list[Any], results: tuple[Any, ...]) -> list[Any]:
    """``results`` of a once-differentiable backward, recorded as the outputs of a node
    that refuses to run: it hangs off the Function's inputs and the incoming gradients,
    so any backward through these gradients reaches it."""
    edges, metas = input_edges(grads)
    values = [None if r is None else np.asarray(r.data if isinstance(r, Tensor) else r)
              for r in results]
    error = DelayedError(
        node.name(), node.next_functions + edges, node._input_meta + metas,
        tuple(((), np.dtype(np.float64)) if v is None else (v.shape, v.dtype) for v in values),
        node.device,
    )
    return [None if v is None else Tensor._make(v, error, i, node.device)
            for i, v in enumerate(values)]


_NOT_A_TENSOR = ((), np.dtype(np.float64))
"""The metadata a Function's node keeps for an output that is not a tensor."""


class DelayedError(Node):
    """Stands for the backward of a ``once_differentiable`` backward: raises when run."""

    __slots__ = ("of",)

    def __init__(self, of: str, *graph: Any) -> None:
        super().__init__(*graph)
        self.of = of

    def backward(self, grads: tuple[Grad, ...]) -> list[Grad | None]:
        raise BackwardError(self.name(), f"{self.of} has a backward marked "
                                         f"@once_differentiable, so the gradients it computed "
                                         f"have no derivative; drop the decorator to "
                                         f"differentiate them again")
