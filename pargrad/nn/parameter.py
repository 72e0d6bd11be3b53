"""Parameter: a leaf Tensor that requires grad and that a ``Module`` registers as one of
its parameters when it is assigned as an attribute (``self.weight = Parameter(...)``).

>>> import pargrad
>>> w = pargrad.nn.Parameter(pargrad.zeros(2))
>>> w.requires_grad, w.is_leaf
(True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import CPU, Device
from pargrad.tensor import Tensor
from pargrad.versions import counter_of


class Parameter(Tensor):
    """A leaf Tensor made for a ``Module``: ``Parameter(data, requires_grad=True)``.

    From a Tensor it shares the tensor's memory and version counter (as ``detach()``
    does, and as PyTorch's Parameter shares its tensor's storage); anything else (an
    array, a list, a number) is copied, as ``pargrad.tensor`` copies. ``data=None`` makes
    an empty float64 parameter. Ops on a Parameter give plain Tensors.

    Raises TypeError for ``requires_grad=True`` on data that is not floating point.

    >>> import numpy as np, pargrad
    >>> a = np.ones(2)
    >>> p = pargrad.nn.Parameter(a)
    >>> p.data is a, isinstance(p * 2, pargrad.nn.Parameter)
    (False, False)
    """

    __slots__ = ()

    def __new__(cls, data: Any = None, requires_grad: bool = True) -> Parameter:
        if isinstance(data, Tensor):
            param = cls._make(data.data, device=data.device)
            param._counter = counter_of(data)
        else:
            source = Tensor(np.empty(0) if data is None else data)
            param = cls._make(source.data)
        param.requires_grad_(requires_grad)
        return param  # type: ignore[return-value]

    def __init__(self, data: Any = None, requires_grad: bool = True) -> None:
        pass  # __new__ made it: Tensor.__init__ would copy the data again

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickling and deepcopy keep the class (Tensor's __reduce__ would make a Tensor),
        # so that a copied Module still finds its parameters.
        grad = None if self._grad is None else self._grad.detach()
        return (_rebuild_parameter, (self.data, self._requires_grad, grad, self._device))


def _rebuild_parameter(data: np.ndarray, requires_grad: bool, grad: Tensor | None,
                       device: Device = CPU) -> Parameter:
    param = Parameter(Tensor._make(data, device=device), requires_grad)
    param._grad = grad
    return param


def empty_parameter(shape: tuple[int, ...], dtype: Any, device: Any = None) -> Parameter:
    """A Parameter of ``shape`` whose values are not set yet (a layer's initializer
    fills them in place)."""
    return Parameter(Tensor(np.empty(shape, dtype), device=device))
