"""Making leaf Tensors the way numpy makes arrays: ``zeros``, ``ones``, ``empty``,
``full``, their ``*_like`` forms, ``arange``, ``linspace``, ``eye``, and ``from_numpy``
(which shares the array's memory instead of copying it).

Each takes numpy's parameters plus ``requires_grad`` and ``device`` (as
``pargrad.tensor``). The default dtype is numpy's: float64 for ``zeros``/``ones``/
``empty``/``eye``/``linspace``; ``full`` and ``arange`` take the dtype of their values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import CPU
from pargrad.devices import device as as_device
from pargrad.replay import recorder
from pargrad.tensor import Tensor


def _leaf(array: np.ndarray, requires_grad: bool, device: Any) -> Tensor:
    """A new leaf around ``array`` (made here, so not copied again)."""
    leaf = Tensor._make(array, device=CPU if device is None else as_device(device))
    leaf.requires_grad_(requires_grad)
    if recorder.active and (found := recorder.current()) is not None:
        found.note_constant(leaf, array)  # pargrad.capture: a constant of the recording
    return leaf


def zeros(shape: Any, dtype: Any = np.float64, *, requires_grad: bool = False,
          device: Any = None) -> Tensor:
    """A leaf of ``shape`` filled with zeros.

    >>> import pargrad
    >>> pargrad.zeros((2, 3), requires_grad=True).shape
    (2, 3)
    """
    return _leaf(np.zeros(shape, dtype), requires_grad, device)


def ones(shape: Any, dtype: Any = np.float64, *, requires_grad: bool = False,
         device: Any = None) -> Tensor:
    """A leaf of ``shape`` filled with ones."""
    return _leaf(np.ones(shape, dtype), requires_grad, device)


def empty(shape: Any, dtype: Any = np.float64, *, requires_grad: bool = False,
          device: Any = None) -> Tensor:
    """A leaf of ``shape`` whose values are whatever the memory held (as ``np.empty``)."""
    return _leaf(np.empty(shape, dtype), requires_grad, device)


def full(shape: Any, fill_value: Any, dtype: Any = None, *, requires_grad: bool = False,
         device: Any = None) -> Tensor:
    """A leaf of ``shape`` filled with ``fill_value`` (its dtype unless ``dtype`` is given:
    ``full(3, 1)`` is int64, ``full(3, 1.0)`` float64)."""
    return _leaf(np.full(shape, fill_value, dtype), requires_grad, device)


def _like(like: Any, dtype: Any, device: Any) -> tuple[tuple[int, ...], Any, Any]:
    """The shape, dtype and device a ``*_like`` function copies from ``like``."""
    array = like.data if isinstance(like, Tensor) else np.asarray(like)
    if device is None and isinstance(like, Tensor):
        device = like.device
    return array.shape, array.dtype if dtype is None else dtype, device


def zeros_like(like: Any, dtype: Any = None, *, requires_grad: bool = False,
               device: Any = None) -> Tensor:
    """Zeros with the shape, dtype and device of ``like`` (a Tensor or array-like).

    The result is a new leaf: it never takes part in ``like``'s graph.
    """
    shape, dtype, device = _like(like, dtype, device)
    return _leaf(np.zeros(shape, dtype), requires_grad, device)


def ones_like(like: Any, dtype: Any = None, *, requires_grad: bool = False,
              device: Any = None) -> Tensor:
    """Ones with the shape, dtype and device of ``like``; a new leaf."""
    shape, dtype, device = _like(like, dtype, device)
    return _leaf(np.ones(shape, dtype), requires_grad, device)


def full_like(like: Any, fill_value: Any, dtype: Any = None, *, requires_grad: bool = False,
              device: Any = None) -> Tensor:
    """``fill_value`` with the shape, dtype and device of ``like``; a new leaf."""
    shape, dtype, device = _like(like, dtype, device)
    return _leaf(np.full(shape, fill_value, dtype), requires_grad, device)


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None, *,
           requires_grad: bool = False, device: Any = None) -> Tensor:
    """Evenly spaced values in ``[start, stop)`` (``arange(n)``: 0 ... n-1), as
    ``np.arange``: integers for integer arguments, so pass floats (or a float ``dtype``)
    for a leaf that requires grad.

    >>> import pargrad
    >>> pargrad.arange(3.0)
    tensor([0., 1., 2.], dtype=float64)
    """
    values = np.arange(start, step=step, dtype=dtype) if stop is None \
        else np.arange(start, stop, step, dtype=dtype)
    return _leaf(values, requires_grad, device)


def linspace(start: Any, stop: Any, num: int = 50, endpoint: bool = True, dtype: Any = None,
             *, requires_grad: bool = False, device: Any = None) -> Tensor:
    """``num`` evenly spaced values from ``start`` to ``stop`` (included unless
    ``endpoint=False``), as ``np.linspace``."""
    return _leaf(np.linspace(start, stop, num, endpoint=endpoint, dtype=dtype), requires_grad,
                 device)


def eye(n: int, m: int | None = None, k: int = 0, dtype: Any = np.float64, *,
        requires_grad: bool = False, device: Any = None) -> Tensor:
    """An ``n`` x ``m`` (default ``n`` x ``n``) leaf with ones on diagonal ``k``."""
    return _leaf(np.eye(n, m, k, dtype=dtype), requires_grad, device)


def from_numpy(array: np.ndarray, *, requires_grad: bool = False) -> Tensor:
    """A leaf on the CPU that shares ``array``'s memory (no copy, as ``torch.from_numpy``):
    a change to either shows in both. To update a parameter made this way, change the
    Tensor under ``no_grad`` (``w -= lr * w.grad``), so that its version counter sees it;
    a write through ``array`` bypasses it.

    >>> import numpy as np, pargrad
    >>> a = np.zeros(2)
    >>> t = pargrad.from_numpy(a)
    >>> a[0] = 5.0
    >>> t
    tensor([5., 0.], dtype=float64)
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy: expected a numpy array, got {type(array).__name__}; "
                        f"pargrad.tensor(data) copies any array-like")
    return _leaf(array, requires_grad, None)
