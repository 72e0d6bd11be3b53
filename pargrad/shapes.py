"""Un-broadcasting: the one place where a broadcast gradient is summed back to a shape.

Written only with numpy functions that pargrad Tensors also implement (through numpy's
dispatch protocols), so it works on plain arrays and, when a graph of the backward is
being recorded, on Tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sum_to(grad: Any, shape: tuple[int, ...]) -> Any | None:
    """Sum ``grad`` over the axes along which ``shape`` was broadcast to ``grad.shape``.

    Returns ``grad`` itself when the shapes already match and ``None`` when ``shape``
    does not broadcast to ``grad.shape`` (the caller turns that into an error).
    """
    gshape = grad.shape
    if gshape == shape:
        return grad
    lead = len(gshape) - len(shape)
    if lead < 0:
        return None
    axes = list(range(lead))
    for i, size in enumerate(shape):
        gsize = gshape[lead + i]
        if size == 1 and gsize != 1:
            axes.append(lead + i)
        elif size != gsize:
            return None
    if type(grad) is np.ndarray:  # the ufunc and method np.sum and np.reshape end in
        summed = np.add.reduce(grad, axis=tuple(axes), keepdims=True) if axes else grad
        return summed.reshape(shape)  # (the same sums), without their Python wrappers
    summed = np.sum(grad, axis=tuple(axes), keepdims=True) if axes else grad
    return np.reshape(summed, shape)
