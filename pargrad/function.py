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

from typing import Any

import numpy as np

from pargrad.devices import Device, common_device
from pargrad.grad_mode import is_grad_enabled, no_grad
from pargrad.graph import Grad, Node
from pargrad.tensor import Tensor, check_saved_data, input_edges


class FunctionCtx:
    """What ``forward`` leaves for ``backward``.

    Attributes:
        needs_input_grad: one bool per positional argument of ``apply``: whether that
            argument needs a gradient (backward may return None for the others).
    """

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self._saved: tuple[Any, ...] | None = ()
        self._saved_arrays: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep tensors (or arrays) for backward; read them back with ``saved_tensors``."""
        self._saved = tensors
        self._saved_arrays = tuple(t.data if isinstance(t, Tensor) else None for t in tensors)

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """What ``save_for_backward`` kept.

        Raises RuntimeError if they were freed by a backward without ``retain_graph``,
        or if a saved tensor was given new ``.data`` since it was saved.
        """
        if self._saved is None:
            raise RuntimeError(
                "saved tensors were freed after the first backward; pass retain_graph=True "
                "to backward through this graph more than once"
            )
        check_saved_data(self._saved, self._saved_arrays, "saved tensor")
        return self._saved


class Function:
    """Base class for custom ops with a hand-written backward (see the module example).

    ``forward(ctx, *args, **kwargs)`` runs with grad mode off and receives the arguments
    as given (Tensors stay Tensors); it returns an array or Tensor, or a tuple of them
    for several outputs. ``backward(ctx, *grads)`` receives one Tensor per output and
    returns one gradient (Tensor, array or None) per positional argument of ``apply``.
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
        with no_grad():
            result = cls.forward(ctx, *args, **kwargs)
        several = isinstance(result, tuple)
        arrays = [np.asarray(r.data if isinstance(r, Tensor) else r)
                  for r in (result if several else (result,))]
        on = common_device(args, f"{cls.__name__}.apply")
        node: Node | None = None
        if is_grad_enabled() and any(needs):
            node = FunctionNode(cls, ctx, args, arrays, on)
        outputs = tuple(
            Tensor._make(a, node if a.dtype.kind == "f" else None, i, on)
            for i, a in enumerate(arrays)
        )
        return outputs if several else outputs[0]


class FunctionNode(Node):
    """The backward node of one ``Function.apply`` call."""

    __slots__ = ("ctx", "function")

    def __init__(
        self, function: type[Function], ctx: FunctionCtx, args: tuple[Any, ...],
        outputs: list[np.ndarray], device: Device,
    ) -> None:
        edges, metas = input_edges(args)
        super().__init__(edges, metas, tuple((o.shape, o.dtype) for o in outputs), device)
        self.function = function
        self.ctx = ctx

    def name(self) -> str:
        return f"{self.function.__name__}Backward"

    def _free_saved(self) -> bool:
        had_saved = bool(self.ctx._saved)
        self.ctx._saved = None
        return had_saved

    def backward(self, grads: tuple[Grad, ...]) -> list[Grad | None]:
        wrapped = [g if isinstance(g, Tensor) else Tensor._make(np.asarray(g), device=self.device)
                   for g in grads]
        result = self.function.backward(self.ctx, *wrapped)
        results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        keep_tensors = is_grad_enabled()
        return [r.data if isinstance(r, Tensor) and not keep_tensors else r for r in results]
